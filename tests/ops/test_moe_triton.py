"""The Triton routed experts (kestrel.ops.moe.triton_experts) against the reference `moe_experts`.

Without CUDA the kernels run in Triton's interpreter on CPU (tests/conftest.py) at tiny sizes that do not divide
the tiles; with CUDA the same cases run compiled, and the `gpu` tests add `mini`'s sizes and a CUDA graph. The
output and the intermediates (h, y) are filled with NaN before every run, so an element the kernels leave
unwritten, or read without having written, fails the comparison.

Legend: T tokens, A experts per token, E experts, I expert width, Din the experts' input width.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.moe import moe_experts, moe_experts_grouped
from tests.ops.graph_check import assert_replay_matches_eager

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# partial tiles and several K steps at Din=40, I=24
SMALL_TILES = dict(block_m=16, block_n=(16, 16), block_k=(16, 16))
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _experts():
    from kestrel.ops.moe import triton_experts

    return triton_experts


def _inputs(T, Din, I, E, A, dtype, seed, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, Din, generator=g)  # [T, Din]
    w13 = torch.randn(E, 2 * I, Din, generator=g) / Din**0.5  # [E, 2I, Din]
    w2 = torch.randn(E, Din, I, generator=g) / I**0.5  # [E, Din, I]
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :A]  # [T, A] distinct within a token, as top-k gives
    weights = torch.rand(T, A, generator=g)  # [T, A] fp32
    w_dtype = w_dtype or dtype
    return (
        x.to(DEVICE, dtype),
        w13.to(DEVICE, w_dtype),
        w2.to(DEVICE, w_dtype),
        weights.to(DEVICE),
        ids.to(DEVICE),
    )


def run_poisoned(monkeypatch, x, w13, w2, weights, ids, act, **tiles):
    """moe_experts_triton with its output and intermediates filled with NaN first."""
    mod = _experts()
    nan = float("nan")
    monkeypatch.setattr(
        mod, "_scratch", lambda shape, dtype, device: torch.full(shape, nan, dtype=dtype, device=device)
    )
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    got = mod.moe_experts_triton(x, w13, w2, weights, ids, act, out=out, **tiles)
    assert got.data_ptr() == out.data_ptr() and got.dtype == x.dtype
    return got


def assert_matches(got, ref):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # rounded where the reference rounds: at most a flipped last bit of gate/up, h or y apart
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("T", [1, 3, 7])
def test_matches_reference(monkeypatch, T, act, dtype):
    x, w13, w2, weights, ids = _inputs(T, Din=40, I=24, E=5, A=3, dtype=dtype, seed=T)  # tokens share experts
    got = run_poisoned(monkeypatch, x, w13, w2, weights, ids, act, **SMALL_TILES)
    assert_matches(got, moe_experts(x, w13, w2, weights, ids, act))


def test_several_blocks_per_expert_and_default_tiles(monkeypatch):
    """~27 pairs per expert: two blocks of 16 each; and the default tiles (larger than every dimension)."""
    x, w13, w2, weights, ids = _inputs(40, Din=40, I=24, E=3, A=2, dtype=torch.float32, seed=5)
    ref = moe_experts(x, w13, w2, weights, ids, "situ")
    assert_matches(run_poisoned(monkeypatch, x, w13, w2, weights, ids, "situ", **SMALL_TILES), ref)
    assert_matches(run_poisoned(monkeypatch, x, w13, w2, weights, ids, "situ"), ref)


def test_pairs_sorted_beforehand(monkeypatch):
    """sorted_pairs (the MoE layer's sort before it forks the shared experts' stream, KESTREL_MOE_SORT_FIRST):
    the same output as the sort inside; a sort of other shapes is refused."""
    x, w13, w2, weights, ids = _inputs(9, Din=40, I=24, E=5, A=3, dtype=torch.float32, seed=12)
    ref = moe_experts(x, w13, w2, weights, ids, "silu")
    pairs = _experts().sort_pairs(ids, 5)
    assert_matches(run_poisoned(monkeypatch, x, w13, w2, weights, ids, "silu", sorted_pairs=pairs), ref)
    with pytest.raises(AssertionError, match="sorted_pairs"):
        _experts().moe_experts_triton(
            x, w13, w2, weights, ids, "silu", sorted_pairs=_experts().sort_pairs(ids, 4)
        )


def test_weights_in_another_dtype(monkeypatch):
    """fp32 expert weights under bf16 activations: rounded to bf16 as the reference's w.to(x.dtype)."""
    x, w13, w2, weights, ids = _inputs(
        3, Din=40, I=24, E=5, A=3, dtype=torch.bfloat16, seed=6, w_dtype=torch.float32
    )
    got = run_poisoned(monkeypatch, x, w13, w2, weights, ids, "silu", **SMALL_TILES)
    assert_matches(got, moe_experts(x, w13, w2, weights, ids, "silu"))


