"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors`` -> per-layer, per-projection
A [r, in] and B [out, r] matrices and their scaling (lora_alpha / r, or / sqrt(r) with rsLoRA), checked against the
model before any of it is used. The same adapter may come as one file (``write_adapter_file``: the safetensors with
the config in its metadata), which is how the DashInfer facade stores ``NAME.aslora``.

What ember takes (what PEFT writes for a Llama-family model): ``peft_type`` LORA; target modules among q/k/v/o and
gate/up/down projections; any rank up to ``max_lora_rank``; per-module ``rank_pattern`` / ``alpha_pattern``. What it
refuses, by name: DoRA, trained biases, ``modules_to_save`` (whole replaced layers), ``fan_in_fan_out``, other
modules (embeddings, LM head), and weights whose shapes do not match the model (an adapter of another base model).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ember.config import ModelShape
from ember.errors import BadRequestError

CONFIG_KEY = "adapter_config"  # an adapter file's metadata entry holding its adapter_config.json
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names of the dtypes an adapter's A and B may have
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


def module_name(layer: int, proj: str) -> str:
    """The checkpoint name of a projection, as PEFT's keys and the base weights spell it."""
    return f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], LoRAWeights]  # (layer, projection) -> A, B, scaling

    @property
    def targets(self) -> set[str]:
        return {p for _, p in self.weights}


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection an adapter may target, for the whole (unsplit) model."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    inter = shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _bad(path: str, why: str) -> BadRequestError:
    return BadRequestError(f"lora adapter {path}: {why}")


def _module_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's alpha_pattern: the value of the first key that ends this module's name (keys may be regexes)."""
    for key, value in pattern.items():
        if re.search(rf"(^|\.){key}$", module):
            return value
    return default


def weights_file(path: str) -> str:
    """The safetensors file of an adapter: the folder's adapter_model.safetensors, or the single file itself."""
    return path if os.path.isfile(path) else os.path.join(path, "adapter_model.safetensors")


def _config(path: str) -> dict[str, Any]:
    """The adapter_config.json of a PEFT folder, or the one an adapter file carries in its metadata."""
    if os.path.isfile(path):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                text = (f.metadata() or {}).get(CONFIG_KEY)
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for a damaged file)
            raise _bad(path, f"not an adapter file (a safetensors file with its config): {e}") from None
        if text is None:
            raise _bad(path, f"the file carries no adapter config (metadata {CONFIG_KEY!r})")
    else:
        if not os.path.isdir(path):
            raise _bad(path, "no such folder")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.isfile(os.path.join(path, name)):
                raise _bad(path, f"{name} is missing (a PEFT adapter folder holds adapter_config.json and "
                                 "adapter_model.safetensors)")
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise _bad(path, f"adapter_config.json cannot be read: {e}") from None
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _bad(path, f"adapter_config.json is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _bad(path, "adapter_config.json is not a JSON object")
    return cfg


def write_adapter_file(folder: str, out: str) -> str:
    """One file holding a PEFT adapter folder: its weights (adapter_model.safetensors, or PEFT's older .bin) as
    safetensors, its adapter_config.json in the metadata. DashInfer's serialize writes adapters as such NAME.aslora
    files; ember reads one wherever it reads a folder."""
    from safetensors.torch import load_file, save_file

    cfg, st, binary = (os.path.join(folder, n) for n in ("adapter_config.json", "adapter_model.safetensors",
                                                          "adapter_model.bin"))
    if not os.path.isfile(cfg) or not (os.path.isfile(st) or os.path.isfile(binary)):
        raise _bad(folder, "a PEFT adapter folder needs adapter_config.json and adapter_model.safetensors (or .bin)")
    with open(cfg, encoding="utf-8") as f:
        text = f.read()
    tensors = load_file(st) if os.path.isfile(st) else torch.load(binary, map_location="cpu", weights_only=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={CONFIG_KEY: text})
    return out


def read_adapter_config(path: str, max_lora_rank: int) -> dict[str, Any]:
    """The adapter's config, checked: the files exist, it is a LoRA ember can apply, no rank above the limit."""
    cfg = _config(path)
    _check_fields(path, cfg)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad(path, f"peft_type={cfg.get('peft_type')!r} is not supported: only LORA adapters")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None)):
        if cfg.get(key) not in (off, None) and cfg.get(key) != []:
            raise _bad(path, f"{key}={cfg[key]!r} is not supported (ember applies plain LoRA on the projections)")
    if cfg.get("bias", "none") != "none":
        raise _bad(path, f"bias={cfg['bias']!r} is not supported: adapters with trained biases are not")
    targets = cfg.get("target_modules") or []
    if not isinstance(targets, (str, list)):
        raise _bad(path, f"target_modules={targets!r} is not a module name or a list of them")
    targets = [targets] if isinstance(targets, str) else targets
    unknown = [t for t in targets if not isinstance(t, str) or t not in PROJECTIONS]
    if unknown:
        raise _bad(path, f"target_modules {unknown} are not supported: the model's LoRA targets are {PROJECTIONS}")
    rank = config_rank(cfg)
    if rank > max_lora_rank:
        raise _bad(path, f"rank {rank} is above max_lora_rank={max_lora_rank}: raise max_lora_rank")
    return cfg


def config_rank(cfg: dict[str, Any]) -> int:
    """The largest rank an adapter config names (r, and its rank_pattern)."""
    return max([int(cfg.get("r", 8)), *map(int, (cfg.get("rank_pattern") or {}).values())])


