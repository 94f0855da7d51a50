"""Suffix decoding's index (``core.suffix``) against drafts worked out by hand, and ``method="suffix"`` in the
engine core over the scripted executor: recent outputs draft for a repeated answer (the copy test and the hypothesis
test in test_speculator.py run it too; milliseconds a test, no model)."""

from __future__ import annotations

import pytest
from unit.core.test_speculator import always_draft, copying_script  # noqa: F401 (a fixture)
from unit.fakes import make_core, request, run, samples

from ember.config import EngineConfig, SpeculativeConfig
from ember.core.suffix import RecentSuffixes, SuffixIndex
from ember.errors import ConfigError


def _index(tokens, depth=24, factor=1.0, min_prob=0.1):
    idx = SuffixIndex(depth, factor, min_prob)
    idx.extend(tokens)
    return idx


def test_the_longest_match_drafts_not_the_latest():
    """"2 3" is followed by 9 most recently, but the context's last 4 tokens match only the first occurrence."""
    text = [8, 1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 9]
    draft = _index(text).speculate([8, 1, 2, 3], 4)
    assert draft.tokens == [4, 5, 6, 7] and draft.score == 4.0


def test_the_continuation_most_occurrences_share_drafts_and_the_draft_stops_where_they_split():
    """"5 6" is followed by 7 twice and by 8 once: 7 has a share of 2/3; then the two "5 6 7" continue with 1 and 3
    (1/3 each, the latest wins a tie), under min_token_prob=0.4 the draft stops before it."""
    text = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 4, 4, 5, 6]
    draft = _index(text).speculate(text, 2)
    assert draft.tokens == [7, 3] and draft.score == pytest.approx(2 / 3 + 1 / 3)
    assert _index(text, min_prob=0.4).speculate(text, 2).tokens == [7]


def test_a_short_match_drafts_at_most_spec_factor_tokens_a_matched_token():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _index(text).speculate([0, 1, 2], 8).tokens == [3, 4]  # a 2-token match: 2 tokens
    assert _index(text, factor=2.0).speculate([0, 1, 2], 8).tokens == [3, 4, 5, 6]
    assert _index(text).speculate([1, 2, 3, 4, 5], 8).tokens == [6, 7, 8, 9]  # to the text's end
    assert _index(text, depth=3).speculate([1, 2, 3, 4, 5], 8).tokens == [6, 7, 8]  # the match counts up to depth
    assert _index(text).speculate([8, 8], 8).tokens == [] and _index(text).speculate([1, 2], 0).tokens == []


def test_a_copy_that_skips_a_token_resyncs_once_after_a_long_match():
    """The sequence copies a passage (a 10-token match drafts its next tokens); the model drops one of them: the
    last two tokens are found nowhere, and the resync drafts from just past the dropped token. It does not follow
    a resync with another, nor a short match, nor without ``resync``; a changed token resyncs a step later."""
    passage = list(range(100, 130))
    seq = [1, 2, 3, *passage, 4, 5, *passage[:10]]
    idx = _index(seq, depth=24)
    idx.resync = True
    first = idx.speculate(seq, 4)
    assert first.tokens == passage[10:14] and first.match == 10
    seq.append(passage[11])  # passage[10] dropped
    idx.extend(seq[-1:])
    assert idx.speculate(seq, 4).tokens == passage[12:16]
    plain = _index(seq)
    assert plain.speculate(seq, 4).tokens == []  # no resync: nothing until the copy matches two tokens again
    seq.append(passage[13])  # passage[12] dropped too, right after the resync's draft: no second resync
    idx.extend(seq[-1:])
    assert idx.speculate(seq, 4).tokens == []
    changed = [1, 2, 3, *passage, 4, 5, *passage[:10]]
    idx = _index(changed)
    idx.resync = True
    assert idx.speculate(changed, 4).tokens == passage[10:14]
    for token, want in ((999, []), (passage[11], passage[12:16])):  # passage[10] changed to 999, then the copy
        changed.append(token)
        idx.extend([token])
        assert idx.speculate(changed, 4).tokens == want
    short = [1, 2, 3, *passage, 4, 5, *passage[:3]]
    idx = _index(short)
    idx.resync = True
    assert idx.speculate(short, 4).tokens == passage[3:6]
    short.append(passage[4])
    idx.extend(short[-1:])
    assert idx.speculate(short, 4).tokens == []


def test_a_match_longer_than_its_draft_counts_its_whole_length():
    """The passage copied twice before: its occurrences stay two as the match grows past the draft's cap; the draft
    records the match's whole length (what the resync asks for)."""
    passage = list(range(100, 130))
    seq = [*passage, 1, *passage, 2, *passage[:12]]
    draft = _index(seq).speculate(seq, 4)
    assert draft.tokens == passage[12:16] and draft.match == 12


def test_recent_suffixes_never_draft_across_two_outputs_and_stay_bounded():
    recent = RecentSuffixes(max_requests=4, max_depth=24, spec_factor=1.0, min_prob=0.1, max_tokens=40)
    recent.add([1, 2, 3, 4, 5])
    recent.add([5, 6, 7])
    assert recent.speculate([9, 1, 2, 3], 5).tokens == [4, 5]  # stops at the output's end
    assert recent.speculate([4, 5], 3).tokens == [] and recent.speculate([5, 5], 3).tokens == []
    for i in range(10):
        recent.add(list(range(100 * i, 100 * i + 9)))
        assert recent.total <= 40 and len(recent.outputs) <= 4
    assert recent.speculate([901, 902], 2).tokens == [903, 904]
    assert recent.speculate([1, 2], 2).tokens == []  # dropped with the older half


@pytest.mark.parametrize("cached", [10000, 0])
def test_suffix_recent_outputs_draft_a_repeated_answer_unless_turned_off(always_draft, cached):  # noqa: F811
    answer = list(range(200, 230))
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6, suffix_decoding_max_cached_requests=cached)
    c = make_core(num_blocks=64, script=copying_script({0: answer}), speculative=spec)
    for rid, prompt in (("first", [10, 11, 12, 13]), ("again", [20, 21, 22, 23, 24])):
        c.add(request(rid, prompt, max_tokens=30, temperature=0.0, seed=0))
        assert samples(run(c)[rid])[0][0] == answer
        if rid == "first":
            first = c.speculator.counts.accepted_tokens
    again = c.speculator.counts.accepted_tokens - first
    assert first == 0 and (again > 15 if cached else again == 0)


def test_suffix_config_defaults_and_errors_name_the_key():
    spec = EngineConfig(speculative_config={"method": "suffix"}).speculative_config
    assert spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert SpeculativeConfig().num_speculative_tokens == 8
    with pytest.raises(ConfigError, match=r"speculative_config\.suffix_decoding_min_token_prob=1\.5 is out of range"):
        SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=1.5)
    with pytest.raises(ConfigError, match=r"suffix_decoding_max_spec_factor=nan is out of range"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=float("nan"))
    with pytest.raises(ConfigError, match=r"suffix_decoding_max_tree_depth=1 is out of range: it must be an int"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=1)
    with pytest.raises(ConfigError, match=r"suffix_decoding_max_tree_depth=0 is out of range"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=0)
    with pytest.raises(ConfigError, match=r"suffix_decoding_max_spec_factor=0\.01 is out of range: with "
                                          r"suffix_decoding_max_tree_depth=24 no match drafts a token"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=0.01)
    with pytest.raises(ConfigError, match=r"suffix_decoding_max_tree_depth=8 is only read by method='suffix' \(the "
                                          r"method is 'ngram'\)"):
        SpeculativeConfig(suffix_decoding_max_tree_depth=8)
