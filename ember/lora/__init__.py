"""LoRA adapters: the request handle users pass (``LoRARequest``) and the PEFT adapter reader."""

from ember.lora.adapter import LoRAAdapter, LoRAWeights, read_adapter, read_adapter_config
from ember.lora.request import LoRARequest

__all__ = ["LoRARequest", "LoRAAdapter", "LoRAWeights", "read_adapter", "read_adapter_config"]
