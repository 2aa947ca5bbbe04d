from kestrel.ops.attnres.bank import Bank
from kestrel.ops.attnres.naive import attnres_mix, attnres_mix_norm

__all__ = ["Bank", "attnres_mix", "attnres_mix_norm"]
