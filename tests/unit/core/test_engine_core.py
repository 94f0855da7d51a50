"""The engine core over a scripted executor (``tests/unit/fakes.py``): scheduling, stop rules, n > 1, beam search,
aborts, preemption and the outputs the core sends, without a model (each test runs in milliseconds)."""

from __future__ import annotations

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from unit.fakes import EOS, add, default_script, make_core, request, request_samples, run, samples

from ember.protocol import FinishReason, SamplingRow
from ember.sampling_params import SamplingParams


def default_script_for(handle: int, num_output_tokens: int) -> int:
    return default_script(SamplingRow(handle, SamplingParams(), None, num_output_tokens))


def _all_free(core) -> bool:
    bm = core.block_manager
    return bm.num_used == 0 and not core.requests and not core.executor.live


def test_a_request_runs_to_max_tokens_and_frees_everything():
    core = make_core()
    core.add(request("a", list(range(10, 50)), max_tokens=5))
    got = samples(run(core)["a"])
    tokens, reasons = got[0]
    assert len(tokens) == 5 and reasons == [FinishReason.LENGTH]
    handle = core.executor.steps[0].sampling[0].handle
    assert tokens == [default_script_for(handle, i) for i in range(5)]
    assert _all_free(core)


def test_eos_and_stop_ids_end_a_sample_with_its_stop_reason():
    def script(row):
        return EOS if row.num_output_tokens == 3 else 7 if row.num_output_tokens == 1 else 50

    core = make_core(script=script)
    core.add(request("eos", [5, 6, 7], max_tokens=10))
    core.add(request("stop-id", [5, 6, 8], max_tokens=10, stop_token_ids=[7]))
    core.add(request("ignore", [5, 6, 9], max_tokens=6, ignore_eos=True))
    out = run(core)
    assert samples(out["eos"])[0] == ([50, 7, 50, EOS], [FinishReason.STOP])
    assert samples(out["stop-id"])[0] == ([50, 7], [FinishReason.STOP])
    stop_reasons = [s.stop_reason for o in out["stop-id"] for s in o.samples if s.finish_reason]
    assert stop_reasons == [7]
    assert samples(out["ignore"])[0] == ([50, 7, 50, EOS, 50, 50], [FinishReason.LENGTH])
    assert _all_free(core)


def test_n_samples_share_the_prompt_and_end_once_each():
    for caching in (True, False):  # the samples share the prompt's blocks also when prefix caching is off
        core = make_core(prefix_caching=caching)
        prompt = list(range(100, 164))  # four full blocks
        ids = add(core, request("n", prompt, n=3, max_tokens=4, temperature=1.0, seed=1))
        assert ids == ["n#0", "n#1", "n#2"]
        got = request_samples(run(core), ids)
        assert sorted(got) == [0, 1, 2]
        assert all(len(t) == 4 and r == [FinishReason.LENGTH] for t, r in got.values())
        handles = {row.handle for b in core.executor.steps for row in b.sampling}
        assert len(handles) == 3
        seeds = sorted(new.seed for m in core.executor.messages for new in m.new)
        assert seeds == [1, 2, 3]  # sample i draws with seed + i, as before the fan-out
        prefilled = sum(p.length for b in core.executor.steps for p in b.prefills)
        assert prefilled < 2 * len(prompt)  # the others start on the first one's prompt blocks
        assert core.block_manager.hit_tokens == (96 if caching else 0)  # counted only where users asked for it
        assert _all_free(core)


def test_a_core_request_is_one_sample():
    core = make_core()
    try:
        core.add(request("n", [1, 2, 3], n=2, temperature=1.0))
    except ValueError as e:
        assert "fan n > 1 out in the front end" in str(e)
    else:
        raise AssertionError("n > 1 reached the core")


def test_abort_ends_every_sample_and_the_others_go_on():
    core = make_core()
    core.add(request("keep", [1, 3, 5, 7], max_tokens=6))
    ids = add(core, request("drop", [2, 4, 6, 8], n=2, max_tokens=50, temperature=1.0))
    early = [o for _ in range(3) for o in core.step()]
    outs = [core.abort(cid) for cid in ids]
    assert all(s.finish_reason == FinishReason.ABORT for o in outs for s in o.samples)
    assert core.abort("drop#0") is None and core.abort("never-seen") is None
    rest = run(core)
    assert not set(ids) & set(rest)
    assert samples([o for o in early if o.request_id == "keep"] + rest["keep"])[0][1] == [FinishReason.LENGTH]
    assert len(samples([o for o in early if o.request_id == "keep"] + rest["keep"])[0][0]) == 6
    assert _all_free(core)


