"""ember's serialized model: two files side by side, named after the model.

- ``NAME.asmodel`` (JSON): format and version, architecture, the transformers config, the weights' dtype, the
  generation defaults, the tokenizer files and chat template, the flags of the program that wrote it (``extra``),
  and an index of the weights (name, dtype, shape of each tensor, and the byte size of the weights file) to
  validate them against;
- ``NAME.asparam`` (safetensors): the weights under Hugging Face names, already in that dtype; a quantized weight
  ``X.weight`` is stored as ``X.qdata`` (int8, or uint8 holding two int4 values), ``X.scales`` and, for int4,
  ``X.offsets`` (see ember.quantization.tensor), with the QuantConfig that made it under ``quant_config``.

DashInfer names its serialized pair the same way; its facade writes them (``HuggingFaceModel.serialize``), ``ember
convert`` writes them, and ``ember.LLM(model="DIR/NAME.asmodel")`` runs them. Loading needs neither the source
checkpoint nor a tokenizer conversion, so a converted model starts fast and on its own.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import dtypes
from ember.distributed import WeightSlice
from ember.errors import ConfigError
from ember.model_loader.hf import Select, read_all, read_slice
from ember.quantization import QuantConfig, QuantizedTensor, requantize

FORMAT = "ember.asmodel"
FORMAT_VERSION = 1
MODEL_SUFFIX, PARAM_SUFFIX = ".asmodel", ".asparam"
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8", "I32": "int32",
              "I64": "int64", "BOOL": "bool"}


def pair_paths(out_dir: str, name: str) -> tuple[str, str]:
    """The .asmodel and .asparam paths of model NAME in out_dir."""
    if not name or "/" in name or os.sep in name:
        raise ValueError(f"model_name={name!r} is not a file name: use letters, digits, '-', '_' or '.' "
                         "(replace '/' with '_')")
    return os.path.join(out_dir, name + MODEL_SUFFIX), os.path.join(out_dir, name + PARAM_SUFFIX)


@dataclass(slots=True)
class ModelContents:
    """Everything a serialized model holds, in memory (what HuggingFaceModel.load_model reads)."""

    architecture: str
    hf_config: Any
    generation_config: dict[str, Any]
    tokenizer: Any  # ember.tokenizer.Tokenizer
    tensors: dict[str, torch.Tensor | QuantizedTensor]
    dtype: torch.dtype
    source: str
    # what the program that wrote the pair wants kept with it (a facade's own flags: DashInfer's serialize
    # arguments); stored verbatim under "extra", never read by ember
    extra: dict[str, Any] = field(default_factory=dict)
    quant_config: QuantConfig | None = None  # set: write() stores the weights quantized


def default_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint's own float dtype (config.json's dtype), else bfloat16 (GGUF, or no dtype recorded)."""
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name if name in dtypes.NAMES else torch.bfloat16
    return dtypes.DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)


def parse_dtype(value: str | torch.dtype | None, hf_config: Any, name: str = "dtype") -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch dtype); None or 'auto' is the checkpoint's own."""
    if value is None or value == "auto":
        return default_dtype(hf_config)
    if isinstance(value, torch.dtype) and value in dtypes.NAMES:
        return value
    if value not in dtypes.DTYPES:
        raise ValueError(f"{name}={value!r} is not supported: use 'float32', 'bfloat16' or 'float16'")
    return dtypes.DTYPES[value]


def read_contents(checkpoint: Any, dtype: torch.dtype, source: str,
                  progress: Callable[[Iterable], Iterable] | None = None, keep_quantized: bool = False,
                  tokenizer: Any = None) -> ModelContents:
    """Read a checkpoint (see model_loader.open_checkpoint) into memory, floating-point weights cast to dtype.
    keep_quantized: weights stored quantized (GGUF blocks, a quantized .asmodel) stay so, to be stored again without
    a round trip through float. A tied LM head is left out, as transformers' save_pretrained does. tokenizer: an
    ember Tokenizer to store instead of the checkpoint's own."""
    from ember.models import resolve_architecture

    hf_config = checkpoint.hf_config()
    architecture, _ = resolve_architecture(getattr(hf_config, "architectures", None))
    tensors: dict[str, torch.Tensor] = {}
    items: Iterable = checkpoint.tensors(hf_config, keep_quantized=keep_quantized)
    for name, t in (progress(items) if progress else items):
        if name == "lm_head.weight" and getattr(hf_config, "tie_word_embeddings", False):
            continue
        if isinstance(t, QuantizedTensor):
            tensors[name] = t if keep_quantized else t.dequantize(dtype).contiguous()
        else:
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    tokenizer = tokenizer if tokenizer is not None else checkpoint.tokenizer()
    return ModelContents(architecture, hf_config, checkpoint.generation_config(), tokenizer, tensors,
                         dtype, source)


