"""The sampler's masks and penalties against transformers' logits processors on random logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ember.layers.logits_processors import apply_presence_frequency, apply_repetition_penalty, token_counts
from ember.layers.sampler import filter_candidates

V = 257


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def top_k_top_p_min_p(logits, top_k, top_p, min_p) -> torch.Tensor:
    """Our candidates scattered back to full rows, -inf where removed, to compare with transformers."""
    cand = filter_candidates(logits, top_k, top_p, min_p)
    return torch.full_like(logits, float("-inf")).scatter(1, cand.ids, cand.logits)


def _same_mask(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    finite = ~torch.isinf(a)
    torch.testing.assert_close(a[finite], b[finite])


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
    _same_mask(ours, ref)


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
    seen = token_counts([ids], V, logits.device) > 0
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, torch.tensor([penalty])), ref)


def test_presence_frequency_openai_definition():
    logits = _logits(1)
    out_ids = [3, 3, 3, 9, 200]
    got = apply_presence_frequency(logits, token_counts([out_ids], V, logits.device), torch.tensor([0.5]),
                                   torch.tensor([0.25]))
    expected = logits.clone()
    for t in set(out_ids):
        expected[0, t] -= 0.5 + 0.25 * out_ids.count(t)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("max_tokens", 0), ("min_p", 1.5), ("n", 0), ("logprobs", 21),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
                                         ("stop", [""])])
def test_sampling_params_validation_names_field(field, value):
    from ember import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
