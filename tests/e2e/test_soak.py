"""The soak (``ember bench soak``, ember/benchmarks/soak.py) for a short while: ``EMBER_SOAK_SECONDS`` of the mixed
load (default 120) on a real ``ember serve``; the same checks as the long run but latency (no timing assertions):
no 5xx but 503, every answer right for its request, no hang, aborted streams ended as "abort" in the engine, KV
usage and requests in flight back to zero, RSS grown less than 5% after warm-up."""

from __future__ import annotations

import os

import pytest

from ember.benchmarks.soak import SoakConfig, run_soak
from ember.benchmarks.soak_report import tables
from ember.benchmarks.soak_load import Kinds


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    seconds = float(os.environ.get("EMBER_SOAK_SECONDS", "120"))
    cfg = SoakConfig(duration=seconds, window=seconds / 6, burst_every=seconds / 6, sample_every=3.0,
                     workdir=str(tmp_path_factory.mktemp("soak")))
    out = run_soak(cfg)
    print(tables(out))
    return out


@pytest.mark.timeout(1800)
def test_soak_checks_pass(report):
    latency = "p99_last_over_first_window"  # the long run's check: a timing, not asserted here
    assert latency in report["checks"]
    for name, check in report["checks"].items():
        assert name == latency or check["ok"], (name, check)
    assert report["server_exit_code"] == 0, report["server_log_tail"]


def test_soak_covers_every_kind(report):
    """Every kind was sent and got the answers it is there for: refusals for bad bodies, 503s in bursts, clients
    that left, adapters and the base model both served."""
    by_kind = report["requests_by_kind"]
    assert set(Kinds.WEIGHTS) | {"burst"} <= set(by_kind), by_kind
    assert by_kind["burst"].get("503", 0) > 0 and by_kind["burst"].get("200", 0) > 0
    assert set(by_kind["bad_request"]) <= {"400", "404", "503"} and by_kind["bad_request"].get("400", 0) > 0
    assert by_kind["abort_stream"].get("left", 0) > 0 and by_kind["disconnect"].get("left", 0) > 0
    for kind in ("chat", "chat_stream", "completion", "completion_stream", "n_samples", "beams", "json_schema"):
        assert by_kind[kind].get("200", 0) > 0, (kind, by_kind[kind])
    assert {"base", "soak-a", "soak-b"} <= set(report["requests_by_model"])
    assert report["samples"][-1]["finished_abort"] > 0
