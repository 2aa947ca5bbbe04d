from kestrel.ops.attnres.naive import attnres_mix, attnres_mix_norm
from kestrel.ops.attnres.sources import attnres_mix_norm_sources

__all__ = ["attnres_mix", "attnres_mix_norm", "attnres_mix_norm_sources"]