def test_a_stop_string_found_by_the_front_end_finishes_the_sample_before_the_next_step():
    core = make_core()
    core.add(request("s", [1, 2, 3], max_tokens=20))
    core.step()
    core.step()
    core.stop_sample("s", 0)
    assert not core.requests and core.step() == []
    assert _all_free(core) or core.has_work()  # the released handle goes to the worker with the next batch
    run(core)
    assert _all_free(core)


def test_a_pool_too_small_for_every_sequence_preempts_and_recomputes_to_the_same_tokens():
    core = make_core(num_blocks=12, max_num_seqs=6)
    for i in range(6):
        core.add(request(f"r{i}", [10 + i] * 40, max_tokens=40))
    out = run(core)
    assert core.stats().scheduler.preemptions > 0
    for i in range(6):
        tokens, reasons = samples(out[f"r{i}"])[0]
        assert reasons == [FinishReason.LENGTH] and len(tokens) == 40
        assert len(set(tokens)) > 1
    assert _all_free(core)


def test_beam_search_returns_one_final_output_with_the_best_beams():
    core = make_core()
    core.add(request("b", [4, 5, 6], beam_width=3, n=2, max_tokens=4))
    out = run(core)["b"]
    final = [o for o in out if any(s.finish_reason for s in o.samples)]
    assert len(final) == 1
    beams = sorted(final[0].samples, key=lambda s: s.index)
    assert [s.index for s in beams] == [0, 1]
    assert all(len(s.new_token_ids) == 4 and s.cumulative_logprob is not None for s in beams)
    assert beams[0].cumulative_logprob >= beams[1].cumulative_logprob
    assert _all_free(core)


def test_beam_searches_that_fill_a_small_pool_each_end():
    """Found by hypothesis: two searches whose answered beams held every block while each waited for a sibling that
    could not get one (nothing ran, forever); a beam that preempted itself each step because its answered sibling
    held the block it needed. Answered beams now give up their blocks first: every search ends, the pool whole."""
    for num_blocks, reqs in ((8, [(48, 2), (49, 2)]), (9, [(54, 12), (43, 7)])):
        core = make_core(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64)
        for i, (plen, max_tokens) in enumerate(reqs):
            core.add(request(f"b{i}", [(i * 31 + j) % 900 + 3 for j in range(plen)], beam_width=2,
                             max_tokens=max_tokens))
        out = run(core, max_steps=2000)
        for i, (_, max_tokens) in enumerate(reqs):
            tokens, reasons = samples(out[f"b{i}"])[0]
            assert len(reasons) == 1 and 0 < len(tokens) <= max_tokens
        assert core.stats().scheduler.preemptions > 0
        assert _all_free(core)


def test_two_beam_searches_that_fit_one_at_a_time_do_not_take_turns_for_ever():
    """Found by the state machine (test_core_state_machine.py): each search had one beam answered and one waiting;
    the other search's answered beam was preempted to right behind the queue's head, became the next head, and
    preempted this one's in turn, so neither second beam ever ran. The head's siblings now wait right behind it."""
    core = make_core(num_blocks=16, block_size=4, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
    core.add(request("a", [(j * 7) % 90 + 10 for j in range(30)], 64, beam_width=2, max_tokens=8, ignore_eos=True))
    core.add(request("b", [(j * 13) % 90 + 200 for j in range(30)], 64, beam_width=2, max_tokens=8, ignore_eos=True))
    out = run(core, max_steps=2000)
    for rid in ("a", "b"):
        tokens, reasons = samples(out[rid])[0]
        assert reasons == [FinishReason.LENGTH] and len(tokens) == 8
    assert core.stats().scheduler.preemptions > 0
    assert _all_free(core)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(6, 40),
       reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(1, 3),
                               st.one_of(st.none(), st.integers(0, 8))), min_size=1, max_size=8))
