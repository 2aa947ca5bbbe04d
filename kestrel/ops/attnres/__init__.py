from kestrel.ops.attnres.naive import attnres_mix

__all__ = ["attnres_mix"]
