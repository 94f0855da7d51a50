"""The memory budget (fractions, EMBER_MEM_RATIO, measured activations), the start-up fit check and warm-up,
scheduling policies, the host tier, "interrupted", and engine statistics, on a tiny random Llama."""

from __future__ import annotations

import re

import pytest
from conftest import TESTS, make_tiny_model, random_prompts
from internals import core_of

from ember import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, tokenizer_dir) -> str:
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("long")), tokenizer_dir, max_position=8192)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _pool(model_dir, **kw) -> tuple[int, int, str]:
    """(pool bytes, activation bytes, how the budget was decided)."""
    llm = LLM(model_dir, dtype="float32", max_model_len=8192, max_num_seqs=64, device="cpu", **kw)
    try:
        stats = llm.stats()
        return stats["kv_cache_bytes"], stats["activation_bytes"], stats["kv_budget_source"]
    finally:
        llm.shutdown()


def _expected(fraction: float, act: int, source: str) -> float:
    """The fraction of the available RAM the engine saw (its message names it), less the measured activations."""
    avail = float(re.search(r"of ([\d.]+) GiB available RAM", source).group(1)) * 2**30
    return fraction * avail - act


def test_pool_follows_the_memory_fraction_and_env(long_llama_dir, monkeypatch):
    from ember.worker.memory import available_memory_bytes

    # fractions giving ~96 and ~192 MiB on this machine: above a fresh process's activations, below the 256 MiB that
    # 64 x 8192 tokens need (which would cap the pool)
    small, large = (float(f"{mib * 2**20 / available_memory_bytes():.3g}") for mib in (96, 192))
    for fraction in (small, large):
        pool, act, source = _pool(long_llama_dir, kv_cache_memory_fraction=fraction)
        assert act > 0 and source.startswith(f"kv_cache_memory_fraction={fraction} of")
        assert abs(pool - _expected(fraction, act, source)) < 0.01 * pool + 16 * 8192
    monkeypatch.setenv("EMBER_MEM_RATIO", str(small))
    pool, act, source = _pool(long_llama_dir)
    assert source.startswith(f"EMBER_MEM_RATIO={small} of")
    assert abs(pool - _expected(small, act, source)) < 0.01 * pool + 16 * 8192
    monkeypatch.setenv("EMBER_MEM_RATIO", "1.5")
    with pytest.raises(ValueError, match=r"EMBER_MEM_RATIO='1.5' is out of range: .*\(0, 1\]"):
        LLM(long_llama_dir, dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=0 is out of range"):
        LLM(long_llama_dir, kv_cache_memory_fraction=0)


def test_configuration_that_cannot_fit_names_what_would(llama_dir):
    per_block = kv_bytes_per_block_of(llama_dir)
    with pytest.raises(ValueError) as e:
        LLM(llama_dir, dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_memory=10 * per_block)
    msg = str(e.value)
    assert "cannot hold one sequence of max_model_len=256" in msg
    assert "max_model_len=160 (one sequence at a time)" in msg and "max_num_seqs=4" in msg
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=1e-09"):
        LLM(llama_dir, dtype="float32", kv_cache_memory_fraction=1e-9)


def kv_bytes_per_block_of(llama_dir) -> int:
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
    try:
        return llm.model_info.kv_block_bytes
    finally:
        llm.shutdown()


_SERVE_AFTER_WARMUP = """
import json, sys
sys.path.insert(0, sys.argv[2])
from conftest import random_prompts
from ember import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=256, max_model_len=256, kv_cache_memory="64MiB")
prompts = random_prompts(250, 40, 40, llm.model_info.vocab_size, seed=40)
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
print(json.dumps(llm.stats()))
llm.shutdown()
"""


def test_serving_needs_no_more_memory_than_the_warm_up(llama_dir):
    """The warm-up ran every seat decoding at full length; 250 requests decoding together (50 MB of logits a
    step) then raise the process's peak RSS by no more than noise. RSS belongs to the whole process, so this runs
    in a fresh one: what earlier tests left in the heap would otherwise decide it."""
    import json
    import subprocess
    import sys

    here = TESTS
    run = subprocess.run([sys.executable, "-c", _SERVE_AFTER_WARMUP, llama_dir, here], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["activation_bytes"] > 40 * 2**20  # the dummy forward saw the 256-row logits
    assert stats["serving_peak_bytes"] <= stats["warmup_peak_bytes"] + 16 * 2**20


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_policies_keep_greedy_outputs_in_a_tiny_pool(llama_dir, tiny_llm, policy):
    prompts = random_prompts(16, 20, 60, tiny_llm.model_info.vocab_size, seed=41)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _tokens(tiny_llm.generate(prompts, params, use_tqdm=False))
    per_block = tiny_llm.model_info.kv_block_bytes
    small = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=24 * per_block,
                scheduling_policy=policy, max_num_batched_tokens=64)
    try:
        assert _tokens(small.generate(prompts, params, use_tqdm=False)) == expected
        stats = small.stats()
        assert stats["scheduling_policy"] == policy and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if policy == "guaranteed_no_evict":
            assert stats["preemptions"] == 0
        else:
            assert stats["preemptions"] > 0
        assert stats["running"] == stats["waiting"] == stats["interrupted"] == 0
    finally:
        small.shutdown()


def test_request_that_can_never_be_reserved_fails_at_once(llama_dir):
    per_block = kv_bytes_per_block_of(llama_dir)
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=8 * per_block,
              scheduling_policy="guaranteed_no_evict")
    try:
        with pytest.raises(ValueError, match=r"max_tokens=60 with n=4 needs 16 KV blocks .* pool's 8"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=60, n=4), use_tqdm=False)
        with pytest.raises(ValueError, match="max_model_len"):  # longer than the pool and than max_model_len
            llm.generate([[5] * 200], GREEDY, use_tqdm=False)
        assert len(llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24
    finally:
        llm.shutdown()


def test_request_given_up_ends_interrupted_and_keeps_its_tokens(llama_dir):
    """When a sequence cannot get a block even alone (here a block holder outside the scheduler shrinks the pool
    under it, as another model in the same engine could), it ends with "interrupted"; the others carry on."""
    from ember.core.request import CoreRequest
    from ember.protocol import EngineRequest

    per_block = kv_bytes_per_block_of(llama_dir)
    llm = LLM(llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 * per_block)
    try:
        holder = CoreRequest(EngineRequest("holder", [1], GREEDY, 128)).seqs[0]
        core_of(llm).block_manager.allocate(holder, 5 * 16)  # 5 of the 8 blocks: 48 tokens left
        long, short = llm.generate([[7] * 20, [8] * 4], [SamplingParams(temperature=0, max_tokens=100,
                                                                        ignore_eos=True), GREEDY], use_tqdm=False)
        assert long.finished and long.outputs[0].finish_reason == "interrupted"
        assert 0 < len(long.outputs[0].token_ids) < 100
        assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 24
        stats = llm.stats()
        assert stats["interrupted"] == 1 and stats["kv_blocks_free"] == 3
    finally:
        llm.shutdown()


def test_host_tier_serves_evicted_prefixes(llama_dir, tiny_llm, monkeypatch):
    """The host tier, run on CPU through its test switch: prefixes pushed out of a tiny device pool come back
    from host memory, the outputs report them per tier, and the tokens stay those of an engine without it."""
    vocab = tiny_llm.model_info.vocab_size
    system = random_prompts(1, 96, 96, vocab, seed=42)[0]
    first = [system + s for s in random_prompts(4, 8, 20, vocab, seed=43)]
    flood = random_prompts(12, 100, 120, vocab, seed=44)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    per_block = tiny_llm.model_info.kv_block_bytes
    cpu = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=24 * per_block,
              cpu_cache_memory=256 * per_block, device="cpu")
    try:
        assert cpu.stats()["host_tier"].startswith("off (CPU engine")
        expected = _tokens(cpu.generate(first, params, use_tqdm=False))
    finally:
        cpu.shutdown()
    monkeypatch.setenv("EMBER_HOST_TIER_ON_CPU", "1")
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=24 * per_block,
              cpu_cache_memory=256 * per_block, device="cpu")
    try:
        assert llm.stats()["host_tier"] == "256 blocks"
        llm.generate(first[:1], params, use_tqdm=False)
        llm.generate(flood, params, use_tqdm=False)  # evicts the system prompt's blocks to the host
        assert llm.stats()["swapped_out_blocks"] >= 96 // 16
        outs = llm.generate(first, params, use_tqdm=False)
        assert _tokens(outs) == expected
        assert outs[0].num_host_cached_tokens == 96 and outs[0].num_device_cached_tokens == 0
        assert all(o.num_cached_tokens == o.num_device_cached_tokens + o.num_host_cached_tokens >= 96 for o in outs)
        stats = llm.stats()
        assert stats["swapped_in_blocks"] >= 96 // 16 and stats["prefix_cache_host_hit_tokens"] >= 96
    finally:
        llm.shutdown()


