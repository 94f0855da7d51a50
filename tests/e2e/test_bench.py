"""The benchmark harness on a tiny random model: workloads are fixed and seeded, every backend gets the identical
requests and produces exactly the requested tokens, the figures are computed right, reports are written.
(No timing assertions: benchmarks are not tests.) transformers runs as a second backend in this environment."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ember.benchmarks import metrics
from ember.benchmarks.workloads import WORKLOADS, build_requests, fixed_requests, vocabulary
from ember.entrypoints.cli import main

VOCAB = vocabulary(1000, {0, 1, 2})


def test_workloads_are_seeded_and_match_their_definition():
    w1 = build_requests(WORKLOADS["W1"], VOCAB, seed=0)
    assert w1 == build_requests(WORKLOADS["W1"], VOCAB, seed=0)
    assert w1 != build_requests(WORKLOADS["W1"], VOCAB, seed=1)
    assert len(w1) == 64
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 16 <= r.max_tokens <= 256 for r in w1)
    assert all(t not in (0, 1, 2) for r in w1 for t in r.prompt_token_ids)
    w2 = build_requests(WORKLOADS["W2"], VOCAB)
    prefix = w2[0].prompt_token_ids[:384]
    assert len(w2) == 64 and all(r.prompt_token_ids[:384] == prefix and r.max_tokens == 64 for r in w2)
    assert all(16 <= len(r.prompt_token_ids) - 384 <= 64 for r in w2)
    w3 = build_requests(WORKLOADS["W3"], VOCAB)
    assert len(w3) == 8 and all(len(r.prompt_token_ids) == 1500 and r.max_tokens == 128 for r in w3)
    w4 = build_requests(WORKLOADS["W4"], VOCAB)
    assert len(w4) == 256 and all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024
                                  for r in w4)
    small = build_requests(WORKLOADS["W1"], VOCAB, num_requests=5, output_cap=4, prompt_cap=20)
    assert [r.prompt_token_ids for r in small] == [r.prompt_token_ids[:20] for r in w1[:5]]
    assert all(r.max_tokens <= 4 for r in small)
    lat = fixed_requests(32, 128, 3, VOCAB)
    assert [len(r.prompt_token_ids) for r in lat] == [32] * 3 and len({tuple(r.prompt_token_ids) for r in lat}) == 3


def test_serving_and_latency_figures_from_known_timestamps():
    result = {"wall_s": 2.0, "load_s": 0.0, "outputs": [
        {"prompt_tokens": 8, "output_tokens": 3, "token_times": [0.1, 0.3, 0.5]},   # TTFT 100 ms, TPOT 200 ms
        {"prompt_tokens": 8, "output_tokens": 2, "token_times": [0.4, 0.5]},        # TTFT 400 ms, TPOT 100 ms
    ]}
    fig = metrics.serving_figures(result, 0, slo_ttft_ms=300, slo_tpot_ms=250)
    assert fig["ttft_ms_p50"] == pytest.approx(250) and fig["e2e_ms_p50"] == pytest.approx(500)
    assert fig["tpot_ms_p50"] == pytest.approx(150) and fig["itl_ms_p50"] == pytest.approx(200)
    assert fig["goodput_requests_per_s"] == pytest.approx(0.5)  # only the first meets the TTFT SLO
    assert fig["output_tokens_per_s"] == pytest.approx(2.5)
    lat = metrics.latency_figures(result, 0)["prompt_8"]
    assert lat["ttft_ms_median"] == pytest.approx(250) and lat["decode_tokens_per_s"] == pytest.approx(1 / 0.15)
    med = metrics.median_figures([{"a": 1.0, "b": {"c": 3}}, {"a": 5.0, "b": {"c": 1}}, {"a": 2.0, "b": {"c": 2}}])
    assert med == {"a": 2.0, "b": {"c": 2}}


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    code = main(["bench", *args, "--out", str(out), "--threads", "1"])
    assert code == 0
    mode = args[0]
    name = ("latency-text" if "text" in args else "latency") if mode == "latency" else f"{mode}-W1"
    assert (out / f"{name}.png").stat().st_size > 1000
    with open(out / f"{name}.json") as f:
        return json.load(f)


def test_throughput_runs_every_backend_on_the_same_requests(llama_dir, tmp_path):
    record = _bench(tmp_path, "throughput", "--model", llama_dir, "--backends",
                    "ember,ember-float,ember-json,ember-lora,hf", "--python", f"hf={sys.executable}", "--dtype",
                    "float32", "--num-requests", "5", "--output-cap", "6", "--prompt-cap", "40", "--repeats", "2")
    expected = sum(r.max_tokens for r in build_requests(WORKLOADS["W1"], _vocab(llama_dir), num_requests=5,
                                                        output_cap=6, prompt_cap=40))
    for backend in ("ember", "ember-float", "ember-json", "ember-lora", "hf"):
        assert len(record["runs"][backend]) == 2
        assert all(run["output_tokens"] == expected for run in record["runs"][backend])
        assert record["median"][backend]["peak_rss_mib"] > 50
    assert record["ember_over"]["ember"] == pytest.approx(1.0)
    assert record["ember_over"]["hf"] == pytest.approx(record["median"]["ember"]["output_tokens_per_s"]
                                                       / record["median"]["hf"]["output_tokens_per_s"])
    assert record["machine"]["cores"] == os.cpu_count()


def test_latency_reports_each_prompt_length(llama_dir, tmp_path):
    record = _bench(tmp_path, "latency", "--model", llama_dir, "--backends", "ember,hf", "--python",
                    f"hf={sys.executable}", "--dtype", "float32", "--prompt-lens", "8,24", "--output-len", "5",
                    "--runs", "2", "--repeats", "1")
    for backend in ("ember", "hf"):
        for key in ("prompt_8", "prompt_24"):
            fig = record["median"][backend][key]
            assert fig["runs"] == 2 and fig["output_tokens"] == 5
            assert 0 < fig["ttft_ms_median"] <= fig["ttft_ms_p99"]
            assert fig["decode_tokens_per_s"] > 0


def test_latency_on_text_prompts_reports_each_kind(llama_dir, tmp_path):
    """--prompts text: chat prompts of three kinds rendered with the model's template, the same token ids for every
    backend (here ember with and without n-gram speculation, and sending predictions), figures per kind."""
    record = _bench(tmp_path, "latency", "--model", llama_dir, "--backends", "ember,ember-ngram,ember-prediction",
                    "--dtype", "float32", "--prompts", "text", "--output-len", "6", "--runs", "1", "--repeats", "1")
    assert record["prompts"] == "text"
    for backend in ("ember", "ember-ngram", "ember-prediction"):
        fig = record["median"][backend]
        assert [k for k in fig if k.startswith("prompt_")] == ["prompt_copy", "prompt_code", "prompt_chat"]
        assert all(fig[k]["runs"] == 1 and fig[k]["output_tokens"] == 6 for k in ("prompt_copy", "prompt_chat"))


def test_serving_ends_every_request(llama_dir, tmp_path):
    record = _bench(tmp_path, "serving", "--model", llama_dir, "--dtype", "float32", "--num-requests", "6",
                    "--output-cap", "4", "--prompt-cap", "30", "--rate", "50", "--concurrency", "2",
                    "--repeats", "1")
    fig = record["median"]["ember"]
    assert fig["requests_per_s"] * fig["wall_s"] == pytest.approx(6)
    assert fig["ttft_ms_p50"] <= fig["e2e_ms_p50"] and fig["goodput_requests_per_s"] <= fig["requests_per_s"]


def test_scaling_runs_each_point_with_its_concurrency_and_prompt_length(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "scaling", "--model", llama_dir, "--dtype", "float32", "--concurrency", "1,4",
                 "--prompt-lens", "8,24", "--prompt-len", "10", "--output-len", "3", "--requests-per-len", "2",
                 "--repeats", "1", "--out", str(out), "--threads", "1"]) == 0
    assert (out / "scaling.png").stat().st_size > 1000
    with open(out / "scaling.json") as f:
        record = json.load(f)
    runs = record["runs"]
    # concurrency c: max(c, 8) requests of --prompt-len tokens; prompt length n: --requests-per-len requests of n
    for c in ("1", "4"):
        (run,) = runs["concurrency"][c]["ember"]
        assert run["output_tokens"] == 8 * 3 and run["prompt_tokens"] == 8 * 10
    for n in (8, 24):
        (run,) = runs["prompt_len"][str(n)]["ember"]
        assert run["output_tokens"] == 2 * 3 and run["prompt_tokens"] == 2 * n
    assert record["median"]["prompt_len"]["24"]["ember"]["output_tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert "| requests in flight |" in table and "| prompt tokens |" in table
    assert main(["bench", "scaling", "--model", llama_dir, "--concurrency", "0,4", "--out", str(out)]) == 2
    assert "--concurrency='0,4'" in capsys.readouterr().err
    assert main(["bench", "scaling", "--model", llama_dir, "--prompt-lens", "8,8", "--out", str(out)]) == 2
    assert "each once" in capsys.readouterr().err
    assert main(["bench", "scaling", "--model", llama_dir, "--backends", "llamacpp", "--out", str(out)]) == 2
    assert "engines that batch" in capsys.readouterr().err


def test_serving_at_several_rates_draws_the_curve(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "serving", "--model", llama_dir, "--dtype", "float32", "--num-requests", "4",
                 "--output-cap", "3", "--prompt-cap", "20", "--rates", "40,10", "--concurrency", "2", "--repeats", "1",
                 "--out", str(out), "--threads", "1"]) == 0
    with open(out / "serving-W1-curve.json") as f:
        curve = json.load(f)
    assert curve["mode"] == "serving-curve" and curve["rates"] == [10.0, 40.0]
    for p, rate in zip(curve["points"], (10, 40)):
        with open(out / f"rate-{rate}" / "serving-W1.json") as f:
            one = json.load(f)
        assert one["rate"] == rate and p["median"]["ember"]["goodput_requests_per_s"] == \
            one["median"]["ember"]["goodput_requests_per_s"]
    assert (out / "serving-W1-curve.png").stat().st_size > 1000
    assert "| 40 | ember |" in capsys.readouterr().out
    assert main(["bench", "serving", "--model", llama_dir, "--rates", "2,inf", "--out", str(out)]) == 2
    assert "--rates='2,inf'" in capsys.readouterr().err
    for rates in ("", "2,2"):
        assert main(["bench", "serving", "--model", llama_dir, "--rates", rates, "--out", str(out)]) == 2
        assert f"--rates={rates!r}" in capsys.readouterr().err


def test_missing_baseline_environment_is_a_clear_error(llama_dir, tmp_path, capsys):
    code = main(["bench", "throughput", "--model", llama_dir, "--backends", "ember,vllm", "--venvs",
                 str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--num-requests", "1"])
    assert code == 2
    assert "setup_baselines.sh vllm" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", llama_dir, "--backends", "ember,tgi"]) == 2
    assert "--backends" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", llama_dir, "--backends", "llamacpp", "--python",
                 f"llamacpp={sys.executable}", "--out", str(tmp_path / "o")]) == 2
    assert "needs a .gguf model" in capsys.readouterr().err
    # predictions exist only on the text prompts' copy and code requests: elsewhere the variant would be plain ember
    for mode in (["throughput"], ["latency"], ["latency", "--prompts", "random"]):
        assert main(["bench", *mode, "--model", llama_dir, "--backends", "ember,ember-prediction"]) == 2
        assert "ember-prediction needs `ember bench latency --prompts text`" in capsys.readouterr().err
    # the JSON records are for the guided backends: an unguided one would write free text until max_tokens' worth
    assert main(["bench", "latency", "--prompts", "json", "--model", llama_dir, "--backends", "ember-json,ember"]) == 2
    assert "run it with the guided backends ember-json and ember-json-ngram, not ember" in capsys.readouterr().err


def _vocab(model: str) -> list[int]:
    from ember.benchmarks.bench import _vocab

    return _vocab(model)
