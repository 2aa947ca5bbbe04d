"""Triton DSA kernels (indexer scores, exact top-k) against naive.py.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU at tiny sizes (set here, before triton is first
imported); with CUDA the same tiny cases run compiled on the GPU, and the `gpu` tests add the real sizes.
Outputs are poisoned before every run so that an element the kernel never writes fails the comparison.

Legend: B sequences, L score positions (Lmax), HI indexer heads, DI indexer head dim, k = index_topk.
"""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.ops.dsa import by_position, indexer_scores_batched, keep_selected_, topk_select
from tests.ops.graph_check import assert_replay_matches_eager
from tests.ops.kernel_modules import load_kernels as _load  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.sort, InterpretedFunction):
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run this file alone or export it",
            allow_module_level=True,
        )


_scores = _load("kestrel.ops.dsa.triton_scores")
indexer_scores_triton, indexer_scores_paged_triton, indexer_scores_prefill_triton = (
    _scores.indexer_scores_triton,
    _scores.indexer_scores_paged_triton,
    _scores.indexer_scores_prefill_triton,
)
topk_triton = _load("kestrel.ops.dsa.triton_topk").topk_triton
keep_selected_triton = _load("kestrel.ops.dsa.triton_select").keep_selected_triton

DEVICE = "cpu" if INTERPRET else "cuda"
NAN, INF = float("nan"), float("inf")
SMALL_TILES = dict(seg=32, block=16, cblock=16)  # several segments and loop trips even at L = 37
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled Triton)"
)


def poisoned(shape, dtype, value):
    return torch.full(shape, value, dtype=dtype, device=DEVICE)


def run_topk(scores, lens, k, **tiles):
    """topk_triton into a poisoned output: the reference's selection (topk_select), listed by position."""
    scores, lens = scores.to(DEVICE), lens.to(DEVICE)
    out = poisoned((scores.shape[0], k), torch.int64, -7)
    got = topk_triton(scores, lens, k, out=out, **tiles)
    assert got.data_ptr() == out.data_ptr()
    assert not (got == -7).any(), "unwritten output"
    want = by_position(topk_select(scores, lens - 1, k))
    assert torch.equal(got, want), f"k={k} lens={lens.tolist()}\n{got}\n{want}"


# ---------------------------------------------------------------- indexer scores


def scores_inputs(B, L, HI, DI, lens, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HI, DI, generator=g).to(dtype)  # [B, HI, DI]
    k = torch.randn(B, L, DI, generator=g).to(dtype)  # [B, L, DI]
    w = torch.randn(B, HI, generator=g).to(dtype)  # [B, HI]
    lens = torch.tensor(lens, dtype=torch.int64)
    return q, k, w, lens


def check_scores(got, q, k, w, lens, scale):
    """Valid positions equal the reference (on the same bf16 values, fp32 math); padding is NaN."""
    assert got.dtype == torch.float32
    ref = indexer_scores_batched(q.float(), k.float(), w.float(), scale).cpu()  # [B, L]
    got = got.cpu()
    valid = torch.arange(got.shape[1])[None, :] < lens[:, None].cpu()  # [B, L]
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert got[~valid].isnan().all()


@pytest.mark.parametrize(
    "B,L,HI,DI,lens",
    [(3, 37, 3, 24, [1, 37, 20]), (2, 100, 16, 16, [100, 64]), (4, 257, 5, 40, [257, 0, 129, 1])],
)
def test_scores_dense_match_reference(B, L, HI, DI, lens):
    q, k, w, lens = scores_inputs(B, L, HI, DI, lens, seed=L)
    padded = torch.arange(L)[None, :] >= lens[:, None]  # [B, L]
    k[padded] = torch.tensor([NAN, INF] * DI, dtype=k.dtype)[:DI]  # garbage past lens is never read
    out = poisoned((B, L), torch.float32, 12345.0)
    got = indexer_scores_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), DI**-0.5, lens.to(DEVICE), out=out)
    assert got.data_ptr() == out.data_ptr() and not (got == 12345.0).any()
    check_scores(got, q, k.masked_fill(padded[..., None], 0.0), w, lens, DI**-0.5)


