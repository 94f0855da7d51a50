"""SamplingParams refuses what the sampler could not take, by name, before a request is queued: an integer beyond
int64 once reached a tensor mid-step and stopped the engine for everyone (the server's fuzz test found top_k=2**64)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember import SamplingParams
from ember.errors import BadRequestError
from ember.sampling_params import INT64_MAX

# field -> how a value is given, and the smallest value allowed (top_k: -1 also, meaning off)
_INTEGERS = {
    "top_k": (lambda v: v, -1), "min_tokens": (lambda v: v, 0), "max_tokens": (lambda v: v, 1),
    "no_repeat_ngram_size": (lambda v: v, 0), "seed": (lambda v: v, -INT64_MAX - 1),
    "stop_token_ids": (lambda v: [v], 0), "bad_words_ids": (lambda v: [[v]], 0),
    "stop_token_sequences": (lambda v: [[v]], 0), "eos_token_ids": (lambda v: (v,), 0),
}



def _params(field: str, value: int) -> SamplingParams:
    """The field set to value; max_tokens None unless it is the field (min_tokens may exceed the default 16)."""
    return SamplingParams(**{"max_tokens": None, field: _INTEGERS[field][0](value)})


@pytest.mark.parametrize("field", sorted(_INTEGERS))
def test_integers_beyond_int64_are_refused_by_name(field):
    low = _INTEGERS[field][1]
    _params(field, INT64_MAX)  # the largest int64 is taken
    _params(field, low)
    for value in (INT64_MAX + 1, 2**70, low - 1):
        with pytest.raises(BadRequestError, match=rf"^{field}=.* is out of range: {field} must be .*{INT64_MAX}"):
            _params(field, value)


@given(field=st.sampled_from(sorted(_INTEGERS)), value=st.integers(-2**70, 2**70))
def test_any_integer_is_taken_in_range_or_refused_naming_the_field(field, value):
    if _INTEGERS[field][1] <= value <= INT64_MAX:
        _params(field, value)
    else:
        with pytest.raises(BadRequestError, match=rf"^{field}="):
            _params(field, value)
