from kestrel.ops.activation.naive import glu_act, situ, swiglu

__all__ = ["glu_act", "situ", "swiglu"]
