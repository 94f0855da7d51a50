"""An image in a prompt, as the front end hands it to the engine core: where its embeddings go and what its
encoder reads. The content hash keys the workers' encoder cache (a repeated image is encoded once) and the prefix
cache (the same text with another image never takes the first image's KV)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Placeholder:
    """Prompt positions [offset, offset + length) take the embeddings of the item hashed ``hash``, in order."""

    hash: str
    offset: int
    length: int
    # the item's token grid (temporal, height, width) for models whose positions follow it (Qwen2-VL's M-RoPE:
    # t * h * w == length); None for the others
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        return self.offset < stop and self.end > start


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One image of a prompt: its place and the processor's arrays its encoder reads (numpy, e.g. ``pixel_values``
    [3, H, W]); sent to the workers only in the step that encodes it."""

    placeholder: Placeholder
    data: dict[str, Any]

    @property
    def hash(self) -> str:
        return self.placeholder.hash
