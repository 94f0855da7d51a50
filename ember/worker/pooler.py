"""Pooling: a pooling request's hidden states -> one vector, as sentence-transformers' ``Pooling`` and
``Normalize`` modules compute it. A prompt prefilled in chunks is pooled across them: the first token's state
(``cls``) or the running sum (``mean``) is kept per sequence until its last chunk, so the vector is the one a
single whole-prompt forward gives."""

from __future__ import annotations

import torch

from ember.worker.input_batch import PoolingRows


class Pooler:
    def __init__(self) -> None:
        self.partial: dict[int, tuple[torch.Tensor, int]] = {}  # handle -> (first state or sum, tokens summed)

    def forget(self, handles: list[int]) -> None:
        """Drop what is kept of sequences that finished or were preempted (a resumed one starts again)."""
        for h in handles:
            self.partial.pop(h, None)

    def __call__(self, hidden: torch.Tensor, rows: list[PoolingRows]) -> dict[int, list[float]]:
        """The vectors of the sequences whose last chunk ran in this step (float32, truncated to ``dimensions``,
        then L2-normalised where asked); the others' chunks are folded into what is kept."""
        done: list[tuple[int, torch.Tensor]] = []
        for r in rows:
            x = hidden[r.start:r.start + r.length].float()
            kind = r.params.pooling
            if kind == "last":
                if r.last:
                    done.append((r.handle, x[-1]))
                continue
            kept = self.partial.get(r.handle)
            if kind == "cls":
                kept = (x[0], 1) if r.position == 0 else kept
            else:  # mean
                s = x.sum(dim=0)
                kept = (s, r.length) if kept is None else (kept[0] + s, kept[1] + r.length)
            if r.last:
                self.partial.pop(r.handle, None)
                done.append((r.handle, kept[0] if kind == "cls" else kept[0] / kept[1]))
            else:
                self.partial[r.handle] = kept
        if not done:
            return {}
        by_handle = {r.handle: r.params for r in rows}
        out = {}
        for handle, v in done:
            p = by_handle[handle]
            if p.dimensions is not None:
                v = v[:p.dimensions]
            if p.normalize:
                v = torch.nn.functional.normalize(v, p=2.0, dim=0)
            out[handle] = v.tolist()
        return out
