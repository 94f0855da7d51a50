"""The processors that read a sample's history (penalties, n-gram and word bans, min_tokens, the thinking budget) on
rows verifying a speculative draft: row j's logits are those of a sample that never speculated and holds the j
drafted tokens before it, and the state kept between steps takes in only the tokens the verification kept (a
rejected drafted token never counts later)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.layers.logits_processors import DEFAULT_PROCESSORS, RowState
from ember.protocol import SamplingRow
from ember.sampling_params import SamplingParams

V = 24
START, END = (20,), (21, 22)
PARAMS = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                        no_repeat_ngram_size=2, bad_words_ids=[[3], [5, 6]], min_tokens=3, eos_token_ids=(2,),
                        thinking_token_budget=2, thinking_tags=(START, END))


def _processed(logits: torch.Tensor, rows: list[SamplingRow], states: list[RowState]) -> torch.Tensor:
    for proc in DEFAULT_PROCESSORS:
        wanted = [i for i, r in enumerate(rows) if proc.wants(r.params)]
        if wanted:
            logits = proc(logits, wanted, rows, states)
    return logits


tokens_st = st.lists(st.integers(0, V - 1), max_size=5)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10),
       steps=st.lists(st.tuples(tokens_st, st.integers(0, 5), st.integers(0, V - 1)), max_size=8))
def test_a_verifying_row_is_processed_as_a_sample_holding_the_draft_before_it(prompt, steps):
    state, tokens = RowState(None), list(prompt)
    for draft, kept, sampled in steps:
        n = len(tokens) - len(prompt)
        rows = [SamplingRow(0, PARAMS, None, n + j, tokens + draft[:j], len(prompt), j) for j in range(len(draft) + 1)]
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(len(tokens)))
        got = _processed(logits, rows, [state] * len(rows))
        for j, row in enumerate(rows):
            alone = SamplingRow(0, PARAMS, None, n + j, row.token_ids, len(prompt))
            want = _processed(logits[j:j + 1], [alone], [RowState(None)])[0]
            assert torch.equal(got[j], want), (j, row.token_ids)
        tokens += draft[:min(kept, len(draft))] + [sampled]  # the kept drafted tokens, then the sampler's own
