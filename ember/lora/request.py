"""``LoRARequest``: which adapter a request runs with, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import BadRequestError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it (keys its KV prefix cache and its slot), and the folder
    PEFT saved it to (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise BadRequestError(f"lora_name={self.lora_name!r} is out of range: it must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise BadRequestError(f"lora_int_id={self.lora_int_id!r} is out of range: it must be an integer >= 1 "
                                  "(0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise BadRequestError(f"lora_path={self.lora_path!r} is out of range: it must be the adapter's folder")
