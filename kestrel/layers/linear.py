"""Linear layers that know how their weight is sharded and loaded.

Every parameter carries `weight_loader(param, loaded, shard_id)`: it takes a full checkpoint tensor, narrows
it to this rank's part, and copies it into the right slice (for merged layers, `shard_id` names the slice).
`param.expected_shards` lists the shard ids a checkpoint must provide; the model loader uses it to report
missing tensors. Weight layout is PyTorch's: [out_features, in_features], y = x W^T.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kestrel.ops.linear import linear, linear_many
from kestrel.utils.dist import parallel_state


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not have the shape this parameter expects."""


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ShapeMismatch(f"{what}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameters: the checkpoint tensor is the parameter."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for a replicated parameter"
    copy_checked(param.data, loaded, "weight")


def set_loader(param: nn.Parameter, loader=default_weight_loader, shards: Sequence = (None,)) -> nn.Parameter:
    param.weight_loader = loader
    param.expected_shards = tuple(shards)
    return param


class Linear(nn.Module):
    """A replicated linear layer (every rank holds the whole weight)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = set_loader(nn.Parameter(torch.empty(out_features, in_features, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def apply_many(pairs: Sequence[tuple[torch.Tensor, Linear]]) -> list[torch.Tensor]:
    """[layer(x) for x, layer in pairs]: layers reading one input (x, or x.detach()) in one launch at decode
    (`kestrel.ops.linear.linear_many`)."""
    return linear_many([(x, layer.weight) for x, layer in pairs])


class ColumnLinear(Linear):
    """Output features split across tensor-parallel ranks. With `output_sizes`, the weight is several
    checkpoint tensors stacked along the output dim (e.g. q|k|v); each is split across ranks on its own, except
    the shards named in `replicated`, which every rank holds whole (small projections that feed a replicated
    computation, merged in only to save a matmul)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        dtype: torch.dtype | None = None,
        output_sizes: Sequence[int] | None = None,
        shard_names: Sequence[str] | None = None,
        replicated: Sequence[str] = (),
    ):
        ps = parallel_state()
        sizes = list(output_sizes) if output_sizes is not None else [out_features]
        self.shard_names = list(shard_names) if shard_names is not None else None
        if self.shard_names is not None and len(self.shard_names) != len(sizes):
            raise ValueError("shard_names must match output_sizes")
        if set(replicated) - set(self.shard_names or ()):
            raise ValueError(f"replicated shards {sorted(replicated)} must be among shard_names")
        whole = [name in replicated for name in (self.shard_names or [None])]
        for size, keep in zip(sizes, whole):
            if size % ps.tp_size and not keep:
                raise ValueError(f"output size {size} is not divisible by tp_size={ps.tp_size}")
        self.full_sizes = sizes
        self.local_sizes = [s if keep else s // ps.tp_size for s, keep in zip(sizes, whole)]
        self.replicated = whole
        super().__init__(in_features, sum(self.local_sizes), dtype)
        shards = self.shard_names if self.shard_names is not None else [None]
        set_loader(self.weight, self.load_shard, shards)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        ps = parallel_state()
        index = 0 if shard_id is None else self.shard_names.index(shard_id)
        if shard_id is None and self.shard_names is not None:
            raise ShapeMismatch("merged weight loaded without a shard id")
        full, local = self.full_sizes[index], self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        if loaded.shape[0] != full:
            raise ShapeMismatch(
                f"{shard_id or 'weight'}: checkpoint has {tuple(loaded.shape)}, "
                f"model expects ({full}, {self.in_features})"
            )
        part = (
            loaded if self.replicated[index] else loaded.narrow(0, ps.tp_rank * local, local)
        )  # [local, in]
        copy_checked(param.data.narrow(0, offset, local), part, str(shard_id or "weight"))


class RowLinear(Linear):
    """Input features split across tensor-parallel ranks; the caller all-reduces the partial outputs."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        ps = parallel_state()
        if in_features % ps.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tp_size={ps.tp_size}")
        self.full_in = in_features
        super().__init__(in_features // ps.tp_size, out_features, dtype)
        set_loader(self.weight, self.load_shard)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        ps = parallel_state()
        if loaded.dim() != 2 or loaded.shape[1] != self.full_in:
            raise ShapeMismatch(
                f"weight: checkpoint has {tuple(loaded.shape)}, "
                f"model expects ({self.out_features}, {self.full_in})"
            )
        local = self.in_features
        copy_checked(param.data, loaded.narrow(1, ps.tp_rank * local, local), "weight")
