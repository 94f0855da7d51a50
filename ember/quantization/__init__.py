"""Weight quantization: the stored layout (tensor), what to quantize (config), the device matmuls (kernels), and
the calibrated transformations of the float weights that come before rounding (calibration, awq, smoothquant)."""

from ember.quantization.config import INT4_GROUP_SIZES, QUANT_ALGORITHMS, QUANT_METHODS, QUANT_MODES, QuantConfig
from ember.quantization.kernels import QuantizedMatmul, cpu_holds_int5, cpu_holds_int6
from ember.quantization.stacked import StackedMatmul
from ember.quantization.tensor import (GGUF_DIRECT_TYPES, QuantizedTensor, concat_rows, from_gguf, quantize_int4,
                                       quantize_int8, quantize_int8_symmetric, requantize)

__all__ = ["GGUF_DIRECT_TYPES", "INT4_GROUP_SIZES", "QUANT_ALGORITHMS", "QUANT_METHODS", "QUANT_MODES", "QuantConfig",
           "QuantizedMatmul", "QuantizedTensor", "StackedMatmul", "concat_rows", "cpu_holds_int5", "cpu_holds_int6",
           "from_gguf", "quantize_int4", "quantize_int8", "quantize_int8_symmetric", "requantize"]
