"""AsyncLLM: many concurrent generators on one event loop, aborts, and every KV block back afterwards."""

from __future__ import annotations

import asyncio

import pytest
from conftest import random_prompts
from internals import core_of

from ember import AsyncLLM, SamplingParams
from ember.sampling_params import OutputKind


@pytest.fixture(scope="module")
def engine(llama_dir):
    e = AsyncLLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_num_seqs=16)
    yield e
    e.shutdown()


def test_fifty_concurrent_with_aborts(engine):
    prompts = random_prompts(50, 4, 40, engine.model_info.vocab_size, seed=31)
    aborted = set(range(0, 50, 5))

    async def one(i: int):
        params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=i)
        last, seen = None, 0
        async for out in engine.generate(prompts[i], params, request_id=f"r{i}"):
            last = out
            seen += 1
            if i in aborted and seen == 3:
                await engine.abort(f"r{i}")
        return i, last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(main())
    for i, last in results:
        assert last.finished
        reason = last.outputs[0].finish_reason
        if i in aborted:
            assert reason == "abort" and len(last.outputs[0].token_ids) < 40
        else:
            assert reason == "length" and len(last.outputs[0].token_ids) == 40
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_breaking_out_aborts_and_delta_kind(engine):
    prompt = random_prompts(1, 10, 10, engine.model_info.vocab_size, seed=32)[0]

    async def main():
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True),
                                       request_id="b"):
            break  # the loop closes the generator, which aborts the request
        for _ in range(200):
            if "b" not in core_of(engine).requests:
                break
            await asyncio.sleep(0.01)
        deltas = [d async for d in engine.generate(prompt, SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, output_kind=OutputKind.DELTA), request_id="b")]
        return deltas

    deltas = asyncio.run(main())  # reusing the id proves the first request ended
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 10
    assert all(len(d.outputs[0].token_ids) <= 1 for d in deltas)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_duplicate_request_id_rejected(engine):
    prompt = random_prompts(1, 10, 10, engine.model_info.vocab_size, seed=33)[0]

    async def main():
        gen = engine.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="request_id"):
            await engine.generate(prompt, SamplingParams(max_tokens=5), request_id="dup").__anext__()
        rest = [o async for o in gen]
        return first, rest

    first, rest = asyncio.run(main())
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 50