def test_scores_fp32_and_mixed_inputs_default_lens():
    q, k, w, _ = scores_inputs(2, 19, 4, 16, [19, 19], seed=7, dtype=torch.float32)
    got = indexer_scores_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), 0.25)
    check_scores(got, q, k, w, torch.tensor([19, 19]), 0.25)
    k = k.bfloat16()  # fp32 queries over bf16 keys
    got = indexer_scores_triton(
        q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), 0.25, torch.tensor([3, 19], device=DEVICE)
    )
    check_scores(got, q, k, w, torch.tensor([3, 19]), 0.25)


def paged_inputs(lens, page_size, maxp, HI, DI, seed, dtype=torch.bfloat16):
    """A KVPool-shaped key pool (page 0 the dummy) and shuffled page tables padded with page 0."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    num_pages = B * maxp
    pool = torch.randn((num_pages + 1) * page_size, DI, generator=g).to(dtype)  # [rows, DI]
    perm = torch.randperm(num_pages, generator=g) + 1
    page_table = perm.view(B, maxp).clone()  # [B, maxp]
    lens = torch.tensor(lens, dtype=torch.int64)
    used = -(-lens // page_size)  # pages in use per sequence
    page_table[torch.arange(maxp)[None, :] >= used[:, None]] = 0
    q = torch.randn(B, HI, DI, generator=g).to(dtype)
    w = torch.randn(B, HI, generator=g).to(dtype)
    return q, pool, page_table.to(torch.int32), lens, w


def gather_pages(pool, page_table, page_size):
    """The keys as `PagedCacheView.read_kv_batched` gathers them: [B, maxp * page_size, DI]."""
    B, maxp = page_table.shape
    paged = pool.view(-1, page_size, pool.shape[-1])  # [pages + 1, page, DI]
    return paged[page_table.long()].reshape(B, maxp * page_size, pool.shape[-1])


@pytest.mark.parametrize(
    "page_size,maxp,lens", [(4, 10, [1, 40, 37, 13]), (16, 3, [48, 17, 0]), (7, 5, [35, 1])]
)
def test_scores_paged_match_gathered_reference(page_size, maxp, lens):
    HI, DI = 6, 32
    q, pool, page_table, lens, w = paged_inputs(lens, page_size, maxp, HI, DI, seed=page_size)
    L = maxp * page_size
    out = poisoned((len(lens), L), torch.float32, 12345.0)
    got = indexer_scores_paged_triton(
        q.to(DEVICE),
        pool.to(DEVICE),
        page_table.to(DEVICE),
        lens.to(DEVICE),
        w.to(DEVICE),
        DI**-0.5,
        page_size=page_size,
        out=out,
    )
    assert got.shape == (len(lens), L) and not (got == 12345.0).any()
    check_scores(got, q, gather_pages(pool, page_table, page_size), w, lens, DI**-0.5)


@pytest.mark.parametrize("fill_past", [True, False])
def test_scores_paged_short_rows_in_a_wide_buffer(monkeypatch, fill_past):
    """Decode's graphs are as wide as the engine's longest context, so most of a short row's key tiles lie past
    its length: the kernel skips them (each program walks several tiles here, TARGET_PROGRAMS lowered so that a
    tiny case does). The valid positions equal the reference; the tiles wholly past a row's length hold NaN, or
    with fill_past=False (the work list, WORK_LIST_MIN_L lowered to this width) what `out` held; the tail of the
    tile a row ends in is NaN either way; the top-k, which reads each row's first lens only, selects the
    reference's set; and below WORK_LIST_MIN_L fill_past=False takes the grid over the width, NaN past each row."""
    monkeypatch.setattr(_scores, "TARGET_PROGRAMS", 2)
    monkeypatch.setattr(_scores, "WORK_LIST_MIN_L", 1024)  # the work list at a tiny width
    page_size, maxp, HI, DI = 16, 72, 3, 16  # L = 1152: 9 tiles of 128, 4 a program, 3 programs a row
    q, pool, page_table, lens, w = paged_inputs([5, 600, 1152, 0, 129], page_size, maxp, HI, DI, seed=11)
    L = maxp * page_size
    out = poisoned((len(lens), L), torch.float32, 12345.0)
    got = indexer_scores_paged_triton(
        *(t.to(DEVICE) for t in (q, pool, page_table, lens, w)),
        DI**-0.5,
        page_size=page_size,
        out=out,
        fill_past=fill_past,
    ).cpu()
    pos = torch.arange(L)[None, :]
    valid = pos < lens[:, None]
    dead = pos // _scores.BLOCK_S * _scores.BLOCK_S >= lens[:, None]  # [B, L] tiles wholly past the row
    ref = indexer_scores_batched(
        q.float(), gather_pages(pool, page_table, page_size).float(), w.float(), DI**-0.5
    )
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert got[~valid & ~dead].isnan().all()
    assert got[dead].isnan().all() if fill_past else (got[dead] == 12345.0).all()
    run_topk(got, lens, 8, **SMALL_TILES)
    if not fill_past:  # narrower than WORK_LIST_MIN_L: the grid over the width, NaN past every row
        monkeypatch.setattr(_scores, "WORK_LIST_MIN_L", L + 1)
        narrow = indexer_scores_paged_triton(
            *(t.to(DEVICE) for t in (q, pool, page_table, lens, w)),
            DI**-0.5,
            page_size=page_size,
            out=poisoned((len(lens), L), torch.float32, 12345.0),
            fill_past=False,
        ).cpu()
        assert torch.equal(narrow[valid], got[valid]) and narrow[~valid].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scores_paged_scale_the_weights_as_projected(dtype):
    """Decode hands the head weights over as projected, with their factor (`Indexer.finish(scaled=False)`): the
    scores are those of the weights cast to fp32 and scaled first, bit for bit."""
    page_size, maxp, HI, DI = 4, 10, 6, 32
    q, pool, page_table, lens, w = paged_inputs([1, 40, 37, 13], page_size, maxp, HI, DI, seed=8, dtype=dtype)
    args = [t.to(DEVICE) for t in (q, pool, page_table, lens)]
    factor = HI**-0.5
    got = indexer_scores_paged_triton(*args, w.to(DEVICE), 0.25, page_size=page_size, weights_scale=factor)
    want = indexer_scores_paged_triton(*args, w.to(DEVICE).float() * factor, 0.25, page_size=page_size)
    assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
    check_scores(
        got, q.float(), gather_pages(pool, page_table, page_size).float(), w.float() * factor, lens, 0.25
    )


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_scores_paged_fp8_keys_match_the_dequantized_reference(query_dtype):
    """FP8 keys with one scale per token (KVPool(index_fp8=True)): the kernel's scores equal the reference
    over the dequantized keys."""
    from kestrel.ops.quant import dequantize_fp8_rows, quantize_fp8_rows

    page_size, maxp, HI, DI = 4, 10, 6, 32
    q, pool, page_table, lens, w = paged_inputs(
        [1, 40, 37, 13], page_size, maxp, HI, DI, seed=5, dtype=query_dtype
    )
    pool = pool * torch.linspace(0.01, 30, pool.shape[0])[:, None]  # rows of very different magnitudes
    keys, scale = quantize_fp8_rows(pool)  # [rows, DI] fp8, [rows, 1]
    got = indexer_scores_paged_triton(
        *(t.to(DEVICE) for t in (q, keys, page_table, lens, w)),
        DI**-0.5,
        page_size=page_size,
        key_scale=scale.to(DEVICE),
    )
    ref_keys = gather_pages(dequantize_fp8_rows(keys, scale, torch.float32), page_table, page_size)
    check_scores(got, q.float(), ref_keys, w.float(), lens, DI**-0.5)


