"""The verify step's timing at start-up (``worker.verify_cost``) against a model whose step takes a known time on a
fake clock: which draft lengths are timed, the ratio to a decode step, the lengths between them interpolated, and a
dip (the machine's noise) flattened."""

from __future__ import annotations

import pytest
import torch

from ember.worker import verify_cost
from ember.worker.verify_cost import measure_verify_costs, timed_points


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Model(torch.nn.Module):
    """A step of n rows takes step_time(n) on the clock; the attention metadata must be a decode row at n = 1 and a
    draft span of n rows over the whole context otherwise."""

    def __init__(self, clock: _Clock, step_time, context: int) -> None:
        super().__init__()
        self.clock, self.step_time, self.context = clock, step_time, context
        self.rows: list[int] = []

    def forward(self, ids, positions, meta):
        n = len(ids)
        assert positions.tolist() == list(range(self.context - n, self.context))
        if n == 1:
            assert meta.num_decode == 1 and meta.decode_context_lens.tolist() == [self.context]
        else:
            (span,) = meta.prefills
            assert meta.num_decode == 0 and span.draft and (span.length, span.context_len) == (n, self.context)
        self.rows.append(n)
        self.clock.now += self.step_time(n)
        return torch.zeros(n, 4)

    def compute_logits(self, hidden):
        return hidden


def _measure(monkeypatch, step_time, most: int, context: int = 40) -> tuple[tuple[float, ...], _Model]:
    clock = _Clock()
    monkeypatch.setattr(verify_cost.time, "perf_counter", clock)
    model = _Model(clock, step_time, context)
    return measure_verify_costs(model, torch.device("cpu"), 16, context, most, repeats=3), model


def test_draft_lengths_timed():
    assert timed_points(1) == [0, 1]
    assert timed_points(8) == [0, 1, 2, 3, 4, 6, 8]
    assert timed_points(24) == [0, 1, 2, 3, 4, 6, 9, 13, 19, 24]


def test_costs_are_the_timed_ratios_and_linear_between(monkeypatch):
    """Rows in passes of 3, as the int4 kernel runs them: 1-3 rows cost a step, each further pass half a step."""
    costs, model = _measure(monkeypatch, lambda n: 1.0 + 0.5 * ((n - 1) // 3), 8)
    assert len(costs) == 9 and costs[0] == 1.0
    assert costs[:5] == pytest.approx([1.0, 1.0, 1.0, 1.5, 1.5])
    assert costs[6] == pytest.approx(2.0) and costs[8] == pytest.approx(2.0)  # 7 and 9 rows: three passes
    assert costs[5] == pytest.approx(1.75) and costs[7] == pytest.approx(2.0)  # not timed: between
    assert sorted(set(model.rows)) == [1, 2, 3, 4, 5, 7, 9]


def test_a_dip_is_flattened(monkeypatch):
    costs, _ = _measure(monkeypatch, lambda n: {1: 1.0, 2: 1.2, 3: 1.1}.get(n, 1.3), 3)
    assert costs == pytest.approx((1.0, 1.2, 1.2, 1.3))


def test_the_context_must_hold_the_draft(monkeypatch):
    with pytest.raises(ValueError, match="context=8 must exceed most=8"):
        _measure(monkeypatch, lambda n: 1.0, 8, context=8)
