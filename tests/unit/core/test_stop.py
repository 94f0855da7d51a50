"""The core's stop rules (``check_stop``) and the one status enum they end in, without a model."""

from __future__ import annotations

import pytest

from ember.core.stop import check_stop
from ember.protocol import FinishReason, RequestStatus
from ember.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _params(**kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.eos_token_ids = (2,)  # the front end fills these in from the model
    return p


@pytest.mark.parametrize("kw, output, want", [
    ({}, [9, 2], (FinishReason.STOP, None)),  # EOS
    (dict(ignore_eos=True, max_tokens=10), [9, 2], None),
    (dict(min_tokens=3), [9, 2], None),  # EOS before min_tokens is not a stop ...
    (dict(min_tokens=2), [9, 2], (FinishReason.STOP, None)),  # ... from the min_tokens-th token on it is
    (dict(stop_token_ids=[9]), [4, 9], (FinishReason.STOP, 9)),
    (dict(stop_token_sequences=[[4, 9]]), [4, 9], (FinishReason.STOP, [4, 9])),
    (dict(stop_token_sequences=[[7, 4]]), [4], None),  # a sequence reaching into the prompt does not count
    (dict(max_tokens=2), [4, 9], (FinishReason.LENGTH, None)),
    (dict(max_tokens=3), [4, 9], None),
])
def test_check_stop(kw, output, want):
    assert check_stop(_params(**kw), PROMPT + output, len(PROMPT), max_model_len=100) == want


def test_max_model_len_ends_a_sample():
    assert check_stop(_params(), PROMPT + [4, 9], len(PROMPT), max_model_len=5) == (FinishReason.LENGTH, None)
    assert check_stop(_params(), PROMPT + [4], len(PROMPT), max_model_len=5) is None


def test_each_finished_status_maps_to_one_finish_reason_and_back():
    finished = [s for s in RequestStatus if s.is_finished]
    assert {s.finish_reason for s in finished} == set(FinishReason)
    assert all(RequestStatus.finished(s.finish_reason) is s for s in finished)
    assert RequestStatus.WAITING.finish_reason is None and not RequestStatus.RUNNING.is_finished
    assert FinishReason.STOP == "stop" and str(FinishReason.INTERRUPTED) == "interrupted"
