"""DashInfer's LoRA files: ``serialize(..., lora_cfg={...})`` converts PEFT adapter folders into ``NAME.aslora``
files beside the serialized model (ember's one-file adapter: the safetensors with the config in its metadata), and
marks the model as serialized for LoRA; ``Engine.load_lora(model, NAME)`` finds ``NAME.aslora`` there, or takes an
absolute path to one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ember.config import ModelShape
from ember.lora.adapter import inspect_adapter, write_adapter_file

SUFFIX = ".aslora"


@dataclass(frozen=True, slots=True)
class LoraRecipe:
    """serialize's lora_cfg: adapters input_base_dir/NAME for each NAME; lora_only: write them, not the model."""

    input_base_dir: str
    lora_names: tuple[str, ...]
    lora_only: bool = False

    @classmethod
    def of(cls, lora_cfg: Any) -> "LoraRecipe | None":
        if lora_cfg is None:
            return None
        if not isinstance(lora_cfg, dict):
            raise ValueError(f"lora_cfg={lora_cfg!r} is not supported: pass a dict with 'input_base_dir', "
                             "'lora_names' and optionally 'lora_only'")
        unknown = sorted(set(lora_cfg) - {"input_base_dir", "lora_names", "lora_only"})
        if unknown:
            raise ValueError(f"lora_cfg keys {unknown} are unknown: allowed are input_base_dir, lora_names, lora_only")
        base, names = lora_cfg.get("input_base_dir"), lora_cfg.get("lora_names")
        if not isinstance(base, str) or not os.path.isdir(os.path.expanduser(base)):
            raise ValueError(f"lora_cfg['input_base_dir']={base!r} is not a folder: it must hold one PEFT adapter "
                             "folder per name in lora_names")
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"lora_cfg['lora_names']={names!r} is out of range: it must be a list of adapter "
                             "folder names")
        return cls(os.path.expanduser(base), tuple(names), bool(lora_cfg.get("lora_only", False)))

    def write(self, out_dir: str, shape: ModelShape) -> list[str]:
        """Write each adapter as out_dir/NAME.aslora, checked against the model (a file that does not fit is removed
        again). The rank limit is the runtime config's lora_max_rank, checked at load_lora."""
        os.makedirs(out_dir, exist_ok=True)
        paths = []
        for name in self.lora_names:
            path = write_adapter_file(os.path.join(self.input_base_dir, name), os.path.join(out_dir, name + SUFFIX))
            try:
                inspect_adapter(path, shape, max_lora_rank=1 << 30)
            except ValueError:
                os.remove(path)
                raise
            paths.append(path)
        return paths


def adapter_path(model_path: str, lora_name: str) -> str:
    """Where DashInfer looks for an adapter: an absolute path as given, else NAME.aslora beside the model."""
    if os.path.isabs(lora_name):
        return lora_name
    return os.path.join(os.path.dirname(os.path.abspath(model_path)), lora_name + SUFFIX)
