"""Read a Hugging Face checkpoint folder: config.json, *.safetensors (sharded index too), generation_config.json."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ember.distributed import WeightSlice

# which part of each named tensor a rank reads (None: none of it); see LlamaForCausalLM.weight_slice
Select = Callable[[str], "WeightSlice | None"]


def read_all(name: str) -> WeightSlice:
    """The selector of a rank that holds the whole model."""
    return WeightSlice()


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model={path!r} has no config.json: not a Hugging Face checkpoint folder")
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs as strict dataclasses

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)  # an auto_map is never run
    except (ValueError, KeyError, OSError, json.JSONDecodeError, StrictDataclassError) as e:
        raise ValueError(f"model={path!r}: config.json could not be read ({e})") from e


def load_generation_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"model={path!r}: shards named in the index are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors weights")
    return files


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
        except SafetensorError as e:
            raise ValueError(f"model file {file!r} is corrupt: {e}") from e


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

    def tokenizer(self):
        from ember.tokenizer import Tokenizer

        return Tokenizer.load(self.path)
