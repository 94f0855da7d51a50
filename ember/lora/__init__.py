"""LoRA adapters: the request handle users pass (``LoRARequest``); the PEFT adapter reader is ``ember.lora.adapter``
(it needs torch, the handle does not)."""

from ember.lora.request import LoRARequest

__all__ = ["LoRARequest"]
