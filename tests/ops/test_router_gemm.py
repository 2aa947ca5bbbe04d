"""The router's logits as one bf16 GEMM over an exact three-way split of the fp32 weight
(kestrel.ops.moe.router_gemm) against the fp32 reference x.float() @ w.t()."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.moe.router_gemm import mm_fp32_out_works, router_logits_bf16x3, split_bf16x3


def _weight(E: int, D: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(E, D, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_split_is_exact():
    w = _weight(64, 512)
    # a power of two, a tiny one, a huge one, one with its last bit set
    w[0, :4] = torch.tensor([1.0, -3.0e-30, 7.0e20, 1.0 + 2.0**-23])
    parts = split_bf16x3(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (192, 512)
    hi, mid, lo = parts.float().view(3, 64, 512)
    assert torch.equal((hi + mid) + lo, w)  # every weight exactly, bit for bit


def test_split_products_match_the_fp32_reference():
    """The GEMM's products are exact: emulated here in fp64, the split's logits equal the reference's to fp32
    rounding, and the top-6 experts of every token agree."""
    D, E = 2048, 64
    w = _weight(E, D, seed=1)
    x = torch.randn(300, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    exact = x.double() @ w.double().t()  # [T, E]
    split = (x.double() @ split_bf16x3(w).double().t()).view(-1, 3, E).sum(1)
    assert torch.allclose(split, exact, rtol=1e-12, atol=1e-14)  # the split loses nothing (fp64 sums)
    ref = x.float() @ w.t()
    assert (ref.double() - exact).abs().max() < 1e-5
    assert torch.equal(ref.topk(6).indices, split.float().topk(6).indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_logits_on_gpu_match_the_fp32_reference():
    assert mm_fp32_out_works(torch.device("cuda")), "torch.mm(bf16, bf16, out_dtype=fp32) is missing"
    D, E = 2048, 64
    w = _weight(E, D, seed=3).cuda()
    x = torch.randn(4099, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    got = router_logits_bf16x3(x, split_bf16x3(w))
    exact = x.double() @ w.double().t()
    ref = x.float() @ w.t()
    assert got.dtype == torch.float32 and got.shape == (4099, E)
    # within the textbook bound of an fp32 dot product of D terms, D * 2^-24 * sum |x w|, as fp32's GEMM is
    # (on the H200: max errors 1.0e-5 here, 1.9e-6 for cuBLAS' fp32 GEMM, bound ~1e-4)
    bound = D * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert ((ref.double() - exact).abs() <= bound).all()
    assert ((got.double() - exact).abs() <= bound).all()
    agree = (got.topk(6).indices.sort(1).values == ref.topk(6).indices.sort(1).values).all(1).float().mean()
    assert agree > 0.999


def test_router_split_refreshes_in_place(monkeypatch):
    """Router.inference_logits keeps the split in one buffer: refilled in place (same storage, so captured CUDA
    graphs keep reading it) after an in-place update of the weight and after a checkpoint load (which copies
    through .data and moves no version counter). The GEMM is emulated on the CPU."""
    import kestrel.layers.moe as moe
    from kestrel.presets import preset_config

    monkeypatch.setattr(moe, "mm_fp32_out_works", lambda device: True)
    monkeypatch.setattr(
        moe, "ROUTER_DOT_MAX_TOKENS", 0
    )  # the GEMM's [T, 3, E] parts, not the Triton kernel's
    monkeypatch.setattr(
        moe,
        "router_logit_parts_bf16x3",
        lambda x, parts: (x.double() @ parts.double().t()).view(x.shape[0], 3, -1),
    )
    router = moe.Router(preset_config("tiny"))
    router.weight.data.copy_(_weight(*router.weight.shape, seed=8))
    x = torch.randn(5, router.weight.shape[1]).to(torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the CPU stands in for CUDA
    with torch.no_grad():
        first = router.inference_logits(x)
        buffer = router._split.data_ptr()
        torch.testing.assert_close(first, x.double() @ router.weight.double().t())
        parts = router.inference_logits(x, parts=True)  # [T, 3, E], for the fused router to add
        assert parts.shape == (5, 3, router.weight.shape[0])
        torch.testing.assert_close(parts.sum(1), first)
        router.weight.mul_(2.0)  # an in-place update (an optimizer step)
        torch.testing.assert_close(router.inference_logits(x), 2 * first)
        router.weight.weight_loader(router.weight, 3 * router.weight.detach() / 2)  # a checkpoint load
        torch.testing.assert_close(router.inference_logits(x), 3 * first)
    assert router._split.data_ptr() == buffer
    with pytest.raises(AssertionError, match="no backward"):
        router.inference_logits(x)
