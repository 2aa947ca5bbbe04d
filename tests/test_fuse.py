"""KESTREL_COMPILE_TRAIN: the fused (torch.compile) ops give the eager ops' values and gradients, only while
autograd records."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import init_random_weights
from kestrel.ops.norm import rms_norm
from kestrel.presets import preset_config


def _loss_and_grads(model, ids):
    ctx = ForwardContext.build([20, 12], device=ids.device)
    ctx.row_len = 32
    model.zero_grad(set_to_none=True)
    with forward_context(ctx):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_compiled_training_step_equals_eager(device, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "off")  # the reference pass is eager (auto compiles on CUDA)
    monkeypatch.setenv("KESTREL_KDA_BACKEND", "naive")  # under test: the fused elementwise ops, nothing else
    model = init_random_weights(KimiForCausalLM(preset_config("tiny")), seed=2).to(device)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(0)).to(device)
    loss, grads = _loss_and_grads(model, ids)
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: an earlier test's graphs must not count as this one's
    compiled_loss, compiled_grads = _loss_and_grads(model, ids)
    assert counters["stats"]["unique_graphs"] > 0  # the compiled path really ran
    if device == "cpu":
        assert torch.allclose(compiled_loss, loss, rtol=1e-5)
        for name, g in grads.items():
            assert torch.allclose(compiled_grads[name], g, rtol=1e-4, atol=1e-6), name
        return
    # CUDA: the fused kernels reduce in another order than eager's, so fp32 rounding differs element by
    # element; each gradient as a whole agrees to fp32 accumulation error
    assert torch.allclose(compiled_loss, loss, rtol=1e-4)
    for name, g in grads.items():
        err = (compiled_grads[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= 1e-4, (name, err.item())


def _nodes_between(out: torch.Tensor, source: torch.Tensor) -> list[str]:
    """The names of the autograd nodes on the paths from out back to source (source's own node excluded)."""
    seen, names, stack = {source.grad_fn}, [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_compiled_glu_writes_its_gradient_in_one_piece(act, monkeypatch):
    """glu_act while autograd records, compiled: the eager values and gradients, and no split of gate_up in the
    autograd graph (whose backward would concatenate the halves' gradients: a cat a MoE layer)."""
    from kestrel.ops.activation import glu_act

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 10, generator=g, requires_grad=True)
    x, probe = torch.randn(12, 10, generator=g), torch.randn(12, 8, generator=g)

    def run():
        weight.grad = None
        gate_up = (x @ weight.t()).bfloat16()  # [12, 2I], a projection's output
        out = glu_act(gate_up, act)
        nodes = _nodes_between(out, gate_up)
        (out.float() * probe).sum().backward()
        return out, weight.grad, nodes

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "off")
    want, want_grad, eager_nodes = run()
    assert any("Split" in n for n in eager_nodes), eager_nodes  # the contrast: chunk's backward concatenates
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    got, got_grad, nodes = run()
    assert not any("Split" in n for n in nodes), nodes
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-2, atol=1e-2)


def test_inference_keeps_the_eager_op(monkeypatch):
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    x, w = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6))