def test_paged_scores_then_topk_equal_the_naive_pipeline():
    page_size, maxp, HI, DI, topk = 8, 6, 4, 16, 10
    q, pool, page_table, lens, w = paged_inputs([48, 3, 25, 10], page_size, maxp, HI, DI, seed=3)
    scores = indexer_scores_paged_triton(
        q.to(DEVICE),
        pool.to(DEVICE),
        page_table.to(DEVICE),
        lens.to(DEVICE),
        w.to(DEVICE),
        0.25,
        page_size=page_size,
    )
    check_scores(scores, q, gather_pages(pool, page_table, page_size), w, lens, 0.25)
    # The selection is exact on the kernel's own scores (which may differ from the reference's in the last bit).
    run_topk(scores, lens, topk, **SMALL_TILES)


def test_paged_prefill_rows_share_one_expanded_page_table():
    """Prefill (MLAttention._paged_prefill_scores): every prefill token is a row with its causal length, all
    rows reading one sequence's page table through a stride-0 expand."""
    page_size, maxp, HI, DI, t = 4, 6, 3, 16, 7
    _, pool, page_table, _, _ = paged_inputs([24], page_size, maxp, HI, DI, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(t, HI, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(t, HI, generator=g).to(torch.bfloat16)
    lens = torch.arange(18, 18 + t)  # the chunk's tokens at positions 17..23
    rows = page_table.expand(t, -1)  # [t, maxp], stride 0 between rows
    assert rows.stride(0) == 0
    out = poisoned((t, maxp * page_size), torch.float32, 12345.0)
    got = indexer_scores_paged_triton(
        q.to(DEVICE),
        pool.to(DEVICE),
        rows.to(DEVICE),
        lens.to(DEVICE),
        w.to(DEVICE),
        0.25,
        page_size=page_size,
        out=out,
    )
    check_scores(got, q, gather_pages(pool, page_table, page_size).expand(t, -1, -1), w, lens, 0.25)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t,first", [(7, 18), (40, 1), (23, 60)])
def test_prefill_scores_kernel_matches_the_per_row_kernel(t, first, fp8):
    """The prefill kernel (blocks of query rows against one key tile at a time) gives the decode kernel's
    per-row scores and the reference's, NaN past each row's causal length; with several row and key blocks,
    partial ones included, and FP8 keys."""
    from kestrel.ops.quant import dequantize_fp8_rows, quantize_fp8_rows

    page_size, maxp, HI, DI = 4, 21, 3, 24
    _, pool, page_table, _, _ = paged_inputs([first + t - 1], page_size, maxp, HI, DI, seed=t)
    g = torch.Generator().manual_seed(first)
    q = torch.randn(t, HI, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(t, HI, generator=g).to(torch.bfloat16)
    lens = torch.arange(first, first + t)  # the chunk's tokens at positions first - 1 ...
    key_scale = None
    keys = pool
    if fp8:
        keys, key_scale = quantize_fp8_rows(pool * torch.linspace(0.01, 30, pool.shape[0])[:, None])
    dev = [x.to(DEVICE) for x in (q, keys, page_table[0], lens, w)]
    extra = dict(page_size=page_size, key_scale=None if key_scale is None else key_scale.to(DEVICE))
    out = poisoned((t, maxp * page_size), torch.float32, 12345.0)
    got = indexer_scores_prefill_triton(*dev, 0.25, **extra, out=out, block_m=16, block_s=16)
    assert not (got == 12345.0).any()
    rows = page_table.expand(t, -1).to(DEVICE)
    per_row = indexer_scores_paged_triton(dev[0], dev[1], rows, dev[3], dev[4], 0.25, **extra)
    torch.testing.assert_close(got, per_row, rtol=1e-5, atol=1e-5, equal_nan=True)
    ref_keys = dequantize_fp8_rows(keys, key_scale, torch.float32) if fp8 else pool
    check_scores(got, q, gather_pages(ref_keys, page_table, page_size).expand(t, -1, -1), w, lens, 0.25)


def test_prefill_scores_unfilled_past_every_row_then_topk():
    """fill_past=False: a key tile past every row of its block's length keeps what `out` held, every tile with
    a visible key is written as before (NaN past each row's own length), and the top-k, which reads each row's
    first lens only, selects the reference's set from it."""
    page_size, maxp, HI, DI, t, first = 4, 21, 3, 24, 40, 5
    _, pool, page_table, _, _ = paged_inputs([first + t - 1], page_size, maxp, HI, DI, seed=3)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(t, HI, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(t, HI, generator=g).to(torch.bfloat16)
    lens = torch.arange(first, first + t)
    dev = [x.to(DEVICE) for x in (q, pool, page_table[0], lens, w)]
    tiles = dict(page_size=page_size, block_m=16, block_s=16)
    want = indexer_scores_prefill_triton(*dev, 0.25, **tiles)  # [t, L], NaN past each row's length
    got = indexer_scores_prefill_triton(
        *dev, 0.25, **tiles, fill_past=False, out=poisoned(tuple(want.shape), torch.float32, 12345.0)
    )
    cols = torch.arange(want.shape[1])[None, :]
    block_len = torch.stack([lens[r // 16 * 16 : r // 16 * 16 + 16].max() for r in range(t)])
    live = (cols // 16 * 16 < block_len[:, None]).to(DEVICE)  # [t, L] tiles some row of the block sees
    torch.testing.assert_close(got[live], want[live], rtol=0, atol=0, equal_nan=True)
    assert (got[~live] == 12345.0).all() and (~live).any()
    assert (cols < lens[:, None]).to(DEVICE)[~live].sum() == 0  # nothing visible was left out
    run_topk(got, lens, 7, **SMALL_TILES)


@pytest.mark.parametrize("fill_past", [True, False])
def test_prefill_scores_with_document_starts(fill_past):
    """starts (training's packed rows): positions before each row's start are NaN as those past its length
    are, the rest equal the scores without starts, and a key tile before every row's start of its block (rows
    32-39: start 45, tiles of 16) is stored as NaN, not skipped; the top-k then selects inside the documents."""
    page_size, maxp, HI, DI, t, first = 4, 21, 3, 24, 40, 5
    _, pool, page_table, _, _ = paged_inputs([first + t - 1], page_size, maxp, HI, DI, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(t, HI, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(t, HI, generator=g).to(torch.bfloat16)
    lens = torch.arange(first, first + t)  # row r sees positions up to first - 1 + r
    starts = torch.tensor([0] * 13 + [17] * 17 + [41] * 2 + [45] * 8)  # each row's document's first position
    dev = [x.to(DEVICE) for x in (q, pool, page_table[0], lens, w)]
    tiles = dict(page_size=page_size, block_m=16, block_s=16)
    plain = indexer_scores_prefill_triton(*dev, 0.25, **tiles)
    out = poisoned(tuple(plain.shape), torch.float32, 12345.0)
    got = indexer_scores_prefill_triton(
        *dev, 0.25, **tiles, starts=starts.to(DEVICE), fill_past=fill_past, out=out
    )
    cols = torch.arange(plain.shape[1])[None, :]
    inside = ((cols >= starts[:, None]) & (cols < lens[:, None])).to(DEVICE)
    seen = (cols < lens[:, None]).to(DEVICE)
    torch.testing.assert_close(got[inside], plain[inside], rtol=0, atol=0)
    assert got[seen & ~inside].isnan().all() and (seen & ~inside).sum() > 16 * 8
    if fill_past:
        assert got[~seen].isnan().all()
    picked = topk_triton(got, lens.to(DEVICE), 7, **SMALL_TILES).cpu()
    assert ((picked >= starts[:, None]) | (picked < 0)).all()
    want = by_position(topk_select(torch.where(inside, plain, NAN).cpu(), lens - 1, 7))
    assert torch.equal(picked, want)


@pytest.mark.parametrize("k", [5, 16, 37])
def test_keep_selected_matches_the_reference(k):
    """keep_selected_triton: each picked row keeps only its True positions that its list names (-1 padding,
    positions already False stay False), rows not picked are untouched; rows strided, picks unordered."""
    g = torch.Generator().manual_seed(k)
    N, L, M = 30, 70, 12
    base = torch.rand(N, L + 9, generator=g) < 0.7
    picks = torch.randperm(N, generator=g)[:M]
    indices = torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(M)])  # [M, k]
    indices[torch.rand(M, k, generator=g) < 0.2] = -1
    want = keep_selected_(base[:, :L].clone(), picks, indices)
    big = base.to(DEVICE)
    got = keep_selected_triton(big[:, :L], picks.to(DEVICE), indices.to(DEVICE))
    assert got.data_ptr() == big.data_ptr()  # in place
    assert torch.equal(got.cpu(), want)
    assert torch.equal(big[:, L:].cpu(), base[:, L:])  # past the view: untouched
    assert keep_selected_triton(big[:, :L], picks[:0].to(DEVICE), indices[:0].to(DEVICE)) is not None  # M = 0


def test_keep_selected_reference_semantics():
    """naive.keep_selected_: row 1 keeps {0, 3} of its True positions {0, 2, 3} (4 was never True; -1 pads)."""
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    keep_selected_(mask, torch.tensor([1]), torch.tensor([[0, 3, 4, -1]]))
    assert mask.tolist() == [[1, 1, 0, 1, 0], [1, 0, 0, 1, 0], [0, 1, 1, 1, 1]]


# ---------------------------------------------------------------- exact top-k


@pytest.mark.parametrize("L", [37, 100, 257])
def test_topk_random_scores(L):
    g = torch.Generator().manual_seed(L)
    scores = torch.randn(4, L, generator=g)  # [B, L]
    lens = torch.tensor([1, L, L // 2 + 3, 0])
    tiles = SMALL_TILES if L < 200 else dict(seg=64, block=32, cblock=32)
    for k in (1, 16, L // 3) + ((L,) if L < 64 else ()):  # the interpreter's sort is slow past a few dozen
        run_topk(scores, lens, k, **tiles)


def test_topk_rows_in_several_launches():
    """More rows than one launch takes (the grid limit): blocks of max_rows rows, the last one partial."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(7, 40, generator=g)  # [B, L]
    lens = torch.tensor([40, 1, 17, 0, 40, 33, 5])
    run_topk(scores, lens, 9, max_rows=3, **SMALL_TILES)


@pytest.mark.parametrize("seed", range(2))
def test_topk_heavy_ties_and_nan(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 100
    scores = torch.randint(-3, 4, (B, L), generator=g).float()  # 7 distinct values: ties everywhere
    scores[torch.rand(B, L, generator=g) < 0.1] = NAN
    lens = torch.tensor([L, 1, 57, 99, 64])
    for k in (1, 7, 33, 64):
        run_topk(scores, lens, k, **SMALL_TILES)


def test_topk_ties_decided_in_the_last_radix_pass():
    # Scores a few ulps apart share the top 22 key bits: the threshold is found by the third pass, with ties.
    g = torch.Generator().manual_seed(5)
    ulps = torch.randint(0, 6, (3, 80), generator=g).to(torch.int32)
    scores = (torch.tensor(1.5).view(torch.int32) + ulps).view(torch.float32)  # [B, L]
    lens = torch.tensor([80, 41, 77])
    for k in (1, 9, 30):
        run_topk(scores, lens, k, **SMALL_TILES)


def test_topk_special_values():
    mixed = [-INF, 2.0, NAN, -INF, INF, 0.0, -0.0, 0.0, NAN, -1e-45, 1e-45, -0.0, 3e38, -3e38, INF, 2.0, -INF]
    scores = torch.tensor([mixed, [NAN] * 17, [0.0, -0.0] * 8 + [NAN]])
    lens = torch.tensor([17, 17, 16])
    for k in (1, 5, 16, 17, 40):
        run_topk(scores, lens, k, **SMALL_TILES)


def test_topk_ignores_garbage_past_lens():
    g = torch.Generator().manual_seed(21)
    L, lens = 50, torch.tensor([1, 9, 50, 14])
    scores = torch.randn(4, L, generator=g)
    padded = torch.arange(L)[None, :] >= lens[:, None]
    for garbage in (NAN, INF, 1e30):
        run_topk(scores.masked_fill(padded, garbage), lens, 8, **SMALL_TILES)


def test_topk_k_beyond_length_and_lens_beyond_width():
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(3, 37, generator=g)
    run_topk(scores, torch.tensor([37, 5, 100]), 45, **SMALL_TILES)  # k > L; lens > L means all of the row


def test_topk_default_tiles():
    g = torch.Generator().manual_seed(9)
    scores = torch.randint(0, 20, (3, 257), generator=g).float()
    run_topk(scores, torch.tensor([257, 100, 1]), 64)


def test_topk_non_contiguous_rows():
    g = torch.Generator().manual_seed(10)
    wide = torch.randn(3, 120, generator=g)
    run_topk(wide[:, 10:110], torch.tensor([100, 3, 77]), 12, **SMALL_TILES)


# ---------------------------------------------------------------- real sizes on CUDA


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["randn", "ties"])
@pytest.mark.parametrize("B,L,topk", [(64, 131072, 2048), (16, 32768, 2048), (3, 5000, 2048), (4, 70000, 64)])
def test_topk_cuda_real_sizes(B, L, topk, kind):
    g = torch.Generator(device="cuda").manual_seed(B + L)
    if kind == "randn":
        scores = torch.randn(B, L, generator=g, device="cuda")  # [B, L]
    else:  # a few hundred values: the threshold bin holds a large share of the row
        scores = torch.randint(0, 300, (B, L), generator=g, device="cuda").float()
    scores[torch.rand(B, L, generator=g, device="cuda") < 0.01] = NAN
    lens = torch.randint(1, L + 1, (B,), generator=g, device="cuda")
    lens[0], lens[-1] = L, 1
    run_topk(scores, lens, topk)


@pytest.mark.gpu
@requires_cuda
def test_topk_cuda_prefill_triangle():
    # A prefill chunk: row t sees t + 1 positions, so the first k rows are short (every valid one selected,
    # listed straight from the scores) and the rest go through the radix passes, in one launch.
    g = torch.Generator(device="cuda").manual_seed(4)
    scores = torch.randn(4096, 4096, generator=g, device="cuda")  # [T, L]
    scores[torch.rand(4096, 4096, generator=g, device="cuda") < 0.01] = NAN
    run_topk(scores, torch.arange(1, 4097, device="cuda"), 2048)


@pytest.mark.gpu
@requires_cuda
def test_topk_cuda_all_equal_row_keeps_every_candidate():
    # The worst case of the candidate list: one value everywhere, so the whole row survives the first pass.
    scores = torch.full((2, 131072), 0.5, device="cuda")
    run_topk(scores, torch.tensor([131072, 90001], device="cuda"), 2048)


@pytest.mark.gpu
@requires_cuda
def test_paged_scores_cuda_real_size():
    page_size, maxp, HI, DI = 64, 2048, 64, 128  # 131072 positions
    q, pool, page_table, lens, w = paged_inputs([131072, 1, 70000, 4097], page_size, maxp, HI, DI, seed=11)
    q, pool, page_table, lens, w = (t.cuda() for t in (q, pool, page_table, lens, w))
    L = maxp * page_size
    out = torch.full((4, L), 12345.0, device="cuda")
    got = indexer_scores_paged_triton(q, pool, page_table, lens, w, DI**-0.5, page_size=page_size, out=out)
    assert not (got == 12345.0).any()
    keys = gather_pages(pool, page_table, page_size)  # [B, L, DI]
    ref = indexer_scores_batched(q.float(), keys.float(), w.float(), DI**-0.5)  # [B, L]
    valid = torch.arange(L, device="cuda")[None, :] < lens[:, None]
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert got[~valid].isnan().all()
    idx = topk_triton(got, lens, 2048)
    assert torch.equal(idx, by_position(topk_select(got, lens - 1, 2048)))


@pytest.mark.gpu
@requires_cuda
def test_paged_scores_and_topk_cuda_graph():
    page_size, maxp, HI, DI, topk = 64, 40, 16, 64, 256

    def inputs(lens, seed):
        q, pool, page_table, lens, w = paged_inputs(lens, page_size, maxp, HI, DI, seed=seed)
        return tuple(t.cuda() for t in (q, pool, page_table, lens, w))

    first = inputs([2560, 1, 300, 1000], seed=30)
    fresh = inputs([7, 2560, 2000, 64], seed=31)

    def step(q, pool, page_table, lens, w):
        scores = indexer_scores_paged_triton(q, pool, page_table, lens, w, DI**-0.5, page_size=page_size)
        return scores.nan_to_num(nan=-1.0), topk_triton(scores, lens, topk)

    assert_replay_matches_eager(step, first, fresh)


@pytest.mark.gpu
@requires_cuda
def test_paged_scores_work_list_real_size_in_a_graph():
    """Decode's form (fill_past=False): one wave of programs over the rows' live tiles, at decode's real shapes,
    a batch of short rows in a 131072-wide buffer with a few long ones. Its scores are the NaN-filling form's
    bit for bit on every valid position (the same tiles, the same math), the tiles past each row stay as they
    were, and a CUDA graph replay with new lengths equals eager."""
    page_size, maxp, HI, DI, B = 64, 2048, 16, 128, 64
    lens = [4096] * (B - 4) + [131072, 1, 0, 70001]
    q, pool, page_table, lens, w = paged_inputs(lens, page_size, maxp, HI, DI, seed=12)
    q, pool, page_table, lens, w = (t.cuda() for t in (q, pool, page_table, lens, w))
    L = maxp * page_size
    filled = indexer_scores_paged_triton(q, pool, page_table, lens, w, DI**-0.5, page_size=page_size)
    out = torch.full((B, L), 12345.0, device="cuda")
    got = indexer_scores_paged_triton(
        q, pool, page_table, lens, w, DI**-0.5, page_size=page_size, out=out, fill_past=False
    )
    pos = torch.arange(L, device="cuda")[None, :]
    valid = pos < lens[:, None]
    dead = pos // _scores.BLOCK_S * _scores.BLOCK_S >= lens[:, None]
    assert torch.equal(got[valid], filled[valid])
    assert (got[dead] == 12345.0).all() and got[~valid & ~dead].isnan().all()

    def step(q, pool, page_table, lens, w):
        scores = indexer_scores_paged_triton(
            q, pool, page_table, lens, w, DI**-0.5, page_size=page_size, fill_past=False
        )
        return scores.masked_fill(torch.arange(L, device="cuda")[None, :] >= lens[:, None], -1.0)

    fresh = (q.flip(0), pool, page_table.flip(0), lens.flip(0), w.flip(0))
    assert_replay_matches_eager(step, (q, pool, page_table, lens, w), fresh)
