"""What to quantize and how: one slotted dataclass, validated before any work starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ember.config import INT4_GROUP_SIZES, QUANT_ALGORITHMS, QUANT_METHODS, QUANT_MODES

__all__ = ["INT4_GROUP_SIZES", "QUANT_ALGORITHMS", "QUANT_METHODS", "QUANT_MODES", "QuantConfig"]


@dataclass(slots=True, frozen=True)
class QuantConfig:
    """method: 'int8' (A16W8, per-output-channel scales), 'int4' (A16W4, groups of group_size along the input,
    asymmetric) or 'w8a8' (int8 weights and dynamic per-token int8 activations). Every linear layer of the decoder
    is quantized; the token embedding and the LM head too when ``embeddings`` (int8 per row: the logits are where 4
    bits cost most; in the mixed layout a Q6_K table stays int6). ``algorithm``: the calibrated transformation the
    float weights went through first ('awq' before int4, 'smoothquant' before w8a8), None for plain rounding; it
    changes the weights, not the layout or the kernels. ``mixed`` (int4 only; a GGUF whose linear weights mix 4-, 5-
    or 6-bit and other blocks, as Q4_K_M does): each weight in the layout its blocks fit, int4 / int5 / int6 where
    its parts come so (kept exactly), int8 per row otherwise."""

    method: str
    group_size: int = 128
    embeddings: bool = False
    algorithm: str | None = None
    mixed: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization={self.method!r} is not supported: use one of {', '.join(QUANT_METHODS)} "
                             "or None")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is out of range: int4 groups are one of "
                             f"{INT4_GROUP_SIZES}")
        if self.algorithm is not None and QUANT_ALGORITHMS.get(self.algorithm) != self.method:
            allowed = ", ".join(f"{a!r} (with {m!r})" for a, m in QUANT_ALGORITHMS.items())
            raise ValueError(f"algorithm={self.algorithm!r} is not supported with method={self.method!r}: use one of "
                             f"{allowed} or None")
        if self.mixed and (self.method != "int4" or self.algorithm is not None):
            raise ValueError(f"mixed=True is only for plain int4 (method={self.method!r}, "
                             f"algorithm={self.algorithm!r})")

    @classmethod
    def of(cls, mode: str, group_size: int = 128, embeddings: bool = False) -> "QuantConfig":
        """The config of a quantization mode as EngineConfig and `ember convert` name it: a method, or a
        calibrated algorithm (its method implied)."""
        if mode in QUANT_ALGORITHMS:
            return cls(QUANT_ALGORITHMS[mode], group_size, embeddings, mode)
        return cls(mode, group_size, embeddings)

    @property
    def mode(self) -> str:
        """The name EngineConfig(quantization=...) gives this config: the algorithm, else the method."""
        return self.algorithm or self.method

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
        base = f"int4 g{self.group_size}" if self.method == "int4" else self.method
        if self.mixed:
            base += " + int8"
        return f"{base} ({self.algorithm})" if self.algorithm else base

    def to_dict(self) -> dict[str, Any]:
        """The .asmodel's quant_config; ``algorithm`` and ``mixed`` only when set, so plain configs read as they
        always did."""
        d = asdict(self)
        if d["algorithm"] is None:
            del d["algorithm"]
        if not d["mixed"]:
            del d["mixed"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "QuantConfig | None":
        return cls(**d) if d else None

