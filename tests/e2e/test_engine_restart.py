"""Dying processes under load: a tensor-parallel rank SIGKILLed, the engine core's process SIGKILLed, a burst that
runs the KV pool dry. The requests in flight end with a clear error (nothing waits forever), /health says so, and
`ember serve` starts its engine again by itself (bounded, logged, counted in /metrics), then answers with
transformers' greedy tokens again."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import httpx
import pytest
import psutil

from conftest import hf_float32, hf_greedy, random_prompts
from server_utils import running_server

PROMPT = random_prompts(1, 8, 8, 49152, seed=71)[0]
ARGS = ("--max-num-seqs", "16", "--max-model-len", "512", "--dtype", "float32", "--served-model-name", "tiny")


def _children(pid: int, marker: str) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if marker in " ".join(p.cmdline())]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, str]:
    """The status and the whole body (a stream's events included)."""
    r = httpx.post(url, json=body, timeout=timeout)
    return r.status_code, r.text


def get(url: str) -> tuple[int, str]:
    r = httpx.get(url, timeout=30)
    return r.status_code, r.text


def _health(url: str) -> tuple[int, str]:
    return get(url + "/health")


def _load(url: str, n: int, results: list) -> list[threading.Thread]:
    """n long requests in flight (half streamed): each records how it ended."""
    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            results.append(post(url + "/v1/completions", body, timeout=300))
        except Exception as e:  # noqa: BLE001  (a dropped connection is an ending too; recorded, then checked)
            results.append((None, repr(e)))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _, text = get(url + "/metrics")
        for line in text.splitlines():
            if line.startswith("ember_num_requests_running") and float(line.split()[-1]) >= n:
                return
        time.sleep(0.1)
    raise AssertionError("the load never ran")


def _ended_with_errors(results: list, threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request in flight was left waiting"
    for status, text in results:
        if status == 200:  # a stream: it ends with an error event naming the stop, then [DONE]
            assert '"code":"engine_dead"' in text and text.rstrip().endswith("data: [DONE]"), text[-400:]
        else:
            assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead", text


def _back(url: str) -> float:
    """Seconds until /health answers 200 again, after it has said (503 with a code) that the engine stopped."""
    start, seen = time.monotonic(), set()
    while time.monotonic() - start < 180:
        status, text = _health(url)
        if status == 200 and seen:
            assert seen <= {"engine_dead", "engine_restarting"}, seen
            return time.monotonic() - start
        if status != 200:
            seen.add(json.loads(text)["error"]["code"])
        time.sleep(0.05)
    raise AssertionError(f"the engine did not come back; /health said {seen or 200}")


def _serves_again(url: str, llama_dir: str) -> None:
    from ember.tokenizer import Tokenizer

    want = Tokenizer.load(llama_dir).decode(hf_greedy(hf_float32(llama_dir), PROMPT, 12))
    status, text = post(url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"] == want


def _restarts(url: str) -> float:
    _, text = get(url + "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("ember_engine_restarts_total"))


def _killed_under_load(srv, marker: str, n: int, llama_dir: str) -> float:
    """SIGKILL the server's one child process named by marker while n requests run: each ends with engine_dead, the
    engine comes back and answers with transformers' tokens; the seconds until /health said 200 again."""
    results: list = []
    threads = _load(srv.url, n, results)
    _wait_running(srv.url, n)
    (child,) = _children(srv.pid, marker)
    child.send_signal(signal.SIGKILL)
    _ended_with_errors(results, threads)
    took = _back(srv.url)
    _serves_again(srv.url, llama_dir)
    return took


def test_a_killed_tensor_parallel_rank_ends_its_requests_and_the_engine_restarts(llama_dir):
    with running_server(llama_dir, *ARGS, "--tensor-parallel-size", "2") as srv:
        took = _killed_under_load(srv, "ember.executor.rank", 6, llama_dir)
        assert _restarts(srv.url) == 1 and "restarting it" in srv.log() and "serving again" in srv.log()
        print(f"tp=2, rank 1 SIGKILLed under 6 requests: /health 200 again after {took:.1f} s")
        (rank,) = _children(srv.pid, "ember.executor.rank")  # the new engine's rank, killed while nothing runs:
        rank.send_signal(signal.SIGKILL)  # the idle loop notices, no request needed
        took = _back(srv.url)
        _serves_again(srv.url, llama_dir)
        assert _restarts(srv.url) == 2 and "while the engine was idle" in srv.log()
        print(f"tp=2, rank 1 SIGKILLed while idle: /health 200 again after {took:.1f} s")


def test_a_killed_core_process_restarts_within_its_bound(llama_dir):
    """The engine core in its own process, SIGKILLed twice with --max-engine-restarts 1: the first time the engine
    comes back; the second time it stays down, /health answers 503 engine_dead and requests get 503."""
    with running_server(llama_dir, *ARGS, "--max-engine-restarts", "1",
                        env={"EMBER_ENGINE_CORE_PROCESS": "1"}) as srv:
        took = _killed_under_load(srv, "ember.frontend.core_process", 4, llama_dir)
        print(f"core process SIGKILLed under 4 requests: /health 200 again after {took:.1f} s")
        (core,) = _children(srv.pid, "ember.frontend.core_process")
        core.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "is not restarted" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        status, text = _health(srv.url)
        assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead"
        status, text = post(srv.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead"
        assert _restarts(srv.url) == 1 and "is not restarted" in srv.log()


def test_a_burst_beyond_the_kv_pool_ends_every_request_and_frees_every_block(llama_dir):
    """48 concurrent requests whose KV together needs several times the pool: the scheduler preempts and
    recomputes, every request ends 200 with its full length, and the pool is empty afterwards."""
    with running_server(llama_dir, *ARGS, "--kv-cache-memory", "2MiB") as srv:
        done: list = []

        def one(i: int) -> None:
            body = {"model": "tiny", "prompt": random_prompts(1, 100, 200, 49152, seed=100 + i)[0],
                    "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
            done.append(post(srv.url + "/v1/completions", body, timeout=600))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert len(done) == 48 and all(status == 200 for status, _ in done), [s for s, _ in done]
        _, text = get(srv.url + "/metrics")
        rows = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(("ember_kv_cache_usage_perc", "ember_num_preemptions_total"))}
        assert rows["ember_kv_cache_usage_perc"] == 0.0 and rows["ember_num_preemptions_total"] > 0, rows
        assert _health(srv.url)[0] == 200
        assert os.path.exists(f"/proc/{srv.pid}")


def test_a_stopped_engine_lets_go_of_its_model_and_kv_pool(llama_dir):
    """An engine whose loop stopped after an error holds its model and KV pool no more (its client may still be
    referenced): a server that starts the engine again has the memory for it."""
    import gc
    import weakref

    from ember import LLM, SamplingParams
    from ember.errors import EngineDeadError

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    core = llm.client._loop.core
    executor = weakref.ref(core.executor)

    def fault(*_):
        raise RuntimeError("a fault inside a step")
    core.step = fault
    del core
    ember_log = logging.getLogger("ember")
    ember_log.disabled = True  # pytest keeps log records, and the loop's record holds the failed step's frames
    try:
        with pytest.raises(EngineDeadError, match="a fault inside a step"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        ember_log.disabled = False
    gc.collect()
    assert executor() is None and not llm.client.is_alive()
    assert "a fault inside a step" in llm.client.stop_reason()
    llm.shutdown()
