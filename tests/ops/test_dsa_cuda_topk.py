"""The CUDA exact top-k (kestrel.ops.dsa.cuda_topk) against naive.topk_select and topk_triton.

The kernel tests need a CUDA device and nvcc (skipped otherwise); `available()` is checked on every machine.
Outputs are poisoned before every run so that an element the kernel never writes fails the comparison.

Legend: B rows, L score positions, k = index_topk.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl

from kestrel.ops.dsa import by_position, cuda_topk, topk_select
from kestrel.ops.dsa.cuda_topk import available, topk_cuda
from kestrel.ops.pdl import pdl_args, pdl_begin

NAN, INF = float("nan"), float("inf")
KERNEL = torch.cuda.is_available() and available()
requires_kernel = pytest.mark.skipif(
    not KERNEL, reason=f"topk_cuda unavailable: {cuda_topk.UNAVAILABLE_REASON or 'no CUDA device'}"
)


@triton.jit
def _slow_copy(src, dst, n, rounds, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """dst = src (nearly: rounds of float work first, a few microseconds), launched with PDL where it is on."""
    pdl_begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    for _ in range(rounds):
        x = x * 1.0000001 - x * 1e-7
    tl.store(dst + offs, x, mask=offs < n)


def run_topk(scores, lens, k, lens_dtype=torch.int64):
    """topk_cuda (every kernel variant that takes the rows, and its own pick) into a poisoned output equals the
    reference's selection by position; a short variant whose rows are too wide is refused, by topk_cuda with a
    ValueError and by the library's launcher itself. Returns the variants that ran."""
    scores, lens = scores.cuda(), lens.cuda()
    want = by_position(topk_select(scores, lens.long() - 1, k))
    assert cuda_topk.num_variants() >= 1
    flat = scores if scores.stride(-1) == 1 else scores.contiguous()  # what topk_cuda hands the kernel
    ran = [v for v in range(cuda_topk.num_variants()) if cuda_topk.variant_takes(v, flat)]
    for variant in [*ran, None]:  # None: topk_cuda's own pick
        out = torch.full((scores.shape[0], k), -7, dtype=torch.int64, device="cuda")
        got = topk_cuda(scores, lens.to(lens_dtype), k, out=out, variant=variant)
        assert got.data_ptr() == out.data_ptr()
        assert not (got == -7).any(), f"variant {variant}: unwritten output"
        assert torch.equal(got, want), f"variant {variant} k={k} lens={lens.tolist()[:8]}\n{got}\n{want}"
    for variant in sorted(set(range(cuda_topk.num_variants())) - set(ran)):
        out = torch.full((scores.shape[0], k), -7, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=f"variant {variant} takes rows of at most"):
            topk_cuda(scores, lens.to(lens_dtype), k, out=out, variant=variant)
        with pytest.raises(RuntimeError, match="invalid argument"):  # the launcher's own check
            cuda_topk._launch(cuda_topk._load(), flat, lens.to(lens_dtype).contiguous(), k, out, variant)
        assert (out == -7).all(), f"variant {variant} wrote a row it refused"
    return ran


def edge_lens(L: int, k: int) -> list[int]:
    """Lens at the edges of rows of L scores, k selected: 0, 1, k - 1, k, k + 1, L - 1, L, past L, negative."""
    return [0, 1, k - 1, k, k + 1, L - 1, L, L + 1, -5, 10**6]


