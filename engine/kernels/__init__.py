"""Compute kernels for the engine: GGML dequantization and quantized matmul (torch, CPU/CUDA)."""

from .dequant import (
    SUPPORTED_TYPES,
    UnsupportedQuantType,
    dequantize,
    quant_matmul,
    row_nbytes,
    tensor_nbytes,
)

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "quant_matmul",
    "row_nbytes",
    "tensor_nbytes",
]
