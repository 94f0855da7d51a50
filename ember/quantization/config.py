"""What to quantize and how: one slotted dataclass, validated before any work starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

QUANT_METHODS = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(slots=True, frozen=True)
class QuantConfig:
    """method: 'int8' (A16W8, per-output-channel scales), 'int4' (A16W4, groups of group_size along the input,
    asymmetric) or 'w8a8' (int8 weights and dynamic per-token int8 activations). Every linear layer of the decoder
    is quantized; the token embedding and the LM head too when ``embeddings`` (always int8 per row: the logits are
    where 4 bits cost most)."""

    method: str
    group_size: int = 128
    embeddings: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization={self.method!r} is not supported: use one of {', '.join(QUANT_METHODS)} "
                             "or None")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is out of range: int4 groups are one of "
                             f"{INT4_GROUP_SIZES}")

    def linear_layout(self, in_features: int) -> tuple[str, int]:
        """(kind, group size) of a linear weight with in_features inputs: int4 in groups (the configured one, or the
        largest smaller one that divides in_features: small test models), int8 (and w8a8) one scale per channel."""
        if self.method != "int4":
            return "int8", in_features
        for g in (self.group_size, *sorted((g for g in INT4_GROUP_SIZES if g < self.group_size), reverse=True)):
            if in_features % g == 0:
                return "int4", g
        raise ValueError(f"int4 quantization needs input sizes divisible by {min(INT4_GROUP_SIZES)}: a layer has "
                         f"{in_features} inputs")

    def describe(self) -> str:
        return f"int4 g{self.group_size}" if self.method == "int4" else self.method

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "QuantConfig | None":
        return cls(**d) if d else None

