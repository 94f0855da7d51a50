"""Read a Hugging Face checkpoint folder: config.json, *.safetensors (sharded index too), generation_config.json."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ember.distributed import WeightSlice
from ember.errors import ConfigError

# which part of each named tensor a rank reads (None: none of it); see LlamaForCausalLM.weight_slice
Select = Callable[[str], "WeightSlice | None"]


def read_all(name: str) -> WeightSlice:
    """The selector of a rank that holds the whole model."""
    return WeightSlice()


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model={path!r} has no config.json: not a Hugging Face checkpoint folder")
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs as strict dataclasses

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)  # an auto_map is never run
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError, StrictDataclassError) as e:
        raise ConfigError(f"model={path!r}: config.json could not be read ({type(e).__name__}: {e})") from None


def load_generation_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"model file {file!r} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model file {file!r} holds a {type(config).__name__}, not a JSON object")
    return config


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ConfigError(f"model file {index!r} is not a safetensors index (a weight_map of names to files): "
                              f"{type(e).__name__}: {e}") from None
        if not all(isinstance(n, str) and os.path.basename(n) == n for n in names):
            raise ConfigError(f"model file {index!r}: weight_map names files outside its folder: {names[:5]}")
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"model={path!r}: shards named in the index are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ConfigError(f"model={path!r} has no *.safetensors weights")
    return files


def safetensors_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the files, from their headers alone (the safetensors library checks each
    header against its file: offsets, sizes, dtypes; its errors become ConfigError naming the file)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model file {file!r} is not a valid safetensors file: {e}") from None
    return shapes


def read_slice(f: Any, name: str, sl: WeightSlice) -> torch.Tensor:
    """Only the slice's bytes of a tensor in an open safetensors file (the file is memory-mapped)."""
    if sl.whole:
        return f.get_tensor(name)
    part = f.get_slice(name)
    return part[sl.start:sl.stop] if sl.dim == 0 else part[:, sl.start:sl.stop]


def iter_safetensors(path: str, select: Select = read_all) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = select(name)
                    if sl is not None:
                        yield name, read_slice(f, name, sl)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model file {file!r} is not a valid safetensors file: {e}") from None


class HFCheckpoint:
    """A Hugging Face folder behind the interface every checkpoint kind shares (see model_loader.open_checkpoint)."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        self.path = path

    def hf_config(self) -> Any:
        return load_hf_config(self.path)

    def generation_config(self) -> dict[str, Any]:
        return load_generation_config(self.path)

    def native_quantization(self) -> None:
        return None  # float weights (pre-quantized Hugging Face formats such as GPTQ are not read)

    def tensors(self, config: Any, keep_quantized: bool = False,
                select: Select = read_all) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self.path, select)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape from the headers; none for a folder without weight files (reading the weights says
        they are missing, after the config's own errors, which name the field)."""
        if not os.path.isfile(os.path.join(self.path, "model.safetensors.index.json")) and not glob.glob(
                os.path.join(self.path, "*.safetensors")):
            return {}
        return safetensors_shapes(safetensors_files(self.path))

    def tokenizer(self):
        from ember.tokenizer import Tokenizer

        return Tokenizer.load(self.path)
