"""The sampler's masks and penalties against transformers' logits processors on random logits."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ember.layers.logits_processors import RowState, apply_presence_frequency, apply_repetition_penalty
from ember.layers.sampler import filter_candidates
from ember.protocol import SamplingRow

V = 257


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def top_k_top_p_min_p(logits, top_k, top_p, min_p) -> torch.Tensor:
    """Our candidates scattered back to full rows, -inf where removed, to compare with transformers."""
    cand = filter_candidates(logits, top_k, top_p, min_p)
    return torch.full_like(logits, float("-inf")).scatter(1, cand.ids, cand.logits)


def _same_mask(a: torch.Tensor, b: torch.Tensor, undecided: torch.Tensor | None = None) -> None:
    """Same tokens kept and the same values; ``undecided`` marks tokens either side may keep."""
    differ = torch.isinf(a) != torch.isinf(b)
    if undecided is not None:
        differ &= ~undecided
    assert not differ.any()
    finite = ~torch.isinf(a) & ~torch.isinf(b)
    torch.testing.assert_close(a[finite], b[finite])


def _top_p_undecided(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Tokens whose probability mass ranked above them (among the top k, when k > 0) is within float32 summation
    error of p: top-p keeps or drops them by rounding (ours sums the mass from the top, transformers from the
    bottom), so neither answer is wrong."""
    logits = logits.double()
    if k > 0:
        logits = logits.masked_fill(logits < logits.topk(min(k, logits.shape[-1])).values[..., -1:], float("-inf"))
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    above = sorted_probs.cumsum(-1) - sorted_probs
    near = (above - p).abs() < 2e-6  # float32 sums of <= 257 probabilities: a few ulps of 1 (seen: 1.9e-7)
    return torch.zeros_like(near).scatter(-1, order, near)


def _transformers_warped(logits: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """transformers' TopK -> TopP -> MinP warpers, in generate's order, on one row [1, V]."""
    ref = logits.clone()
    if k > 0:
        ref = TopKLogitsWarper(k)(None, ref)
    if p < 1:
        ref = TopPLogitsWarper(p)(None, ref)
    if min_p > 0:
        ref = MinPLogitsWarper(min_p)(None, ref)
    return ref


def _check_rows(logits: torch.Tensor, ks: list[int], ps: list[float], mins: list[float]) -> None:
    ours = top_k_top_p_min_p(logits, torch.tensor(ks), torch.tensor(ps), torch.tensor(mins))
    for row, (k, p, m) in enumerate(zip(ks, ps, mins)):
        _same_mask(ours[row:row + 1], _transformers_warped(logits[row:row + 1], k, p, m))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 300), p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9),
       temp=st.floats(0.1, 2.0))
def test_warpers_match_transformers(seed, k, p, min_p, temp):
    logits = _logits(seed)
    ref = _transformers_warped(TemperatureLogitsWarper(temp)(None, logits.clone()), k, p, min_p)
    ours = top_k_top_p_min_p(logits / temp, torch.tensor([k]), torch.tensor([p]), torch.tensor([min_p]))
    _same_mask(ours, ref, _top_p_undecided(logits / temp, k, p) if p < 1 else None)


@pytest.mark.parametrize("scale", [3.0, 0.01])  # peaked: the 512 candidates suffice; flat: full sort
def test_warpers_per_row_large_vocab(scale):
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(8)) * scale
    _check_rows(logits, [0, 3000, 0], [0.9, 0.95, 1.0], [0.0, 0.0, 0.1])


def test_warpers_per_row_in_one_batch():
    _check_rows(_logits(7, rows=3), [5, 0, 50], [1.0, 0.7, 0.9], [0.0, 0.0, 0.2])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), penalty=st.floats(0.5, 2.0),
       ids=st.lists(st.integers(0, V - 1), min_size=1, max_size=40))
def test_repetition_penalty_matches_transformers(seed, penalty, ids):
    logits = _logits(seed)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits.clone())
    seen = torch.bincount(torch.tensor(ids), minlength=V)[None] > 0
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, torch.tensor([penalty])), ref)


def test_presence_frequency_openai_definition():
    logits = _logits(1)
    out_ids = [3, 3, 3, 9, 200]
    counts = torch.bincount(torch.tensor(out_ids), minlength=V)[None].float()
    got = apply_presence_frequency(logits, counts, torch.tensor([0.5]),
                                   torch.tensor([0.25]))
    expected = logits.clone()
    for t in set(out_ids):
        expected[0, t] -= 0.5 + 0.25 * out_ids.count(t)
    torch.testing.assert_close(got, expected)