def test_out_of_range_ids_add_nothing(monkeypatch):
    """ids outside [0, E) (another rank's experts under EP) contribute nothing; their rows of y stay NaN."""
    x, w13, w2, weights, ids = _inputs(4, Din=40, I=24, E=5, A=3, dtype=torch.float32, seed=7)
    ids[0, 1], ids[2, 0], ids[3, 2] = -1, 5, -3
    outside = (ids < 0) | (ids >= 5)
    got = run_poisoned(monkeypatch, x, w13, w2, weights, ids, "silu", **SMALL_TILES)
    ref = moe_experts(x, w13, w2, weights.masked_fill(outside, 0.0), ids.masked_fill(outside, 0), "silu")
    assert_matches(got, ref)


def _randomize(moe, g: torch.Generator) -> None:
    """Every parameter of a MoE layer but the routing bias drawn from g (on g's device), scaled by its fan-in."""
    for name, p in moe.named_parameters():
        if name != "gate.e_score_correction_bias":
            p.copy_(torch.randn(p.shape, generator=g, device=g.device) / p.shape[-1] ** 0.5)


def _shared_expert(T, Din, I, dtype, seed):
    """A shared expert's (ws13 [2I, Din], ws2 [Din, I]), and its reference output on x as the routed reference
    computes one expert that every token takes at weight 1.0."""
    _, s13, s2, _, _ = _inputs(1, Din=Din, I=I, E=1, A=1, dtype=dtype, seed=seed)

    def ref(x):
        ones = torch.ones(x.shape[0], 1, device=DEVICE)
        zeros = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=DEVICE)
        return moe_experts(x, s13, s2, ones, zeros, "situ")

    return (s13[0], s2[0]), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_shared_expert_in_the_same_launches(monkeypatch, T, dtype):
    """shared=: the shared expert as one more expert every token takes, after the routed experts' blocks (40
    tokens: three blocks of 16); the routed output plus the shared one, each rounded to x's dtype and the sum
    again (the MoE layer's `routed + shared_experts(x)`). Out-of-range ids still add nothing."""
    x, w13, w2, weights, ids = _inputs(T, Din=40, I=24, E=5, A=2, dtype=dtype, seed=30 + T)
    ids[0, 1] = 5  # another rank's expert
    if T > 1:
        ids[1, 0] = -1  # sorts before every expert's rows: starts[0] > 0
    outside = (ids < 0) | (ids >= 5)
    shared, shared_ref = _shared_expert(T, Din=40, I=24, dtype=dtype, seed=31)
    got = run_poisoned(monkeypatch, x, w13, w2, weights, ids, "situ", shared=shared, **SMALL_TILES)
    routed = moe_experts(x, w13, w2, weights.masked_fill(outside, 0.0), ids.masked_fill(outside, 0), "situ")
    assert_matches(got, routed + shared_ref(x))
    if dtype == torch.bfloat16 and T < 40:  # (40 tokens: the blocks' layout only; the interpreter is slow)
        # bit for bit what the same kernels give apart, added as the layer adds them (the routed sum rounded
        # to bf16 first, then the sum): the fused combine's rounding, not only its tolerance
        mod, ones = _experts(), torch.ones(T, 1, device=DEVICE)
        zeros = torch.zeros(T, 1, dtype=torch.int64, device=DEVICE)
        apart = mod.moe_experts_triton(x, w13, w2, weights, ids, "situ", **SMALL_TILES)
        alone = mod.moe_experts_triton(
            x, shared[0][None], shared[1][None], ones, zeros, "situ", **SMALL_TILES
        )
        assert torch.equal(got, apart + alone)
        # accumulate: out += the result in the combine, as torch's add_ rounds it
        before = torch.randn(x.shape, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
        into = mod.moe_experts_triton(
            x,
            w13,
            w2,
            weights,
            ids,
            "situ",
            shared=shared,
            out=before.clone(),
            accumulate=True,
            **SMALL_TILES,
        )
        assert torch.equal(into, before + got)
        # default tiles too
        assert_matches(run_poisoned(monkeypatch, x, w13, w2, weights, ids, "situ", shared=shared), got)
    with pytest.raises(AssertionError, match="routed experts' width"):
        _experts().moe_experts_triton(x, w13, w2, weights, ids, "situ", shared=(shared[0][:-2], shared[1]))


def test_when_the_layer_fuses_its_shared_mlp(monkeypatch):
    """MoE._shared_in_experts: the shared MLP's weights where the Triton experts run it (their width and input,
    decode sizes, KESTREL_MOE_FUSE_SHARED on), None otherwise: the grouped or reference experts, a latent MoE
    (tiny's own config), more tokens than OVERLAP_SHARED_MAX_TOKENS, the flag off, another dtype."""
    from kestrel.layers.moe import OVERLAP_SHARED_MAX_TOKENS, MoE
    from kestrel.presets import preset_config

    triton_fn = _experts().moe_experts_triton
    config = preset_config("tiny").replace(routed_expert_hidden_size=None, latent_moe_use_norm=False)
    moe = MoE(config, layer_id=1)
    x = torch.zeros(4, config.hidden_size)
    monkeypatch.delenv("KESTREL_MOE_FUSE_SHARED", raising=False)
    got = moe._shared_in_experts(x, triton_fn)
    assert got is not None and got[0] is moe.shared_experts.gate_up_proj.weight
    assert got[1] is moe.shared_experts.down_proj.weight
    assert moe._shared_in_experts(x, moe_experts) is None
    assert (
        moe._shared_in_experts(torch.zeros(OVERLAP_SHARED_MAX_TOKENS + 1, config.hidden_size), triton_fn)
        is None
    )
    assert MoE(preset_config("tiny"), layer_id=1)._shared_in_experts(x, triton_fn) is None  # latent MoE
    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "0")
    assert moe._shared_in_experts(x, triton_fn) is None
    monkeypatch.delenv("KESTREL_MOE_FUSE_SHARED")
    moe.shared_experts.down_proj.weight.data = moe.shared_experts.down_proj.weight.data.double()
    assert moe._shared_in_experts(x, triton_fn) is None


