"""The training layout (rows of equal length, documents packed inside rows) computes what the per-sequence
reference path computes, in dense and in sparse (DSA) mode; the indexer's KL loss trains only the indexer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import init_random_weights
from kestrel.presets import preset_config

DOCS = [[9, 30, 25], [40, 24], [64]]  # three rows of 64 tokens; documents never cross rows
R = 64


def _model(**changes):
    config = preset_config("tiny")
    if changes:
        config = config.replace(**changes)
    return init_random_weights(KimiForCausalLM(config), seed=4)


def _ids():
    return torch.randint(0, 256, (len(DOCS) * R,), generator=torch.Generator().manual_seed(0))


def _ctx(rows: bool, device: str = "cpu", **extras) -> ForwardContext:
    lens = [n for row in DOCS for n in row]
    ctx = ForwardContext.build(lens, device=device)
    if rows:
        ctx.row_len = R
    ctx.extras.update(extras)
    return ctx


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


def test_rows_equal_per_sequence_sparse_and_dense():
    model, ids = _model(), _ids()
    with torch.no_grad():
        with forward_context(_ctx(rows=False)):
            ref = model(ids)
        with forward_context(_ctx(rows=True)):
            sparse = model(ids)
        wide = _model(index_topk=4096)
        with forward_context(_ctx(rows=True, dsa_dense=True)):
            dense = model(ids)
        with forward_context(_ctx(rows=False)):
            wide_ref = wide(ids)
    assert _rel(ref, sparse) < 1e-5  # top-8 selection inside each document, same as the reference
    assert _rel(wide_ref, dense) < 1e-5  # dense warm-up = all visible tokens of the document
    assert _rel(sparse, dense) > 1e-3  # and the selection matters at these lengths


def test_indexer_kl_trains_only_the_indexer():
    model, ids = _model(), _ids()
    kl: list = []
    with forward_context(_ctx(rows=True, dsa_dense=True, indexer_kl=kl)):
        model(ids)
    assert len(kl) == len(model.config.mla_layer_ids) and all(k.item() >= 0 for k in kl)
    sum(kl).backward()
    for name, p in model.named_parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad == (".indexer." in name), name


def test_indexer_kl_goes_down_when_the_indexer_learns():
    model, ids = _model(), _ids()
    with torch.no_grad():  # sharpen the random attention so that there is something to learn
        for name, p in model.named_parameters():
            if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
                p.mul_(12)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if ".indexer." in n], lr=1e-2)
    losses = []
    for _ in range(25):
        kl: list = []
        with forward_context(_ctx(rows=True, dsa_dense=True, indexer_kl=kl)):
            model(ids)
        loss = sum(kl)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("autocast", [False, True])
def test_kl_scores_in_one_matmul_match_the_per_head_loop(autocast):
    """The indexer KL's scores of its sampled queries (every head in one batched matmul) against the per-head
    reference, values and gradients; under bf16 autocast (training's) each head's logits are rounded alike."""
    model = _model()
    layer = model.model.layers[model.config.mla_layer_ids[0]].self_attn
    g = torch.Generator().manual_seed(3)
    leaves = [
        torch.randn(2, R, 4, 16, generator=g),
        torch.randn(2, R, 4, generator=g),
        torch.randn(2, R, 16, generator=g),
    ]
    picks = torch.tensor([63, 40, 17, 3, 0])
    grads, outs = [], []
    for fn in (layer.indexer.picked_scores, lambda q, w, k, p: layer.indexer.row_scores(q, w, k, picks=p)):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*xs, picks)
        assert out.shape == (2, 5, R) and out.dtype == torch.float32
        (out * torch.linspace(-1, 1, R)).sum().backward()
        outs.append(out)
        grads.append([x.grad for x in xs])
    # each head's logits are rounded alike (one bf16 matmul a head, or one for all): the scores agree closely;
    # under autocast the keys' gradient is one bf16 matmul over all heads (the loop summed the heads' in fp32):
    # ~3e-3 of its largest value apart
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if not autocast else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)


def test_sparse_rows_select_through_the_triton_kernels(monkeypatch):
    """KESTREL_ATTN_BACKEND=triton (on CUDA, auto): sparse training scores the rows with the prefill indexer kernel
    and selects with the Triton top-k (here in Triton's interpreter); same scores on the visible positions and
    the same output as the reference scoring and top-k."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted on the CPU
    # one MLA layer, not tiny's two: the interpreted top-k is nearly all of this test's time (~45 s with two on CI)
    model = _model(layer_types=("kda", "kda", "mla", "kda", "kda", "kda")).to(dev)
    ids = _ids().to(dev)
    assert len(model.config.mla_layer_ids) == 1
    layer = model.model.layers[model.config.mla_layer_ids[0]].self_attn
    g = torch.Generator().manual_seed(1)
    q_i, w_i, k_i = (
        torch.randn(R, 4, 16, generator=g).to(dev),
        torch.randn(R, 4, generator=g).to(dev),
        torch.randn(R, 16, generator=g).to(dev),
    )
    picks = torch.tensor([3, 17, 40, 63], device=dev)
    fast = layer.indexer.row_scores_triton(q_i, w_i, k_i, picks)  # [4, R]
    ref = layer.indexer.row_scores(q_i[None], w_i[None], k_i[None], picks)[0]
    causal = torch.arange(R, device=dev)[None, :] <= picks[:, None]
    assert torch.allclose(fast[causal], ref[causal], rtol=1e-5, atol=1e-5)
    assert fast[~causal].isnan().all()  # past each query: invalid, as the top-k reads it
    with torch.no_grad():
        monkeypatch.setenv("KESTREL_ATTN_BACKEND", "torch")
        with forward_context(_ctx(rows=True, device=dev)):
            expected = model(ids)
        monkeypatch.setenv("KESTREL_ATTN_BACKEND", "triton")
        with forward_context(_ctx(rows=True, device=dev)):
            got = model(ids)
    assert _rel(expected, got) < 1e-5


def test_host_positions_are_the_positions_without_a_device_read():
    """ForwardContext.host_positions(): the positions computed on the CPU from the host layout, the copy the
    sparse row selection decides with; recomputed for a replaced layout; refused for decode contexts."""
    import dataclasses

    ctx = _ctx(rows=True)
    assert ctx.host_positions().device.type == "cpu" and torch.equal(ctx.host_positions(), ctx.positions)
    direct = ForwardContext(torch.tensor([4, 5, 6, 0, 1]), torch.tensor([0, 3, 5]), [3, 2], [4, 0])
    assert torch.equal(direct.host_positions(), direct.positions)
    moved = dataclasses.replace(direct, new_lens=[2, 2], prefix_lens=[1, 7])
    assert moved.host_positions().tolist() == [1, 2, 7, 8]
    with pytest.raises(RuntimeError, match="decode"):
        dataclasses.replace(direct, decode=True).host_positions()


def test_host_offsets_are_cu_seqlens_without_a_device_read():
    """ForwardContext.host_cu_seqlens(): cu_seqlens on the CPU, what fla's varlen kernels index their chunks
    with; recomputed for a replaced layout; refused for decode contexts."""
    import dataclasses

    ctx = _ctx(rows=True)
    lens = [n for row in DOCS for n in row]
    assert ctx.host_cu_seqlens().device.type == "cpu"
    assert ctx.host_cu_seqlens().tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    direct = ForwardContext(torch.tensor([4, 5, 6, 0, 1]), torch.tensor([0, 3, 5]), [3, 2], [4, 0])
    assert direct.host_cu_seqlens().tolist() == [0, 3, 5]
    moved = dataclasses.replace(direct, cu_seqlens=torch.tensor([0, 1, 5]), new_lens=[1, 4])
    assert moved.host_cu_seqlens().tolist() == moved.cu_seqlens.tolist()
    with pytest.raises(RuntimeError, match="decode"):
        dataclasses.replace(direct, decode=True).host_cu_seqlens()


def test_document_causal_mask_keeps_each_token_to_its_own_document():
    """The rows' mask, built from the device's offsets: key s is visible to query t exactly when both are in
    the same document and s <= t (checked against the document ids spelled out by hand)."""
    from kestrel.layers.mla import _build_document_causal

    B = len(DOCS)
    doc = torch.tensor([d for d, n in enumerate(n for row in DOCS for n in row) for _ in range(n)]).view(B, R)
    expected = (doc[:, :, None] == doc[:, None, :]) & torch.ones(R, R, dtype=torch.bool).tril()
    assert torch.equal(_build_document_causal(_ctx(rows=True), B, R), expected)
    whole = ForwardContext.build([R])  # one document fills the row: no boundary to search
    assert torch.equal(_build_document_causal(whole, 1, R), torch.ones(1, R, R, dtype=torch.bool).tril())


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch.cuda's sync debug mode is the check"
)
@pytest.mark.parametrize("accum", [1, 2], ids=["one-batch", "two-batches-a-step"])
def test_training_step_queues_without_a_host_sync(tmp_path, accum):
    """A whole training step on the GPU (the context, the forward with fla's varlen KDA and conv, the sparse
    DSA selection, the backward, AdamW, the expert-bias update, the figures' copy) is queued without waiting for
    the work queued before it, once the kernels are compiled: the host can launch the next step while this one
    runs (Trainer.train). Torch reports every sync; the only ones allowed are the blocking copies of fla's chunk
    index, which `_warm_chunk_index` runs on a side stream with nothing else queued. Also for a step of two
    batches (--grad-accum 2: their loss weight summed, their routing and family figures gathered)."""
    import traceback
    import warnings

    from kestrel.config import TrainConfig
    from kestrel.presets import shipped_model_dir
    from kestrel.train.data import PackedBatches
    from kestrel.train.trainer import Trainer, mixture_config

    # the demo's shapes: fla's kernels are autotuned for them by the committed archive
    # (scripts/triton-autotune-h200.tgz), where the tiny preset's would take minutes on a fresh machine
    cfg = TrainConfig(
        out_dir=str(tmp_path / "run"),
        model="demo",
        tokenizer=str(shipped_model_dir()),
        steps=10,
        batch_rows=2,
        row_len=2048,
        retrieval_lengths=(1024,),
        dsa_dense_steps=0,
        device="cuda",
    )
    trainer = Trainer(cfg)
    # the batches from the retrieval family alone, the project's own generator: the arithmetic families draw
    # from reasoning_gym, whose wheels (.whl-train) do not fit a device call's carry beside .whl and the tree
    trainer.data = PackedBatches(
        trainer.tokenizer,
        cfg.batch_rows,
        cfg.row_len,
        replace(mixture_config(cfg), weights={"retrieval": 1.0}),
        seed=cfg.seed,
    )
    # pinned, as the loop's batches are; with accum 1 a batch alone, as launch_step took it before --grad-accum
    steps = [[next(trainer.data).pin_memory() for _ in range(accum)] for _ in range(3)]
    steps = [step[0] if accum == 1 else step for step in steps]
    trainer.train_step(steps[0])  # compiles and autotunes (which syncs)
    trainer.train_step(steps[1])
    torch.cuda.synchronize()
    syncs = []

    def show(message, *args, **kwargs):
        if "synchronizing CUDA operation" not in str(message):
            return  # e.g. torch's own note that the debug mode is a prototype
        stack = "".join(traceback.format_stack())
        if "_warm_chunk_index" not in stack:
            syncs.append(f"{str(message).splitlines()[0]}\n{stack}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            figures = trainer.launch_step(steps[2])
            caught = len(syncs)
            torch.ones(1, device="cuda").item()  # a control: a sync the filter above must catch
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(syncs) == caught + 1, "the control sync was not reported: has torch's warning text changed?"
    assert caught == 0, syncs[0]
    values = figures.read()
    assert len(values) == 3 + len(trainer.data.family_names) and all(math.isfinite(v) for v in values[:3])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch.cuda's sync debug mode is the check"
)
def test_sparse_row_selection_makes_no_host_sync(monkeypatch):
    """Sparse training's per-row selection (indexer scores, Triton top-k, the mask) queues its work without a
    device-to-host sync: the rows to score come from the host's positions, the index check runs on the device."""
    from kestrel.layers.mla import _document_causal

    monkeypatch.setenv("KESTREL_ATTN_BACKEND", "triton")
    model = _model().cuda()
    layer = model.model.layers[model.config.mla_layer_ids[0]].self_attn
    ctx, B = _ctx(rows=True, device="cuda"), len(DOCS)
    g = torch.Generator().manual_seed(2)
    q_i = torch.randn(B, R, 4, 16, generator=g).cuda()
    w_i, k_i = torch.randn(B, R, 4, generator=g).cuda(), torch.randn(B, R, 16, generator=g).cuda()
    visible = _document_causal(ctx, B, R)
    warm = visible.clone()
    layer._select_rows(ctx, q_i, w_i, k_i, warm)  # compiles the kernels
    torch.cuda.synchronize()
    allowed = visible.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer._select_rows(ctx, q_i, w_i, k_i, allowed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(allowed, warm) and bool((allowed <= visible).all())
    assert int(allowed.sum(-1).max()) == layer.indexer.topk  # deep queries keep exactly top-k
