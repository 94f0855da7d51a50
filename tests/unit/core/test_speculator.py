"""Speculative decoding in the engine core, over the scripted executor: drafts verified inside continuous batching
keep every request's tokens and finish what they are without speculation, the KV pool and the prefix cache stay
exact, and the messages carry drafts and the kept counts (milliseconds a test, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unit.fakes import EOS, make_core, request, run, samples

import ember.core.speculator as speculator
from ember.config import EngineConfig, SpeculativeConfig
from ember.core.ngram import NgramIndex
from ember.core.speculator import best_k, draft_weight
from ember.errors import ConfigError
from ember.protocol import DRAFT_PLACEHOLDER, FinishReason

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def copying_script(patterns: dict[int, list[int]]):
    """A 'model' whose output token i of the request seeded s is patterns[s][i] (cycled): a copy of text the
    request already holds makes n-gram drafts that verify."""
    def script(row):
        pattern = patterns[row.seed or 0]
        return pattern[row.num_output_tokens % len(pattern)]
    return script


@pytest.fixture
def always_draft(monkeypatch):
    """Drafts cost nothing: every sequence drafts all it can, whatever the batch (the cost model is tested apart)."""
    monkeypatch.setattr(speculator, "verify_extra", lambda k, costs=None: 0.0)


def _run(patterns, prompts, spec, max_tokens, num_blocks=64, max_num_seqs=8, budget=256, **core):
    c = make_core(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  script=copying_script(patterns), speculative=spec, **core)
    for i, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        c.add(request(f"r{i}", prompt, max_tokens=mt, temperature=0.0, seed=i))
    out = run(c)
    return c, {rid: samples(o)[0] for rid, o in out.items()}


def _cached_blocks_are_real(core, finished_tokens: list[list[int]]) -> None:
    """Every block in the prefix cache holds tokens that some request really has at that block's place."""
    bs = core.block_manager.block_size
    real = {tuple(t[i:i + bs]) for t in finished_tokens for i in range(0, len(t) - bs + 1, bs)}
    for block, (_, tokens, _) in core.block_manager.block_keys.items():
        assert tokens in real, (block, tokens)


@pytest.mark.parametrize("spec", [NGRAM, SpeculativeConfig(method="suffix", num_speculative_tokens=4)],
                         ids=["ngram", "suffix"])
def test_drafts_copied_from_the_prompt_verify_and_the_output_is_unchanged(always_draft, spec):
    prompt = [10 + i for i in range(24)]
    patterns = {0: prompt[4:12] + [99] + prompt[13:] + prompt[:4]}  # copies the prompt, one token its own
    base, want = _run(patterns, [prompt], None, [40])
    core, got = _run(patterns, [prompt], spec, [40])
    assert got == want
    counts = core.speculator.counts
    assert counts.accepted_tokens > 20 and counts.drafted_tokens > counts.accepted_tokens  # kept and rejected
    assert len(core.executor.messages) < len(base.executor.messages) - 10  # fewer steps for the same tokens
    assert core.block_manager.num_used == 0 and not core.executor.live
    # the drafts went out with their rows, and the kept count came back after each verification
    sent = [m for m in core.executor.messages if m.draft_token_ids]
    assert sent and all(len(d) <= 4 for m in sent for d in m.draft_token_ids.values())
    assert any(m.num_computed_tokens for m in core.executor.messages)


def test_eos_inside_a_kept_draft_ends_the_sample_there(always_draft):
    prompt = [10, 11, 12, 13, EOS, 20, 10, 11]
    patterns = {0: [12, 13, EOS, 50]}  # the draft after "10 11" is "12 13 EOS 20": EOS is kept, then it stops
    _, want = _run(patterns, [prompt], None, [30])
    core, got = _run(patterns, [prompt], NGRAM, [30])
    assert got == want == {"r0": ([12, 13, EOS], [FinishReason.STOP])}
    assert core.speculator.counts.accepted_tokens == 2  # 13 and EOS; the draft's "20" was not reached


