"""Tensor and pipeline parallelism on CPU over gloo: a split model gives the tokens of one rank, each rank reads
and holds only its share, every executor runs the same ranks, and a failing or ending engine leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TESTS, random_prompts
from internals import core_of, oracle_drafts

from ember import LLM, SamplingParams
from ember.errors import ConfigError, EngineDeadError

HERE = TESTS
SCRIPTS = os.path.join(HERE, "parallel_scripts")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float = 15) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _split_llm(model: str, tp: int, pp: int, blocks: int, **kwargs) -> LLM:
    """An engine whose every rank holds exactly `blocks` KV blocks (per-rank bytes shrink with the split)."""
    probe = _kv_block_bytes(model)
    return LLM(model, dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               max_model_len=256,
               kv_cache_memory=blocks * probe // (tp * pp), **kwargs)


def _kv_block_bytes(model: str) -> int:
    """Bytes of one 16-token block of the whole model (the tiny models have 2 layers and 2 KV heads: T and P up to
    2 each divide it evenly)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * head_dim * 4


def _run(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_split_model_gives_the_tokens_of_one_rank(tiny_models, kind, monkeypatch):
    """T=2, P=2 and T=2 x P=2 against T=1, float32, in a 40-block pool with 64-token steps: chunked prefill,
    prefix-cache hits (the prompts share a 100-token system prompt and run twice) and preemption all happen; the
    T=2 x P=2 engine verifies speculative drafts too (kept and rejected: ``oracle_drafts``), in 32 blocks."""
    model = tiny_models[kind]
    system = random_prompts(1, 100, 100, 49152, seed=31)[0]
    prompts = [system + s for s in random_prompts(10, 5, 40, 49152, seed=32)]
    ref = _split_llm(model, 1, 1, 40, max_num_batched_tokens=64)
    try:
        want = [_run(ref, prompts), _run(ref, prompts)]
    finally:
        ref.shutdown()
    oracle_drafts(monkeypatch, prompts, want[0][0])
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        spec = {"speculative_config": {"num_speculative_tokens": 4}} if (tp, pp) == (2, 2) else {}
        blocks = 32 if spec else 40  # drafts finish sequences in fewer steps: a smaller pool still preempts
        llm = _split_llm(model, tp, pp, blocks, max_num_batched_tokens=64, **spec)
        try:
            assert llm.model_info.executor == "mp" and core_of(llm).block_manager.num_blocks == blocks
            got = [_run(llm, prompts), _run(llm, prompts)]
            stats = llm.stats()
            assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
            assert not spec or 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
            for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
                assert tokens == want_tokens, (tp, pp)
                diff = max(abs(a - b) for x, y in zip(lps, want_lps) for a, b in zip(x, y))
                assert diff < 1e-4, (tp, pp, diff)
            reports = llm.client.rank_reports()
            assert [r["rank"] for r in reports] == list(range(tp * pp))
            assert all(r["layers"] == 2 // pp and r["kv_heads"] == 2 // tp for r in reports)
            pids = core_of(llm).executor.pids
        finally:
            llm.shutdown()
        assert not _wait_gone(pids)


def _table(embedding) -> torch.Tensor:
    return embedding.qt.dequantize() if embedding.qt is not None else embedding.weight.float()


def _dequantized(module) -> torch.Tensor:
    return module.qmm.dequantized(torch.float32) if module.qmm is not None else module.weight.float()


@pytest.mark.parametrize("source", ["safetensors", "asmodel-int4", "asmodel-int8", "gguf"])
def test_each_rank_reads_only_its_slices(tiny_models, tmp_path, source):
    """Every tensor a rank reads is its own part (never the whole weight of a split layer), and what it holds is
    exactly that part of what one rank holds: column and row slices, fused QKV and gate/up, vocabulary rows,
    int4 groups, GGUF blocks."""
    from ember.config import EngineConfig
    from ember.distributed import ParallelContext
    from ember.model_loader import load_model, open_checkpoint

    if source == "gguf":
        from conftest import default_gguf

        path, tp, dtype = default_gguf(), 3, "auto"
    elif source.startswith("asmodel"):
        from ember.model_loader.convert import convert
        from ember.quantization import QuantConfig

        quant = QuantConfig("int4", 32, True) if source.endswith("int4") else QuantConfig("int8")
        path = convert(tiny_models["qwen2"], str(tmp_path), "q", quant_config=quant)
        tp, dtype = 2, "auto"
    else:
        path, tp, dtype = tiny_models["qwen2"], 2, "float32"
    config = EngineConfig(path, dtype=dtype, device="cpu").resolve().model
    whole = load_model(config).model
    for rank in range(tp):
        ctx = ParallelContext(tp_size=tp, tp_rank=rank)
        part = load_model(config, ctx).model
        ckpt = open_checkpoint(path)
        full_sizes = {n: t.shape for n, t in ckpt.tensors(ckpt.hf_config(), keep_quantized=True)}
        for name, t in ckpt.tensors(ckpt.hf_config(), keep_quantized=True, select=part.weight_slice):
            if len(full_sizes[name]) == 2 and "norm" not in name:
                assert t.shape[0] * t.shape[1] <= -(-full_sizes[name][0] * full_sizes[name][1] // tp), name
        for i in (0, len(whole.model.layers) - 1):
            w, p = whole.model.layers[i], part.model.layers[i]
            heads = part.heads
            d = whole.shape.head_dim
            q = slice(heads.q_start * d, (heads.q_start + heads.num_heads) * d)
            kv = slice(heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
            wq = _dequantized(w.self_attn.qkv_proj)
            nq, nkv = whole.heads.num_heads * d, whole.heads.num_kv_heads * d
            want_qkv = torch.cat([wq[:nq][q], wq[nq:nq + nkv][kv], wq[nq + nkv:][kv]])
            torch.testing.assert_close(_dequantized(p.self_attn.qkv_proj), want_qkv, rtol=0, atol=0)
            torch.testing.assert_close(_dequantized(p.self_attn.o_proj), _dequantized(w.self_attn.o_proj)[:, q],
                                       rtol=0, atol=0)
            inter = w.mlp.down_proj.in_features // tp
            cols = slice(rank * inter, (rank + 1) * inter)
            torch.testing.assert_close(_dequantized(p.mlp.down_proj), _dequantized(w.mlp.down_proj)[:, cols],
                                       rtol=0, atol=0)
            gu = _dequantized(w.mlp.gate_up_proj)
            want_gu = torch.cat([gu[:inter * tp][cols], gu[inter * tp:][cols]])
            torch.testing.assert_close(_dequantized(p.mlp.gate_up_proj), want_gu, rtol=0, atol=0)
        emb = part.model.embed_tokens
        full = whole.model.embed_tokens
        rows = emb.stop - emb.start
        torch.testing.assert_close(_table(emb)[:rows], _table(full)[emb.start:emb.stop], rtol=0, atol=0)


def _default_model_runs(configs, dtype, prompts_of, params):
    from conftest import default_gguf

    runs = {}
    for tp, pp in configs:
        llm = LLM(default_gguf(), dtype=dtype, device="cpu", max_model_len=512, kv_cache_memory="32MiB",
                  tensor_parallel_size=tp,
                  pipeline_parallel_size=pp)
        try:
            runs[tp, pp] = (llm.model_info, llm.generate(prompts_of(llm), params, use_tqdm=False))
        finally:
            llm.shutdown()
    return runs


def _prompts(llm):
    chat = ["What is the capital of France? Tell me about its history.", "Name three primary colours.",
            "Count from one to five."]
    return [llm.client.chat_prompt([{"role": "user", "content": c}]) for c in chat] + \
        [[1] + random_prompts(1, 30, 30, 49152, seed=0)[0]]


def _prompt_lps(outs):
    return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]


def test_default_model_split_three_ways_is_exact_in_float32():
    """The embedded SmolLM2 GGUF (9 heads, 3 KV heads, its Q4_1 / Q8_0 blocks sliced per rank) in float32: T=3
    gives one rank's greedy tokens and its prompt logprobs within 1e-4."""
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0)
    runs = _default_model_runs(((1, 1), (3, 1)), "float32", _prompts, params)
    (_, want), (info, got) = runs[1, 1], runs[3, 1]
    assert info.tensor_parallel_size == 3 and info.quantization is None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    diff = max(abs(a - b) for x, y in zip(_prompt_lps(got), _prompt_lps(want)) for a, b in zip(x, y))
    assert diff < 1e-4


def test_default_model_int4_as_loaded_split_three_ways_and_in_two_stages():
    """int4 as loaded (bf16 activations), T=3 and P=2 against T=1. A split adds partial sums in another order
    (T=3), which moves the bf16 hidden states by their spacing, so scores move by bf16 noise (measured mean
    |d logprob| 0.080 at T=3, 0 at P=2 on an AMX Xeon with float32 logits; float32 agrees to 1e-4, test above).
    Checked: prompt logprobs agree to that noise, and greedy tokens agree except where T=1 itself saw a near tie."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, prompt_logprobs=0)
    # bfloat16 keeps the GGUF's int4 blocks on every CPU (dtype "auto" is float32, dequantized, without fast bf16)
    runs = _default_model_runs(((1, 1), (3, 1), (1, 2)), "bfloat16", _prompts, params)
    want = runs[1, 1][1]
    for key in ((3, 1), (1, 2)):
        info, got = runs[key]
        assert info.quantization == "int4 g32"
        diffs = [abs(a - b) for x, y in zip(_prompt_lps(got), _prompt_lps(want)) for a, b in zip(x, y)]
        assert sum(diffs) / len(diffs) < 0.15, key
        for g, w in zip(got, want):
            g, w = g.outputs[0], w.outputs[0]
            first = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
            if first is not None:  # a near tie in T=1's own scores
                top = w.logprobs[first]
                assert g.token_ids[first] in top, (key, first)
                assert top[w.token_ids[first]].logprob - top[g.token_ids[first]].logprob < 0.6, (key, first)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_under_torchrun_give_the_tokens_of_one_process(llama_dir, tmp_path):
    """Two `torchrun --nnodes=2 --node-rank=0|1` processes on 127.0.0.1 (one rank each, T=2): rank 0 runs the
    script and the engine, rank 1 serves it and ends with it; the tokens are one process's."""
    prompts = random_prompts(3, 5, 30, 49152, seed=41)
    ref = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB")
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(
            prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    finally:
        ref.shutdown()
    out, port = str(tmp_path / "out.json"), _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--master-addr=127.0.0.1", f"--master-port={port}"]
    script = [os.path.join(SCRIPTS, "launched.py"), llama_dir, out, "2", "1", json.dumps(prompts)]
    nodes = [subprocess.Popen(torchrun + [f"--node-rank={n}"] + script, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    logs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    with open(out) as f:
        result = json.load(f)
    assert result == {"executor": "launched", "tokens": want}


def test_ray_executor_gives_the_tokens_of_one_process(llama_dir):
    pytest.importorskip("ray")
    prompts = random_prompts(3, 5, 30, 49152, seed=42)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB")
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.shutdown()
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB",
              tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert llm.model_info.executor == "ray"
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()
    import ray

    assert not ray.is_initialized()  # the local cluster it started is stopped again


def test_a_killed_worker_ends_requests_with_an_error_and_leaves_nothing(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB",
              tensor_parallel_size=2)
    pids = core_of(llm).executor.pids
    errors: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(random_prompts(4, 5, 20, 49152, seed=43),
                         SamplingParams(max_tokens=230, ignore_eos=True), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    while llm.stats()["running"] == 0:
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - start < 10
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "rank 1" in str(errors[0]) and "exited with code -9" in str(errors[0])
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not _wait_gone(pids, 5)
    llm.shutdown()


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(llama_dir, monkeypatch):
    from ember.executor import multiproc

    monkeypatch.setattr(multiproc, "RANK_COMMAND", [sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"could not start: rank 1 \(pid \d+\) exited with code 3"):
        LLM(llama_dir, dtype="float32", device="cpu", tensor_parallel_size=2, kv_cache_memory="16MiB")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("how", ["end", "exception", "sigint"])
def test_the_script_ending_leaves_no_worker_behind(llama_dir, how):
    shm = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "ends.py"), llama_dir, how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()[1:]]
    assert pids, proc.communicate()[1]
    if how == "sigint":
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode == 0) == (how == "end"), err
    if how != "end":
        assert ("KeyboardInterrupt" if how == "sigint" else "the user's code failed") in err
    assert not _wait_gone(pids), f"ranks {pids} outlived the script"
    assert set(os.listdir("/dev/shm")) <= shm  # no shared-memory segment left either


def test_sizes_that_cannot_work_fail_before_any_process_starts(llama_dir, monkeypatch):
    from ember.config import EngineConfig
    from ember.model_loader import check_parallel

    before = set(os.listdir("/proc"))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 is out of range .* allowed: \[1, 2, 4\]"):
        LLM(llama_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 is out of range: .* 2 layers; allowed: 1..2"):
        LLM(llama_dir, pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match=r"distributed_executor_backend='nccl' is not supported: use one of "
                                          r"'uni', 'mp', 'launched', 'ray'"):
        LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="nccl")
    with pytest.raises(ConfigError, match="'uni' runs one rank"):
        LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="needs every rank started by a launcher"):
        LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="launched")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=0 is out of range"):
        LLM(llama_dir, tensor_parallel_size=0)
    spawned = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _alive(int(p))]
    assert not [p for p in spawned if "ember.executor" in open(f"/proc/{p}/cmdline").read()]
    # more ranks than CUDA devices (checked with a pretend device count: this machine has no GPU)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = EngineConfig(llama_dir).resolve().model
    cuda = type(model)(**{**{f: getattr(model, f) for f in model.__slots__}, "device": "cuda"})
    with pytest.raises(ConfigError, match=r"2 ranks on this machine .* is out of range: it has 1 CUDA devices"):
        check_parallel(cuda, 2, 1, ranks_here=2)
    check_parallel(cuda, 2, 2, ranks_here=1)  # one rank here of four launched over several machines
    check_parallel(cuda, 2, 2, ranks_here=None)  # a Ray cluster places them


def test_int4_groups_that_a_split_would_cut_are_refused(tiny_models):
    """The tiny models' o_proj has 64 inputs, so int4 takes groups of 64 there: they cannot be split over 2 ranks."""
    with pytest.raises(ConfigError, match=r"int4 groups of 64: each rank's 32 inputs of o_proj must hold whole "
                                          r"groups; allowed: \[1\], or a smaller quant_group_size"):
        LLM(tiny_models["llama"], quantization="int4", quant_group_size=128, tensor_parallel_size=2, device="cpu")


def test_async_llm_and_the_cli_split_a_model(llama_dir):
    """AsyncLLM(tensor_parallel_size=2) streams one rank's tokens; `ember generate -tp 2` runs."""
    import asyncio

    from ember import AsyncLLM

    prompt = random_prompts(1, 10, 10, 49152, seed=44)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB")
    try:
        want = ref.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        ref.shutdown()

    async def run() -> list[int]:
        llm = AsyncLLM(llama_dir, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="16MiB",
                       tensor_parallel_size=2)
        try:
            last = None
            async for out in llm.generate(prompt, params):
                last = out
            return last.outputs[0].token_ids
        finally:
            llm.shutdown()

    assert asyncio.run(run()) == want
    cli = subprocess.run([sys.executable, "-m", "ember", "generate", "hello", "--model", llama_dir, "--no-chat",
                          "-tp", "2", "--max-tokens", "5", "--dtype", "float32", "--device", "cpu",
                          "--kv-cache-memory", "16MiB", "--max-model-len", "256"],
                         capture_output=True, text=True, timeout=180)
    assert cli.returncode == 0, cli.stderr
    assert "5 tokens in" in cli.stderr


def test_a_gguf_column_slice_that_cuts_a_block_reads_only_the_covering_blocks():
    """Blocks that are dequantized where a slice cuts them (the 256-value blocks of Q4_K / Q5_K / Q6_K; Q6_K here) may
    be cut by a rank's columns: the covering blocks are read and trimmed after dequantizing. Blocks kept as they are
    (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 -> int4 / int5 / int8) must not be cut."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import quantize_q6_k

    from ember.distributed import WeightSlice
    from ember.model_loader.gguf import _slice_raw
    from ember.model_loader.gguf_file import GGUFTensor

    def tensor(raw, kind, k):
        return GGUFTensor("t", kind, (k, 4), raw, *gguf.GGML_QUANT_SIZES[kind])

    x = np.random.default_rng(0).standard_normal((4, 768)).astype(np.float32)
    raw = quantize_q6_k(x)
    part, rows, cols, trim = _slice_raw(raw, tensor(raw, Q.Q6_K, 768), WeightSlice(1, 300, 500), 4, 768, keep=False)
    assert part.shape[1] < raw.shape[1] and (rows, cols) == (4, 200)  # block 1 of 3, not the whole rows
    got = gguf.dequantize(part, Q.Q6_K)[:, trim[0]:trim[1]]
    np.testing.assert_array_equal(got, gguf.dequantize(raw, Q.Q6_K)[:, 300:500])
    for kind in (Q.Q8_0, Q.Q5_0):
        kept = gguf.quants.quantize(x[:, :128], kind)
        with pytest.raises(ValueError, match="cut a block"):
            _slice_raw(kept, tensor(kept, kind, 128), WeightSlice(1, 40, 100), 4, 128, keep=True)


def test_dashinfer_gpu_ids_split_the_model(llama_dir, tmp_path, monkeypatch):
    """DashInfer's compute_unit(CUDA, [0, 1]) is tensor parallelism over two GPUs (checked as a configuration:
    this machine has none, where the same call runs one CPU engine)."""
    from ember.compat.dashinfer.allspark.engine import engine_config
    from ember.compat.dashinfer.allspark.runtime_config import AsModelConfig
    from ember.model_loader.convert import convert

    path = convert(llama_dir, str(tmp_path), "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = engine_config(AsModelConfig("m", path, compute_unit="CUDA:0,1"), warn=False)
    assert (cpu.device, cpu.tensor_parallel_size) == ("cpu", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = engine_config(AsModelConfig("m", path, compute_unit="CUDA:0,1"), warn=False)
    assert (gpu.device, gpu.tensor_parallel_size) == ("cuda", 2)
    with pytest.raises(ValueError, match="set CUDA_VISIBLE_DEVICES=2,3 and pass device ids"):
        engine_config(AsModelConfig("m", path, compute_unit="CUDA:2,3"), warn=False)
