"""StreamingLLM (attention_window + sink_tokens) against a reference written here: transformers'
own Llama, recomputing the whole sequence each step with an attention mask that lets position q see keys
k <= q with k < sink or k > q - (window - sink), keys at their original positions. Float32, greedy."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_float32, random_prompts

from ember import LLM, SamplingParams
from ember.errors import BadRequestError, ConfigError

SINK, WINDOW = 4, 16
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return hf_float32(llama_dir, attn_implementation="eager")


def reference(hf, prompt: list[int], new: int, sink: int = SINK, window: int = WINDOW) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        n = len(ids)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (k <= q) & ((k < sink) | (k > q - (window - sink)))
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            ids.append(int(hf(torch.tensor([ids]), attention_mask=mask).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def streaming(llama_dir):
    # a pool of 12 blocks of 4 tokens: three sequences' windows (16 tokens each), far less than 4 windows of tokens
    llm = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=12 * 4 * 512, max_model_len=256,
              attention_window=WINDOW, sink_tokens=SINK, max_num_seqs=3)
    yield llm
    llm.shutdown()


def test_four_windows_match_reference_with_constant_memory(hf, streaming):
    prompts = random_prompts(3, 5, 9, hf.config.vocab_size, seed=3)
    outs = streaming.generate(prompts, SamplingParams(max_tokens=4 * WINDOW, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(hf, prompt, 4 * WINDOW)
    stats = streaming.stats()
    assert stats["kv_blocks_total"] == 12 and stats["preemptions"] == 0  # 3 x 64+ tokens in 48 slots
    assert stats["kv_blocks_free"] == 12


def test_prompt_longer_than_window_and_samples(hf, streaming):
    """A 40-token prompt (past the window: its tail is computed one token a step); n=2 greedy samples each
    compute their own ring."""
    prompt = random_prompts(1, 40, 40, hf.config.vocab_size, seed=4)[0]
    want = reference(hf, prompt, 20)
    out = streaming.generate([prompt], SamplingParams(max_tokens=20, n=2, **GREEDY), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_window_as_long_as_the_sequence_is_ordinary_attention(hf, llama_dir):
    prompt = random_prompts(1, 8, 8, hf.config.vocab_size, seed=5)[0]
    llm = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=256,
              attention_window=8 + 24, sink_tokens=SINK)
    plain = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=256)
    try:
        params = SamplingParams(max_tokens=24, **GREEDY)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        # and the reference with that window (then ordinary causal attention) agrees
        assert reference(hf, prompt, 24, window=8 + 24) == got
    finally:
        llm.shutdown()
        plain.shutdown()


def test_streaming_llm_errors(streaming, tiny_models):
    with pytest.raises(ConfigError, match="sink_tokens=4 needs attention_window"):
        LLM(tiny_models["llama"], sink_tokens=4)
    with pytest.raises(ConfigError, match="attention_window=4 is out of range"):
        LLM(tiny_models["llama"], attention_window=4, sink_tokens=4)
    with pytest.raises(ConfigError, match="sliding-window"):
        LLM(tiny_models["mistral"], dtype="float32", kv_cache_memory="4MiB", attention_window=32)
    with pytest.raises(BadRequestError, match="beam_width=2 is not supported with attention_window"):
        streaming.generate([[5, 6, 7]], SamplingParams(beam_width=2, max_tokens=4), use_tqdm=False)
