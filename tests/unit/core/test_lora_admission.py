"""LoRA admission in the scheduler (over the scripted engine core): a prompt whose adapter finds no free slot keeps
its place while the prompts behind it that need no adapter or a resident one are admitted, in order; one slot is
drained for it, so a stream of requests for the resident adapters cannot starve it."""

from __future__ import annotations

from unit.fakes import add, make_core, request, run, samples

from ember.protocol import FinishReason


def waiting_ids(core) -> list[str]:
    return [s.request.request_id for s in core.scheduler.waiting]


def running_ids(core) -> list[str]:
    return [s.request.request_id for s in core.scheduler.running]


def step(core, seen: dict[str, list]) -> None:
    for out in core.step():
        seen.setdefault(out.request_id, []).append(out)


def test_requests_behind_a_prompt_without_a_slot_are_admitted_and_keep_their_order():
    core, seen = make_core(max_loras=2, max_num_seqs=16), {}
    add(core, request("a1", [3] * 20, lora_id=1, max_tokens=30))
    step(core, seen)
    add(core, request("a2", [4] * 20, lora_id=2, max_tokens=30))
    step(core, seen)  # slot 0 holds adapter 1 (taken first), slot 1 adapter 2
    for rid, lora in (("h3", 3), ("base", 0), ("more1", 1), ("more2", 2), ("h4", 4), ("base2", 0)):
        add(core, request(rid, [5, 6, 7], lora_id=lora, max_tokens=30))
    step(core, seen)
    # adapter 3 finds no slot; adapter 1's slot, the least recently taken, is drained for it: no new user of
    # adapter 1 behind it; adapter 2's and the base model's requests go on; adapter 4 waits too
    assert running_ids(core) == ["a1", "a2", "base", "more2", "base2"]
    assert waiting_ids(core) == ["h3", "more1", "h4"]
    assert core.scheduler.draining == 1
    for rid, outs in run(core).items():
        seen.setdefault(rid, []).extend(outs)
    for rid in ("a1", "a2", "h3", "base", "more1", "more2", "h4", "base2"):
        tokens, reasons = samples(seen[rid])[0]
        assert reasons == [FinishReason.LENGTH] and len(tokens) == 30
    assert core.block_manager.num_used == 0 and core.scheduler.draining is None


def test_a_stream_of_resident_adapter_requests_does_not_starve_the_waiting_one():
    """Adapter 1 always has a running request and a new one arrives every step: without the drained slot, requests
    passing the waiting adapter-2 prompt would hold adapter 1's (only) slot forever."""
    core = make_core(max_loras=1, max_num_seqs=64, num_blocks=256)
    add(core, request("first", [9] * 8, lora_id=1, max_tokens=6))
    core.step()
    add(core, request("blocked", [8] * 8, lora_id=2, max_tokens=3))
    admitted_at = None
    for step in range(40):
        add(core, request(f"s{step}", [7, step + 10], lora_id=1, max_tokens=6))
        core.step()
        if admitted_at is None and "blocked" in running_ids(core):
            admitted_at = step
    # "first" ends after its 6 tokens; "blocked" takes the slot the step after
    assert admitted_at is not None and admitted_at <= 7, admitted_at
    # adapter 1's requests that arrived behind it waited for it, then ran in arrival order
    run(core)
    assert core.block_manager.num_used == 0 and not core.requests


def test_without_adapters_in_the_way_admission_is_first_come_first_served():
    """A blocked prompt passes nothing over when the reason is seats: the queue stops at it."""
    core = make_core(max_loras=1, max_num_seqs=2)
    add(core, request("a", [3] * 5, lora_id=1, max_tokens=4))
    add(core, request("b", [4] * 5, max_tokens=4))
    add(core, request("c", [5] * 5, max_tokens=4))
    core.step()
    assert running_ids(core) == ["a", "b"] and waiting_ids(core) == ["c"]
    assert core.scheduler.draining is None
