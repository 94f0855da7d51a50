"""Many callers at once on the Python API: ``LLM.generate`` from 16 threads, and ``AsyncLLM`` from 200 asyncio
tasks with cancellations at random points. Greedy answers must equal transformers' (each prompt alone, its own KV
cache), every KV block must come back and the engine must still serve afterwards."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from conftest import hf_float32, hf_greedy, random_prompts
from internals import core_of

from ember import LLM, AsyncLLM, SamplingParams
from ember.sampling_params import OutputKind

MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """transformers' greedy answer of a prompt, computed once a prompt."""
    hf, answers = hf_float32(llama_dir), {}

    def answer(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in answers:
            answers[key] = hf_greedy(hf, prompt, MAX_TOKENS)
        return answers[key]

    return answer


def assert_drained(engine) -> None:
    """Nothing left in the core: no request, no sequence queued or running, every KV block free. The stats call is
    a command the engine loop takes after every command sent before it (the aborts of closed streams), so the core
    is read once they have all been handled."""
    stats = engine.stats()
    assert stats["kv_cache_usage"] == 0.0 and stats["running"] == 0 and stats["waiting"] == 0, stats
    core = core_of(engine)
    assert not core.requests, sorted(core.requests)[:5]
    assert not core.scheduler.has_work() and core.block_manager.num_used == 0


def test_llm_generate_from_16_threads_equals_transformers(llama_dir, reference):
    prompts = random_prompts(48, 3, 40, 49152, seed=71)
    prompts[5] = list(prompts[4])  # equal prompts from different threads share cached blocks
    prompts[20] = prompts[4][:30] if len(prompts[4]) >= 30 else prompts[4] + prompts[20]
    llm = LLM(llama_dir, dtype="float32", max_num_seqs=16, max_model_len=128, kv_cache_memory="128KiB")
    try:
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(16)

        def caller(t: int) -> None:
            try:
                start.wait()
                mine = list(range(t, len(prompts), 16))
                outs = llm.generate([prompts[i] for i in mine], greedy(), use_tqdm=False)
                for i, out in zip(mine, outs):
                    assert out.finished and out.outputs[0].finish_reason == "length"
                    results[i] = out.outputs[0].token_ids
            except BaseException as e:  # re-raised on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[0]
        assert sorted(results) == list(range(len(prompts)))
        for i, p in enumerate(prompts):
            assert results[i] == reference(p), i
        assert_drained(llm)
    finally:
        llm.shutdown()


def test_200_async_streams_with_random_cancellations(llama_dir, reference):
    prompts = random_prompts(200, 3, 40, 49152, seed=72)
    for i in range(0, 200, 10):  # some prompts repeat an earlier one's prefix
        prompts[i + 1] = prompts[i][:24] + prompts[i + 1]
    rng = random.Random(73)
    # what each task does: run to the end, cancel its own task after k outputs, be cancelled from outside after a
    # random delay, break out of its loop (the generator's close aborts), abort its request, or be cancelled with
    # all the others of the storm at once, when the tasks have seen 300 outputs together
    plans = [rng.choice(["run", "run", "cancel-self", "cancel-outside", "break", "abort", "storm"]) for _ in prompts]
    storm_at, seen_total = 300, [0]
    at = [rng.randint(0, MAX_TOKENS) for _ in prompts]
    engine = AsyncLLM(llama_dir, dtype="float32", max_num_seqs=32, max_model_len=128, kv_cache_memory="192KiB")
    try:
        async def one(i: int) -> list[int] | None:
            tokens: list[int] = []
            kind = OutputKind.DELTA if i % 2 else OutputKind.CUMULATIVE
            seen = 0
            async for out in engine.generate(prompts[i], greedy(output_kind=kind), request_id=f"r{i}"):
                tokens = tokens + out.outputs[0].token_ids if kind is OutputKind.DELTA else out.outputs[0].token_ids
                seen += 1
                seen_total[0] += 1
                if seen_total[0] == storm_at:
                    storm.set()
                if seen > at[i] and plans[i] == "cancel-self":
                    asyncio.current_task().cancel()
                    await asyncio.sleep(0)  # the cancellation lands here
                if seen > at[i] and plans[i] == "break":
                    return None
                if seen > at[i] and plans[i] == "abort":
                    await engine.abort(f"r{i}")
                if out.finished:
                    return tokens if out.outputs[0].finish_reason == "length" else None
            raise AssertionError(f"r{i}: the stream ended without a finished output")

        async def cancel_storm(tasks: list[asyncio.Task]) -> None:
            await storm.wait()
            for i, task in enumerate(tasks):
                if plans[i] == "storm":
                    task.cancel()

        async def main() -> list:
            nonlocal storm
            storm = asyncio.Event()
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            watcher = asyncio.create_task(cancel_storm(tasks))
            for i, task in enumerate(tasks):
                if plans[i] == "cancel-outside":
                    asyncio.get_running_loop().call_later(rng.random() * 0.05 * at[i], task.cancel)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            watcher.cancel()
            return results

        storm: asyncio.Event | None = None

        results = asyncio.run(main())
        finished = 0
        for i, r in enumerate(results):
            if isinstance(r, asyncio.CancelledError):
                assert plans[i] in ("cancel-self", "cancel-outside", "storm"), (i, plans[i])
                continue
            assert not isinstance(r, BaseException), (i, r)
            if r is None:
                assert plans[i] in ("break", "abort"), (i, plans[i])
                continue
            assert r == reference(prompts[i]), i  # run to the end, or a cancellation that came too late
            finished += 1
        assert finished >= sum(p == "run" for p in plans)
        # the storm came while most of its tasks still waited for seats (32 of them for 200 requests)
        assert sum(isinstance(r, asyncio.CancelledError) and plans[i] == "storm" for i, r in enumerate(results)) > 10
        assert_drained(engine)

        async def fresh() -> list[int]:
            outs = [o async for o in engine.generate(prompts[0], greedy(), request_id="r0")]  # a reused id
            return outs[-1].outputs[0].token_ids

        assert asyncio.run(fresh()) == reference(prompts[0])
    finally:
        engine.shutdown()


def test_async_callers_with_n_and_stop_strings_on_the_core_process(llama_dir, monkeypatch):
    """The core in its own process hears of a stop string one step late and sends the stopped sample one more
    token: a request of n = 2 with a stop string used to wait for ever. Every request ends here, each sample with
    a final status, no text past its stop string, and the pool is whole after."""
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    prompts = random_prompts(60, 3, 30, 49152, seed=74)
    stops = ["e", "a", "o", "s"]  # in most tokens' text: the samples stop early and at different steps
    engine = AsyncLLM(llama_dir, dtype="float32", max_num_seqs=16, max_model_len=128, kv_cache_memory="192KiB")
    try:
        async def one(i: int):
            params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, stop=stops,
                                    output_kind=OutputKind.FINAL_ONLY)
            outs = [o async for o in engine.generate(prompts[i], params, request_id=f"p{i}")]
            return outs[-1]

        async def main() -> list:
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            for task in tasks[::7]:
                asyncio.get_running_loop().call_soon(task.cancel)  # some callers leave at once
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        stopped = 0
        for i, r in enumerate(results):
            if isinstance(r, asyncio.CancelledError):
                continue
            assert not isinstance(r, BaseException), (i, r)
            assert r.finished and sorted(c.index for c in r.outputs) == [0, 1]
            for c in r.outputs:
                assert c.finish_reason in ("stop", "length"), (i, c)
                if c.finish_reason == "stop":  # cut before the stop string it reports (vLLM: the first of the list)
                    assert c.stop_reason in stops and c.stop_reason not in c.text, (i, c)
                    stopped += 1
                else:
                    assert not any(s in c.text for s in stops), (i, c)
        assert stopped > 0
        # the client's output thread tells the core of a stop string after it has handed the output over: once the
        # answer to one stats call has come back through that thread, the stops it sent before are in the core's
        # queue ahead of a second call
        engine.stats()
        stats = engine.stats()
        assert stats["kv_cache_usage"] == 0.0 and stats["running"] == 0 and stats["waiting"] == 0, stats

        async def fresh() -> list[int]:
            return [o async for o in engine.generate(prompts[0], greedy(), request_id="p0")][-1].outputs[0].token_ids

        assert len(asyncio.run(fresh())) == MAX_TOKENS
    finally:
        engine.shutdown()