@settings(max_examples=30, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=20),
       steps=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=4), max_size=6))
def test_penalty_counts_kept_between_steps_equal_counting_the_whole_history(prompt, steps):
    """A sample's token counts are updated with each step's new tokens only; they must equal counting the whole
    sequence (and its output) from scratch at every step."""
    from ember import SamplingParams

    state, tokens = RowState(None), list(prompt)
    for new in [[]] + steps:
        tokens.extend(new)
        row = SamplingRow(0, SamplingParams(repetition_penalty=1.2), None, len(tokens) - len(prompt), tokens,
                          len(prompt))
        counts = state.token_counts(row, V, torch.device("cpu"))
        assert counts[0].tolist() == torch.bincount(torch.tensor(tokens), minlength=V).float().tolist()
        out = torch.bincount(torch.tensor(tokens[len(prompt):], dtype=torch.long), minlength=V).float()
        assert counts[1].tolist() == out.tolist()


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("max_tokens", 0), ("min_p", 1.5), ("n", 0), ("logprobs", 21),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
                                         ("stop", [""])])
def test_sampling_params_validation_names_field(field, value):
    from ember import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ----- no_repeat_ngram_size, bad_words_ids, output-only repetition penalty, stop token sequences: end to end ----

def _hf_processed_greedy(model, prompt: list[int], steps: int, processors: list) -> list[int]:
    """transformers' greedy tokens with the given logits processors applied to each step's scores."""
    from transformers.generation.logits_process import LogitsProcessorList

    procs = LogitsProcessorList(processors)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(steps):
            scores = procs(ids, out.logits[:, -1].float())
            nxt = scores.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer_dir):
    """A random Llama over only 64 token ids, so that greedy outputs repeat tokens and n-grams and the bans bite;
    (its checkpoint folder carries the default tokenizer, of which it uses the first 64 ids)."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from ember import LLM

    out = str(tmp_path_factory.mktemp("small-vocab"))
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(out)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out)
    llm = LLM(out, dtype="float32", max_num_seqs=8, kv_cache_memory="16MiB")
    # the same model verifying drafts (each position sampled with the drafted tokens before it in its history)
    spec = LLM(out, dtype="float32", max_num_seqs=8, kv_cache_memory="16MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    yield hf, llm, spec
    llm.shutdown()
    spec.shutdown()


@pytest.mark.parametrize("case", ["ngram1", "ngram2", "ngram3", "bad_words", "rep_output_only", "rep"])
def test_token_bans_and_penalties_match_transformers(case, small_vocab, monkeypatch):
    """Each case also with speculative decoding: drafts of the expected answer with every third token wrong
    (``oracle_drafts``), kept whole, in part and not at all, give the same tokens."""
    from transformers.generation.logits_process import (NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor)

    from conftest import random_prompts
    from internals import oracle_drafts

    from ember import SamplingParams

    hf, llm, spec = small_vocab
    prompts = random_prompts(4, 3, 12, 1000, seed=11)
    prompts = [[t % 61 + 3 for t in p] for p in prompts]  # into the small vocabulary, past BOS/EOS
    steps = 64
    changed, answers, requests = [], [], []
    for prompt in prompts:
        # bad words chosen from the unconstrained greedy output, so that they bite
        free = _hf_processed_greedy(hf, prompt, steps, [])
        if case.startswith("ngram"):
            n = int(case[-1])
            kwargs, procs = {"no_repeat_ngram_size": n}, [NoRepeatNGramLogitsProcessor(n)]
        elif case == "bad_words":
            words = [[free[0]], [free[3], free[4]], [prompt[-1], free[0], 7]]
            kwargs, procs = {"bad_words_ids": words}, [NoBadWordsLogitsProcessor(words)]
        elif case == "rep":
            kwargs, procs = {"repetition_penalty": 1.8}, [RepetitionPenaltyLogitsProcessor(1.8)]
        else:
            kwargs = {"repetition_penalty": 1.8, "repetition_penalty_output_only": True}
            procs = [RepetitionPenaltyLogitsProcessor(1.8, prompt_ignore_length=len(prompt))]
        expected = _hf_processed_greedy(hf, prompt, steps, procs)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, **kwargs)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected, case
        changed.append(got != free)
        answers.append(expected)
        requests.append(params)
    assert any(changed)  # the constraint bit somewhere
    oracle_drafts(monkeypatch, prompts, answers, vocab=64)
    before = spec.stats()
    outs = spec.generate(prompts, requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == answers, case
    after = spec.stats()
    drafted, kept = (after[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    assert 0 < kept < drafted


def test_stop_token_sequence_ends_generation_and_stays_in_output(tiny_llm):
    from ember import SamplingParams

    prompt = [120, 340, 560, 780]
    free = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop = free[5:7]
    first = next(i for i in range(1, len(free)) if free[i - 1:i + 1] == stop)  # earliest end of the sequence
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop_token_sequences=[[5, 6, 7], stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


@pytest.mark.parametrize("field,value", [("no_repeat_ngram_size", -1), ("bad_words_ids", [[]]),
                                         ("stop_token_sequences", [[1, -2]]), ("eos_token_ids", (-1,))])
def test_new_sampling_fields_validated(field, value):
    from ember import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unseeded_draws_come_from_the_samplers_own_generator():
    """Unseeded rows draw from a generator of the sampler's own, seeded by the engine's seed: the process's global
    RNG (which a user or another engine may reseed, and which a CUDA graph capture marks as capturing) neither moves
    their tokens nor is moved by them."""
    from ember.layers.logits_processors import RowState
    from ember.layers.sampler import Sampler
    from ember.protocol import SamplingRow
    from ember.sampling_params import SamplingParams

    logits = torch.zeros(6, V)  # uniform: every draw is the noise's choice
    rows = [SamplingRow(i, SamplingParams(temperature=1.0), None, 0) for i in range(6)]

    def draw(seed: int, global_seed: int) -> tuple[list[int], float]:
        sampler = Sampler(V, seed=seed)
        torch.manual_seed(global_seed)
        tokens = sampler(logits, rows, [RowState(None) for _ in rows]).token_ids
        return tokens + sampler(logits, rows, [RowState(None) for _ in rows]).token_ids, torch.rand(1).item()

    a, after_a = draw(seed=0, global_seed=1)
    b, after_b = draw(seed=0, global_seed=2)
    c, _ = draw(seed=5, global_seed=1)
    assert a == b and a != c
    torch.manual_seed(1)
    assert after_a == torch.rand(1).item()


def test_thinking_budget_forces_the_end_tag_then_decodes_as_transformers(tiny_llm, llama_dir, monkeypatch):
    """A prompt that opens <think>: after thinking_token_budget tokens the end tag's tokens are forced (several
    tokens in this vocabulary), then greedy decoding goes on; every unforced token equals transformers' greedy
    token on the same prefix, with speculative decoding too. A prompt without an open block decodes as without a
    budget."""
    from conftest import hf_float32, hf_greedy

    from ember import SamplingParams

    tok = tiny_llm.client.tokenizer
    start, end = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert len(end) > 1
    hf = hf_float32(llama_dir)
    prompt = [120, 340, 560, 780] + start
    for budget in (0, 3):
        out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=budget + len(end) + 4,
                                                         ignore_eos=True, thinking_token_budget=budget),
                                use_tqdm=False)[0].outputs[0].token_ids
        thought = hf_greedy(hf, prompt, budget)
        after = hf_greedy(hf, prompt + thought + end, 4)
        assert out == thought + end + after, budget
    # with speculative decoding: drafts of that answer, every third token wrong, through the forced end tag
    from internals import oracle_drafts

    from ember import LLM

    budget, answer = 3, thought + end + after
    oracle_drafts(monkeypatch, [prompt], [answer])
    with LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB",
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as spec:
        out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=len(answer), ignore_eos=True,
                                                     thinking_token_budget=budget), use_tqdm=False)
        assert out[0].outputs[0].token_ids == answer
        assert 0 < spec.stats()["spec_decode_num_accepted_tokens"] < spec.stats()["spec_decode_num_draft_tokens"]
    plain = [120, 340, 560, 780]
    free = tiny_llm.generate([plain], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    limited = tiny_llm.generate([plain], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        thinking_token_budget=0), use_tqdm=False)[0].outputs[0]
    assert limited.token_ids == free
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
