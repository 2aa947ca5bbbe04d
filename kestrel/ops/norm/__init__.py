from kestrel.ops.norm.naive import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
