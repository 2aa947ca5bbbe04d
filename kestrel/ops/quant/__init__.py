from kestrel.ops.quant.mxfp4 import BLOCK, E2M1_VALUES, pack_mxfp4, unpack_mxfp4

__all__ = ["BLOCK", "E2M1_VALUES", "pack_mxfp4", "unpack_mxfp4"]
