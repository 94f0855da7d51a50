"""``ember bench serving --rates 0.5,1,2,4``: the serving run at each arrival rate in turn, and the curve of goodput,
TTFT p99 and TPOT p99 against the rate, one line a backend.

Each rate is a whole ``serving`` run (its backends and repeats interleaved, its own record in ``<out>/rate-<r>``);
the curve's record (``serving[-http]-<W>-curve.json``) keeps each rate's medians and runs, its chart and table
show where each backend stops meeting the SLOs.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

log = logging.getLogger("ember.bench")

_FIGURES = ("requests_per_s", "goodput_requests_per_s", "output_tokens_per_s", "ttft_ms_p99", "tpot_ms_p99")


def parse_rates(text: str) -> list[float]:
    """``--rates``: finite arrival rates > 0, each once, sorted."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (r > 0) or r == float("inf") for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rates={text!r}: expected finite arrival rates > 0, comma separated, each once")
    return sorted(rates)


def run_curve(args: argparse.Namespace, run_bench) -> dict:
    """run_bench at each of ``args.rates``; writes the curve's JSON, chart and table to ``args.out``."""
    from ember.benchmarks import report

    rates = parse_rates(args.rates)
    points = []
    record: dict = {}
    for rate in rates:
        one = copy.copy(args)
        one.rate, one.out = rate, os.path.join(args.out, f"rate-{rate:g}")
        log.info("arrival rate %g requests/s", rate)
        record = run_bench(one)
        points.append({"rate": rate, "median": {b: {k: f[k] for k in _FIGURES} for b, f in record["median"].items()},
                       "runs": record["runs"]})
    curve = {k: record[k] for k in ("mode", "machine", "model", "backends", "dtypes", "threads", "repeats", "seed",
                                    "workload", "workload_description", "num_requests", "http", "concurrency",
                                    "slo_ttft_ms", "slo_tpot_ms", "versions")}
    curve.update(mode="serving-curve", command=record.get("command"), rates=rates, points=points)
    base = os.path.join(args.out, f"serving{'-http' if args.http else ''}-{args.workload}-curve")
    report.write_json(curve, base + ".json")
    chart = write_chart(curve, base + ".png")
    print(table(curve))
    print(f"\nwrote {base}.json" + (f" and {base}.png" if chart else ""))
    return curve


def table(curve: dict) -> str:
    """Markdown: a row a rate and backend: requests/s, goodput, TTFT and TPOT p99, and the goodput's ratio of ember's
    to the backend's."""
    from ember.benchmarks.report import _name

    rows = [f"| arrivals / s | backend | requests/s | goodput / s (TTFT <= {curve['slo_ttft_ms']:g} ms, TPOT <= "
            f"{curve['slo_tpot_ms']:g} ms) | TTFT p99 ms | TPOT p99 ms | ember's goodput / backend's |",
            "|---|---|---|---|---|---|---|"]
    for p in curve["points"]:
        med = p["median"]
        ember = med.get("ember", {}).get("goodput_requests_per_s")
        for b, f in med.items():
            good = f["goodput_requests_per_s"]
            ratio = "n/a" if ember is None or good == 0 else f"{ember / good:.2f}x"
            rows.append(f"| {p['rate']:g} | {_name(b)} | {f['requests_per_s']:.2f} | {good:.2f} | "
                        f"{f['ttft_ms_p99']:.0f} | {f['tpot_ms_p99']:.1f} | {ratio} |")
    return "\n".join(rows)


def write_chart(curve: dict, path: str) -> bool:
    """Goodput, TTFT p99 and TPOT p99 against the arrival rate; False without matplotlib."""
    from ember.benchmarks.report import _name, pyplot, save_chart

    plt = pyplot()
    if plt is None:
        return False

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = (("goodput_requests_per_s", "goodput, requests/s", None),
              ("ttft_ms_p99", "TTFT p99, ms", curve["slo_ttft_ms"]), ("tpot_ms_p99", "TPOT p99, ms",
                                                                      curve["slo_tpot_ms"]))
    for ax, (key, label, slo) in zip(axes, panels):
        for b in curve["backends"]:
            pts = [(p["rate"], p["median"][b][key]) for p in curve["points"] if b in p["median"]]
            ax.plot(*zip(*pts), marker="o", label=_name(b), color="#d9480f" if b == "ember" else None)
        if slo is not None:
            ax.axhline(slo, color="#868e96", linestyle="--", linewidth=1, label="SLO")
            ax.set_yscale("log")
        else:
            ax.plot(curve["rates"], curve["rates"], color="#ced4da", linewidth=1, label="offered")
        ax.set_xlabel("arrivals, requests/s")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{curve['workload']}, its first {curve['num_requests']} requests; at most {curve['concurrency']} "
                 "in flight"
                 f"{' (over HTTP)' if curve.get('http') else ''}", fontsize=9)
    save_chart(plt, fig, curve["machine"], path, f"; {os.path.basename(curve['model'])}")
    return True