def test_a_draft_never_runs_past_max_tokens(always_draft):
    prompt = list(range(10, 30))
    patterns = {0: list(range(10, 30))}
    for max_tokens in range(1, 8):
        core, got = _run(patterns, [prompt + prompt[:3]], NGRAM, [max_tokens])
        assert len(got["r0"][0]) == max_tokens
        for m in core.executor.messages:
            for handle, draft in m.draft_token_ids.items():
                assert len(draft) <= max_tokens - 1


def test_no_draft_for_beams_or_when_the_batch_is_large(monkeypatch):
    prompt = [10, 11, 12, 10, 11]
    patterns = {0: [12, 10, 11]}
    monkeypatch.setattr(speculator, "verify_extra", lambda k, costs=None: 0.0)
    core = make_core(script=copying_script(patterns), speculative=NGRAM)
    core.add(request("beam", prompt, max_tokens=8, beam_width=2))
    run(core)
    assert core.speculator.counts.drafts == 0
    # a request whose sampling reads its history drafts: each position's row carries the drafted tokens before it
    core = make_core(script=copying_script(patterns), speculative=NGRAM)
    core.add(request("pen", prompt, max_tokens=8, temperature=0.0, seed=0, repetition_penalty=1.2))
    run(core)
    assert core.speculator.counts.drafts > 0
    big = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=1)
    core, _ = _run({0: [12, 10, 11], 1: [12, 10, 11]}, [prompt, prompt], big, [8, 8])  # 2 rows > 1: no draft
    assert core.speculator.counts.drafts == 0


def test_the_cost_model_drafts_less_as_acceptance_falls_and_the_batch_grows():
    one, full = draft_weight(1), draft_weight(16)
    assert one == 1.0 and full > 7
    assert best_k(0.95, one, 8) == 8
    assert best_k(0.9, one, 8) > best_k(0.5, one, 8) > 0
    assert best_k(0.15, one, 8) == 0  # rarely right: not worth a verifying step
    assert best_k(0.5, full, 8) == 0  # a full batch: the verifying row's extra weighs 7 rows' share
    assert best_k(0.95, full, 8) > 0  # unless nearly every drafted token is kept


def test_the_cost_model_follows_the_timed_verify_steps():
    """With the verify steps timed at start-up (``WorkerInfo.verify_costs``) the draft length follows them: free
    verification drafts all, a steep one little, and rows in passes of 3 (the int4 kernel's) stop a draft where a
    pass would begin; past the table the cost grows as its last two entries do."""
    flat = (1.0,) * 9
    steep = tuple(1.0 + 0.3 * k for k in range(9))
    passes = (1.0, 1.0, 1.0, 1.6, 1.6, 1.6, 2.2, 2.2, 2.2)
    assert best_k(0.5, 1.0, 8, costs=flat) == 8
    assert best_k(0.9, 1.0, 8) == 8 > best_k(0.9, 1.0, 8, costs=steep) == 5
    assert best_k(0.5, 1.0, 8, costs=steep) == 1
    assert best_k(0.6, 1.0, 8, costs=passes) == 2
    assert speculator.verify_extra(4, (1.0, 1.1, 1.3)) == pytest.approx(0.7)
    assert speculator.verify_extra(3, None) == speculator.DRAFT_STEP_COST + 3 * speculator.DRAFT_TOKEN_COST


def test_a_draft_models_steps_count_against_its_drafts():
    """A draft model's token costs draft_cost of a target step to make: a copy (a = 0.99) still drafts long with a
    draft at half the target's cost, ordinary agreement (a = 0.7) only a short draft or none, and a draft as costly
    as the target never pays."""
    assert best_k(0.99, 1.0, 8, 0.1) == 8
    assert 0 < best_k(0.99, 1.0, 8, 0.5) <= 8
    assert best_k(0.7, 1.0, 8, 0.5) <= 1 < best_k(0.7, 1.0, 8, 0.1) < best_k(0.7, 1.0, 8)
    assert best_k(0.99, 1.0, 8, 1.0) == 0 and best_k(0.5, 1.0, 8, 0.5) == 0


