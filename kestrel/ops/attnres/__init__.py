from kestrel.ops.attnres.naive import attnres_mix, attnres_mix_norm

__all__ = ["attnres_mix", "attnres_mix_norm"]
