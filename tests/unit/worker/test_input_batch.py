"""The step messages as diffs (``SchedulerOutput``, ``StepWriter``, ``InputBatch``): what a model runner holds after
applying each message equals the core's own sequences, under preemption, n > 1, beam search, prefix hits and aborts;
and a decode step sends a few bytes a row, not its history."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st
from unit.fakes import add, make_core, request

from ember.protocol import KVWindow, NewSequence, SchedulerOutput
from ember.sampling_params import SamplingParams
from ember.worker.input_batch import InputBatch


def _checked(core):
    """Wrap the scripted executor: after each message, the runner's copy of every scheduled sequence equals the
    core's (tokens, blocks, computed tokens), and nothing finished is still held."""
    executor = core.executor
    run = executor.execute_model
    checked = [0]

    def execute(message):
        live = {s.seq_id: s for s in core.scheduler.running}
        out = run(message)
        held = executor.input_batch.seqs
        for handle, n in zip(message.handles, message.num_tokens):
            seq, mine = live[handle], held[handle]
            assert mine.token_ids == seq.token_ids and mine.block_ids == seq.block_table
            assert mine.num_computed_tokens == seq.num_computed_tokens + n  # the runner already counted this step
            checked[0] += 1
        assert not set(message.finished) & set(held)
        return out

    executor.execute_model = execute
    return checked


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(8, 40), prefix_caching=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(1, 3), st.booleans(),
                               st.one_of(st.none(), st.integers(0, 8))), min_size=1, max_size=8))
def test_the_runner_holds_what_the_core_has(num_blocks, prefix_caching, reqs):
    core = make_core(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=prefix_caching)
    checked = _checked(core)
    aborts: dict[int, list[str]] = {}
    for i, (plen, max_tokens, n, beam, abort_at) in enumerate(reqs):
        rid = f"r{i}"
        extra = dict(beam_width=2, n=min(n, 2)) if beam else dict(
            n=n, temperature=1.0 if n > 1 else 0.0)
        ids = add(core, request(rid, [(i % 3 * 31 + j) % 900 + 3 for j in range(plen)], max_tokens=max_tokens,
                                **extra))
        if abort_at is not None and i > 0:  # the first runs to its end
            aborts.setdefault(abort_at, []).extend(ids)
    step = 0
    while core.has_work() or any(s >= step for s in aborts):
        for rid in aborts.pop(step, []):
            core.abort(rid)
        core.step()
        step += 1
        assert step < 5000
    assert checked[0] > 0
    assert not core.executor.input_batch.seqs  # every sequence ended and was dropped


def test_a_sequence_goes_out_in_full_once_then_as_diffs():
    core = make_core(block_size=4)
    core.add(request("a", list(range(10, 19)), max_tokens=6))  # 9 tokens: 3 blocks
    core.step()
    first = core.executor.messages[0]
    assert [type(n) for n in first.new] == [NewSequence] and first.new[0].token_ids == list(range(10, 19))
    assert len(first.new[0].block_ids) == 3
    core.step()  # token 10 of the sequence: it fits block 3
    second = core.executor.messages[1]
    handle = first.new[0].handle
    token = core.executor.script(core.executor.steps[0].sampling[0])
    assert not second.new and second.new_token_ids == {handle: [token]}
    assert not second.new_block_ids
    for _ in range(3):
        core.step()
    grew = [m for m in core.executor.messages if m.new_block_ids]
    assert grew and all(len(ids) == 1 for m in grew for ids in m.new_block_ids.values())


def test_a_decode_step_is_a_few_bytes_a_row_whatever_the_history():
    """64 rows at 300 tokens of context with penalties (which read the history): the step's message is the new
    token and handle of each row, not their histories."""
    core = make_core(num_blocks=64 * 22, max_num_seqs=64, max_model_len=400, max_num_batched_tokens=2048)
    for i in range(64):
        core.add(request(f"r{i}", [(i * 13 + j) % 900 + 3 for j in range(300)], max_model_len=400, max_tokens=20,
                         repetition_penalty=1.2, presence_penalty=0.3))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    core.step()
    message = core.executor.messages[-1]
    assert len(message.handles) == 64 and not message.new
    assert len(pickle.dumps(message)) < 64 * 40


def test_a_window_maps_positions_to_ring_slots():
    batch = InputBatch(block_size=4, window=KVWindow(size=8, sink=2))
    params = SamplingParams()
    batch.update(SchedulerOutput(new=[NewSequence(7, list(range(20)), 5, 9, [3, 5], params, None)]))
    rows = batch.plan(SchedulerOutput(handles=[7], num_tokens=[1]))
    # position 9 -> slot 2 + (9 - 2) % 6 = 3: block 0 (id 3), offset 3; 8 slots filled
    assert rows.positions == [9] and rows.slots == [3 * 4 + 3] and rows.decode_context_lens == [8]