@pytest.mark.parametrize("fuse", ["1", "0"])
@pytest.mark.parametrize("latent", [False, True])
def test_layer_adds_its_output_into_the_residual(monkeypatch, fuse, latent):
    """MoE.forward(x, add_to=r): r += the block's output, bit for bit `r + moe(x)` in bf16: inside the experts'
    combine where they run in Triton with the shared MLP fused (compiled on CUDA, in the interpreter on CPU),
    else by add_ (the shared MLP apart, or a latent MoE)."""
    import kestrel.layers.moe as moe_layer
    from kestrel.presets import preset_config

    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", fuse)
    monkeypatch.setattr(moe_layer, "routed_experts_fn", lambda h, ids: _experts().moe_experts_triton)
    config = preset_config("tiny")
    if not latent:
        config = config.replace(routed_expert_hidden_size=None, latent_moe_use_norm=False)
    moe = moe_layer.MoE(config, layer_id=1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        _randomize(moe, g)
        moe.to(DEVICE)
        x = torch.randn(5, config.hidden_size, generator=g).bfloat16().to(DEVICE)
        r = torch.randn(5, config.hidden_size, generator=g).bfloat16().to(DEVICE)
        want = r + moe(x)
        into = r.clone()
        assert moe(x, add_to=into) is into
        assert torch.equal(into, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("combine", [False, True], ids=["torch_combine", "triton_combine"])
def test_grouped_path_combine_with_out_of_range_ids(dtype, combine):
    """The grouped path's end, the weighted sum back to tokens: the Triton kernel (`combine_sorted`) and the
    torch form both equal the reference, and ids outside [0, E) add nothing (a negative id sorts into expert
    0's rows, an id >= E into rows no expert computes)."""
    x, w13, w2, weights, ids = _inputs(9, Din=40, I=24, E=5, A=3, dtype=dtype, seed=8)
    ids[0, 1], ids[2, 0], ids[3, 2], ids[8, 1] = -1, 5, -3, 7
    outside = (ids < 0) | (ids >= 5)
    ref = moe_experts(x, w13, w2, weights.masked_fill(outside, 0.0), ids.masked_fill(outside, 0), "silu")
    got = moe_experts_grouped(x, w13, w2, weights, ids, "silu", use_grouped_mm=False, triton_combine=combine)
    assert got.dtype == dtype
    assert_matches(got, ref)


def test_combine_sorted_gathers_weights_and_drops_out_of_range_ids():
    """y rows in a shuffled (expert-major) order come back to their tokens, weighted, rounded once; a pair with
    an id outside [0, E) adds nothing even where its row (and weight) is NaN, as uncomputed rows may be."""
    from kestrel.ops.moe.triton_experts import combine_sorted

    g = torch.Generator().manual_seed(3)
    T, A, Din, E = 6, 4, 1100, 9  # Din past one 1024-wide column block
    ids = torch.randint(0, E, (T, A), generator=g)
    order = torch.randperm(T * A, generator=g)
    y = torch.randn(T * A, Din, generator=g).bfloat16()  # sorted row i holds pair order[i]
    weights = torch.rand(T, A, generator=g)
    ids[1, 2], ids[4, 0] = E, -2
    outside = ((ids < 0) | (ids >= E)).flatten()
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # [M, Din] in pair order
    ref = (pairs.float().view(T, A, Din) * weights[..., None] * ~outside.view(T, A, 1)).sum(1).bfloat16()
    y[(order[:, None] == torch.nonzero(outside).flatten()).any(1)] = float("nan")  # their sorted rows
    weights = weights.masked_fill(outside.view(T, A), float("nan"))
    got = combine_sorted(y.to(DEVICE), order.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), E)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("parallel", [False, True, None])
@pytest.mark.parametrize("M, E", [(1, 8), (7, 5), (300, 64), (1536, 64), (2048, 64), (2049, 64), (700, 384)])
def test_sort_pairs_is_a_stable_sort_by_expert(M, E, parallel):
    """The counting sort (up to COUNTING_SORT_MAX_PAIRS pairs; one program, one a block of pairs, or the pick) and
    torch.sort past it give torch.sort's stable order and the experts' first rows, out-of-range ids (another
    rank's experts) included among the ids."""
    mod = _experts()
    assert mod.COUNTING_SORT_MAX_PAIRS == 2048  # the cases straddle it
    g = torch.Generator().manual_seed(M)
    ids = torch.randint(-2, E + 2, (M,), generator=g).to(DEVICE)
    order, starts = mod.sort_pairs(ids, E, parallel=parallel)
    sorted_ids, ref_order = torch.sort(ids, stable=True)
    ref_starts = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=DEVICE), out_int32=True)
    assert starts.tolist() == ref_starts.tolist()
    inside = slice(int(starts[0]), int(starts[E]))  # the rows the kernels read
    assert order[inside].tolist() == ref_order[inside].tolist()


