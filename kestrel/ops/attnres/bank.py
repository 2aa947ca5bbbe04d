"""Training's AttnRes bank in one buffer, and the mix over it with a written-out backward (model-spec 4.1-4.2).

Inference keeps the bank of completed block sums in one buffer and mixes views of it. Training kept it as a list:
every mix stacked its sources, forward and again in its backward (on `mini`, 2 rows of 8704 tokens: 21.5 ms of
`cat` in a 0.51 s step on the H200, session 29), and autograd added each entry's gradient from every consumer
into it, one `add_` per pair (another 10.7 ms). Here an entry is copied into the buffer once, when its block
closes; a mix reads the buffer's entries, and the running sum where it is (the fast kernel's `last`: copied into
the buffer first, it cost 48 copies of [T, D] a step on mini). The backward of a mix adds its gradients for the
entries into one gradient buffer in the same pass that computes them, and each entry's gradient reaches autograd
once, through the entry's first consumer: every later mix depends on that consumer's output (through the running
sum, or through a later entry that does), so autograd runs their backwards first.

Legend: S sources (n entries, plus the running sum where one is given), T tokens, D hidden.
"""

from __future__ import annotations

import torch

from kestrel.ops.attnres.naive import attnres_mix_norm
from kestrel.utils.fuse import for_training


class Bank:
    """The entries (x0, then each completed block sum) of one training forward: `rows.buf[:n]` [n, T, D] of
    `slots` (the model's block count); `rows.grad` the entries' gradients."""

    def __init__(self, x0: torch.Tensor, slots: int):
        self.rows = _Rows(x0.new_empty(slots, *x0.shape))  # [slots, T, D], outside autograd
        self.sources: list[torch.Tensor] = []  # the entries as autograd knows them (the forward's only)
        self.read = 0  # entries [0, read) have a mix that owns their gradient

    def __len__(self) -> int:
        return len(self.sources)

    def close(self, partial: torch.Tensor) -> None:
        """A completed block sum (or x0) becomes the next entry."""
        assert len(self.sources) < self.rows.buf.shape[0], "the bank is full"
        assert partial.dtype == self.rows.buf.dtype, (
            f"a {partial.dtype} entry in a {self.rows.buf.dtype} bank"
        )
        with torch.no_grad():
            self.rows.buf[len(self.sources)].copy_(partial)
        self.sources.append(partial)

    def mix_norm(
        self,
        partial: torch.Tensor | None,
        query: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        out_weight: torch.Tensor,
        out_eps: float,
    ) -> torch.Tensor:
        """`attnres_mix_norm` over the entries, and the running sum `partial` [T, D] where given. Returns [T, D]
        in the bank's dtype."""
        n = len(self.sources)
        owned = self.sources[self.read : n]  # entries no mix read before: this one hands on their gradient
        self.read = n
        return _BankMixNorm.apply(self.rows, n, query, norm_weight, out_weight, eps, out_eps, partial, *owned)