def write(contents: ModelContents, out_dir: str, name: str) -> tuple[str, str]:
    """Write NAME.asmodel and NAME.asparam into out_dir; the .asmodel goes last, so its presence means a whole pair."""
    from safetensors.torch import save_file

    from ember.version import __version__

    model_path, param_path = pair_paths(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    config = contents.hf_config.to_dict()
    config["dtype"] = dtypes.NAMES[contents.dtype]
    config.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        contents.tokenizer.hf.save_pretrained(tmp)
        tok_files = {}
        for f in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, f), encoding="utf-8") as fh:
                tok_files[f] = fh.read()
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ember_version": __version__,
        "model_name": name,
        "architecture": contents.architecture,
        "source": contents.source,
        "dtype": dtypes.NAMES[contents.dtype],
        "config": config,
        "generation_config": contents.generation_config,
        "chat_template": getattr(contents.tokenizer.hf, "chat_template", None),
        "tokenizer": tok_files,
        "extra": contents.extra,
        "quant_config": contents.quant_config.to_dict() if contents.quant_config else None,
        "weights": {"file": os.path.basename(param_path), "tensors": {}, "bytes": 0},
    }
    for p in (model_path, param_path):  # a half-written pair must not validate
        if os.path.exists(p):
            os.remove(p)
    tensors = quantize_tensors(contents.tensors, contents.quant_config, contents.dtype)
    save_file(tensors, param_path + ".tmp", metadata={"format": "pt", "ember": FORMAT})
    os.replace(param_path + ".tmp", param_path)
    meta["weights"]["tensors"] = _header_index(param_path)
    meta["weights"]["bytes"] = os.path.getsize(param_path)
    with open(model_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(meta, f)
    os.replace(model_path + ".tmp", model_path)
    return model_path, param_path


def is_quantizable(name: str, quant: QuantConfig) -> bool:
    """Whether quant quantizes this tensor: every projection; the embedding and the LM head when it says so."""
    if name.endswith("_proj.weight"):
        return True
    return quant.embeddings and name in ("model.embed_tokens.weight", "lm_head.weight")


def quantize_tensors(tensors: dict[str, torch.Tensor | QuantizedTensor], quant: QuantConfig | None,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors to store: with a QuantConfig, each weight the engine would quantize becomes X.qdata / X.scales
    (/ X.offsets) in exactly the layout the engine builds at load time; everything else is float in dtype."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quant is None or not is_quantizable(name, quant):
            out[name] = t.dequantize(dtype).contiguous() if isinstance(t, QuantizedTensor) else t
            continue
        # the layout Linear builds from the same QuantConfig (embedding tables: int8 per row)
        kind, group = quant.linear_layout(t.shape[1]) if name.endswith("_proj.weight") else ("int8", t.shape[1])
        qt = requantize(t, kind, group)
        base = name.removesuffix(".weight")
        out[base + ".qdata"], out[base + ".scales"] = qt.data.contiguous(), qt.scales.contiguous()
        if qt.offsets is not None:
            out[base + ".offsets"] = qt.offsets.contiguous()
    return out


def _header_index(param_path: str) -> dict[str, list]:
    """name -> [dtype, shape] of every tensor in a safetensors file, from its header alone."""
    with open(param_path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > min(100 << 20, os.path.getsize(param_path) - 8):
            raise ValueError(f"{param_path!r} is not a safetensors file (header length {size})")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{param_path!r} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return {k: [_ST_DTYPES.get(v["dtype"], v["dtype"]), v["shape"]] for k, v in sorted(header.items())}


def read_meta(model_path: str) -> dict[str, Any]:
    """The .asmodel JSON, checked for format and version; ValueError naming the file otherwise."""
    if not os.path.isfile(model_path):
        raise ConfigError(f"model={model_path!r} does not exist")
    try:
        with open(model_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"model file {model_path!r} is not an ember .asmodel file: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"model file {model_path!r} is not an ember .asmodel file (format is not {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"model file {model_path!r} has format_version={meta.get('format_version')!r}: this ember "
                         f"reads version {FORMAT_VERSION}; convert the model again with `ember convert`")
    return meta


def param_path_of(model_path: str, meta: dict[str, Any]) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(model_path)), meta["weights"]["file"])


def validate(model_path: str) -> str | None:
    """None when the pair is whole and consistent, else what is wrong (a missing, truncated or foreign file)."""
    try:
        meta = read_meta(model_path)
        name = meta["weights"]["file"]
        if not isinstance(name, str) or os.path.basename(name) != name:
            return f"weights file {name!r} is not a file name beside it"
        param_path = param_path_of(model_path, meta)
        if not os.path.isfile(param_path):
            return f"its weights file {param_path!r} is missing"
        if os.path.getsize(param_path) != meta["weights"]["bytes"]:
            return (f"its weights file {param_path!r} has {os.path.getsize(param_path)} bytes, "
                    f"{meta['weights']['bytes']} expected (truncated or replaced)")
        if _header_index(param_path) != meta["weights"]["tensors"]:
            return f"the tensors in {param_path!r} do not match the index in {model_path!r}"
    except (ValueError, KeyError, OSError, TypeError, AttributeError, RecursionError) as e:
        return f"{type(e).__name__}: {e}"
    return None


class AsModelCheckpoint:
    """A serialized pair behind the interface every checkpoint kind shares (see model_loader.open_checkpoint)."""

    kind = "asmodel"

    def __init__(self, path: str) -> None:
        problem = validate(path)
        if problem is not None:
            raise ConfigError(f"model={path!r} cannot be loaded: {problem}")
        self.path = path
        self.meta = read_meta(path)
        self.param_path = param_path_of(path, self.meta)
        for key, kind in (("config", dict), ("tokenizer", dict), ("dtype", str)):
            if not isinstance(self.meta.get(key), kind):
                raise ConfigError(f"model file {path!r}: {key} is {type(self.meta.get(key)).__name__}, not a "
                                  f"{kind.__name__}")
        if not all(isinstance(v, str) and os.path.basename(k) == k and k not in ("", ".", "..")
                   for k, v in self.meta["tokenizer"].items()):
            raise ConfigError(f"model file {path!r}: the tokenizer files it embeds are not all text under plain file "
                              f"names: {sorted(self.meta['tokenizer'])[:5]}")

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs strictly

        config = dict(self.meta["config"])
        try:
            return AutoConfig.for_model(config.pop("model_type"), **config)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, StrictDataclassError) as e:
            raise ConfigError(f"model file {self.path!r}: its config does not make a transformers config "
                              f"({type(e).__name__}: {e})") from None

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every float tensor, from the index (checked against the weights file's header)."""
        return {name: tuple(shape) for name, (_, shape) in self.meta["weights"]["tensors"].items()}

    def generation_config(self) -> dict[str, Any]:
        return dict(self.meta.get("generation_config") or {})

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.meta.get("extra") or {})

    def native_quantization(self) -> QuantConfig | None:
        try:
            return QuantConfig.from_dict(self.meta.get("quant_config"))
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"model file {self.path!r}: quant_config={self.meta.get('quant_config')!r} is not "
                              f"one ember writes ({e})") from None

    def tensors(self, config: Any, keep_quantized: bool = True, select: Select = read_all
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Stored quantized weights come back as one QuantizedTensor under their X.weight name. select: the part of
        each weight to read (rows, or columns on group boundaries: the scales are sliced with them)."""
        from safetensors import SafetensorError, safe_open

        try:
            f = safe_open(self.param_path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model file {self.param_path!r} is not a valid safetensors file: {e}") from None
        with f:
            names = set(f.keys())
            for name in f.keys():
                if name.endswith((".scales", ".offsets")) and name.rsplit(".", 1)[0] + ".qdata" in names:
                    continue
                if not name.endswith(".qdata"):
                    sl = select(name)
                    if sl is not None:
                        yield name, read_slice(f, name, sl)
                    continue
                base = name.removesuffix(".qdata")
                sl = select(base + ".weight")
                if sl is not None:
                    yield base + ".weight", _read_quantized(f, base, base + ".offsets" in names, sl)

    def tokenizer(self):
        """The embedded tokenizer files, unpacked once into ember's cache and loaded from there."""
        from ember.cache import cache_dir, file_key
        from ember.tokenizer import Tokenizer

        folder = cache_dir("asmodel-tokenizers", file_key(self.path))
        if not os.path.isdir(folder):
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
            for name, text in self.meta["tokenizer"].items():
                with open(os.path.join(tmp, os.path.basename(name)), "w", encoding="utf-8") as f:
                    f.write(text)
            try:
                os.replace(tmp, folder)
            except OSError:  # another process unpacked it first
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        return Tokenizer.load(folder)


def _read_quantized(f: Any, base: str, has_offsets: bool, sl: WeightSlice) -> QuantizedTensor:
    """One stored quantized weight, only the slice's rows or columns (columns on whole groups; a weight with one
    scale a row keeps that scale for any column slice)."""
    shape = f.get_slice(base + ".qdata").get_shape()
    scale_cols = f.get_slice(base + ".scales").get_shape()[1]
    kind = "int8" if f.get_slice(base + ".qdata").get_dtype() == "I8" else "int4"
    per = 2 if kind == "int4" else 1  # values a stored byte holds
    k = shape[1] * per
    group = k // scale_cols
    data_sl = scale_sl = sl
    if sl.dim == 1:
        cuts_group = scale_cols > 1 and (sl.start % group or sl.stop % group)
        if cuts_group or sl.start % per or sl.stop % per:
            raise ValueError(f"{base}: columns {sl.start}..{sl.stop} cut its quantization groups of {group}: choose "
                             "a tensor_parallel_size whose slices hold whole groups")
        data_sl = WeightSlice(1, sl.start // per, sl.stop // per)
        scale_sl = WeightSlice() if scale_cols == 1 else WeightSlice(1, sl.start // group, sl.stop // group)
        group = sl.stop - sl.start if scale_cols == 1 else group
    data, scales = read_slice(f, base + ".qdata", data_sl), read_slice(f, base + ".scales", scale_sl)
    offsets = read_slice(f, base + ".offsets", scale_sl) if has_offsets else None
    return QuantizedTensor(kind, data, scales, offsets, group)
