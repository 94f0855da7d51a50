"""The sampler's greedy pick: the chunked CPU argmax equals torch's argmax, ties and NaN included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.layers.sampler import greedy_tokens


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.sampled_from([7, 1024, 2048, 2500, 5000]), seed=st.integers(0, 10_000),
       ties=st.lists(st.integers(0, 4999), max_size=4), nan_at=st.one_of(st.none(), st.integers(0, 4999)),
       coarse=st.booleans())
def test_greedy_tokens_equal_torch_argmax(rows, vocab, seed, ties, nan_at, coarse):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if coarse:  # few distinct values: many ties across and within chunks
        logits = logits.round()
    for t in ties:  # equal maxima, in the head and the tail
        logits[:, t % vocab] = 50.0
    if nan_at is not None:
        logits[rows // 2, nan_at % vocab] = float("nan")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