class _Rows:
    """What the mixes' backwards share: the entries `buf` [slots, T, D] and their gradients `grad` (zeros until
    the first backward). Plain tensors only: a tensor of the graph kept on a Function's context (as the entries in
    `Bank.sources` would be) makes a reference cycle through autograd's nodes, and the step's activations then
    live until Python's cycle collector runs (on mini, 10-20 GB more at the peak, session 29)."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.grad: torch.Tensor | None = None

    def grad_rows(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.zeros_like(self.buf)
        return self.grad


class _BankMixNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, rows: _Rows, n: int, query, norm_weight, out_weight, eps: float, out_eps: float, partial, *owned
    ):
        src = rows.buf[:n]  # [n, T, D] (the op asserts the running sum's shape and dtype against it)
        ctx.rows, ctx.n, ctx.owned, ctx.eps, ctx.out_eps = rows, n, len(owned), eps, out_eps
        ctx.save_for_backward(query, norm_weight, out_weight, partial)
        # fp32 math by definition (autocast would run its scores' matmul in bf16); no autograd: the fast kernel
        with torch.autocast(src.device.type, enabled=False):
            return attnres_mix_norm(src, query, norm_weight, eps, out_weight, out_eps, partial)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if getattr(ctx, "ran", False):  # the entries' gradients would add onto the first pass's
            raise RuntimeError(
                "a second backward through training's AttnRes bank (retain_graph) is not supported"
            )
        ctx.ran = True
        query, norm_weight, out_weight, partial = ctx.saved_tensors
        rows, n = ctx.rows, ctx.n
        acc = rows.grad_rows()
        backward = for_training(mix_norm_backward, grad)
        g_partial, g_query, g_norm, g_out = backward(
            rows.buf, acc, n, partial, query, norm_weight, out_weight, ctx.eps, ctx.out_eps, grad
        )
        owned = [acc[i] for i in range(n - ctx.owned, n)]  # complete: every later mix's backward has run
        return None, None, g_query, g_norm, g_out, None, None, g_partial, *owned


def mix_norm_backward(
    bank: torch.Tensor,
    bank_grad: torch.Tensor,
    n: int,
    partial: torch.Tensor | None,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    out_weight: torch.Tensor,
    eps: float,
    out_eps: float,
    grad: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attnres_mix_norm(cat(bank[:n], partial), ...)` for the output gradient `grad` [T, D]:
    adds the entries' into bank_grad[:n] (in place) and returns (partial's or None, query's, norm_weight's,
    out_weight's), each in its input's dtype. fp32 math; the entries and the running sum are read apart (no
    [S, T, D] copy). With r_j a source, n_j = rsqrt(mean(r_j^2) + eps), u_j = r_j . (norm_weight * query):
    e_j = n_j u_j, p = softmax_j(e), mix = sum_j p_j r_j, out = out_weight * rms(mix rounded to the dtype)."""
    D = bank.shape[-1]
    qn = (norm_weight.float() * query.float()).flatten()  # [D]
    parts = [bank[:n].float()]  # [n, T, D] (and [1, T, D] for the running sum)
    if partial is not None:
        parts.append(partial.float()[None])
    inv_rms = [torch.rsqrt(r.pow(2).mean(-1) + eps) for r in parts]  # [s, T] each
    dots = [r @ qn for r in parts]  # [s, T]
    p = torch.softmax(torch.cat([a * b for a, b in zip(inv_rms, dots)]), dim=0)  # [S, T]
    ps = list(p.split([r.shape[0] for r in parts]))
    mix = sum((w[..., None] * r).sum(0) for w, r in zip(ps, parts))  # [T, D]
    x = mix.to(bank.dtype).float()
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + out_eps)  # [T, 1]
    y = x * inv  # [T, D] the normalized mix
    g = grad.float()
    g_out = (g * y).sum(0)  # [D]
    g_y = g * out_weight.float()
    g_mix = inv * (g_y - y * (g_y * y).mean(-1, keepdim=True))  # [T, D]
    g_p = torch.cat([(g_mix[None] * r).sum(-1) for r in parts])  # [S, T]
    g_e = p * (g_p - (p * g_p).sum(0))  # [S, T] through the softmax
    g_es = g_e.split([r.shape[0] for r in parts])
    g_qn = torch.zeros_like(qn)
    g_src = []
    for r, w, ge, a, b in zip(parts, ps, g_es, inv_rms, dots):
        # d e_j / d r_j = n_j qn - u_j n_j^3 r_j / D
        g_src.append(
            w[..., None] * g_mix + ge[..., None] * (a[..., None] * qn - (b * a**3 / D)[..., None] * r)
        )
        g_qn = g_qn + ((ge * a)[..., None] * r).sum((0, 1))
    bank_grad[:n] += g_src[0].to(bank_grad.dtype)
    g_partial = g_src[1][0].to(partial.dtype) if partial is not None else None
    g_query = (g_qn * norm_weight.float()).to(query.dtype).view(query.shape)
    g_norm = (g_qn * query.float().flatten()).to(norm_weight.dtype)
    return g_partial, g_query, g_norm, g_out.to(out_weight.dtype)
