"""What a loaded model's weights are held as, in words. The mixed layout is decided weight by weight at load (a GGUF's
4-, 5- and 6-bit blocks as int4 / int5 / int6 where the device's kernel takes them, other blocks int8), so the config
alone cannot say it: the layers can."""

from __future__ import annotations

import torch

from ember.config import INT4_GROUP_SIZES

A8 = " a8"  # a kind's mark where its weights multiply int8 activations per 32 inputs (EngineConfig.int8_activations)
# every kind a layer can hold, in one order on every rank (their counts are summed over the ranks)
HELD_KINDS = (tuple(f"{m} g{g}{a}" for m in ("int4", "int5") for g in INT4_GROUP_SIZES for a in ("", A8))
              + ("int6", "int8", "int8" + A8, "w8a8"))


def held_kinds(model: torch.nn.Module) -> dict[str, int]:
    """Weights (rows x inputs) per kind as the layers hold them: 'int4 g32', 'int4 g32 a8', 'int5 g32', 'int6',
    'int8', 'int8 a8', 'w8a8'. Each matmul once (a tied LM head's is its table's) and each quantized embedding table
    an LM head does not share."""
    modules = list(model.modules())
    shared = {id(m.tied_to) for m in modules if getattr(m, "tied_to", None) is not None}
    seen: set[int] = set()
    counts: dict[str, int] = {}

    def add(kind: str, weights: int) -> None:
        counts[kind] = counts.get(kind, 0) + weights

    for module in modules:
        for mm in (getattr(module, "qmm", None), getattr(module, "table6", None)):
            if mm is None or id(mm) in seen:
                continue
            seen.add(id(mm))
            for part in getattr(mm, "parts", (mm,)):
                kind = f"{part.method} g{part.group_size}" if part.method in ("int4", "int5") else part.method
                add(kind + A8 if part.int8_x else kind, part.n * part.k)
        table = getattr(module, "qt", None)  # an embedding's int8 rows: a head's own are its qmm, counted above
        if table is not None and not hasattr(module, "tied_to") and id(module) not in shared:
            rows, cols = table.shape
            add(table.kind, rows * cols)
    return counts


def takes_int8_activations(counts: dict[str, int]) -> bool:
    """Whether any weight counted (``held_kinds``, or its sums over the ranks) multiplies int8 activations."""
    return any(n for kind, n in counts.items() if kind.endswith(A8))


def describe_held(counts: dict[str, int], fallback: str) -> str:
    """The kinds and their shares of the quantized weights, largest first ("int4 g32 (63%) + int6 (24%) + int8
    (13%)"); ``fallback`` (the config's description) when nothing is counted."""
    total = sum(counts.values())
    if not total:
        return fallback
    ranked = sorted(((k, n) for k, n in counts.items() if n), key=lambda kv: (-kv[1], kv[0]))
    return " + ".join(f"{kind} ({100 * n / total:.0f}%)" for kind, n in ranked)

