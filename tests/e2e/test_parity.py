"""Greedy tokens and logprobs against transformers, in float32, for every architecture."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY, default_gguf, hf_float32, hf_greedy, random_prompts

from ember import LLM, SamplingParams

NEW_TOKENS = 40


@pytest.mark.parametrize("kind", list(TINY))
def test_greedy_parity_tiny(kind, tiny_models):
    path = tiny_models[kind]
    hf = hf_float32(path)
    prompts = random_prompts(4, 3, 70, hf.config.vocab_size, seed=1)  # some exceed mistral's 48-token window
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, exp in zip(outs, expected):
        assert out.outputs[0].token_ids == exp


def test_logprobs_match_transformers(tiny_models):
    path = tiny_models["qwen2"]
    hf = hf_float32(path)
    prompt = random_prompts(1, 20, 20, hf.config.vocab_size, seed=3)[0]
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                                                    prompt_logprobs=5), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    comp = out.outputs[0]
    full = prompt + comp.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].float().log_softmax(-1)
    # generated tokens: position len(prompt)-1+i predicts token i
    for i, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lps[t].logprob - v) < 1e-4
        assert lps[tok].rank == 1  # greedy picks the most likely token
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(comp.token_ids,
                                                                                         comp.logprobs)), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4


def test_greedy_parity_real_smollm2_gguf():
    """The real default model: transformers dequantizes the same GGUF; both run in float32."""
    path = default_gguf()
    hf = hf_float32(os.path.dirname(path), gguf_file=os.path.basename(path))
    llm = LLM(path, dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    try:
        tok = llm.tokenizer
        texts = ["The history of the Roman Empire", "def fibonacci(n):",
                 llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}])]
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_parity_with_small_prefill_chunks(kind, tiny_models):
    """Prompts split into 16-token chunks (mistral: across its 48-token sliding window) still match transformers."""
    path = tiny_models[kind]
    hf = hf_float32(path)
    prompts = random_prompts(3, 40, 90, hf.config.vocab_size, seed=4)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
