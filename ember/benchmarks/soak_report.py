"""A soak report (``ember bench soak``'s JSON) as Markdown tables and a chart: what docs/reliability.md shows, and
what the command prints at the end of a run."""

from __future__ import annotations

STATUS_COLUMNS = ("200", "400", "404", "503", "left", "0")


def tables(report: dict) -> str:
    """Requests by kind and status, latency and memory per window, the checks."""
    cfg = report["settings"]
    out = [f"{report['requests']} requests in {cfg['duration']:.0f} s, {cfg['concurrency']} clients; status codes "
           + ", ".join(f"{k}: {v}" for k, v in report["status_codes"].items())
           + "; by model " + ", ".join(f"{k}: {v}" for k, v in sorted(report["requests_by_model"].items())), ""]
    others = sorted({c for codes in report["requests_by_kind"].values() for c in codes} - set(STATUS_COLUMNS))
    columns = [c for c in STATUS_COLUMNS if any(c in v for v in report["requests_by_kind"].values())] + others
    out += ["| kind | " + " | ".join(columns) + " | all |", "|---|" + "---:|" * (len(columns) + 1)]
    for kind, codes in report["requests_by_kind"].items():
        out.append(f"| {kind} | " + " | ".join(str(codes.get(c, 0)) for c in columns)
                   + f" | {sum(codes.values())} |")
    out += ["", "| window (s) | answers | p50 (s) | p99 (s) | RSS at end (MiB) | KV usage max |",
            "|---|---:|---:|---:|---:|---:|"]
    for w in report["latency_windows"]:
        rows = [s for s in report["samples"] if s["phase"] == "load" and w["start_s"] <= s["t"] < w["end_s"]]
        rss = f"{rows[-1]['rss_bytes'] / 2**20:.1f}" if rows else "-"
        kv = f"{max(s.get('kv_usage', 0.0) for s in rows):.1%}" if rows else "-"
        p50, p99 = (f"{w[k]:.3f}" if w[k] is not None else "-" for k in ("p50_s", "p99_s"))
        out.append(f"| {w['start_s']:.0f}-{w['end_s']:.0f} | {w['requests']} | {p50} | {p99} | {rss} | {kv} |")
    idle = report["samples"][-1]
    out += ["", f"After the load, idle: RSS {idle['rss_bytes'] / 2**20:.1f} MiB, KV usage {idle.get('kv_usage')}, "
            f"finished by reason " + ", ".join(f"{k.removeprefix('finished_')}: {v:.0f}" for k, v in idle.items()
                                               if k.startswith("finished_")), "",
            "| check | value | limit | ok |", "|---|---|---|---|"]
    for name, c in report["checks"].items():
        value = f"{c['value']:.4g}" if isinstance(c["value"], float) else c["value"]
        out.append(f"| {name} | {value} | {c['limit']} | {'yes' if c['ok'] else '**no**'} |")
    return "\n".join(out)


def chart(report: dict, path: str) -> None:
    """RSS and KV usage over time above p50 / p99 latency per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = [s for s in report["samples"] if s["phase"] == "load"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    t = [s["t"] / 60 for s in load]
    top.plot(t, [s["rss_bytes"] / 2**20 for s in load], color="tab:blue")
    top.set_ylabel("server RSS (MiB)", color="tab:blue")
    top.axvline(report["settings"]["duration"] * report["settings"]["warmup_frac"] / 60, color="grey", ls=":")
    kv = top.twinx()
    kv.plot(t, [100 * s.get("kv_usage", 0) for s in load], color="tab:orange", alpha=0.5, lw=0.8)
    kv.set_ylabel("KV usage (%)", color="tab:orange")
    wins = [w for w in report["latency_windows"] if w["p50_s"] is not None]
    mid = [(w["start_s"] + w["end_s"]) / 120 for w in wins]
    bottom.plot(mid, [w["p50_s"] for w in wins], "o-", label="p50")
    bottom.plot(mid, [w["p99_s"] for w in wins], "s-", label="p99")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("minutes (dotted: end of warm-up)")
    bottom.legend()
    fig.suptitle(f"ember serve soak: {report['requests']} requests, {report['settings']['concurrency']} clients")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
