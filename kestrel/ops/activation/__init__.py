from kestrel.ops.activation.naive import glu_act, sigmoid_gate, situ, swiglu

__all__ = ["glu_act", "sigmoid_gate", "situ", "swiglu"]