def test_ngram_index_finds_the_longest_latest_match():
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    idx.extend(tokens[:6])
    idx.extend(tokens[6:])
    assert idx.propose(tokens, 2) == [4, 9]  # "1 2 3" (n = 3) last followed by 4 9
    assert idx.propose([7, 2, 3], 3) == [5, 6, 1]  # "2 3": its latest occurrence with a follower
    assert idx.propose([8, 8], 3) == []
    assert idx.propose(tokens, 0) == []


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(8, 40), budget=st.integers(8, 96), max_num_seqs=st.integers(1, 4),
       reqs=st.lists(st.tuples(st.lists(st.integers(3, 12), min_size=1, max_size=40), st.integers(0, 9),
                               st.integers(1, 30), st.booleans()), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 4, 16]), method=st.sampled_from(["ngram", "suffix"]))
def test_speculation_changes_no_token_under_any_pool_budget_or_batch(num_blocks, budget, max_num_seqs, reqs,
                                                                    block_size, method):
    """Random prompts over a small vocabulary (many n-gram matches), 'models' that copy them with deviations and
    EOS, random pools (preemption), budgets (chunked prefill) and seats: with speculation every request ends with
    the tokens and finish reason it has without, the pool is whole after, and every block the prefix cache holds
    has real tokens."""
    extra = speculator.verify_extra
    speculator.verify_extra = lambda k, costs=None: 0.0
    try:
        prompts = [p for p, *_ in reqs]
        patterns = {i: (p[shift % len(p):] + p[:shift % len(p)] + ([EOS] if eos else [7]))
                    for i, (p, shift, _, eos) in enumerate(reqs)}
        max_tokens = [mt for _, _, mt, _ in reqs]
        kw = dict(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget)
        if num_blocks * block_size < max(len(p) + mt for p, mt in zip(prompts, max_tokens)):
            return  # a request the pool can never hold is interrupted: compared elsewhere
        base, want = _run(patterns, prompts, None, max_tokens, block_size=block_size, **kw)
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=5) if method == "suffix" else \
            SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1)
        core, got = _run(patterns, prompts, spec, max_tokens, block_size=block_size, **kw)
    finally:
        speculator.verify_extra = extra
    assert got == want
    assert core.block_manager.num_used == 0 and not core.requests and not core.executor.live
    _cached_blocks_are_real(core, [list(p) + got[f"r{i}"][0] for i, p in enumerate(prompts)])


def test_speculative_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"speculative_config\.method='eagle' is not supported: use one of 'ngram'"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(ConfigError, match=r"speculative_config\.num_speculative_tokens=0 is out of range"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match=r"speculative_config\.draft is not supported: the keys are"):
        EngineConfig(speculative_config={"draft": 1})
    with pytest.raises(ConfigError, match=r"prompt_lookup_min=5 is out of range: it must be <= prompt_lookup_max"):
        EngineConfig(speculative_config={"prompt_lookup_min": 5})
    with pytest.raises(ConfigError, match="not supported with attention_window"):
        EngineConfig(speculative_config={}, attention_window=64)
    with pytest.raises(ConfigError, match="speculative_config='ngram' is not supported: pass a dict"):
        EngineConfig(speculative_config="ngram")
    assert EngineConfig(speculative_config={"num_speculative_tokens": 3}).speculative_config == \
        SpeculativeConfig(num_speculative_tokens=3)


