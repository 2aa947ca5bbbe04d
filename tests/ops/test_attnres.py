"""AttnRes source mixing against fla's naive reference and the model-spec formula."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.attnres import attnres_mix


def _inputs(S=5, T=7, D=48, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(S, 1, 1, generator=g) * 3 + 0.1  # sources of very different magnitude
    sources = (torch.randn(S, T, D, generator=g) * scales).to(dtype)
    query = torch.randn(D, generator=g)
    norm_weight = 1 + 0.5 * torch.randn(D, generator=g)
    return sources, query, norm_weight


def _hand(sources, query, norm_weight, eps):
    r = sources.double()
    e = torch.einsum(
        "std,d->st", r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + eps), (norm_weight * query).double()
    )
    p = torch.softmax(e, dim=0)
    return torch.einsum("st,std->td", p, r)


@pytest.mark.parametrize("S", [1, 2, 9])
def test_attnres_matches_hand_formula(S):
    sources, query, norm_weight = _inputs(S=S)
    out = attnres_mix(sources, query, norm_weight, 1e-5)
    assert out.shape == sources.shape[1:] and out.dtype == sources.dtype
    torch.testing.assert_close(out.double(), _hand(sources, query, norm_weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_attnres_matches_fla_naive():
    fla_attnres = pytest.importorskip("fla.ops.attnres.naive")
    sources, query, norm_weight = _inputs(S=6, T=11, D=64, seed=1)
    ref = fla_attnres.naive_attnres(query, list(sources), norm_weight, rms_eps=1e-6)
    out = attnres_mix(sources, query, norm_weight, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the [1, D] proj weight as stored in checkpoints flattens to the same query
    out2 = attnres_mix(sources, query[None, :], norm_weight, 1e-6)
    torch.testing.assert_close(out2, ref, rtol=1e-5, atol=1e-5)


def test_attnres_bf16_computes_in_fp32():
    sources, query, norm_weight = _inputs(seed=2, dtype=torch.bfloat16)
    out = attnres_mix(sources, query, norm_weight, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _hand(sources, query, norm_weight, 1e-5), rtol=1e-2, atol=1e-2)


def test_attnres_single_source_is_identity():
    sources, query, norm_weight = _inputs(S=1, seed=3, dtype=torch.bfloat16)
    assert torch.equal(attnres_mix(sources, query, norm_weight, 1e-5), sources[0])


def test_attnres_zero_query_is_uniform_mean():
    sources, _, norm_weight = _inputs(S=4, seed=4)
    out = attnres_mix(sources, torch.zeros(sources.shape[-1]), norm_weight, 1e-5)
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("S", [1, 3])
def test_mix_norm_is_the_norm_of_the_mix(S):
    """The layer-level `mix_norm` (one op on the fast path) is out_norm(mix(...)), the single source included
    (softmax over one source is 1: the norm of that source)."""
    from kestrel.layers.attnres import ResProj, mix, mix_norm
    from kestrel.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(S)
    sources = [torch.randn(4, 32, generator=g) for _ in range(S)]
    proj, norm, out_norm = ResProj(32), RMSNorm(32, 1e-6), RMSNorm(32, 1e-5)
    with torch.no_grad():
        proj.weight.normal_(generator=g)
        norm.weight.uniform_(0.5, 1.5, generator=g)
        out_norm.weight.uniform_(0.5, 1.5, generator=g)
        assert torch.equal(mix_norm(sources, proj, norm, out_norm), out_norm(mix(sources, proj, norm)))
