"""The engine core in its own process (``EMBER_ENGINE_CORE_PROCESS=1``, ``ember.frontend.core_process``): the same
answers as the core on a thread, hf greedy parity, stop strings, structured output, utilities, errors raised in the
caller, and a core process that dies ending every open request with ``EngineDeadError``."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import hf_float32, hf_greedy, random_prompts

from ember import LLM, SamplingParams
from ember.errors import ConfigError, EngineDeadError
from ember.sampling_params import StructuredOutputsParams


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory="32MiB", **kw)


@pytest.fixture(scope="module")
def engines(llama_dir):
    """The same model with the core in its own process and on a thread."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    apart = _llm(llama_dir)
    mp.setenv("EMBER_ENGINE_CORE_PROCESS", "0")
    together = _llm(llama_dir)
    mp.undo()
    yield apart, together
    apart.shutdown()
    together.shutdown()


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_the_core_runs_in_another_process(engines):
    apart, _ = engines
    assert apart.client._loop._process.pid != os.getpid() and apart.client.is_alive()


def test_same_tokens_as_the_core_on_a_thread_and_transformers(engines, llama_dir):
    apart, together = engines
    prompts = random_prompts(4, 5, 40, apart.model_info.vocab_size, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = _tokens(apart, prompts, greedy)
    assert got == _tokens(together, prompts, greedy)
    hf = hf_float32(llama_dir)
    assert [g[0] for g in got] == [hf_greedy(hf, p, 10) for p in prompts]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, n=3, max_tokens=8, ignore_eos=True, logprobs=2)
    assert _tokens(apart, prompts, seeded) == _tokens(together, prompts, seeded)


def test_stop_strings_and_structured_output(engines):
    apart, together = engines
    prompt = {"prompt_token_ids": [100, 200, 300]}
    free = apart.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        cut = apart.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop and stop not in cut.text
        assert cut.text == together.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = apart.generate([prompt], choice, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta")


def test_utilities_stats_and_aborts(engines):
    apart, _ = engines
    stats = apart.stats()
    assert stats["kv_blocks_total"] > 0 and stats["running"] == 0
    stream = apart.stream({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=200,
                                                                          ignore_eos=True))
    first = next(iter(stream))
    assert not first.finished
    stream.close()  # leaving early aborts the request in the core
    deadline = time.monotonic() + 10
    while apart.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert apart.stats()["running"] == 0


def test_a_start_error_is_raised_in_the_caller(llama_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(llama_dir, dtype="float32", max_model_len=10**6, kv_cache_memory="32MiB")


def test_a_bad_switch_value_is_refused(llama_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "yes")
    with pytest.raises(ConfigError, match="EMBER_ENGINE_CORE_PROCESS"):
        LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory="32MiB")


def test_a_core_process_that_dies_ends_every_open_request(llama_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    llm = _llm(llama_dir)
    try:
        stream = llm.stream({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=250,
                                                                            ignore_eos=True))
        it = iter(stream)
        next(it)
        os.kill(llm.client._loop._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code"):
            for _ in it:
                pass
        assert not llm.client.is_alive()
        with pytest.raises(EngineDeadError):
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