def test_a_prediction_drafts_without_speculative_config(always_draft):
    """OpenAI's predicted outputs: drafts come from the prediction (its start while the output copies it, then after
    the output's last tokens found in it), the counts reach the request's outputs, and on an engine without
    speculative_config only the request with a prediction drafts."""
    prompt = [5, 6, 7]
    answer = [20 + i for i in range(30)]
    edited = answer[:10] + [99] + answer[11:]  # the 'model' changes one token of the predicted text
    patterns = {0: edited + [EOS], 1: edited + [EOS]}
    c = make_core(script=copying_script(patterns))
    predicted = request("p", prompt, max_tokens=40, temperature=0.0, seed=0)
    predicted.prediction_token_ids = answer
    c.add(predicted)
    c.add(request("plain", prompt, max_tokens=40, temperature=0.0, seed=1))
    out = run(c)
    assert samples(out["p"])[0] == samples(out["plain"])[0] == (edited + [EOS], [FinishReason.STOP])
    drafted = sum(s.num_draft_tokens for o in out["p"] for s in o.samples)
    kept = sum(s.num_accepted_draft_tokens for o in out["p"] for s in o.samples)
    assert kept >= 20 and drafted >= kept  # each step keeps up to 4 drafted tokens, then samples one itself
    assert sum(s.num_draft_tokens for o in out["plain"] for s in o.samples) == 0
    assert c.stats().as_dict()["spec_decode_num_accepted_tokens"] == kept
    assert "spec_decode_num_drafts" not in make_core().stats().as_dict()  # nothing drafted, nothing shown


def test_a_copy_goes_on_where_the_last_draft_came_from():
    """"1 2" occurs twice in the source, followed by "3 4" and by "9 9". A fresh lookup takes the latest; a sequence
    that was copying the first goes on from there, and looks up again once it stops copying."""
    source = [5, 1, 2, 3, 4, 1, 2, 9, 9]
    fresh = NgramIndex(1, 2)
    fresh.extend(source)
    assert fresh.propose([0, 5, 1, 2], 2) == [9, 9]
    idx = NgramIndex(1, 2)
    idx.extend(source)
    assert idx.propose([0, 5], 1) == [1]  # "5" at 0
    assert idx.propose([0, 5, 1, 2], 2) == [3, 4]  # the draft "1" and the token after it were kept: go on
    assert idx.propose([0, 5, 1, 2, 3, 4, 8], 2) == []  # the copy stopped ("4 8"), and nothing matches


def test_the_last_prompt_token_of_a_chunked_prompt_owes_its_prompt_logprobs_not_a_draft(always_draft):
    """A prompt one token longer than the step's budget ends with a one-token chunk that looks like a decode: it does
    not draft, and its prompt logprobs are complete."""
    prompt = [10 + i % 5 for i in range(17)]
    patterns = {0: [10, 11, 12, 13, 14]}
    c = make_core(max_num_batched_tokens=16, script=copying_script(patterns), speculative=NGRAM)
    c.add(request("r", prompt, max_tokens=12, temperature=0.0, seed=0, prompt_logprobs=1))
    out = run(c)
    assert any(o.prompt_logprobs_done for o in out["r"])
    assert sum(len(o.prompt_logprobs or []) for o in out["r"]) == len(prompt) - 1
    assert c.speculator.counts.drafts > 0 and samples(out["r"])[0][0] == (patterns[0] * 3)[:12]


def test_recent_outputs_draft_for_a_request_that_repeats_an_earlier_answer(always_draft):
    """A request whose own tokens hold nothing to copy drafts from the output of one that finished before it (the
    same answer to another prompt): kept drafts, the same tokens as without speculation."""
    answer = list(range(200, 230))
    patterns = {0: answer}
    want = {}
    for spec in (None, NGRAM):
        c = make_core(num_blocks=64, script=copying_script(patterns), speculative=spec)
        outs = {}
        for rid, prompt in (("first", [10, 11, 12, 13]), ("again", [20, 21, 22, 23, 24])):
            c.add(request(rid, prompt, max_tokens=30, temperature=0.0, seed=0))
            outs.update({r: samples(o)[0] for r, o in run(c).items()})
            if rid == "first" and spec is not None:
                first = c.speculator.counts.accepted_tokens
        if spec is None:
            want = outs
    assert outs == want and outs["again"][0] == answer
    assert first == 0 and c.speculator.counts.accepted_tokens > 15


