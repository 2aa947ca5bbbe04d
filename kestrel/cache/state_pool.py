"""Fixed slots of KDA state: per slot and KDA layer the fp32 recurrent state [H, K, V] and the conv window
[3P, W - 1] (q|k|v channels). Slot 0 is a dummy for padded rows and is never handed out. A slot is zeroed
when it is handed out, so a new request starts from the empty state."""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig


class StatePool:
    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device, zero_on_alloc: bool = True
    ):
        if num_slots < 1:
            raise ValueError(f"state pool needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        H, K, P, W = config.kda_num_heads, config.kda_head_dim, config.kda_proj_dim, config.kda_conv_size
        n = num_slots + 1
        self.ssm = {
            i: torch.zeros(n, H, K, K, dtype=torch.float32, device=device) for i in config.kda_layer_ids
        }
        self.conv = {
            i: torch.zeros(n, 3 * P, W - 1, dtype=dtype, device=device) for i in config.kda_layer_ids
        }
        self._free = list(range(num_slots, 0, -1))
        self._used: set[int] = set()
        self.zero_on_alloc = zero_on_alloc  # checkpoint pools are always overwritten by a copy: no need

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        H, K, P, W = config.kda_num_heads, config.kda_head_dim, config.kda_proj_dim, config.kda_conv_size
        conv = 3 * P * (W - 1) * torch.empty(0, dtype=dtype).element_size()
        return len(config.kda_layer_ids) * (H * K * K * 4 + conv)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        if self.zero_on_alloc:
            for t in (*self.ssm.values(), *self.conv.values()):
                t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._used, f"double free of state slot {slot}"
        self._used.remove(slot)
        self._free.append(slot)


def copy_state(src: StatePool, src_slot: int, dst: StatePool, dst_slot: int) -> None:
    """Copy one slot's KDA state (every layer's recurrent state and conv window) into another pool's slot."""
    for layer, t in src.ssm.items():
        dst.ssm[layer][dst_slot].copy_(t[src_slot])
        dst.conv[layer][dst_slot].copy_(src.conv[layer][src_slot])
