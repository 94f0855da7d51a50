"""Speculative decoding end to end (docs/speculative.md): drafts verified by the model in continuous batching change
no token. Greedy output equals transformers' in float32 and the engine's own output without speculation, seeded
sampling draws the same tokens, logprobs match, and a LoRA adapter, a small KV pool (preemption) and chunked
prefill leave it so. On the real default model a copy task keeps most drafted tokens."""

from __future__ import annotations

import pytest
from conftest import TESTS, hf_float32, hf_greedy, peft_adapter, random_prompts
from internals import core_of, oracle_drafts, worker_of

from ember import LLM, SamplingParams
from ember.errors import BadRequestError
from ember.lora import LoRARequest

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_and_logprobs_are_those_of_one_token_steps(llama_dir, monkeypatch):
    prompts = random_prompts(6, 5, 40, 49152, 2)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB") as base:
        want = base.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    oracle_drafts(monkeypatch, prompts, _tokens(want))
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config=NGRAM) as llm:
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.stats()
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 50 and 0 < kept < drafted
    hf = hf_float32(llama_dir)
    for p, g, w in zip(prompts, got, want):
        assert g.outputs[0].token_ids == hf_greedy(hf, p, 24) == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank


def test_start_up_times_the_verify_step_for_every_draft_length(llama_dir):
    """The speculator sizes drafts by what verifying them costs on this machine (``worker.verify_cost``): a cost
    for every length up to num_speculative_tokens, a decode step's at 0, never falling; the blocks the timing
    wrote are zeros again before the first request."""
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config=NGRAM) as llm:
        costs = core_of(llm).speculator.verify_costs
        assert len(costs) == NGRAM["num_speculative_tokens"] + 1 and costs[0] == 1.0
        assert all(a <= b < float("inf") for a, b in zip(costs, costs[1:]))
        assert not worker_of(llm).kv_cache.any()
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB") as llm:  # nothing to size: nothing timed
        assert core_of(llm).speculator.verify_costs is None


def test_seeded_sampling_draws_the_same_tokens(llama_dir, monkeypatch):
    prompts = random_prompts(3, 5, 40, 49152, 3)
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, n=2)
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB") as base:
        want = [[c.token_ids for c in o.outputs] for o in base.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    oracle_drafts(monkeypatch, [p for p in prompts for _ in range(2)], [t for w in want for t in w])
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config=NGRAM) as llm:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
        assert llm.stats()["spec_decode_num_drafts"] > 0
    assert got == want


def test_small_pool_chunked_prefill_and_lora_change_nothing(llama_dir, tmp_path, monkeypatch):
    """Sixteen requests over a pool of a few sequences (preemptions), 48-token steps (chunked prompts), half of them
    through a LoRA adapter."""
    adapter = str(tmp_path / "adapter")
    peft_adapter(llama_dir, adapter)
    lora = LoRARequest("a", 1, adapter)
    prompts = random_prompts(16, 5, 40, 49152, 5)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    # 12 blocks of 16 tokens (2 layers x K and V x 2 heads x 16 dims x 4 bytes a token)
    kw = dict(dtype="float32", kv_cache_memory=12 * 16 * 512, max_model_len=128, max_num_batched_tokens=48,
              enable_lora=True, max_lora_rank=8)
    loras = [lora if i % 2 else None for i in range(len(prompts))]
    with LLM(llama_dir, **kw) as base:
        want = _tokens(base.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras,
                                     use_tqdm=False))
    oracle_drafts(monkeypatch, prompts, want)
    with LLM(llama_dir, speculative_config=NGRAM, **kw) as llm:
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras,
                                   use_tqdm=False))
        stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_copy_task_on_the_default_model_keeps_most_drafts(method):
    """The real SmolLM2-135M-Instruct asked to copy a passage: the drafts from the prompt (n-gram lookup, suffix
    decoding) are often kept, the text is what one-token steps give, and a stop string cuts it at the same place."""
    passage = open(f"{TESTS}/data/alice_ch1.txt").read()[33:900]
    messages = [{"role": "user", "content": f'Copy this text:\n\n"""{passage}"""'}]
    sp = SamplingParams(max_tokens=96, temperature=0)
    stop = SamplingParams(max_tokens=96, temperature=0, stop=["sister"])
    with LLM() as base:
        want = [base.chat(messages, p, use_tqdm=False)[0].outputs[0] for p in (sp, stop)]
    with LLM(speculative_config={"method": method, "num_speculative_tokens": 4}) as llm:
        got = [llm.chat(messages, p, use_tqdm=False)[0].outputs[0] for p in (sp, stop)]
        stats = llm.stats()
    for g, w in zip(got, want):
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
    assert got[1].finish_reason == "stop" and "sister" not in got[1].text
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert drafted > 40 and accepted / drafted > 0.4, stats  # the 135M model copies loosely: 0.55 here


def _chi_square(a: list[int], b: list[int], top: int = 5) -> float:
    """Two-sample chi-square statistic over the top categories of a and b (the rest pooled)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cats = [t for t, _ in (ca + cb).most_common(top)]
    rows = [[ca[t] for t in cats] + [len(a) - sum(ca[t] for t in cats)],
            [cb[t] for t in cats] + [len(b) - sum(cb[t] for t in cats)]]
    total = len(a) + len(b)
    stat = 0.0
    for j in range(len(cats) + 1):
        col = rows[0][j] + rows[1][j]
        for i, n in enumerate((len(a), len(b))):
            expected = n * col / total
            if expected > 0:
                stat += (rows[i][j] - expected) ** 2 / expected
    return stat


def test_unseeded_sampling_keeps_its_distribution(llama_dir, monkeypatch):
    """1,000 unseeded samples of 4 tokens with and without drafts (the greedy continuation, so drafts are kept and
    rejected at every position): each position's token distribution is the same (two-sample chi-square over the top
    5 tokens and the rest; 35 is p < 1e-5 at 5 degrees of freedom)."""
    prompt = random_prompts(1, 8, 8, 49152, 7)[0]
    greedy = hf_greedy(hf_float32(llama_dir), prompt, 4)
    sp = SamplingParams(max_tokens=4, temperature=0.3, ignore_eos=True)  # the greedy token: ~60% of draws
    n = 1000
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB") as base:
        want = _tokens(base.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False))
    oracle_drafts(monkeypatch, [prompt], [greedy])
    spec = {**NGRAM, "disable_by_batch_size": 64}  # every row of the 64-row batches drafts
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config=spec) as llm:
        got = _tokens(llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False))
        stats = llm.stats()
    kept, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 100 < kept < drafted, stats
    for i in range(4):
        assert _chi_square([t[i] for t in got], [t[i] for t in want]) < 35, i
    assert sum(t[0] == greedy[0] for t in got) < n  # it samples: not every answer is the greedy one


def test_a_prediction_under_a_streaming_window_is_refused(llama_dir):
    """A StreamingLLM window cannot take a draft's KV: a prediction is refused by name, the engine serves on."""
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", attention_window=64) as llm:
        with pytest.raises(BadRequestError, match=r"prompt\['prediction_token_ids'\] is not supported with attention"):
            llm.generate([{"prompt_token_ids": [5, 6, 7], "prediction_token_ids": [8, 9]}], use_tqdm=False)
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
