"""The llamacpp-draft driver reads llama.cpp's printed totals (lines as llama-speculative-simple 0.5.0-dev printed
them here): the harness's time per output token from its token times is llama.cpp's own decode time per token."""

from __future__ import annotations

import importlib

import pytest

from ember.benchmarks.metrics import latency_figures
from ember.benchmarks.runner import DRIVERS

LOG = """0.04.411.151 I encoded    5 tokens in    0.135 seconds, speed:   36.943 t/s
0.04.411.160 I decoded   36 tokens in    2.497 seconds, speed:   14.418 t/s
0.04.411.165 I
0.04.411.172 I n_draft   = 3
0.04.411.174 I n_predict = 36
0.04.411.183 I n_drafted = 27
0.04.411.188 I n_accept  = 27
0.04.411.194 I accept    = 100.000%
"""


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.syspath_prepend(DRIVERS)
    return importlib.import_module("run_llamacpp_draft")


def test_llama_cpp_totals_become_a_record_with_its_own_decode_speed(driver):
    out = driver.parse(LOG)
    assert (out["prompt_tokens"], out["output_tokens"]) == (5, 36)
    assert (out["draft_tokens"], out["accepted_draft_tokens"]) == (27, 27)
    assert out["token_times"][0] == pytest.approx(0.135 + 2.497 / 36)
    assert out["token_times"][-1] == pytest.approx(0.135 + 2.497)
    fig = latency_figures({"outputs": [out], "load_s": 0.0}, 0, ["code"])["code"]
    assert fig["decode_tokens_per_s"] == pytest.approx(36 / 2.497)
    assert fig["draft_acceptance"] == 1.0


def test_a_log_without_the_totals_is_refused_by_name(driver):
    with pytest.raises(SystemExit, match=r"no \['drafted', 'accepted'\] figures"):
        driver.parse(LOG.split("0.04.411.165")[0])
