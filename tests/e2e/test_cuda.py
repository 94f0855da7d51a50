"""The CUDA paths: Triton's paged decode attention and KV write against the gathered torch reference, and decode
steps replayed from CUDA graphs against eager steps and transformers. Skipped without a CUDA device (CI has none;
docs/cuda.md keeps what a GPU machine measured)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_float32, hf_greedy, random_prompts
from internals import worker_of

from ember import LLM, SamplingParams
from ember.worker.cuda_graph import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    assert capture_sizes(10_000)[-1] == 512
    for top in (3, 13, 200):
        sizes = capture_sizes(top)
        assert sizes[-1] == top and all(any(s >= n for s in sizes) for n in range(1, top + 1))


def _reference(q, k_cache, v_cache, tables, lens, window, scale):
    """Each sequence's keys gathered and attended in float32, one at a time."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    for i in range(n):
        length = int(lens[i])
        if length == 0:
            continue
        k = k_cache[tables[i]].reshape(-1, hkv, d)[:length].float()
        v = v_cache[tables[i]].reshape(-1, hkv, d)[:length].float()
        first = max(length - window, 0) if window else 0
        k = k[first:].repeat_interleave(hq // hkv, dim=1)
        v = v[first:].repeat_interleave(hq // hkv, dim=1)
        probs = (torch.einsum("hd,shd->hs", q[i].float(), k) * scale).softmax(dim=-1)
        out[i] = torch.einsum("hs,shd->hd", probs, v)
    return out


@needs_cuda
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block,window,width", [
    (torch.float32, 9, 3, 64, 16, 0, 6), (torch.bfloat16, 14, 2, 64, 16, 0, 6), (torch.float16, 8, 8, 128, 8, 0, 6),
    (torch.float32, 9, 3, 64, 16, 20, 6),
    # tables wider than PART_BLOCKS: each context split over 3 programs, merged by log-sum-exp
    (torch.float32, 9, 3, 64, 4, 0, 40), (torch.bfloat16, 14, 2, 64, 4, 0, 40), (torch.float32, 9, 3, 64, 4, 70, 40)])
def test_triton_decode_attention_matches_the_gathered_reference(dtype, heads, kv_heads, head_dim, block, window,
                                                                width):
    from ember.kernels import triton_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    blocks, n = 200, 5
    k_cache = torch.randn(blocks, block, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    tables = torch.randint(0, blocks, (n, width), device="cuda", generator=g)
    lens = torch.tensor([1, 37, width * block, 0, block], device="cuda")  # 0: a graph's padding row
    q = torch.randn(n, heads, head_dim, device="cuda", generator=g).to(dtype)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, window, head_dim ** -0.5)
    want = _reference(q, k_cache, v_cache, tables, lens, window, head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    assert out[3].abs().max() == 0


@needs_cuda
def test_triton_kv_write_skips_negative_slots():
    from ember.kernels import triton_attention

    k_cache = torch.randn(8, 16, 3, 64, device="cuda")
    v_cache = torch.randn(8, 16, 3, 64, device="cuda")
    qkv = torch.randn(5, 7 * 64, device="cuda")  # k and v as views into a fused projection, as the model has them
    k, v = qkv[:, :3 * 64].view(5, 3, 64), qkv[:, 3 * 64:6 * 64].view(5, 3, 64)
    slots = torch.tensor([3, -1, 100, 7, -1], device="cuda")
    want_k, want_v = k_cache.clone().view(-1, 3, 64), v_cache.clone().view(-1, 3, 64)
    keep = slots >= 0
    want_k[slots[keep]], want_v[slots[keep]] = k[keep], v[keep]
    triton_attention.write_kv_(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.view(-1, 3, 64), want_k) and torch.equal(v_cache.view(-1, 3, 64), want_v)


@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_graph_replayed_decode_matches_eager_and_transformers(kind, tiny_models):
    """Five prompts (a batch padded to the 8-row graph, shrinking to 1 row as they finish) through the graphs, the
    same through eager steps, and transformers' greedy tokens: all equal in float32. Mistral's window included."""
    path = tiny_models[kind]
    hf = hf_float32(path)
    prompts = random_prompts(5, 3, 70, hf.config.vocab_size, seed=4)
    lengths = [40, 9, 25, 3, 17]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory="32MiB", max_num_seqs=16,
                  enforce_eager=eager)
        try:
            worker = worker_of(llm)
            assert worker.attention_backend.name == "triton"
            assert (worker.graphs is None) == eager
            if not eager:
                assert worker.graphs.sizes == [1, 2, 4, 8, 16]
            outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert outs[False] == outs[True] == expected


def test_enforce_eager_takes_a_bool(llama_dir):
    from ember.config import EngineConfig
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match=r"enforce_eager='yes' is out of range: it must be True or False"):
        EngineConfig(llama_dir, enforce_eager="yes")
