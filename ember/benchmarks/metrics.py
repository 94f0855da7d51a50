"""Figures from driver results: throughput per run, latency percentiles, serving SLOs, medians over repeats."""

from __future__ import annotations

import statistics

import numpy as np


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def throughput_figures(result: dict, peak_rss: int) -> dict:
    outs, wall = result["outputs"], result["wall_s"]
    out_tokens = sum(o["output_tokens"] for o in outs)
    prompt_tokens = sum(o["prompt_tokens"] for o in outs)
    return {"requests_per_s": len(outs) / wall, "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (prompt_tokens + out_tokens) / wall, "wall_s": wall,
            "output_tokens": out_tokens, "prompt_tokens": prompt_tokens, "peak_rss_mib": peak_rss / 2**20,
            "load_s": result["load_s"]}


def _ttft_tpot(o: dict) -> tuple[float, float | None]:
    t = o["token_times"]
    return t[0], ((t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None)


def latency_figures(result: dict, peak_rss: int, groups: list[str] | None = None) -> dict:
    """Per prompt length (or per group: ``groups`` names each request's, in request order): TTFT and time per
    output token (after the first), median and p99 over the runs."""
    by_group: dict[str, list[dict]] = {}
    for i, o in enumerate(result["outputs"]):
        by_group.setdefault(groups[i] if groups else o["prompt_tokens"], []).append(o)
    out: dict = {"peak_rss_mib": peak_rss / 2**20, "load_s": result["load_s"]}
    for n, outs in (by_group.items() if groups else sorted(by_group.items())):
        ttft = [_ttft_tpot(o)[0] for o in outs]
        tpot = [x for x in (_ttft_tpot(o)[1] for o in outs) if x is not None]
        out[n if groups else f"prompt_{n}"] = {
                        "ttft_ms_median": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
                        "tpot_ms_median": 1e3 * percentile(tpot, 50), "tpot_ms_p99": 1e3 * percentile(tpot, 99),
                        "decode_tokens_per_s": 1 / percentile(tpot, 50) if tpot else float("nan"),
                        "output_tokens": outs[0]["output_tokens"], "runs": len(outs)}
        drafted = sum(o.get("draft_tokens", 0) for o in outs)
        if drafted:  # speculative decoding: the share of drafted tokens kept, and drafted tokens per output token
            key = n if groups else f"prompt_{n}"
            out[key]["draft_acceptance"] = sum(o.get("accepted_draft_tokens", 0) for o in outs) / drafted
            out[key]["drafted_per_token"] = drafted / sum(o["output_tokens"] for o in outs)
    return out


def serving_figures(result: dict, peak_rss: int, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """TTFT, TPOT, inter-token latency and end-to-end latency p50/p99; goodput counts requests within both SLOs."""
    outs, wall = result["outputs"], result["wall_s"]
    ttft, tpot, itl, e2e, good = [], [], [], [], 0
    for o in outs:
        t = o["token_times"]
        first, per = _ttft_tpot(o)
        ttft.append(first)
        e2e.append(t[-1])
        itl += list(np.diff(t)) if len(t) > 1 else []
        if per is not None:
            tpot.append(per)
        if first * 1e3 <= slo_ttft_ms and (per is None or per * 1e3 <= slo_tpot_ms):
            good += 1
    fig = {"requests_per_s": len(outs) / wall, "output_tokens_per_s": sum(o["output_tokens"] for o in outs) / wall,
           "goodput_requests_per_s": good / wall, "slo_met_fraction": good / len(outs), "wall_s": wall,
           "peak_rss_mib": peak_rss / 2**20}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        fig[f"{name}_ms_p50"] = 1e3 * percentile(values, 50)
        fig[f"{name}_ms_p99"] = 1e3 * percentile(values, 99)
    return fig


def median_figures(runs: list[dict]) -> dict:
    """Key by key median over repeated runs (nested dicts too)."""
    out: dict = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, dict):
            out[key] = median_figures(values)
        elif isinstance(first, (int, float)):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out
