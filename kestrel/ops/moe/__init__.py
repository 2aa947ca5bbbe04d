from kestrel.ops.moe.naive import glu_mlp, latent_moe, moe_experts, route

__all__ = ["glu_mlp", "latent_moe", "moe_experts", "route"]
