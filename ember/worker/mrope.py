"""Multimodal RoPE positions (Qwen2-VL's M-RoPE): three position rows (temporal, height, width) a token. Text tokens
have all three equal; an image's tokens take their (t, h, w) index in the image's token grid, each offset by the
position the image starts at; text after an image continues from that start plus the grid's largest side, so a
sequence's text positions run ahead of (or behind) its token indices by a fixed "rope delta" past its last image.

Computed here, in the runner's plain-Python planning, from the prompt's placeholders (offset, length, grid) and the
token indices a step runs: no table is stored a sequence, a decode step costs one pass over the sequence's images,
and models without M-RoPE never call it."""

from __future__ import annotations

from collections.abc import Sequence

from ember.protocol import Placeholder

Rows = tuple[list[int], list[int], list[int]]


def mrope_positions(placeholders: Sequence[Placeholder], start: int, count: int) -> Rows:
    """The (t, h, w) position rows of token indices start..start+count-1 of a sequence with these images."""
    stop = start + count
    if not placeholders:
        r = list(range(start, stop))
        return r, r, list(r)
    t_rows: list[int] = []
    h_rows: list[int] = []
    w_rows: list[int] = []
    shift = 0  # text position minus token index, after the images so far
    at = start
    for ph in placeholders:
        if ph.offset >= stop:
            break
        if ph.grid is None:
            raise ValueError(f"image {ph.hash[:12]} has no token grid: M-RoPE positions need one")
        gt, gh, gw = ph.grid
        if at < ph.offset:  # text before the image
            r = range(at + shift, min(ph.offset, stop) + shift)
            t_rows.extend(r)
            h_rows.extend(r)
            w_rows.extend(r)
        base = ph.offset + shift
        for k in range(max(at, ph.offset) - ph.offset, min(stop, ph.end) - ph.offset):
            t_rows.append(base + k // (gh * gw))
            h_rows.append(base + k // gw % gh)
            w_rows.append(base + k % gw)
        shift += max(gt, gh, gw) - ph.length
        at = max(at, ph.end)
    if at < stop:
        r = range(at + shift, stop + shift)
        t_rows.extend(r)
        h_rows.extend(r)
        w_rows.extend(r)
    return t_rows, h_rows, w_rows