def test_no_tokens_and_bad_activation():
    x, w13, w2, weights, ids = _inputs(0, Din=40, I=24, E=5, A=3, dtype=torch.float32, seed=8)
    assert _experts().moe_experts_triton(x, w13, w2, weights, ids, "silu").shape == (0, 40)
    x, w13, w2, weights, ids = _inputs(1, Din=40, I=24, E=5, A=3, dtype=torch.float32, seed=8)
    with pytest.raises(ValueError, match="unknown activation"):
        _experts().moe_experts_triton(x, w13, w2, weights, ids, "gelu")


# ---------------------------------------------------------------- CUDA: mini's sizes, graphs, dispatch

MINI = dict(Din=2048, I=256, E=64, A=6)  # presets._MINI: hidden 2048 (no latent MoE), 64 experts, top-6


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T", [1, 64, 256])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_mini_sizes_on_cuda(monkeypatch, T, act):
    x, w13, w2, weights, ids = _inputs(T, dtype=torch.bfloat16, seed=10 + T, **MINI)
    got = run_poisoned(monkeypatch, x, w13, w2, weights, ids, act)
    ref = moe_experts(x, w13, w2, weights, ids, act)
    grouped = moe_experts_grouped(x, w13, w2, weights, ids, act)
    for other in (ref, grouped):
        rel = ((got.float() - other.float()).norm() / other.float().norm()).item()
        assert rel < 1e-2, rel
    again = _experts().moe_experts_triton(x, w13, w2, weights, ids, act)
    assert torch.equal(got, again), "not deterministic"


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay():
    x, w13, w2, weights, ids = _inputs(8, dtype=torch.bfloat16, seed=20, **MINI)
    _, _, _, fresh_weights, fresh_ids = _inputs(8, dtype=torch.bfloat16, seed=21, **MINI)  # routing changes

    def step(x, weights, ids):
        return _experts().moe_experts_triton(x, w13, w2, weights, ids, "situ")

    assert_replay_matches_eager(step, (x, weights, ids), (torch.randn_like(x), fresh_weights, fresh_ids))