def test_recent_outputs_stay_bounded_and_never_draft_across_two_outputs():
    from ember.core.ngram import RecentOutputs

    recent = RecentOutputs(2, max_tokens=40)
    recent.add([1, 2, 3, 4])
    recent.add([5, 6, 7])
    assert recent.propose([9, 1, 2], 5) == [3, 4]  # stops at the output's end
    assert recent.propose([3, 4], 3) == [] and recent.propose([4, 5], 3) == []  # no n-gram spans two outputs
    assert recent.propose([2], 3) == []  # exactly n tokens are looked up
    for i in range(10):
        recent.add(list(range(100 * i, 100 * i + 9)))
    assert recent.total <= 40 and recent.propose([901, 902], 2) == [903, 904]
    assert recent.propose([1, 2], 2) == []  # dropped with the older half


def test_recent_outputs_are_kept_apart_by_cache_salt(always_draft):
    """A request under another prefix-cache salt (another tenant, another adapter) drafts nothing from the first's
    answer; one under the same salt does."""
    import dataclasses

    answer = list(range(300, 330))
    c = make_core(num_blocks=64, script=copying_script({0: answer}), speculative=NGRAM)
    kept = []
    for rid, salt in (("first", "a"), ("other", "b"), ("same", "a")):
        req = dataclasses.replace(request(rid, [10 + len(rid), 11, 12], max_tokens=30, temperature=0.0, seed=0),
                                  cache_salt=salt)
        c.add(req)
        assert samples(run(c)[rid])[0][0] == answer
        kept.append(c.speculator.counts.accepted_tokens - sum(kept))
    assert kept[0] == kept[1] == 0 and kept[2] > 15


def test_the_last_ngram_of_an_output_does_not_hide_an_earlier_one():
    from ember.core.ngram import RecentOutputs

    recent = RecentOutputs(2)
    recent.add([1, 2, 3, 4])
    recent.add([7, 1, 2])  # (1, 2) ends this output: the older occurrence, followed by 3 4, still drafts
    assert recent.propose([1, 2], 2) == [3, 4]
    recent.add([1, 2, 9, 1, 2])  # inside this output (1, 2) is followed by 9: the latest with a follower
    assert recent.propose([1, 2], 2) == [9, 1]


def test_with_a_draft_model_lookup_drafts_first_and_the_model_where_it_finds_nothing(always_draft):
    """With a draft model the prompt lookup still drafts first (its tokens cost nothing to make); a sequence it
    finds nothing for gets the draft model's placeholders, and each source keeps its own estimate."""
    prompt = [10 + i for i in range(40)]
    c = make_core(num_blocks=64, script=copying_script({0: prompt, 1: [90, 91, 92, 93, 94, 95]}), speculative=NGRAM)
    c.add(request("copy", prompt, max_tokens=30, temperature=0.0, seed=0))
    c.add(request("new", [60, 61, 62, 63], max_tokens=30, temperature=0.0, seed=1))
    for _ in range(3):
        c.step()
    spec = c.speculator
    spec.draft_cost, spec.states = 0.1, {}  # as an engine with a draft model measures it (fresh estimates)
    running = {s.request.request_id: s for s in c.scheduler.running}
    spec.propose(list(running.values()))
    copy, new = running["copy"], running["new"]
    at = copy.num_output_tokens
    assert copy.draft_token_ids == prompt[at:at + 4]
    assert new.draft_token_ids == [DRAFT_PLACEHOLDER] * 4
    spec.record(new, 4, 0)
    spec.record(copy, 4, 4)
    model, lookup = spec.states[new.seq_id].model, spec.states[new.seq_id].lookup
    assert model.tried > 0 and model.acceptance < 0.7 and lookup.tried == 0
    assert spec.states[copy.seq_id].lookup.accepted == 4 and spec.states[copy.seq_id].model.tried == 0