def edge_rows(B: int, L: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B rows of L randn scores on the GPU and their lens: random in [0, L], the first rows' at the edges
    (`edge_lens`)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    edges = edge_lens(L, k)
    scores = torch.randn(B, L, generator=g, device="cuda")  # [B, L]
    lens = torch.randint(0, L + 1, (B,), generator=g, device="cuda")
    lens[: len(edges)] = torch.tensor(edges, device="cuda")
    return scores, lens


def test_unavailable_without_cuda_does_not_raise(monkeypatch):
    """No CUDA device, or no nvcc: available() is False with a reason, and topk_cuda says why."""
    for patch in ({"is_available": False}, {"is_available": True, "nvcc": None}):
        monkeypatch.setattr(cuda_topk, "_tried", False)
        monkeypatch.setattr(cuda_topk, "_lib", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda p=patch: p["is_available"])
        if "nvcc" in patch:
            monkeypatch.setattr(cuda_topk, "find_nvcc", lambda: None)
        assert available() is False
        assert cuda_topk.UNAVAILABLE_REASON
    monkeypatch.undo()
    cuda_topk._tried, cuda_topk._lib = False, None  # the next caller loads for real
    assert isinstance(available(), bool)


def test_the_layer_picks_the_kernel_by_env_and_availability(monkeypatch):
    """KESTREL_DSA_TOPK: auto and cuda take the CUDA kernel where it is available; without it auto falls back to
    Triton's with a warning that says why, and cuda is an error that says why; triton takes Triton's; CPU
    tensors never get the CUDA kernel."""
    from kestrel.ops import dsa

    topk_triton = pytest.importorskip("kestrel.ops.dsa.triton_topk").topk_triton
    cuda = torch.device("cuda")
    monkeypatch.setattr(cuda_topk, "available", lambda: True)
    for choice, want in (("auto", topk_cuda), ("cuda", topk_cuda), ("triton", topk_triton)):
        monkeypatch.setenv("KESTREL_DSA_TOPK", choice)
        assert dsa.fast_topk(cuda) is want
        assert dsa.fast_topk(torch.device("cpu")) is topk_triton
    monkeypatch.setattr(cuda_topk, "available", lambda: False)
    monkeypatch.setattr(cuda_topk, "UNAVAILABLE_REASON", "RuntimeError: nvcc not found")
    monkeypatch.setattr(dsa, "_warned", False)
    monkeypatch.setenv("KESTREL_DSA_TOPK", "auto")
    with pytest.warns(RuntimeWarning, match="nvcc not found"):
        assert dsa.fast_topk(cuda) is topk_triton
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        assert dsa.fast_topk(cuda) is topk_triton
    monkeypatch.setenv("KESTREL_DSA_TOPK", "cuda")
    with pytest.raises(RuntimeError, match="nvcc not found"):
        dsa.fast_topk(cuda)
    monkeypatch.setenv("KESTREL_DSA_TOPK", "fast")
    with pytest.raises(ValueError, match="KESTREL_DSA_TOPK"):
        dsa.fast_topk(cuda)


@requires_kernel
@pytest.mark.parametrize("L", [1, 7, 37, 100, 257, 4099])
def test_random_scores(L):
    g = torch.Generator().manual_seed(L)
    scores = torch.randn(4, L, generator=g)  # [B, L]
    lens = torch.tensor([1, L, L // 2 + 3, 0])
    for k in sorted({1, 5, 16, max(1, L // 3), L, 64, 300}):
        run_topk(scores, lens, k)


@requires_kernel
def test_int32_lens_and_lens_out_of_range():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 300, generator=g)
    lens = torch.tensor([300, -4, 1000, 17, 0])  # clamped to [0, L]
    for k in (1, 64, 300):
        run_topk(scores, lens, k, lens_dtype=torch.int32)
        run_topk(scores, lens, k)


@requires_kernel
@pytest.mark.parametrize("seed", range(2))
def test_heavy_ties_and_nan(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 1000
    scores = torch.randint(-3, 4, (B, L), generator=g).float()  # 7 distinct values: ties everywhere
    scores[torch.rand(B, L, generator=g) < 0.1] = NAN
    lens = torch.tensor([L, 1, 570, 999, 640])
    for k in (1, 7, 33, 64, 300):
        run_topk(scores, lens, k)


@requires_kernel
def test_ties_decided_in_the_last_digit():
    # Scores a few ulps apart share the top 22 key bits: T's last digit decides, with ties.
    g = torch.Generator().manual_seed(5)
    ulps = torch.randint(0, 6, (3, 800), generator=g).to(torch.int32)
    scores = (torch.tensor(1.5).view(torch.int32) + ulps).view(torch.float32)  # [B, L]
    lens = torch.tensor([800, 410, 777])
    for k in (1, 9, 300):
        run_topk(scores, lens, k)


@requires_kernel
def test_special_values():
    mixed = [-INF, 2.0, NAN, -INF, INF, 0.0, -0.0, 0.0, NAN, -1e-45, 1e-45, -0.0, 3e38, -3e38, INF, 2.0, -INF]
    scores = torch.tensor([mixed, [NAN] * 17, [0.0, -0.0] * 8 + [NAN], [-INF] * 17, [INF] * 17])
    lens = torch.tensor([17, 17, 16, 17, 9])
    for k in (1, 5, 16, 17, 40):
        run_topk(scores, lens, k)


@requires_kernel
def test_ignores_garbage_past_lens():
    g = torch.Generator().manual_seed(21)
    L, lens = 500, torch.tensor([1, 9, 500, 140])
    scores = torch.randn(4, L, generator=g)
    padded = torch.arange(L)[None, :] >= lens[:, None]
    for garbage in (NAN, INF, 1e30):
        run_topk(scores.masked_fill(padded, garbage), lens, 8)


@requires_kernel
def test_short_rows_in_a_wide_buffer():
    """Decode's graphs hand over scores as wide as the engine's longest context, unwritten past each row's
    length: short rows beside long ones. The cluster variant does a row of fewer than CLUSTER_MIN_L valid scores
    in its first block alone and splits the longer ones; every variant selects the reference's set."""
    g = torch.Generator().manual_seed(12)
    L = 131072
    lens = torch.tensor([4096, 1, 0, 32767, 32768, L, 2049, 40000])
    scores = torch.randn(len(lens), L, generator=g)
    scores[torch.arange(L)[None, :] >= lens[:, None]] = 1e30  # what the unwritten part may hold
    for k in (1, 2048):
        run_topk(scores, lens, k)


def test_the_kernels_split_threshold_is_the_pickers():
    """The cluster variant's row split (cuda_topk.cu's SPLIT_MIN_N) is where choose_variant starts to pick it."""
    import re

    split = re.search(r"constexpr int SPLIT_MIN_N = (\d+);", cuda_topk.SOURCE.read_text())
    assert split and int(split.group(1)) == cuda_topk.CLUSTER_MIN_L


@requires_kernel
def test_non_contiguous_rows_and_unaligned_starts():
    g = torch.Generator().manual_seed(10)
    wide = torch.randn(6, 4131, generator=g).cuda()  # views of it reach the kernel as views
    for start in (0, 1, 2, 3):  # every 16-byte misalignment of the rows' first score
        run_topk(wide[:, start : start + 4099], torch.tensor([4099, 3, 77, 4098, 0, 2000]), 300)
    run_topk(wide[:, 5:12], torch.tensor([7, 3, 1, 6, 0, 7]), 5)
    assert wide[:, 10:40:3].stride() == (4131, 3)
    run_topk(wide[:, 10:40:3], torch.tensor([10, 3, 1, 6, 0, 10]), 5)  # column stride != 1: copied


@requires_kernel
def test_all_equal_rows_take_the_lowest_positions():
    # Every score equal: all of the row is in the threshold digit, more than shared memory keeps (fallback).
    scores = torch.full((3, 131072), 0.5)
    run_topk(scores, torch.tensor([131072, 90001, 2047]), 2048)
    scores[1, 70000:] = 0.75  # the ties at the threshold lie after the keys above it
    run_topk(scores, torch.tensor([131072, 131072, 5]), 2048)


@requires_kernel
def test_one_fallback_digit_then_shared_memory():
    # Scores in [1, 1.25): all share the top 11 key bits (131072 keys, more than shared memory keeps), and about
    # 64 share each 22-bit prefix: the second digit comes from the row, then the candidates fit.
    g = torch.Generator(device="cuda").manual_seed(8)
    scores = 1 + 0.25 * torch.rand(3, 131072, generator=g, device="cuda")  # [B, L]
    for k in (1, 2048, 5000):
        run_topk(scores, torch.tensor([131072, 100000, 3000]), k)


@requires_kernel
def test_first_call_inside_a_graph_capture_is_refused(monkeypatch):
    monkeypatch.setattr(cuda_topk, "_ready", {})  # as if this device had never run the kernel
    scores, lens = torch.randn(2, 100, device="cuda"), torch.tensor([100, 50], device="cuda")
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            topk_cuda(scores, lens, 10)


@requires_kernel
@pytest.mark.parametrize("kind", ["randn", "ties", "few"])
@pytest.mark.parametrize("B,L,k", [(64, 131072, 2048), (16, 32768, 2048), (3, 5000, 2048), (4, 70000, 64)])
def test_real_sizes(B, L, k, kind):
    g = torch.Generator(device="cuda").manual_seed(B + L)
    if kind == "randn":
        scores = torch.randn(B, L, generator=g, device="cuda")  # [B, L]
    elif kind == "ties":  # a few hundred values: ~19 K keys in 131072 share the threshold digit (they fit)
        scores = torch.randint(0, 300, (B, L), generator=g, device="cuda").float()
    else:  # three values: even 22 key bits leave a large part of the row
        scores = torch.randint(0, 3, (B, L), generator=g, device="cuda").float()
    scores[torch.rand(B, L, generator=g, device="cuda") < 0.01] = NAN
    lens = torch.randint(1, L + 1, (B,), generator=g, device="cuda")
    lens[0], lens[-1] = L, 1
    run_topk(scores, lens, k)


@requires_kernel
def test_matches_topk_triton():
    triton_topk = pytest.importorskip("kestrel.ops.dsa.triton_topk")
    g = torch.Generator(device="cuda").manual_seed(2)
    scores = torch.randn(8, 20000, generator=g, device="cuda") + torch.linspace(0, 6, 20000, device="cuda")
    scores[torch.rand(8, 20000, generator=g, device="cuda") < 0.01] = NAN
    lens = torch.tensor([20000, 1, 0, 2048, 2049, 19999, 7, 12345], device="cuda")
    for k in (1, 256, 2048):
        assert torch.equal(topk_cuda(scores, lens, k), triton_topk.topk_triton(scores, lens, k))


@requires_kernel
def test_prefill_triangle():
    # A prefill chunk: row t sees t + 1 positions, so the first k rows take every valid position.
    g = torch.Generator(device="cuda").manual_seed(4)
    scores = torch.randn(4096, 4096, generator=g, device="cuda")  # [T, L]
    scores[torch.rand(4096, 4096, generator=g, device="cuda") < 0.01] = NAN
    run_topk(scores, torch.arange(1, 4097, device="cuda"), 2048)


# ---------------------------------------------------------------- the short variants (rows in registers)


def short_fit(scores) -> set[int]:
    """The short variants that take these scores' rows (cuda_topk.row_slots against ROW_SLOTS)."""
    return {v for v, slots in cuda_topk.ROW_SLOTS.items() if cuda_topk.row_slots(scores) <= slots}


def test_the_variant_tables_agree():
    """cuda_topk.cu's VARIANTS, THREADS, BLOCKS_PER_ROW and ROW_SLOTS describe the same kernels (a short variant's
    ROW_SLOTS is its NT * V, its THREADS its NT), cuda_topk.py's constants name them, and the cluster comes
    last (usable_variants counts on it)."""
    import math
    import re

    src = cuda_topk.SOURCE.read_text()
    count = int(re.search(r"constexpr int NUM_VARIANTS = (\d+);", src).group(1))

    def table(name: str) -> str:
        return re.search(rf"constexpr \w+ {name}\[NUM_VARIANTS\] = \{{(.*?)\}};", src, re.S).group(1)

    def numbers(name: str) -> list[int]:
        return [math.prod(int(f) for f in item.split("*")) for item in table(name).split(",")]

    kernels = re.findall(r"topk_(rows|short)_kernel<([^>]*)>", table("VARIANTS"))
    threads, blocks, slots = numbers("THREADS"), numbers("BLOCKS_PER_ROW"), numbers("ROW_SLOTS")
    assert len(kernels) == len(threads) == len(blocks) == len(slots) == count
    for v, (kind, args) in enumerate(kernels):
        a = [int(x) if x.strip().isdigit() else x.strip() for x in args.split(",")]
        if kind == "short":  # <NT, V>
            assert (threads[v], blocks[v], slots[v]) == (a[0], 1, a[0] * a[1]), v
            assert cuda_topk.ROW_SLOTS[v] == a[0] * a[1]
        else:  # <R, PREFETCH, CL, NT>
            assert (threads[v], blocks[v], slots[v]) == (a[3], a[2], 0), v
            assert v not in cuda_topk.ROW_SLOTS
    assert set(cuda_topk.ROW_SLOTS) == {v for v, (kind, _) in enumerate(kernels) if kind == "short"}
    assert cuda_topk.CLUSTER_VARIANT == count - 1 and blocks[-1] == 2 and set(blocks[:-1]) == {1}
    assert kernels[cuda_topk.SHORT_VARIANT][0] == kernels[cuda_topk.MEDIUM_VARIANT][0] == "rows"
    assert (threads[cuda_topk.SHORT_VARIANT], threads[cuda_topk.MEDIUM_VARIANT]) == (256, 512)
    assert cuda_topk.DEFAULT_VARIANT not in cuda_topk.ROW_SLOTS
    assert set(cuda_topk.REGISTER_PICKS) <= set(cuda_topk.ROW_SLOTS)
    # WITH_ROWS: each short variant's twin (its <NT, V> with ROWS true), nothing for the others
    twins = re.findall(r"nullptr|topk_\w+_kernel<[^>]*>", table("WITH_ROWS"))
    assert len(twins) == count
    for v, (kind, args) in enumerate(kernels):
        if kind == "short":
            nt, per, rows = (x.strip() for x in args.split(","))
            assert rows == "false" and twins[v] == f"topk_short_kernel<{nt}, {per}, true>", v
        else:
            assert twins[v] == "nullptr", v


@requires_kernel
def test_the_library_reports_the_row_slots():
    lib = cuda_topk._load()
    for v in range(cuda_topk.CLUSTER_VARIANT + 1):
        assert lib.kestrel_topk_row_slots(v) == cuda_topk.ROW_SLOTS.get(v, 0), v
    assert lib.kestrel_topk_row_slots(cuda_topk.CLUSTER_VARIANT + 1) == -1
    assert cuda_topk.num_variants() >= cuda_topk.CLUSTER_VARIANT  # every short variant runs on the device


@requires_kernel
@pytest.mark.parametrize("width", [4096, 8192])
def test_short_rows_at_the_widest_and_one_past(width):
    """Rows of exactly the most scores a short variant takes (the last slot's scores among the selected: a
    rising ramp), and one more, which the narrower short variants refuse and the others and the auto pick take;
    lens past L, L - 1, half; k from 1 to past the row."""
    g = torch.Generator(device="cuda").manual_seed(width)
    for L in (width, width + 1):
        noise = torch.randn(5, L, generator=g, device="cuda")
        ramp = torch.linspace(-3, 3, L, device="cuda")  # strictly rising
        scores = torch.stack([noise[0], noise[1] + ramp, noise[2] - ramp, ramp, noise[4]])  # [B, L]
        lens = torch.tensor([L, L - 1, L // 2, L, 10**6])
        for k in (1, 2047, 2048, 2049, L - 1, L, L + 3):
            ran = run_topk(scores, lens, k)
            assert set(ran) & set(cuda_topk.ROW_SLOTS) == short_fit(scores.cuda())
        assert short_fit(scores.cuda()) == ({5, 6, 7, 8} if L == 4096 else {6, 7, 8} if L <= 8192 else set())


@requires_kernel
def test_short_rows_from_unaligned_pointers():
    """Views whose rows start 1-3 scores past a 16-byte boundary (`head`): the row spans one more slot, so the
    widest rows a short variant takes are 3 scores shorter; rows rise to their end, so the last slot counts.
    With a row stride that is not a multiple of 4 scores every row's head is taken as 3."""
    g = torch.Generator(device="cuda").manual_seed(15)
    for width in (4096, 8192):
        wide = torch.randn(3, width + 8, generator=g, device="cuda") + torch.linspace(
            0, 4, width + 8, device="cuda"
        )  # [B, width + 8], row stride a multiple of 4
        for start in range(4):
            for L in sorted({width - 3, width - start, width}):
                view = wide[:, start : start + L]
                lens = torch.tensor([L, L - 1, 2049])
                ran = run_topk(view, lens, 2048)
                fits = (L + start + 3) // 4 <= width // 4
                short = cuda_topk.REGISTER_NARROW if width == 4096 else cuda_topk.REGISTER_WIDE_FEW
                assert (short in ran) == fits, (start, L)
        odd = torch.randn(3, width + 1, generator=g, device="cuda")  # row stride width + 1: heads 0, 1, 2
        ran = run_topk(odd[:, : width - 3], torch.tensor([width - 3, 5, width - 4]), 2048)
        assert short_fit(odd[:, : width - 3]) <= set(ran) and short_fit(odd[:, : width - 3])
        ran = run_topk(odd[:, : width - 2], torch.tensor([width - 2, 5, width - 4]), 2048)
        assert not short_fit(odd[:, : width - 2]) & {
            v for v, s in cuda_topk.ROW_SLOTS.items() if 4 * s == width
        }


@requires_kernel
def test_short_rows_all_equal_and_all_special():
    """Every score equal (all of the row in one bin of every digit: T found in the last, the lowest positions
    taken), every one -inf (valid, in digit 0), NaN (nothing valid), +-0.0 (one key), +inf."""
    L = 8192
    rows = [[0.5] * L, [-INF] * L, [NAN] * L, [0.0, -0.0] * (L // 2), [INF] * L, [-1.0] * L]
    scores, lens = torch.tensor(rows), torch.tensor([L, 4096, L, 3000, 2049, 2048])
    for k in (1, 2047, 2048, 4096, L, L + 1):
        run_topk(scores, lens, k)
        run_topk(scores[:, :4096], lens, k)


@requires_kernel
@pytest.mark.parametrize("seed", range(2))
def test_short_rows_with_few_values_in_every_digit(seed):
    """108 distinct scores whose keys differ in each of their 4 bytes (a few values a byte), about 76 copies of
    each in 8192: every digit's threshold bin holds ties, and T's ties straddle the take."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, L = 6, 8192
    byte_values = ([0x3F, 0x40, 0xBF, 0xC0], [0x00, 0x80, 0xFF], [0x00, 0x7F, 0x80], [0x00, 0x01, 0xFF])
    bits = torch.zeros(B, L, dtype=torch.int64, device="cuda")
    for values in byte_values:
        pick = torch.randint(0, len(values), (B, L), generator=g, device="cuda")
        bits = bits * 256 + torch.tensor(values, device="cuda")[pick]
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # as int32 bit patterns
    scores = bits.to(torch.int32).view(torch.float32)  # [B, L] finite, both signs
    assert not scores.isnan().any()
    lens = torch.tensor([L, L - 1, 4096, 4097, 2048, 1], device="cuda")
    for k in (1, 75, 76, 2048, 4000, L - 1):
        run_topk(scores, lens, k)
        run_topk(scores[:, :4096], lens, k)
    ulps = torch.randint(0, 6, (B, L), generator=g, device="cuda").to(
        torch.int32
    )  # one bin down to the last digit
    close = (torch.tensor(1.5, device="cuda").view(torch.int32) + ulps).view(torch.float32)
    for k in (1, 1300, 2048):
        run_topk(close, lens, k)


@requires_kernel
def test_short_rows_special_values():
    """NaN, +-inf, -0.0 / +0.0, denormals and the scores below -2^127 (keys whose first digit is 0, with -inf):
    T among -inf and those, among the zeros, among +inf."""
    g = torch.Generator(device="cuda").manual_seed(16)
    L = 4096
    pool = torch.tensor(
        [-INF, -3.3e38, -2.0e38, -1.8e38, NAN, INF, 0.0, -0.0, 1e-45, -1e-45, 3e38, 2.0, -2.0], device="cuda"
    )
    mixed = pool[torch.randint(0, len(pool), (L,), generator=g, device="cuda")]
    low = pool[torch.randint(0, 5, (L,), generator=g, device="cuda")]  # -inf, below -2^127, NaN
    low[:100] = torch.randn(100, generator=g, device="cuda")
    zeros = pool[torch.randint(6, 10, (L,), generator=g, device="cuda")]  # +-0.0 and +-denormals
    infs = torch.where(torch.rand(L, generator=g, device="cuda") < 0.6, INF, NAN)
    scores = torch.stack([mixed, low, zeros, infs])  # [B, L]
    for lens in (torch.tensor([L, L, L, L]), torch.tensor([4000, 2049, 2048, 3000])):
        for k in (1, 100, 101, 2048, 3000, 5000):
            run_topk(scores, lens, k)


@requires_kernel
@pytest.mark.parametrize("L", [4096, 4224, 8192])
def test_short_rows_lens_edges_many_rows_and_one(L):
    """lens 0, 1, k - 1, k, k + 1, L - 1, L, past L and negative, int32 and int64, in 300 rows (more than the SMs
    and than REGISTER_MAX_B) and one at a time; k = 1 and k past L."""
    k = 2048
    scores, lens = edge_rows(300, L, k, seed=L)
    for lens_dtype in (torch.int32, torch.int64):
        run_topk(scores, lens, k, lens_dtype=lens_dtype)
    run_topk(scores, lens, 1)
    run_topk(scores[:50], lens[:50], L + 5)
    for i, n in enumerate(edge_lens(L, k)):
        run_topk(scores[i : i + 1], torch.tensor([n]), k, lens_dtype=torch.int32)


@requires_kernel
def test_short_rows_ignore_garbage_past_lens():
    """Decode at a 4K context in an 8192-wide buffer: what lies past each row's length is never selected."""
    g = torch.Generator().manual_seed(17)  # the scores are made on the CPU; run_topk moves them
    L = 8192
    lens = torch.tensor([4096, 1, 0, L, 2049, 2048, 2047, 4097])
    scores = torch.randn(len(lens), L, generator=g)
    padded = torch.arange(L)[None, :] >= lens[:, None]
    for garbage in (NAN, INF, 1e30, -INF):
        for k in (1, 2048):
            run_topk(scores.masked_fill(padded, garbage), lens, k)


@requires_kernel
def test_topk_cuda_picks_a_short_variant_for_decode_rows(monkeypatch):
    """On the device (its short probes passed): decode's rows take the short variants, by their slots and rows."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "auto")
    first, second = cuda_topk.REGISTER_NARROW, cuda_topk.REGISTER_WIDE_FEW
    dev = torch.device("cuda", torch.cuda.current_device())
    wide = torch.zeros(2, 8200, device="cuda")
    for view, want in ((wide[:, :4096], first), (wide[:, 1:4096], first), (wide[:, 1:4097], second)):
        assert cuda_topk.variant_for(2, view.shape[1], dev, cuda_topk.row_slots(view)) == want
    for L, want in ((4096, first), (4224, second), (8192, second)):
        assert cuda_topk.variant_for(64, L, dev, cuda_topk.row_slots(wide[:, :L])) == want
        many = first if L == 4096 else cuda_topk.REGISTER_WIDE_MANY
        assert cuda_topk.variant_for(65, L, dev, cuda_topk.row_slots(wide[:, :L])) == many
    assert (
        cuda_topk.variant_for(1, 8193, dev, cuda_topk.row_slots(torch.zeros(1, 8193)))
        not in cuda_topk.ROW_SLOTS
    )


def test_the_cluster_variant_is_picked_for_few_wide_rows():
    """choose_variant: the two-block cluster while every block has its own SM and rows are wide; never where the
    device cannot run it."""
    wide, sms = cuda_topk.CLUSTER_MIN_L, 132
    assert cuda_topk.choose_variant(1, wide, sms, True) == cuda_topk.CLUSTER_VARIANT
    assert cuda_topk.choose_variant(66, 131072, sms, True) == cuda_topk.CLUSTER_VARIANT
    # 134 blocks > 132 SMs
    assert cuda_topk.choose_variant(67, 131072, sms, True) == cuda_topk.DEFAULT_VARIANT
    assert cuda_topk.choose_variant(1, wide - 1, sms, True) == cuda_topk.DEFAULT_VARIANT
    assert cuda_topk.choose_variant(1, 131072, sms, False) == cuda_topk.DEFAULT_VARIANT
    assert cuda_topk.CLUSTER_VARIANT != cuda_topk.DEFAULT_VARIANT


def test_short_rows_take_the_smaller_blocks():
    """choose_variant: 256 threads a row up to SHORT_MAX_L, and up to MEDIUM_MAX_L for more rows than SMs (512
    for fewer); 1024 past that, whatever the row count; the cluster's rule first."""
    sms, short, medium = 132, cuda_topk.SHORT_VARIANT, cuda_topk.MEDIUM_VARIANT
    assert len({short, medium, cuda_topk.DEFAULT_VARIANT, cuda_topk.CLUSTER_VARIANT}) == 4
    for B in (1, 64, 256, 4096):
        assert cuda_topk.choose_variant(B, 4096, sms, True) == short
        assert cuda_topk.choose_variant(B, cuda_topk.SHORT_MAX_L, sms, True) == short
        assert cuda_topk.choose_variant(B, cuda_topk.MEDIUM_MAX_L + 1, sms, True) == cuda_topk.DEFAULT_VARIANT
    assert cuda_topk.choose_variant(sms, 8192, sms, True) == medium
    assert cuda_topk.choose_variant(sms + 1, 8192, sms, True) == short
    assert cuda_topk.choose_variant(4096, cuda_topk.MEDIUM_MAX_L, sms, False) == short
    assert cuda_topk.choose_variant(1, cuda_topk.MEDIUM_MAX_L, sms, False) == medium
    assert cuda_topk.SHORT_MAX_L < cuda_topk.MEDIUM_MAX_L < cuda_topk.CLUSTER_MIN_L


def test_decode_rows_take_the_short_variants(monkeypatch):
    """choose_variant with the rows' 16-byte slots: up to REGISTER_MAX_B rows that fit a short variant of
    REGISTER_PICKS take theirs (4096 and 8192 aligned scores, mini's 4224, a row of 4093 from an unaligned
    pointer: the narrow variant up to 1024 slots, the wide ones by the rows' count); wider rows, more rows,
    unknown slots or KESTREL_DSA_TOPK_REGISTERS=off take the old picks."""
    sms, first = 132, cuda_topk.REGISTER_NARROW
    slots_of = {4096: 1024, 4224: 1056, 8192: 2048}  # aligned rows
    assert cuda_topk.ROW_SLOTS[first] == 1024
    assert (
        cuda_topk.ROW_SLOTS[cuda_topk.REGISTER_WIDE_FEW]
        == cuda_topk.ROW_SLOTS[cuda_topk.REGISTER_WIDE_MANY]
        == 2048
    )
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "auto")
    for B in (1, 4, 64, 65, cuda_topk.REGISTER_MAX_B):
        second = (
            cuda_topk.REGISTER_WIDE_FEW if B <= cuda_topk.REGISTER_FEW_B else cuda_topk.REGISTER_WIDE_MANY
        )
        assert cuda_topk.choose_variant(B, 4096, sms, True, slots_of[4096]) == first
        assert cuda_topk.choose_variant(B, 4224, sms, True, slots_of[4224]) == second
        assert cuda_topk.choose_variant(B, 8192, sms, True, slots_of[8192]) == second
        assert cuda_topk.choose_variant(B, 4093, sms, True, 1024) == first  # head 3
        assert cuda_topk.choose_variant(B, 4096, sms, True, 1025) == second  # head 1-3
        old_pick = cuda_topk.MEDIUM_VARIANT if B <= sms else cuda_topk.SHORT_VARIANT
        assert cuda_topk.choose_variant(B, 8192, sms, True, 2049) == old_pick
        assert cuda_topk.choose_variant(B, 131072, sms, True, 32768) == cuda_topk.choose_variant(
            B, 131072, sms, True
        )
    B = cuda_topk.REGISTER_MAX_B + 1
    assert cuda_topk.choose_variant(B, 4096, sms, True, 1024) == cuda_topk.SHORT_VARIANT
    assert cuda_topk.choose_variant(1, 4096, sms, True, None) == cuda_topk.SHORT_VARIANT
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "off")
    assert cuda_topk.choose_variant(1, 4096, sms, True, 1024) == cuda_topk.SHORT_VARIANT
    assert cuda_topk.choose_variant(1, 8192, sms, True, 2048) == cuda_topk.MEDIUM_VARIANT


def test_row_slots_count_the_head_as_the_launcher_does():
    """row_slots: L scores after the row's head (its first score's offset in 16 bytes), the first row's head for
    every row when the row stride is a multiple of 4 scores or there is one row, else 3; variant_takes compares
    it with ROW_SLOTS. CPU tensors: only their addresses and strides are read."""
    wide = torch.empty(4, 8200)  # [B, L]
    assert wide.data_ptr() % 16 == 0
    assert cuda_topk.row_slots(wide[:, :4096]) == 1024  # stride 8200 = 4 * 2050: every row aligned
    assert cuda_topk.row_slots(wide[:, 1:4097]) == 1025  # every row's head 1
    assert cuda_topk.row_slots(wide[:, 1:4093]) == 1024
    assert cuda_topk.row_slots(wide[:, 4:4100]) == 1024  # head 0 again
    assert cuda_topk.row_slots(wide[:1, 3:4096]) == 1024  # one row, head 3: 4093 scores
    assert cuda_topk.row_slots(wide[:1, 3:4097]) == 1025
    odd = torch.empty(3, 4097)[:, :4096]  # stride 4097: heads 0, 1, 2
    assert cuda_topk.row_slots(odd) == 1025 and cuda_topk.row_slots(odd[:1]) == 1024
    assert (
        cuda_topk.row_slots(torch.empty(2, 8192)) == 2048
        and cuda_topk.row_slots(torch.empty(2, 8193)) == 2049
    )
    for variant, slots in cuda_topk.ROW_SLOTS.items():
        rows = torch.empty(2, 4 * slots + 4)
        assert cuda_topk.variant_takes(variant, rows[:, : 4 * slots])
        assert not cuda_topk.variant_takes(variant, rows[:, : 4 * slots + 1])
        assert not cuda_topk.variant_takes(variant, rows[:, 1 : 4 * slots + 1])
        assert cuda_topk.variant_takes(variant, rows[:, 3 : 4 * slots])
    for variant in (cuda_topk.DEFAULT_VARIANT, cuda_topk.SHORT_VARIANT, cuda_topk.CLUSTER_VARIANT):
        assert cuda_topk.variant_takes(variant, torch.empty(1, 131073)[:, 1:])


@requires_kernel
def test_the_cluster_is_probed_and_picked_on_sm90():
    g = torch.Generator(device="cuda").manual_seed(9)
    L = cuda_topk.CLUSTER_MIN_L + 1000
    scores, lens = torch.randn(3, L, generator=g, device="cuda"), torch.tensor([L, 5, L // 2], device="cuda")
    run_topk(scores, lens, 2048)
    sms, cluster, registers = cuda_topk._ready[torch.cuda.current_device()]
    assert sms == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    assert cluster == (torch.cuda.get_device_capability()[0] >= 9)
    assert registers, cuda_topk.REGISTER_UNAVAILABLE_REASON


@requires_kernel
def test_a_failing_cluster_probe_leaves_the_default(monkeypatch):
    """Where the cluster variant's probe fails, the device keeps the default variant for every shape (with the
    reason kept), results stay exact, and no CUDA error is left for the next torch op."""
    real_probe = cuda_topk._probe

    def probe(lib, index, variant):
        return "made to fail" if variant == cuda_topk.CLUSTER_VARIANT else real_probe(lib, index, variant)

    monkeypatch.setattr(cuda_topk, "_ready", {})
    monkeypatch.setattr(cuda_topk, "CLUSTER_UNAVAILABLE_REASON", {})
    monkeypatch.setattr(cuda_topk, "_probe", probe)
    device = torch.cuda.current_device()
    L = cuda_topk.CLUSTER_MIN_L + 1000
    assert cuda_topk.variant_for(1, L, torch.device("cuda", device)) == cuda_topk.DEFAULT_VARIANT
    assert cuda_topk._ready[device][1] is False
    if torch.cuda.get_device_capability()[0] >= 9:
        assert cuda_topk.CLUSTER_UNAVAILABLE_REASON[device] == "made to fail"
    g = torch.Generator(device="cuda").manual_seed(10)
    run_topk(torch.randn(2, L, generator=g, device="cuda"), torch.tensor([L, 77], device="cuda"), 2048)
    torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()


@requires_kernel
def test_a_failing_short_probe_leaves_the_old_picks(monkeypatch):
    """Where a short variant of REGISTER_PICKS fails its probe, choose_variant picks none of them on that device
    (the reason kept), decode's rows take the old picks, and results stay exact."""
    real_probe = cuda_topk._probe
    second = cuda_topk.REGISTER_PICKS[-1]

    def probe(lib, index, variant):
        return "made to fail" if variant == second else real_probe(lib, index, variant)

    monkeypatch.setattr(cuda_topk, "_ready", {})
    monkeypatch.setattr(cuda_topk, "REGISTER_UNAVAILABLE_REASON", {})
    monkeypatch.setattr(cuda_topk, "_probe", probe)
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "auto")
    device = torch.cuda.current_device()
    dev = torch.device("cuda", device)
    assert cuda_topk.variant_for(1, 4096, dev, 1024) == cuda_topk.SHORT_VARIANT
    assert cuda_topk.variant_for(1, 8192, dev, 2048) == cuda_topk.MEDIUM_VARIANT
    assert cuda_topk._ready[device][2] is False
    assert cuda_topk.REGISTER_UNAVAILABLE_REASON[device] == "made to fail"
    g = torch.Generator(device="cuda").manual_seed(13)
    run_topk(torch.randn(2, 4096, generator=g, device="cuda"), torch.tensor([4096, 77], device="cuda"), 2048)
    torch.cuda.synchronize()


@requires_kernel
# the default variant; the cluster's; a short variant's (REGISTER_PICKS)
@pytest.mark.parametrize("L", [9000, cuda_topk.CLUSTER_MIN_L + 1000, 4224])
def test_cuda_graph_replay(L):
    from tests.ops.graph_check import assert_replay_matches_eager

    g = torch.Generator(device="cuda").manual_seed(6)
    first = (
        torch.randn(4, L, generator=g, device="cuda"),
        torch.tensor([L, 1, 300, 5000], device="cuda"),
    )
    fresh = (
        torch.randn(4, L, generator=g, device="cuda"),
        torch.tensor([7, L, 2000, 64], device="cuda"),
    )
    assert_replay_matches_eager(lambda s, n: topk_cuda(s, n, 256), first, fresh)


@requires_kernel
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device_while_the_first_is_current():
    """Scores on cuda:1 while cuda:0 is current: the kernel runs on the scores' device, with its own setup."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(3, 5000, generator=g)
    lens = torch.tensor([5000, 17, 2500])
    want = by_position(topk_select(scores, lens - 1, 300))
    with torch.cuda.device(0):
        got = topk_cuda(scores.to("cuda:1"), lens.to("cuda:1"), 300)
    assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), want)


@requires_kernel
# 1024 and 256 threads; the short variants, rows in registers, and their twins that write pool rows too
@pytest.mark.parametrize(
    "variant, rows",
    [
        (cuda_topk.DEFAULT_VARIANT, False),
        (cuda_topk.SHORT_VARIANT, False),
        *((v, False) for v in cuda_topk.ROW_SLOTS),
        *((v, True) for v in cuda_topk.ROW_SLOTS),
    ],
)
def test_waits_for_the_scores_kernel_before_it_in_a_graph(variant, rows):
    """With programmatic dependent launch the top-k may start while the kernel before it ends (in the step: the
    indexer's scores kernel, Triton, launched with PDL). In a CUDA graph after a slow PDL kernel that writes the
    scores, it still selects from the scores that kernel wrote, not from what the buffer held before."""
    B, L, k = 64, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(12)
    src, scores = torch.randn(B, L, generator=g, device="cuda"), torch.zeros(B, L, device="cuda")
    lens, out = torch.full((B,), L, device="cuda"), torch.empty(B, k, dtype=torch.int64, device="cuda")
    table = page_table_for(B, L, 64, torch.int64, seed=12)
    rows_out = torch.empty(B, k, dtype=torch.int32, device="cuda")

    def step():
        _slow_copy[(triton.cdiv(B * L, 1024),)](src, scores, B * L, 2000, BLOCK=1024, **pdl_args(src))
        topk_cuda(scores, lens, k, out=out, variant=variant, rows=(table, 64, rows_out) if rows else None)

    step()  # compiles and sets up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        fresh = torch.Generator(device="cuda").manual_seed(seed)
        src.copy_(torch.randn(B, L, generator=fresh, device="cuda"))
        scores.zero_()  # a top-k that ran ahead would select positions 0 .. k - 1
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, by_position(topk_select(scores, lens - 1, k)))
        assert not torch.equal(out[:, :k], torch.arange(k, device="cuda").expand(B, k))
        if rows:
            from kestrel.ops.mla.triton_decode import selected_rows

            assert torch.equal(rows_out, selected_rows(out, table, 64, lens))


# ---------------------------------------------------------------- pool rows from the short variants' twins


def page_table_for(B: int, L: int, page_size: int, dtype, seed: int, spare: int = 1, first: int = 1):
    """[B, pages] distinct shuffled pages from `first` on (pages * page_size >= L, `spare` pages more), on CUDA."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-L // page_size) + spare
    table = torch.randperm(B * pages + 7, generator=g)[: B * pages] + first  # [B * pages]
    return table.view(B, pages).to(dtype).cuda()


def run_rows(scores, lens, k, table, page_size, lens_dtype=torch.int64):
    """Every short variant that takes the rows, with rows = (table, page_size, rows_out), and topk_cuda_with_rows
    (its own pick), into poisoned outputs: the positions are the reference's and the rows are `selected_rows` of
    them, bit for bit; the pick writes rows exactly when it is a short variant. Every other variant refuses rows
    (topk_cuda with a ValueError, the launcher itself with invalid argument) and writes nothing. Returns the
    short variants that ran."""
    from kestrel.ops.mla.triton_decode import selected_rows

    scores, lens = scores.cuda(), lens.cuda().to(lens_dtype)
    B = scores.shape[0]
    want = by_position(topk_select(scores, lens.long() - 1, k))
    want_rows = selected_rows(want, table, page_size, lens)
    assert want_rows.dtype == torch.int32
    flat = scores if scores.stride(-1) == 1 else scores.contiguous()
    short = [v for v in sorted(cuda_topk.ROW_SLOTS) if cuda_topk.variant_takes(v, flat)]

    def poisoned():
        return (
            torch.full((B, k), -7, dtype=torch.int64, device="cuda"),
            torch.full((B, k), -7, dtype=torch.int32, device="cuda"),
        )

    for variant in short:
        out, rows_out = poisoned()
        got = topk_cuda(scores, lens, k, out=out, variant=variant, rows=(table, page_size, rows_out))
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, want), f"variant {variant}: positions"
        assert torch.equal(rows_out, want_rows), f"variant {variant}: rows\n{rows_out}\n{want_rows}"
    out, rows_out = poisoned()
    got, rows = cuda_topk.topk_cuda_with_rows(scores, lens, k, table, page_size, out=out, rows_out=rows_out)
    assert torch.equal(got, want)
    pick = cuda_topk.variant_for(B, scores.shape[1], scores.device, cuda_topk.row_slots(flat))
    if pick in cuda_topk.ROW_SLOTS:
        assert rows is not None and rows.data_ptr() == rows_out.data_ptr() and torch.equal(rows, want_rows)
    else:
        assert rows is None and (rows_out == -7).all()
    got, rows = cuda_topk.topk_cuda_with_rows(scores, lens, k, table, page_size)  # rows_out made for it
    assert torch.equal(got, want) and (rows is None) == (pick not in cuda_topk.ROW_SLOTS)
    if rows is not None:
        assert torch.equal(rows, want_rows)
    for variant in sorted(set(range(cuda_topk.num_variants())) - set(cuda_topk.ROW_SLOTS)):
        out, rows_out = poisoned()
        with pytest.raises(ValueError, match=f"variant {variant} writes no pool rows"):
            topk_cuda(scores, lens, k, out=out, variant=variant, rows=(table, page_size, rows_out))
        with pytest.raises(RuntimeError, match="invalid argument"):  # the launcher's own check
            cuda_topk._launch(
                cuda_topk._load(), flat, lens.contiguous(), k, out, variant, (table, page_size, rows_out)
            )
        assert (out == -7).all() and (rows_out == -7).all(), f"variant {variant} wrote rows it refused"
    return short


@requires_kernel
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("L", [4096, 4224, 8192])
def test_short_rows_write_the_pool_rows(L, table_dtype):
    """Rows from the kernel equal `selected_rows` of its positions for every short variant: lens 0, 1, k - 1, k,
    k + 1, L - 1, L, past L, negative; k = 1, 2048 and past L; pages of 64 (mini's), 1, 7 (a thread's keys cross
    several pages) and 4096; int32 and int64 lens."""
    k, B = 2048, 40
    scores, lens = edge_rows(B, L, k, seed=L + 1)
    for page_size in (64, 1, 7, 4096):
        table = page_table_for(B, L, page_size, table_dtype, seed=page_size)
        ran = run_rows(scores, lens, k, table, page_size)
        assert set(ran) == short_fit(scores)
        run_rows(scores, lens, k, table, page_size, lens_dtype=torch.int32)
    table = page_table_for(B, L, 64, table_dtype, seed=3)
    run_rows(scores, lens, 1, table, 64)
    run_rows(scores[:8], lens[:8], L + 5, table[:8], 64)
    for i, n in enumerate(edge_lens(L, k)):  # one row at a time
        run_rows(scores[i : i + 1], torch.tensor([n]), k, table[i : i + 1], 64)


@requires_kernel
def test_short_rows_write_the_pool_rows_from_unaligned_rows_and_odd_tables():
    """Rows whose first score is 1-3 past a 16-byte boundary (thread 0's first keys at negative positions), a
    page table that is a view of a wider one, one shared row (stride 0: prefill's layout), and an int64 table
    whose pages pass 2^32 (the kernel reads an entry's low 32-bit word; `selected_rows` truncates the row to
    int32 the same way: no pool is that large, the bits are what is compared)."""
    g = torch.Generator(device="cuda").manual_seed(31)
    B, width, k = 6, 4096, 2048
    wide = torch.randn(B, width + 8, generator=g, device="cuda")  # [B, width + 8]
    lens = torch.tensor([width - 3, 1, 2049, 0, 3000, 10**6])
    table = page_table_for(B, width + 8, 64, torch.int64, seed=4)
    for start in range(4):
        view = wide[:, start : start + width - 3]
        ran = run_rows(view, lens, k, table, 64)
        assert cuda_topk.REGISTER_NARROW in ran
        run_rows(view, lens, k, table.int(), 64)
    wider = page_table_for(B, 2 * width, 16, torch.int32, seed=5)
    run_rows(wide[:, :width], lens, k, wider[:, : width // 16 + 1], 16)  # row stride > width
    shared = page_table_for(1, width, 64, torch.int64, seed=6).expand(B, -1)  # stride 0
    assert shared.stride(0) == 0
    run_rows(wide[:, :width], torch.full((B,), width), k, shared, 64)
    huge = page_table_for(B, width, 64, torch.int64, seed=7, first=2**32 + 5)
    run_rows(wide[:, :width], lens, k, huge, 64)


@requires_kernel
def test_short_rows_write_the_pool_rows_with_ties_and_special_values():
    """Rows whose selection ends inside ties (T's ties taken by position) and among NaN and +-inf: the rows
    follow the positions."""
    L = 8192
    g = torch.Generator(device="cuda").manual_seed(33)
    ties = torch.randint(0, 3, (3, L), generator=g, device="cuda").float()
    special = torch.tensor([[0.5] * L, [-INF] * L, [NAN] * L], device="cuda")
    scores = torch.cat([ties, special])  # [B, L]
    lens = torch.tensor([L, 5000, 2049, L, 4096, L])
    table = page_table_for(6, L, 64, torch.int64, seed=8)
    for k in (1, 2048, 4097):
        run_rows(scores, lens, k, table, 64)
        run_rows(scores[:, :4096], lens, k, table, 64)


@requires_kernel
def test_no_rows_where_the_pick_is_not_a_short_variant(monkeypatch):
    """topk_cuda_with_rows: more rows than REGISTER_MAX_B, rows wider than any short variant takes, or
    KESTREL_DSA_TOPK_REGISTERS=off: the top-k alone (rows None, rows_out untouched), the same positions as
    topk_cuda; topk_cuda(rows=) with its own pick refuses them."""
    g = torch.Generator(device="cuda").manual_seed(34)
    cases = [(cuda_topk.REGISTER_MAX_B + 1, 4096, "auto"), (4, 8200, "auto"), (4, 4096, "off")]
    for B, L, registers in cases:
        monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", registers)
        scores = torch.randn(B, L, generator=g, device="cuda")
        lens = torch.randint(0, L + 1, (B,), generator=g, device="cuda")
        table = page_table_for(B, L, 64, torch.int64, seed=B)
        rows_out = torch.full((B, 2048), -7, dtype=torch.int32, device="cuda")
        got, rows = cuda_topk.topk_cuda_with_rows(scores, lens, 2048, table, 64, rows_out=rows_out)
        assert rows is None and (rows_out == -7).all()
        assert torch.equal(got, topk_cuda(scores, lens, 2048))
        with pytest.raises(ValueError, match="writes no pool rows"):
            topk_cuda(scores, lens, 2048, rows=(table, 64, rows_out))
        run_rows(scores, lens, 2048, table, 64)
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "auto")
    scores, lens = torch.randn(2, 4096, device="cuda"), torch.tensor([4096, 10], device="cuda")
    _, rows = cuda_topk.topk_cuda_with_rows(
        scores, lens, 2048, page_table_for(2, 4096, 64, torch.int32, 9), 64
    )
    assert rows is not None


@requires_kernel
def test_pool_rows_in_cuda_graph_replay():
    """topk_cuda_with_rows captured in a CUDA graph: replays with fresh scores, lengths and page table give the
    eager call's positions and rows."""
    from tests.ops.graph_check import assert_replay_matches_eager

    g = torch.Generator(device="cuda").manual_seed(35)
    B, L = 4, 4224

    def inputs(seed):
        return (
            torch.randn(B, L, generator=g, device="cuda"),
            torch.tensor([L, 1, 300, 2049], device="cuda").roll(seed),
            page_table_for(B, L, 64, torch.int64, seed=seed),
        )

    def call(scores, lens, table):
        got, rows = cuda_topk.topk_cuda_with_rows(scores, lens, 2048, table, 64)
        assert rows is not None
        return got, rows

    assert_replay_matches_eager(call, inputs(0), inputs(1))


def test_rows_arguments_are_checked():
    """check_rows (topk_cuda's `rows`): a clear ValueError for each way the page table, the page size or rows_out
    can be wrong; what it takes comes back as given. CPU tensors: nothing runs."""
    B, L, k, dev = 3, 4096, 2048, torch.device("cpu")
    table = torch.zeros(B, 64, dtype=torch.int64)
    rows_out = torch.empty(B, k, dtype=torch.int32)
    assert cuda_topk.check_rows((table, 64, rows_out), B, L, k, dev) == (table, 64, rows_out)
    assert cuda_topk.check_rows((table.int(), 64, None), B, L, k, dev, make_out=True)[2] is None
    with pytest.raises(ValueError, match="rows need rows_out"):
        cuda_topk.check_rows((table, 64, None), B, L, k, dev)
    assert cuda_topk.check_rows((table[:1].expand(B, -1), 64, rows_out), B, L, k, dev)[0].stride(0) == 0
    assert cuda_topk.check_rows((table, 64, rows_out), B, L - 5, k, dev)  # more pages than needed
    bad = [
        ((table, 64), "must be \\(page_table, page_size, rows_out\\)"),
        ((table, 0, rows_out), "page_size must be an int"),
        ((table, 2**31, rows_out), "page_size must be an int"),
        ((table, 64.0, rows_out), "page_size must be an int"),
        ((table, True, rows_out), "page_size must be an int"),
        ((table[0], 64, rows_out), "page_table must be \\[3, pages\\]"),
        ((table[:2], 64, rows_out), "page_table must be \\[3, pages\\]"),
        ((table.float(), 64, rows_out), "int32 or int64"),
        ((table.short(), 64, rows_out), "int32 or int64"),
        ((torch.zeros(64, B, dtype=torch.int64).t(), 64, rows_out), "unit column stride"),
        ((table[:, :63], 64, rows_out), "63 pages of 64 cover 4032 positions, the scores 4096"),
        ((table, 32, rows_out), "64 pages of 32 cover 2048 positions"),
        ((table, 64, rows_out.long()), "rows_out must be \\[3, 2048\\] int32"),
        ((table, 64, rows_out[:, :100]), "rows_out must be \\[3, 2048\\] int32"),
        ((table, 64, torch.empty(k, B, dtype=torch.int32).t()), "unit column stride"),
        (("table", 64, rows_out), "page_table must be"),
    ]
    for rows, match in bad:
        with pytest.raises(ValueError, match=match):
            cuda_topk.check_rows(rows, B, L, k, dev)
    if torch.cuda.is_available():  # another device than the scores'
        with pytest.raises(ValueError, match="on cuda"):
            cuda_topk.check_rows((table, 64, rows_out), B, L, k, torch.device("cuda", 0))


def test_the_launcher_checks_the_rows_arguments(tmp_path):
    """The library built for sm_90 and bound through cuda_topk's ctypes declarations (`_declare`), on a machine
    without a CUDA device (fake pointers: nothing may launch): every non-short variant refuses rows_out
    (cudaErrorInvalidValue, before it asks for a device), and so does a short one given a null page table, a
    page size below 1, a negative table stride or overlapping rows; with good arguments a short variant passes
    the checks and only then fails for want of a device. The argument list is the extern "C" signature's."""
    import ctypes
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("fake pointers: the GPU tests launch the kernel itself")
    nvcc = cuda_topk.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    lib_path = tmp_path / "cuda_topk.so"
    subprocess.run(
        [nvcc, *cuda_topk.FLAGS, "-arch=sm_90", "-o", str(lib_path), str(cuda_topk.SOURCE)], check=True
    )
    lib = cuda_topk._declare(ctypes.CDLL(str(lib_path)))
    invalid = 1  # cudaErrorInvalidValue

    def launch(variant, rows_out=0x4000, table=0x1000, page_size=64, stride_pt=64, stride_r=2048, B=4):
        L = k = 2048
        return lib.kestrel_topk_launch(
            0x1000, L, B, L, 0x2000, 1, k, 0x3000, k, table, 1, stride_pt, page_size, rows_out, stride_r, None,
            variant, 0,
        )  # fmt: skip

    for variant in range(cuda_topk.CLUSTER_VARIANT + 1):
        assert launch(variant, rows_out=None) != invalid, variant  # no device: a later error
        assert (launch(variant) == invalid) == (variant not in cuda_topk.ROW_SLOTS), variant
    for variant in cuda_topk.ROW_SLOTS:
        for bad in ({"table": None}, {"page_size": 0}, {"stride_pt": -1}, {"stride_r": 2047}):
            assert launch(variant, **bad) == invalid, (variant, bad)
        assert launch(variant, stride_r=0, B=1) != invalid  # one row: its stride is never used
        assert launch(variant, stride_pt=0) != invalid  # one page-table row shared by all
    assert lib.kestrel_topk_error(invalid).decode() == "invalid argument"
