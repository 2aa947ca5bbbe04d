from kestrel.ops.quant.fp8 import FP8, dequantize_fp8_rows, quantize_fp8_rows
from kestrel.ops.quant.mxfp4 import BLOCK, E2M1_VALUES, pack_mxfp4, unpack_mxfp4

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "FP8",
    "dequantize_fp8_rows",
    "pack_mxfp4",
    "quantize_fp8_rows",
    "unpack_mxfp4",
]