def _check_fields(path: str, cfg: dict[str, Any]) -> None:
    """The config's numbers and patterns are of the types PEFT writes: ranks positive integers, alphas finite."""
    ranks = {"r": cfg.get("r", 8)}
    alphas = {"lora_alpha": cfg.get("lora_alpha", 8)}
    for key, into in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict):
            raise _bad(path, f"{key}={pattern!r} is not a JSON object of module pattern -> value")
        for k, v in pattern.items():
            try:
                re.compile(k)
            except re.error as e:
                raise _bad(path, f"{key} key {k!r} is not a regular expression ({e})") from None
            into[f"{key}[{k!r}]"] = v
    for name, v in ranks.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(path, f"{name}={v!r} is out of range: a rank is an integer >= 1")
    for name, v in alphas.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise _bad(path, f"{name}={v!r} is out of range: lora_alpha is a finite number")


def lora_settings(paths: list[str], max_loras: int | None = None, max_lora_rank: int | None = None
                  ) -> dict[str, Any]:
    """The engine settings that hold these adapters: all resident at once unless max_loras says otherwise, and a
    rank limit of at least 16 (vLLM's default) that fits the largest of them (what `--lora` and `--lora-modules`
    start an engine with)."""
    rank = max((config_rank(read_adapter_config(p, 1 << 30)) for p in paths), default=16)
    return dict(enable_lora=True, max_loras=max_loras or max(1, len(paths)),
                max_lora_rank=max_lora_rank or max(16, rank))


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """What an adapter holds, checked against the model without reading its weights: the safetensors key of each
    module's A and B, and each module's scaling."""

    rank: int  # the largest rank of its modules
    keys: dict[tuple[int, str], tuple[str, str]]  # (layer, projection) -> keys of A and B
    scalings: dict[tuple[int, str], float]


def inspect_adapter(path: str, shape: ModelShape, max_lora_rank: int) -> AdapterLayout:
    """The adapter's layout from its config and the safetensors header alone; refuses by name what ember cannot
    apply or what does not fit this model."""
    from safetensors import safe_open

    cfg = read_adapter_config(path, max_lora_rank)
    shapes = projection_shapes(shape)
    parts: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    modules: dict[tuple[int, str], str] = {}
    try:
        with safe_open(weights_file(path), framework="pt") as f:
            header = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for a damaged file)
        raise _bad(path, f"adapter_model.safetensors cannot be read: {e}") from None
    odd = {k: d for k, d in dtypes.items() if d not in _FLOAT_DTYPES}
    if odd:
        key = next(iter(odd))
        raise _bad(path, f"weight {key} has dtype {odd[key]}: LoRA weights are one of {_FLOAT_DTYPES}")
    for key, dims in header.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in PROJECTIONS:
            raise _bad(path, f"weight {key} is not a LoRA A/B of a layer projection: it cannot be applied")
        layer = int(m.group(2))
        if layer >= shape.num_layers:
            raise _bad(path, f"weight {key} is for layer {layer}, but the model has {shape.num_layers} layers")
        parts.setdefault((layer, m.group(3)), {})[m.group(4)] = (key, dims)
        modules[(layer, m.group(3))] = m.group(1)
    alpha_default = float(cfg.get("lora_alpha", 8))
    keys, scalings, top = {}, {}, 0
    for (layer, proj), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _bad(path, f"layer {layer} {proj} has lora_{'A' if 'A' in ab else 'B'} but not its pair")
        (key_a, a), (key_b, b) = ab["A"], ab["B"]
        n_in, n_out = shapes[proj]
        r = a[0] if len(a) == 2 else -1
        if r < 1 or a != (r, n_in) or b != (n_out, r):
            raise _bad(path, f"layer {layer} {proj}: A {a} and B {b} do not fit this model's {n_in} -> {n_out} "
                             "projection (an adapter of another base model?)")
        if r > max_lora_rank:
            raise _bad(path, f"layer {layer} {proj} has rank {r}, above max_lora_rank={max_lora_rank}")
        alpha = float(_module_value(cfg.get("alpha_pattern") or {}, modules[(layer, proj)], alpha_default))
        scalings[(layer, proj)] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r  # r: this module's
        keys[(layer, proj)] = (key_a, key_b)
        top = max(top, r)
    if not keys:
        raise _bad(path, "adapter_model.safetensors holds no LoRA weights")
    return AdapterLayout(top, keys, scalings)


def read_adapter(path: str, name: str, shape: ModelShape, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Every A and B of the adapter, as ``dtype`` on CPU, checked against the model's shapes."""
    from safetensors.torch import load

    layout = inspect_adapter(path, shape, max_lora_rank)
    # from bytes: safetensors 0.8's load_file / get_tensor keep ~1.8 KiB a call for good, and a server whose
    # requests alternate between more adapters than max_loras reads one at every swap (docs/reliability.md)
    try:
        with open(weights_file(path), "rb") as f:
            tensors = load(f.read())
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for a damaged file)
        raise _bad(path, f"adapter_model.safetensors cannot be read: {e}") from None
    weights = {}
    for module, (ka, kb) in layout.keys.items():
        for key in (ka, kb):
            t = tensors[key]
            if not t.is_floating_point():
                raise _bad(path, f"weight {key} has dtype {t.dtype}: LoRA weights are floats")
            if not bool(torch.isfinite(t).all()):
                raise _bad(path, f"weight {key} holds NaN or infinite values: the file is damaged")
        weights[module] = LoRAWeights(tensors[ka].to(dtype).contiguous(), tensors[kb].to(dtype).contiguous(),
                                      layout.scalings[module])
    return LoRAAdapter(name, layout.rank, weights)