def test_inference_takes_the_arguments_by_keyword():
    """Without autograd the op picks its path from its first argument, which may come by keyword."""
    x, w = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x=x, weight=w, eps=1e-6), rms_norm.eager(x, w, 1e-6))
        assert torch.equal(rms_norm(weight=w, eps=1e-6, x=x), rms_norm.eager(x, w, 1e-6))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_auto_compiles_on_cuda_only(device, monkeypatch):
    """KESTREL_COMPILE_TRAIN=auto (the default, also when set empty) compiles a recording op on CUDA and leaves
    the CPU eager; a call over frozen inputs in grad mode records nothing and is not compiled; bad values are
    refused by name."""
    from torch._dynamo.utils import counters

    from kestrel.env import env_field

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "")
    assert env_field("compile_train") == "auto"
    monkeypatch.delenv("KESTREL_COMPILE_TRAIN", raising=False)
    assert env_field("compile_train") == "auto"
    torch._dynamo.reset()
    counters.clear()
    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    rms_norm(x, w, 1e-6)  # grad mode, nothing requires grad: not recorded
    assert counters["stats"]["unique_graphs"] == 0
    x.requires_grad_(True)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None
    assert (counters["stats"]["unique_graphs"] > 0) == (device == "cuda")
    for given, parsed in (("1", "on"), ("ON", "on"), ("0", "off"), ("false", "off")):
        monkeypatch.setenv("KESTREL_COMPILE_TRAIN", given)
        assert env_field("compile_train") == parsed
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "sometimes")
    with pytest.raises(ValueError, match="KESTREL_COMPILE_TRAIN"):
        env_field("compile_train")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_layer_norm_trains_through_its_fused_form(device):
    """LayerNorm (the DSA indexer's key norm) is a `fused` op: recorded by autograd it runs compiled on CUDA (the
    reference elsewhere), with the reference's values and gradients; under no_grad on CUDA, its Triton kernel."""
    from kestrel.ops.norm import layer_norm

    g = torch.Generator().manual_seed(3)
    x0, w0, b0 = (torch.randn(n, generator=g) for n in ((6, 128), (128,), (128,)))
    x0 = 3 * x0 + 1
    leaves = [t.to(device).requires_grad_(True) for t in (x0, w0, b0)]
    twins = [t.detach().clone().requires_grad_(True) for t in leaves]
    y = layer_norm(*leaves, 1e-6)
    ref = layer_norm.eager(*twins, 1e-6)
    (y * y.detach()).sum().backward()
    (ref * ref.detach()).sum().backward()
    torch.testing.assert_close(y, ref)
    for got, want in zip(leaves, twins):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(layer_norm(*twins, 1e-6), ref, rtol=1e-5, atol=1e-5)