@pytest.mark.gpu
@requires_cuda
def test_layer_dispatch(monkeypatch):
    from kestrel.layers.moe import TRITON_EXPERTS_MAX_PAIRS, routed_experts_fn

    mod = _experts()
    h = torch.zeros(2, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(2, 6, device="cuda", dtype=torch.int64)
    big = torch.zeros(TRITON_EXPERTS_MAX_PAIRS // 6 + 1, 6, device="cuda", dtype=torch.int64)
    with torch.no_grad():
        assert routed_experts_fn(h, ids) is mod.moe_experts_triton
        assert routed_experts_fn(h, big) is moe_experts_grouped
        monkeypatch.setenv("KESTREL_MOE_DECODE_KERNEL", "off")
        assert routed_experts_fn(h, ids) is moe_experts_grouped
    monkeypatch.delenv("KESTREL_MOE_DECODE_KERNEL")
    assert routed_experts_fn(h, ids) is not mod.moe_experts_triton  # autograd records: never the Triton path


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("sort_first", ["0", "1"])
def test_shared_experts_on_a_side_stream(monkeypatch, sort_first):
    """KESTREL_MOE_OVERLAP_SHARED: the shared experts on a side stream give the same output as in line, bit for
    bit (the same kernels); replayed in a CUDA graph (a fork and a join inside the capture) it matches eager.
    KESTREL_MOE_SORT_FIRST: the routed pairs sorted before the fork, the same output again."""
    monkeypatch.setenv("KESTREL_MOE_SORT_FIRST", sort_first)
    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "0")  # (tiny's latent MoE would not fuse it anyway)
    from kestrel.layers.moe import MoE
    from kestrel.models.loader import build_model

    model = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=4)
    moe = next(m for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None)
    x = torch.randn(8, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        monkeypatch.setenv("KESTREL_MOE_OVERLAP_SHARED", "0")
        in_line = moe(x)
        monkeypatch.setenv("KESTREL_MOE_OVERLAP_SHARED", "1")
        assert torch.equal(moe(x), in_line)
        assert_replay_matches_eager(moe, (x,), (torch.randn_like(x),))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T", [1, 8, 256])
def test_shared_expert_fused_into_the_layer(monkeypatch, T):
    """KESTREL_MOE_FUSE_SHARED: a MoE layer whose shared MLP has the experts' width (tiny without its latent
    MoE) runs it inside the routed experts' launches; the output matches the layer's unfused one (the shared MLP
    through cuBLAS, on the side stream: other sums, same rounding points), and a CUDA-graph replay matches eager."""
    from kestrel.layers.moe import MoE, routed_experts_fn
    from kestrel.presets import preset_config

    config = preset_config("tiny").replace(routed_expert_hidden_size=None, latent_moe_use_norm=False)
    moe = MoE(config, layer_id=1, dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        _randomize(moe, g)
        x = torch.randn(T, config.hidden_size, generator=g, device="cuda").bfloat16()
        ids = torch.zeros(T, config.num_experts_per_token, dtype=torch.int64, device="cuda")
        assert moe._shared_in_experts(x, routed_experts_fn(x, ids)) is not None
        monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "0")
        unfused = moe(x)
        monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "1")
        fused = moe(x)
        rel = ((fused.float() - unfused.float()).norm() / unfused.float().norm()).item()
        assert rel < 1e-2, rel
        assert torch.equal(moe(x), fused), "not deterministic"
        r = torch.randn_like(x)
        into = r.clone()
        assert moe(x, add_to=into) is into and torch.equal(into, r + fused)  # the residual add in the combine
        assert_replay_matches_eager(moe, (x,), (torch.randn_like(x),))
