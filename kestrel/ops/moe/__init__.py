from kestrel.ops.moe.grouped import grouped_mm_trains, moe_experts_grouped
from kestrel.ops.moe.naive import glu_mlp, latent_moe, moe_experts, replay_route, route

__all__ = [
    "glu_mlp",
    "latent_moe",
    "moe_experts",
    "grouped_mm_trains",
    "moe_experts_grouped",
    "replay_route",
    "route",
]
