"""The packed short conv (fast path) against the per-sequence reference."""

import pytest
import torch

from kestrel.ops.kda.naive import short_conv
from kestrel.ops.kda.packed_conv import short_conv_packed


@pytest.mark.parametrize("lens", [[7], [1, 5, 2, 9], [3, 1, 1, 12, 2], [0, 4]])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("width", [2, 4])
def test_packed_conv_matches_reference(lens, with_state, width):
    g = torch.Generator().manual_seed(sum(lens) + width)
    C, T, N = 6, sum(lens), len(lens)
    x = torch.randn(T, C, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, width, generator=g, dtype=torch.float64, requires_grad=True)
    state = torch.randn(N, C, width - 1, generator=g, dtype=torch.float64) if with_state else None
    if state is not None:
        state.requires_grad_(True)
    inputs = [x, w] + ([state] if with_state else [])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y_ref, s_ref = short_conv(x, w, state, cu)
    y, s = short_conv_packed(x, w, state, cu)
    assert torch.allclose(y, y_ref, atol=1e-12) and torch.equal(s, s_ref)
    # gradients (input, weight, incoming state) through the packed buffer equal the reference's
    probe = torch.randn(y.shape, generator=g, dtype=torch.float64)
    grads_ref = torch.autograd.grad((y_ref * probe).sum() + s_ref.sum(), inputs)
    grads_new = torch.autograd.grad((y * probe).sum() + s.sum(), inputs)
    for a, b in zip(grads_new, grads_ref):
        assert torch.allclose(a, b, atol=1e-12)


def test_packed_conv_one_sequence_bf16():
    x = torch.randn(33, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 4)
    y_ref, s_ref = short_conv(x, w)
    y, s = short_conv_packed(x, w)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(s, s_ref)


def test_window_conv_gradcheck():
    from kestrel.ops.kda.packed_conv import _WindowConv

    g = torch.Generator().manual_seed(1)
    padded = torch.randn(12, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    start = torch.tensor([0, 2, 3, 8, 5])  # windows may overlap and repeat
    assert torch.autograd.gradcheck(lambda p, w: _WindowConv.apply(p, w, start), (padded, weight))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_conv_matches_reference(with_state, dtype):
    """fla-core's varlen causal_conv1d (KESTREL_KDA_CONV=fla) against the reference: values, new states and
    gradients, on packed sequences of odd lengths (one shorter than the window, one empty)."""
    from kestrel.ops.kda.fla import short_conv as short_conv_fla

    lens = [1, 37, 2, 130, 0, 64]
    g = torch.Generator().manual_seed(0)
    C, W, T, N = 96, 4, sum(lens), len(lens)
    x = torch.randn(T, C, generator=g).to(dtype).cuda().requires_grad_(True)
    w = torch.randn(C, W, generator=g).cuda().requires_grad_(True)
    state = torch.randn(N, C, W - 1, generator=g).to(dtype).cuda() if with_state else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    y_ref, s_ref = short_conv(x, w, state, cu)
    y, s = short_conv_fla(x, w, state, cu)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(s, s_ref)
    probe = torch.randn(y.shape, generator=g).cuda()
    grads_ref = torch.autograd.grad((y_ref.float() * probe).sum(), (x, w))
    grads = torch.autograd.grad((y.float() * probe).sum(), (x, w))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(
            a.float(), b.float(), rtol=max(tol, 1e-4), atol=max(tol, 1e-4) * b.abs().max().item()
        )


# -- the inference kernel (Triton; in its interpreter on the CPU) ---------------------------------------------


@pytest.mark.parametrize("lens", [[7], [1, 5, 2, 9], [3, 1, 1, 40, 2], [0, 4], [2, 0]])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize(
    "extra", [9, 2], ids=["stride159", "stride152"]
)  # row alignment 1, and 8 (as mini's 4232)
@pytest.mark.parametrize("planes", [1, 3])  # 3: q | k | v of 50 channels each, across the 128-channel blocks
def test_prefill_conv_kernel_matches_reference(lens, with_state, width, extra, planes):
    pytest.importorskip("triton")
    from kestrel.ops.kda.triton_conv import short_conv_prefill

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(sum(lens) * 7 + width)
    C, T, N = 150, sum(lens), len(lens)  # two channel blocks of 128, the second partial
    wide = torch.randn(T, C + extra, generator=g).to(device)
    off = 5 if extra > 5 else 0  # an unaligned first column too
    x = wide[:, off : off + C]  # rows strided, as a column slice of the merged input projection
    w = torch.randn(C, width, generator=g).to(device)
    state = torch.randn(N, C, width - 1, generator=g).to(device) if with_state else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    y_ref, s_ref = short_conv(x, w, state, cu, planes=planes)
    y, s = short_conv_prefill(x, w, state, cu, planes=planes, block_t=8, block_c=128)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape and s.dtype == s_ref.dtype
    assert y.is_contiguous()  # each plane too
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(s, s_ref)  # copies of inputs and state, exactly


def test_prefill_conv_kernel_bf16_one_sequence():
    pytest.importorskip("triton")
    from kestrel.ops.kda.triton_conv import short_conv_prefill

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=g).to(device, torch.bfloat16)
    w = torch.randn(64, 4, generator=g).to(device, torch.bfloat16)
    state = torch.randn(1, 64, 3, generator=g).to(device, torch.bfloat16)
    y_ref, s_ref = short_conv(x, w, state)
    y, s = short_conv_prefill(x, w, state)
    assert y.dtype == torch.bfloat16 and torch.equal(s, s_ref)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)


def test_row_align():
    pytest.importorskip("triton")
    from kestrel.ops.norm.triton_norm import row_align

    sizes = {4232: 8, 4096: 16, 159: 1, 150: 2, 12: 4, 0: 16}
    assert {n: row_align(n) for n in sizes} == sizes
