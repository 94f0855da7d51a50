"""``tensorrt_llm.quantization`` on ember: QuantAlgo and QuantConfig."""

from ember.compat.tensorrt_llm.quantization.mode import QuantAlgo, QuantConfig

__all__ = ["QuantAlgo", "QuantConfig"]
