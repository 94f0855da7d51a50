"""M-RoPE positions planned from a prompt's placeholders equal transformers' get_rope_index (Qwen2-VL), for the
whole prompt, for any chunk of it, and for decode steps past it (the rope delta)."""

from __future__ import annotations

import pytest
import torch

from ember.protocol import NewSequence, Placeholder, SchedulerOutput
from ember.sampling_params import SamplingParams
from ember.worker.input_batch import InputBatch
from ember.worker.mrope import mrope_positions

# text 3, an image of 1 x 2 x 3 tokens, text 2, an image of 1 x 4 x 2, text 4
LAYOUT = [("text", 3), ((1, 2, 3), 6), ("text", 2), ((1, 4, 2), 8), ("text", 4)]


def _placeholders() -> tuple[tuple[Placeholder, ...], list[int]]:
    out, types, at = [], [], 0
    for i, (kind, n) in enumerate(LAYOUT):
        if kind != "text":
            out.append(Placeholder(f"h{i}", at, n, kind))
        types += [0 if kind == "text" else 1] * n
        at += n
    return tuple(out), types


def _reference(types: list[int], decode: int) -> torch.Tensor:
    """transformers' positions of the prompt, then of ``decode`` generated tokens (position + rope delta)."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=16, vocab_size=32),
                           vision_config=dict(depth=1, embed_dim=8, hidden_size=16, num_heads=2))
    grids = torch.tensor([[g[0], g[1] * 2, g[2] * 2] for g, _ in LAYOUT if g != "text"])  # before the 2 x 2 merge
    ids = torch.zeros(1, len(types), dtype=torch.long)
    pos, delta = Qwen2VLModel(config).get_rope_index(ids, torch.tensor([types]), image_grid_thw=grids)
    after = torch.arange(len(types), len(types) + decode) + delta[0]
    return torch.cat([pos[:, 0], after.expand(3, -1)], dim=1)


def test_positions_equal_transformers_whole_chunked_and_decoding():
    phs, types = _placeholders()
    want = _reference(types, decode=3).tolist()
    total = len(types) + 3
    assert [list(r) for r in mrope_positions(phs, 0, total)] == want
    for start, count in [(0, 5), (5, 7), (12, 1), (4, 15), (len(types), 1), (len(types) + 2, 1)]:
        got = mrope_positions(phs, start, count)
        assert [list(r) for r in got] == [r[start:start + count] for r in want], (start, count)


def test_text_only_positions_are_the_token_indices():
    assert mrope_positions((), 7, 3) == ([7, 8, 9], [7, 8, 9], [7, 8, 9])


@pytest.mark.parametrize("mrope", [False, True])
def test_input_batch_plans_three_rows_only_for_mrope_models(mrope):
    """A decode row and a prefill chunk in one step: the three rows follow each sequence's images; a model without
    M-RoPE gets none (its planning never reads the grids)."""
    phs, types = _placeholders()
    n = len(types)
    batch = InputBatch(4, mrope=mrope)
    params = SamplingParams(temperature=0)
    batch.update(SchedulerOutput(new=[NewSequence(1, list(range(n + 2)), n, n + 1, list(range(8)), params, None,
                                                  placeholders=phs),
                                      NewSequence(2, list(range(n)), n, 4, list(range(8, 16)), params, None,
                                                  placeholders=phs)]))
    rows = batch.plan(SchedulerOutput(handles=[1, 2], num_tokens=[1, 10]))
    assert rows.positions == [n + 1, *range(4, 14)]  # the token indices, as ever (slots follow them)
    if not mrope:
        assert rows.mrope_positions is None
        return
    want = _reference(types, decode=2).tolist()
    assert [list(r) for r in rows.mrope_positions] == [[r[n + 1], *r[4:14]] for r in want]