def test_a_draft_models_catch_up_is_spread_over_steps(always_draft):
    """The draft model's KV holds nothing of a new sequence: while it lacks more than the step's catch-up budget
    (``WorkerInfo.draft_catch_up``, here 8 tokens shared by the step's rows) the sequence drafts nothing and is
    ordered 8 of its tokens fed; once what it lacks fits, it drafts. An order the step does not run is taken back,
    and a preemption (its draft KV goes with its blocks) starts the count again."""
    prompt = [200 + i for i in range(29)]
    c = make_core(num_blocks=64, script=copying_script({0: [90 + i for i in range(40)]}), speculative=NGRAM)
    c.add(request("r", prompt, max_tokens=30, temperature=0.0, seed=0))
    c.step()  # the prompt, then its first output token
    spec = c.speculator
    spec.draft_cost, spec.catch_up, spec.states = 0.1, 8, {}
    seq = c.scheduler.running[0]
    for want in (8, 8, 8):  # 29 tokens lacked before the last (30 tokens): 8 a step, none drafted
        spec.propose([seq])
        assert seq.draft_token_ids == [] and spec.catch_up_orders([seq], []) == {seq.seq_id: want}
    spec.propose([seq])  # 5 lacked: they fit, and the draft follows
    assert seq.draft_token_ids == [DRAFT_PLACEHOLDER] * 4 and spec.catch_up_orders([seq], []) == {}
    n = seq.num_tokens
    assert spec.states[seq.seq_id].fed == n
    spec.states[seq.seq_id].pending = spec.states[seq.seq_id].model
    spec.record(seq, 4, 2)  # the drafter fed its drafted tokens but the last: two of them kept are held
    assert spec.states[seq.seq_id].fed == n + 2
    spec.propose([seq])
    assert seq.draft_token_ids == [DRAFT_PLACEHOLDER] * 4
    seq.draft_token_ids = []  # the scheduler dropped the placeholders: fed as it was
    assert spec.catch_up_orders([seq], []) == {}
    assert spec.states[seq.seq_id].fed == n + 2
    spec.states[seq.seq_id].fed = 0
    spec.propose([seq])
    assert spec.catch_up_orders([], []) == {}  # not scheduled: taken back
    assert spec.states[seq.seq_id].fed == 0
    spec.propose([seq])
    spec.catch_up_orders([seq], [])
    assert spec.states[seq.seq_id].fed == 8
    spec.catch_up_orders([], [seq])  # preempted
    assert spec.states[seq.seq_id].fed == 0


def test_catch_up_orders_reach_the_worker_and_the_output_is_unchanged(always_draft):
    """Over the scripted executor (its 'draft model' drafts nothing useful), a catch-up budget changes only when
    drafts are sent: the messages carry orders of at most the budget a step, and every request's tokens are those
    decoding without speculation gives."""
    prompts = [[300 + 40 * r + i for i in range(20 + 7 * r)] for r in range(3)]
    patterns = {r: [90 + 3 * r + i for i in range(30)] for r in range(3)}
    base, want = _run(patterns, prompts, None, [24] * 3)
    c = make_core(num_blocks=64, script=copying_script(patterns), speculative=NGRAM)
    c.speculator.draft_cost, c.speculator.catch_up = 0.1, 8
    for i, p in enumerate(prompts):
        c.add(request(f"r{i}", p, max_tokens=24, temperature=0.0, seed=i))
    sent = []
    execute = c.executor.execute_model

    def spy(message):
        sent.append(dict(message.draft_catch_up))
        return execute(message)

    c.executor.execute_model = spy
    got = {rid: samples(o)[0] for rid, o in run(c).items()}
    assert got == want
    assert any(sent) and all(sum(o.values()) <= 8 for o in sent), sent