def test_every_sample_ends_exactly_once_and_the_pool_is_whole_after(num_blocks, reqs):
    """Random prompts, lengths, n and aborts over a random pool: every sample of every request ends with exactly one
    finish reason, never past max_tokens, and nothing stays allocated or live in the worker."""
    core = make_core(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64)
    aborts: dict[int, list[str]] = {}
    core_ids: dict[int, list[str]] = {}
    for i, (plen, max_tokens, n, abort_at) in enumerate(reqs):
        rid = f"r{i}"
        core_ids[i] = add(core, request(rid, [(i * 31 + j) % 900 + 3 for j in range(plen)], max_tokens=max_tokens,
                                        n=n, temperature=1.0 if n > 1 else 0.0))
        if abort_at is not None:
            aborts.setdefault(abort_at, []).extend(core_ids[i])
    seen: dict[str, list] = {}
    step = 0
    while core.has_work() or any(s >= step for s in aborts):
        for rid in aborts.pop(step, []):
            out = core.abort(rid)
            if out is not None:
                seen.setdefault(rid, []).append(out)
        for out in core.step():
            seen.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 5000
    for i, (_, max_tokens, n, _) in enumerate(reqs):
        got = request_samples(seen, core_ids[i])
        assert sorted(got) == list(range(n)), (i, got)
        for tokens, reasons in got.values():
            assert len(reasons) == 1 and len(tokens) <= max_tokens
    assert _all_free(core)


@pytest.mark.parametrize("host_blocks", [0, 8])
def test_an_adapter_that_cannot_be_read_leaves_no_kv_in_the_prefix_cache(host_blocks):
    """The failed step computed its prompt's full blocks with the adapter's slot empty, under the adapter's key: they
    leave the prefix cache, so once the folder is back the same prompt is computed again (from neither tier)."""
    prompt = list(range(10, 50))  # two full blocks of 16 and a tail
    core = make_core(max_loras=1, num_host_blocks=host_blocks, num_blocks=6)
    core.executor.unreadable.add("/adapters/1")
    add(core, request("bad", prompt, lora_id=1, max_tokens=2, ignore_eos=True))
    assert run(core)["bad"][-1].error == "lora adapter /adapters/1: no such folder"
    for i in range(3 if host_blocks else 0):  # other prompts take every device block: cached ones go to the host
        add(core, request(f"other{i}", list(range(500 + 40 * i, 540 + 40 * i)), max_tokens=2, ignore_eos=True))
    run(core)
    core.executor.unreadable.clear()
    add(core, request("good", prompt, lora_id=1, max_tokens=2, ignore_eos=True))
    run(core)
    new = [m for m in core.executor.messages if m.new][-1].new[0]
    assert new.num_computed_tokens == 0 and core.block_manager.host_hit_tokens == 0


def test_an_adapter_that_cannot_be_read_ends_only_its_requests():
    """The worker reports an adapter load it could not do (its folder removed after acceptance): the requests that
    need it end with ERROR and the reason, their blocks and slot freed; the base model's and another adapter's
    requests in the same steps run to their length; a later request reads the adapter again."""
    core = make_core(max_loras=2)
    core.executor.unreadable.add("/adapters/2")
    for rid, lora_id in (("a1", 1), ("a2", 2), ("base", 0), ("a2-again", 2)):
        add(core, request(rid, [5, 6, 7, 8], lora_id=lora_id, max_tokens=6, ignore_eos=True))
    outs = run(core)
    for rid in ("a2", "a2-again"):
        last = outs[rid][-1]
        assert last.error == "lora adapter /adapters/2: no such folder"
        assert [s.finish_reason for s in last.samples] == [FinishReason.ERROR] and not last.samples[0].new_token_ids
    for rid in ("a1", "base"):
        assert sum(len(s.new_token_ids) for o in outs[rid] for s in o.samples) == 6
        assert outs[rid][-1].samples[0].finish_reason is FinishReason.LENGTH and outs[rid][-1].error is None
    assert not core.requests and core.block_manager.num_used == 0 and 2 not in core.loras.resident
    core.executor.unreadable.clear()
    add(core, request("later", [5, 6, 7, 8], lora_id=2, max_tokens=3, ignore_eos=True))
    out = run(core)["later"]
    assert out[-1].samples[0].finish_reason is FinishReason.LENGTH and 2 in core.loras.resident