def _saved_by_backward(fn, *args):
    """fn(*args) under autograd, with every tensor its graph keeps for the backward recorded: (output,
    [(shape, dtype)])."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def _bank_chain(mix_norm_bank, x0, weights, mixers, block):
    """AttnRes's schedule over a bank (kestrel.models.kimi's training forward) with tanh(h @ W) for sublayers:
    the output mix and every sublayer's input."""
    from kestrel.ops.attnres import Bank

    bank, partial = Bank(x0, -(-len(weights) // block)), x0  # one entry a block, no spare
    for i, (w, (attn_mix, mlp_mix)) in enumerate(zip(weights, mixers)):
        closes = i % block == 0
        if closes:
            bank.close(partial)
        a = torch.tanh(mix_norm_bank(bank, None if closes else partial, *attn_mix) @ w)
        partial = a if closes else partial + a
        partial = partial + torch.tanh(mix_norm_bank(bank, partial, *mlp_mix) @ w.t())
    return mix_norm_bank(bank, partial, *mixers[-1][0])


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_attnres_bank_trains_like_autograd_through_the_stacked_sources(device, frozen, monkeypatch):
    """Training's AttnRes bank (entries in one buffer, the mix's backward written out, compiled here, adding the
    entries' gradients into one buffer, each handed to autograd by its first consumer) gives the values and
    gradients of autograd through the stacked sources, over a chain of blocks (5 layers in blocks of 2), also
    where some inputs need no gradient (frozen: x0, like an embedding, and the source norms' weights). A mix keeps
    no [S, T, D] stack for its backward (the stacked form, for contrast, does)."""
    from torch._dynamo.utils import counters

    from kestrel.layers.attnres import ResProj, mix_norm, mix_norm_bank
    from kestrel.layers.norm import RMSNorm

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(5)
    L, T, D = 5, 24, 32

    def mixer():
        proj, norm, out_norm = ResProj(D).to(device), RMSNorm(D, 1e-5).to(device), RMSNorm(D, 1e-5).to(device)
        for p in (proj.weight, norm.weight, out_norm.weight):
            p.data.copy_(torch.randn(p.shape, generator=g))
        norm.weight.requires_grad_(not frozen)
        return proj, norm, out_norm

    mixers = [(mixer(), mixer()) for _ in range(L)] + [(mixer(), None)]
    weights = [(torch.randn(D, D, generator=g) / D**0.5).to(device).requires_grad_(True) for _ in range(L)]
    x0 = torch.randn(T, D, generator=g).to(device).requires_grad_(not frozen)

    def stacked(
        bank, partial, proj, norm, out_norm
    ):  # the reference: the layer's mix over the stacked sources
        return mix_norm([*bank.sources, *([] if partial is None else [partial])], proj, norm, out_norm)

    modules = [m for pair in mixers for mix in pair if mix for m in mix]
    leaves = [x0, *weights, *(p for m in modules for p in m.parameters())]
    out = _bank_chain(mix_norm_bank, x0, weights, mixers, 2)
    counters.clear()
    (out * out.detach()).sum().backward()
    assert counters["stats"]["unique_graphs"] > 0  # the mixes' backward ran compiled
    got = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    ref = _bank_chain(stacked, x0, weights, mixers, 2)
    # fp32, but the compiled mix sums in its own order: on an H100 (session 70) one element of 768 came 1.1e-5
    # (3.8e-5 relative) from the stacked form's, past assert_close's fp32 default of 1e-5 + 1.3e-6 relative
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    (ref * ref.detach()).sum().backward()
    for t, grad in zip(leaves, got):
        if not t.requires_grad:
            assert grad is None and t.grad is None
            continue
        torch.testing.assert_close(grad, t.grad, rtol=1e-3, atol=1e-4)
    # what one mix keeps for its backward: nothing of the entries' size times S
    from kestrel.ops.attnres import Bank

    bank = Bank(x0.detach(), 4)
    sources = [torch.randn(T, D, generator=g).to(device).requires_grad_(True) for _ in range(4)]
    for s in sources[:3]:
        bank.close(s)
    _, saved = _saved_by_backward(mix_norm_bank, bank, sources[3], *mixers[0][0])
    assert saved and max(torch.Size(s).numel() for s, _ in saved) == T * D, saved
    _, saved_stacked = _saved_by_backward(mix_norm, sources, *mixers[0][0])
    assert max(torch.Size(s).numel() for s, _ in saved_stacked) == 4 * T * D  # what the bank avoids


def test_attnres_bank_is_freed_with_its_graph_without_the_cycle_collector():
    """Nothing of a training forward's bank outlives its backward through a reference cycle (a graph tensor kept
    on a Function's context makes one: the step's activations then wait for Python's cycle collector, which on
    mini held 10-20 GB more at the peak)."""
    import gc

    from kestrel.layers.attnres import ResProj, mix_norm_bank
    from kestrel.layers.norm import RMSNorm

    D = 16
    proj, norm, out_norm = ResProj(D), RMSNorm(D, 1e-5), RMSNorm(D, 1e-5)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        out, alive = _bank_chain_refs(
            mix_norm_bank, torch.randn(8, D, requires_grad=True), (proj, norm, out_norm)
        )
        out.sum().backward()
        del out
        assert [name for name, ref in alive.items() if ref() is not None] == []
    finally:
        if was_enabled:
            gc.enable()


def test_attnres_bank_refuses_a_second_backward():
    """The entries' gradients add up in one buffer over a backward: a second backward through the same graph
    (retain_graph) would add onto the first's, so it is refused."""
    from kestrel.layers.attnres import ResProj, mix_norm_bank
    from kestrel.layers.norm import RMSNorm

    D = 16
    x0 = torch.randn(8, D, requires_grad=True)
    out, _ = _bank_chain_refs(mix_norm_bank, x0, (ResProj(D), RMSNorm(D, 1e-5), RMSNorm(D, 1e-5)))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.sum().backward()


def _bank_chain_refs(mix_norm_bank, x0, mixer):
    """Two blocks over a bank, and weak references to the bank, its rows and an entry."""
    import weakref

    from kestrel.ops.attnres import Bank

    bank = Bank(x0, 3)
    bank.close(x0)
    a = torch.tanh(2 * x0)
    partial = a + mix_norm_bank(bank, a, *mixer)
    bank.close(partial)
    out = mix_norm_bank(bank, 3 * a, *mixer)
    return out, {"bank": weakref.ref(bank), "rows": weakref.ref(bank.rows), "entry": weakref.ref(partial)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_compiled_moe_combine_keeps_no_rows_of_the_experts_width(device, monkeypatch):
    """Training's memory: the MoE's down-projection and combine, compiled, keep the experts' bf16 rows h [M, I] for
    their backward, not their output y [M, Din] in any dtype (the plain-autograd reference, for contrast, keeps an
    fp32 copy of y's rows gathered to [T, A, Din]), and give the reference's values and gradients."""
    from torch._dynamo.utils import counters

    from kestrel.ops.moe.grouped import combine_down

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(6)
    T, A, E, D, I = 8, 3, 5, 32, 8
    ids = torch.randint(-1, E, (T, A), generator=g).to(device)  # -1: another rank's expert (adds nothing)
    weights = torch.rand(T, A, generator=g).to(device).requires_grad_(True)
    order = torch.argsort(ids.flatten(), stable=True)
    inv = torch.argsort(order)
    offs = torch.searchsorted(ids.flatten()[order], torch.arange(E, device=device), right=True).to(
        torch.int32
    )
    h = torch.randn(T * A, I, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(device).requires_grad_(True)
    args = (offs, order, inv)
    in_range = (ids >= 0) & (ids < E)
    out, saved = _saved_by_backward(combine_down, h, w2, *args, weights, in_range, False)
    assert counters["stats"]["unique_graphs"] > 0  # the forward ran compiled
    assert ((T * A, I), torch.bfloat16) in saved, saved
    assert not [s for s, _ in saved if s[:1] == (T * A,) and torch.Size(s).numel() >= T * A * D], saved
    _, saved_eager = _saved_by_backward(combine_down.eager, h, w2, *args, weights, in_range, False)
    assert any(dt == torch.float32 and torch.Size(s).numel() == T * A * D for s, dt in saved_eager)
    refs = [t.detach().clone().requires_grad_(True) for t in (h, w2, weights)]
    ref = combine_down.eager(refs[0], refs[1], *args, refs[2], in_range, False)
    torch.testing.assert_close(out, ref)
    counters.clear()
    out.square().sum().backward()
    assert counters["stats"]["unique_graphs"] > 0  # the backward's gathers and products ran compiled
    ref.square().sum().backward()
    for got, want in zip((h, w2, weights), refs):  # bf16 products rounded in other places: by norm
        assert float((got.grad - want.grad).float().norm()) <= 1e-2 * float(want.grad.float().norm())


def test_training_bank_is_in_the_autocast_dtype(monkeypatch):
    """Under autocast (training on the GPU), the AttnRes bank of the training forward, the embedding's x0 included,
    is in the autocast dtype, as at inference with bf16 weights; without autocast, fp32."""
    from kestrel.ops.attnres import Bank

    model = init_random_weights(KimiForCausalLM(preset_config("tiny")), seed=2)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(0))
    seen = []
    real = Bank.close

    def spy(bank, partial):
        seen.append((bank.rows.buf.dtype, partial.dtype))
        return real(bank, partial)

    monkeypatch.setattr(Bank, "close", spy)
    for autocast, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids)
        assert seen and all(kinds == (dtype, dtype) for kinds in seen), (autocast, seen)
