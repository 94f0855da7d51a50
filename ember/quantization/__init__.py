"""Weight quantization: the stored layout (tensor), what to quantize (config), the device matmuls (kernels)."""

from ember.quantization.config import INT4_GROUP_SIZES, QUANT_METHODS, QuantConfig
from ember.quantization.kernels import QuantizedMatmul
from ember.quantization.tensor import (GGUF_DIRECT_TYPES, QuantizedTensor, concat_rows, from_gguf, quantize_int4,
                                       quantize_int8, quantize_int8_symmetric, requantize)

__all__ = ["GGUF_DIRECT_TYPES", "INT4_GROUP_SIZES", "QUANT_METHODS", "QuantConfig", "QuantizedMatmul",
           "QuantizedTensor", "concat_rows", "from_gguf", "quantize_int4", "quantize_int8",
           "quantize_int8_symmetric", "requantize"]
