"""The latent cache write (`kestrel.ops.mla.naive.write_rows`) through its Triton kernel against the reference:
NaN-poisoned pools, rows out of order, k_pe as a strided slice of the projection, with and without the indexer
keys. In Triton's interpreter on CPU (tests/conftest.py), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.mla.naive import write_rows

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T: int, R: int, P: int, DI: int, rows_total: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, R + P + 3, generator=g).to(DEVICE, dtype)  # the projection's output, wider
    c_kv, k_pe = proj[:, :R].contiguous(), proj[:, R : R + P]  # k_pe: rows strided by R + P + 3
    keys = torch.randn(T, DI, generator=g).to(DEVICE, dtype)
    rows = torch.randperm(rows_total, generator=g)[:T].to(DEVICE)
    pool = torch.full((rows_total, R + P), float("nan"), dtype=dtype, device=DEVICE)
    index_pool = torch.full((rows_total, DI), float("nan"), dtype=dtype, device=DEVICE)
    return c_kv, k_pe, keys, rows, pool, index_pool


@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("T,R,P,DI", [(7, 40, 8, 24), (1, 512, 64, 128), (0, 16, 8, 8)])
def test_write_rows_matches_reference(T, R, P, DI, with_index):
    from kestrel.ops.mla.triton_write import write_rows_triton

    dtype = torch.bfloat16
    c_kv, k_pe, keys, rows, pool, index_pool = _case(T, R, P, DI, 23, dtype)
    want, want_index = pool.clone(), index_pool.clone()
    write_rows.eager(
        want, rows, (c_kv, k_pe), want_index if with_index else None, keys if with_index else None
    )
    got_index = index_pool if with_index else None
    write_rows_triton(pool, rows, (c_kv, k_pe), got_index, keys if with_index else None)
    assert torch.equal(pool.isnan(), want.isnan())  # untouched rows stay NaN
    assert torch.equal(pool.nan_to_num(), want.nan_to_num())
    assert torch.equal(index_pool.isnan(), want_index.isnan())
    assert torch.equal(index_pool.nan_to_num(), want_index.nan_to_num())


def test_write_rows_casts_and_falls_back():
    """What the kernel does not take (fp32 parts into a bf16 pool, three parts) goes to the reference."""
    from kestrel.ops.mla.triton_write import write_rows_triton

    c_kv, k_pe, keys, rows, pool, index_pool = _case(5, 16, 8, 8, 11, torch.float32, seed=1)
    pool16 = pool.to(torch.bfloat16)
    want = pool16.clone()
    write_rows.eager(want, rows, (c_kv, k_pe))
    write_rows_triton(pool16, rows, (c_kv, k_pe))
    assert torch.equal(pool16.nan_to_num(), want.nan_to_num())
    three = (c_kv[:, :10], c_kv[:, 10:], k_pe)
    want = pool.clone()
    write_rows.eager(want, rows, three)
    write_rows_triton(pool, rows, three)
    assert torch.equal(pool.nan_to_num(), want.nan_to_num()) and torch.equal(pool.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,R,P,DI", [(7, 40, 8, 24), (3, 512, 64, 128)])  # widths not 2^n: masked tails
def test_write_rows_applies_the_norms(T, R, P, DI, dtype):
    """Decode hands c_kv and the indexer keys over before their norms (the RMSNorm's weight and eps, the
    LayerNorm's weight, bias and eps): the kernel norms each row as it stores it, as the reference's norms then
    its write do; with the indexer keys, and without them (the keys' norm then ignored by the reference too)."""
    from kestrel.ops.mla.naive import write_norms
    from kestrel.ops.mla.triton_write import write_rows_triton
    from kestrel.ops.norm import layer_norm, rms_norm

    c_kv, k_pe, keys, rows, pool, index_pool = _case(T, R, P, DI, 17, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    c_kv, keys = c_kv * 3 + 1, keys * 2 - 0.5  # offsets: the LayerNorm's mean matters
    kv_norm = ((torch.rand(R, generator=g) + 0.5).to(DEVICE, dtype), 1e-6)
    index_norm = (
        (torch.rand(DI, generator=g) + 0.5).to(DEVICE, dtype),
        torch.randn(DI, generator=g).to(DEVICE, dtype),
        1e-5,
    )
    want, want_index = pool.clone(), index_pool.clone()
    write_rows.eager(want, rows, (c_kv, k_pe), want_index, keys, kv_norm, index_norm)
    apart, apart_index = pool.clone(), index_pool.clone()  # the norms' own ops, then the plain write
    parts, normed = write_norms((c_kv, k_pe), keys, kv_norm, index_norm)
    assert torch.equal(parts[0], rms_norm(c_kv, *kv_norm)) and torch.equal(
        normed, layer_norm(keys, *index_norm)
    )
    write_rows.eager(apart, rows, parts, apart_index, normed)
    assert torch.equal(want.nan_to_num(), apart.nan_to_num()) and torch.equal(
        want_index.nan_to_num(), apart_index.nan_to_num()
    )
    write_rows_triton(pool, rows, (c_kv, k_pe), index_pool, keys, kv_norm, index_norm)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert torch.equal(pool.isnan(), want.isnan()) and torch.equal(index_pool.isnan(), want_index.isnan())
    torch.testing.assert_close(pool.nan_to_num().float(), want.nan_to_num().float(), **tol)
    torch.testing.assert_close(index_pool.nan_to_num().float(), want_index.nan_to_num().float(), **tol)
    assert torch.equal(pool[rows][:, R:], k_pe.to(dtype))  # k_pe is stored as given
    alone = torch.full_like(pool, float("nan"))  # no indexer keys: c_kv's norm only
    write_rows_triton(alone, rows, (c_kv, k_pe), kv_norm=kv_norm)
    torch.testing.assert_close(alone.nan_to_num().float(), want.nan_to_num().float(), **tol)