def test_4000_token_prompt_delays_no_decoding_request(long_llama_dir):
    """A 4,000-token prompt arriving while 8 requests decode is prefilled in 512-token chunks; every one of the
    8 gets its token in every step of it (counted in steps: none is delayed by even one)."""
    llm = LLM(long_llama_dir, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=512,
              max_model_len=4200)
    steps: list[tuple[set[int], list[int]]] = []
    sched = core_of(llm).scheduler
    original = sched.schedule

    def recording():
        batch = original()
        steps.append(({s.seq_id for s, n in zip(batch.seqs, batch.num_tokens) if n == 1},
                      [n for n in batch.num_tokens if n > 1]))
        return batch

    sched.schedule = recording
    try:
        vocab = llm.model_info.vocab_size
        streams = [llm.stream(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                   for p in random_prompts(8, 5, 10, vocab, seed=45)]
        for s in streams:
            next(s)  # all 8 are decoding now
        long = random_prompts(1, 4000, 4000, vocab, seed=46)[0]
        out = llm.generate([long], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        for s in streams:
            list(s)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 2
    chunk_steps = [i for i, (_, chunks) in enumerate(steps) if chunks and max(chunks) > 10]
    assert len(chunk_steps) >= 4000 // 512
    decoders = steps[chunk_steps[0]][0]
    assert len(decoders) == 8
    for i in chunk_steps:  # each chunk step within the budget, next to every decoding request
        decodes, chunks = steps[i]
        assert sum(chunks) + len(decodes) <= 512 and decodes == decoders
