"""What ``ember bench`` writes: a JSON record (machine, arguments, every run, medians, ratios), a PNG chart and a
Markdown table (the tables docs/results.md shows: ``ember bench report``, ember/benchmarks/current.py)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform

from ember.benchmarks.runner import BACKEND_NAMES

log = logging.getLogger("ember.bench")


def machine() -> dict:
    """The machine a record's figures belong to. ``cpu_id`` (x86 family and model) tells apart CPUs whose model name
    is the same: a cloud VM says "AMD EPYC" for Zen 4 (family 25) and Zen 5 (26) alike, and their figures differ."""
    cpu, fields = platform.processor(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    import torch

    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if fields.get("cpu family") and fields.get("model"):
        info["cpu_id"] = f"family {fields['cpu family']} model {fields['model']}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_json(record: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=2)


def _name(backend: str) -> str:
    return BACKEND_NAMES.get(backend, backend)


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _runs(record: dict, backend: str, pick) -> str:
    """Each repeat's figure, in the order the repeats ran: ``(701, 696, 685)``, or nothing if not recorded."""
    try:
        return " (" + ", ".join(pick(r) for r in record["runs"][backend]) + ")"
    except (KeyError, TypeError):
        return ""


def throughput_table(record: dict) -> str:
    rows = ["| backend | output tok/s | requests/s | total tok/s | wall s | peak RSS MiB | ember / backend |",
            "|---|---|---|---|---|---|---|"]
    for b, fig in record["median"].items():
        runs = _runs(record, b, lambda r: f"{r['output_tokens_per_s']:.0f}")
        rows.append(f"| {_name(b)} | {fig['output_tokens_per_s']:.1f}{runs} | {fig['requests_per_s']:.2f} "
                    f"| {fig['total_tokens_per_s']:.0f} | {fig['wall_s']:.1f} | {fig['peak_rss_mib']:.0f} "
                    f"| {_ratio(record.get('ember_over', {}).get(b))} |")
    return "\n".join(rows)


def latency_table(record: dict) -> str:
    rows = ["| backend | prompt | TTFT ms (median / p99) | TPOT ms (median / p99) | decode tok/s | peak RSS MiB "
            "| ember / backend |", "|---|---|---|---|---|---|---|"]
    for b, fig in record["median"].items():
        rss = f"{fig['peak_rss_mib']:.0f}" if "peak_rss_mib" in fig else "n/a"
        for key, f in fig.items():
            if not key.startswith("prompt_"):
                continue
            runs = _runs(record, b, lambda r: f"{r[key]['decode_tokens_per_s']:.1f}")
            ratio = _ratio(record.get("ember_over", {}).get(b, {}).get(key))
            rows.append(f"| {_name(b)} | {key[7:]} | {f['ttft_ms_median']:.1f} / {f['ttft_ms_p99']:.1f} | "
                        f"{f['tpot_ms_median']:.2f} / {f['tpot_ms_p99']:.2f} | {f['decode_tokens_per_s']:.1f}{runs} | "
                        f"{rss} | {ratio} |")
    from ember.benchmarks.roofline import share_line

    line = share_line(record)
    kept = [f"{_name(b)}: " + ", ".join(f"{k[7:]} {f['draft_acceptance']:.0%} of {f['drafted_per_token']:.2f}"
                                        for k, f in fig.items() if isinstance(f, dict) and "draft_acceptance" in f)
            for b, fig in record["median"].items()
            if any(isinstance(f, dict) and "draft_acceptance" in f for f in fig.values())]
    if kept:
        line = "Drafted tokens kept (of drafted tokens per output token): " + "; ".join(kept) + "." + (
            f"\n\n{line}" if line else "")
    return "\n".join(rows) + (f"\n\n{line}" if line else "")


def serving_table(record: dict) -> str:
    rows = ["| backend | req/s | out tok/s | goodput req/s | TTFT ms p50/p99 | TPOT ms p50/p99 | ITL ms p50/p99 "
            "| E2E s p50/p99 | ember / backend |", "|---|---|---|---|---|---|---|---|---|"]
    for b, f in record["median"].items():
        runs = _runs(record, b, lambda r: f"{r['output_tokens_per_s']:.0f}")
        rows.append(f"| {_name(b)} | {f['requests_per_s']:.2f} | {f['output_tokens_per_s']:.0f}{runs} | "
                    f"{f['goodput_requests_per_s']:.2f} | {f['ttft_ms_p50']:.0f} / {f['ttft_ms_p99']:.0f} | "
                    f"{f['tpot_ms_p50']:.1f} / {f['tpot_ms_p99']:.1f} | {f['itl_ms_p50']:.1f} / {f['itl_ms_p99']:.1f} "
                    f"| {f['e2e_ms_p50'] / 1e3:.2f} / {f['e2e_ms_p99'] / 1e3:.2f} "
                    f"| {_ratio(record.get('ember_over', {}).get(b))} |")
    return "\n".join(rows)


TABLES = {"throughput": throughput_table, "latency": latency_table, "serving": serving_table}


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a warning) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart written (pip install 'ember[bench]')")
        return None
    return plt


def save_chart(plt, fig, machine: dict, path: str, note: str = "") -> None:
    """The machine (and ``note``) in small print at the foot, then the PNG at path."""
    fig.text(0.01, 0.01, f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}{note}", fontsize=7,
             color="#555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_chart(record: dict, path: str) -> bool:
    """A bar chart of the headline figure per backend; False (with a warning) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    mode, med = record["mode"], record["median"]
    names = [_name(b) for b in med]
    fig, ax = plt.subplots(figsize=(7, 4))
    if mode == "throughput":
        values = [f["output_tokens_per_s"] for f in med.values()]
        bars = ax.bar(names, values, color=["#d9480f" if b.startswith("ember") else "#868e96" for b in med])
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values])
        ax.set_ylabel("output tokens/s (median)")
        ax.set_title(f"{record['workload']}: {record['workload_description']}", fontsize=9)
    elif mode == "latency":
        keys = [k for k in next(iter(med.values())) if k.startswith("prompt_")]
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            values = [f[key]["decode_tokens_per_s"] for f in med.values()]
            xs = [j + i * width for j in range(len(names))]
            ax.bar_label(ax.bar(xs, values, width, label=f"{key[7:]}-token prompt"), fmt="%.0f")
        ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(names))], names)
        ax.set_ylabel("batch-1 decode tokens/s (median)")
        ax.legend()
    else:
        keys = ["ttft", "tpot", "itl", "e2e"]
        f = next(iter(med.values()))
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [f[f"{k}_ms_p50"] for k in keys], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [f[f"{k}_ms_p99"] for k in keys], 0.4, label="p99")
        ax.set_xticks(list(xs), [k.upper() for k in keys])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{names[0]} serving {record['workload']} at {record['rate']} req/s", fontsize=9)
        ax.legend()
    save_chart(plt, fig, record["machine"], path)
    return True
