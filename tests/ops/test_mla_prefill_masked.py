"""The masked sparse-prefill kernel (kestrel.ops.mla.triton_prefill) against the decode kernel run with every
prefill token a row, as the engine runs sparse prefill (kestrel.ops.mla.triton_decode.sparse_mla_decode).

Without CUDA the kernels run in Triton's interpreter on CPU (tests/conftest.py). Pool rows of other sequences'
pages and the last page's rows past the sequence are NaN, and the output starts as NaN: a read outside the
sequence, or a row left unwritten, fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel.ops.mla.triton_decode import sparse_mla_decode  # noqa: E402
from kestrel.ops.mla.triton_prefill import selection_bitmap, sparse_mla_prefill_masked  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


def test_selection_bitmap():
    idx = torch.tensor([[0, 31, 33, -1], [32, -1, -1, -1], [-1, -1, -1, -1]])
    bits = selection_bitmap(idx.to(DEVICE), 40).cpu()
    assert bits.shape == (3, 2) and bits.dtype == torch.int32
    assert bits[0, 0].item() == (1 | (1 << 31)) - 2**32  # bit 31 is int32's sign bit
    assert bits[0, 1].item() == 2 and bits[1].tolist() == [0, 1] and bits[2].tolist() == [0, 0]
    assert selection_bitmap(torch.tensor([[3, 40, 99]], device=DEVICE), 40).cpu().tolist() == [
        [8, 0]
    ]  # >= length


def _case(q0, T, k, H=4, R=32, P=16, ps=4, seed=0, empty_row=None):
    g = torch.Generator().manual_seed(seed)
    L = q0 + T
    n_pages = -(-L // ps)
    pages = torch.randperm(n_pages + 3, generator=g)[:n_pages] + 1  # scattered, page 0 the dummy
    pool = torch.full(((n_pages + 4) * ps, R + P), NAN)
    for pos in range(L):
        pool[pages[pos // ps] * ps + pos % ps] = torch.randn(R + P, generator=g)
    indices = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        pos = q0 + t
        chosen = torch.randperm(pos + 1, generator=g)[: min(k, pos + 1)]
        indices[t, : chosen.numel()] = chosen.sort().values  # valid first, in position order (the top-k's)
    if empty_row is not None:
        indices[empty_row] = -1
    q_lat, q_pe = torch.randn(T, H, R, generator=g), torch.randn(T, H, P, generator=g)
    dev = [t.to(DEVICE) for t in (q_lat, q_pe, pool, pages, indices)]
    return (*dev, ps)


@pytest.mark.parametrize("q0, T, k", [(0, 19, 7), (5, 19, 7), (9, 6, 40), (0, 70, 16)])
@pytest.mark.parametrize(
    "tiles", [{}, {"block_q": 8, "block_n": 16, "split_r": 1}, {"block_n": 16, "split_r": 2}]
)
def test_matches_the_decode_kernel_row_by_row(q0, T, k, tiles):
    q_lat, q_pe, pool, pages, indices, ps = _case(q0, T, k, seed=q0 + T + k, empty_row=T // 2)
    scale = 0.3
    table = pages[None].expand(T, -1)  # [T, pages]: every row the sequence's page table
    lens = torch.arange(q0 + 1, q0 + T + 1, device=DEVICE)
    ref = sparse_mla_decode(q_lat, q_pe, pool, table, ps, lens, indices, scale, num_splits=1, block_n=16)
    out = torch.full_like(q_lat, NAN)
    got = sparse_mla_prefill_masked(q_lat, q_pe, pool, pages, ps, q0, indices, scale, out=out, **tiles)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (got[T // 2] == 0).all()  # a row with no selection: zeros, as the decode kernel gives


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiles", [{}, {"block_q": 2, "split_r": 1}, {"block_n": 64}])
def test_gpu_mini_sizes(tiles):
    """mini's sizes (16 heads, R 512, rope 64, page 64), bf16, a 4096-token prompt with a top-2048 per row, the
    last 1024 rows: against the decode kernel row by row (bf16 probabilities rounded in each: 2e-2)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    H, R, P, ps, k, L, T = 16, 512, 64, 64, 2048, 4096, 1024
    q0 = L - T
    pool = torch.randn(L + ps, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
    pages = torch.arange(1, L // ps + 1, device="cuda")
    pos = torch.arange(q0, L, device="cuda")
    key = torch.rand(T, L, device="cuda", generator=g).masked_fill(
        torch.arange(L, device="cuda") > pos[:, None], -1
    )
    top = key.topk(k, dim=-1)
    indices = torch.where(top.values >= 0, top.indices, -1).sort(-1, descending=True).values  # valid first
    q_lat = torch.randn(T, H, R, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(T, H, P, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = sparse_mla_decode(q_lat, q_pe, pool, pages[None].expand(T, -1), ps, pos + 1, indices, 0.07)
    got = sparse_mla_prefill_masked(q_lat, q_pe, pool, pages, ps, q0, indices, 0.07, **tiles)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= 2e-2


def test_positions_past_the_query_are_ignored():
    """A selection that holds positions after its own query (a replayed one could) reads none of them, as
    the decode kernel skips positions >= lens: the two still agree."""
    q0, T, k = 3, 12, 6
    q_lat, q_pe, pool, pages, indices, ps = _case(q0, T, k, seed=4)
    indices[0, -1] = q0 + T - 1  # row 0 sits at position 3: the last position is in its future
    indices[5, -2:] = torch.tensor([q0 + 6, q0 + 9])
    table = pages[None].expand(T, -1)
    lens = torch.arange(q0 + 1, q0 + T + 1, device=DEVICE)
    ref = sparse_mla_decode(q_lat, q_pe, pool, table, ps, lens, indices, 0.3, num_splits=1, block_n=16)
    got = sparse_mla_prefill_masked(q_lat, q_pe, pool, pages, ps, q0, indices, 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_tile_too_narrow_for_the_dot_is_refused():
    """tl.dot needs K >= 16: block_n 8 compiles in the interpreter but not for the GPU, so it is refused everywhere."""
    q_lat, q_pe, pool, pages, indices, ps = _case(0, 4, 3, seed=1)
    with pytest.raises(AssertionError, match="block_n=8"):
        sparse_mla_prefill_masked(q_lat, q_pe, pool, pages, ps, 0, indices, 0.3, block_n=8)
