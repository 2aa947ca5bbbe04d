"""The training loop on the tiny preset (CPU): it learns, the indexer learns only from its KL, a checkpoint it
writes is what the engine serves, and an interrupted run resumes to the same weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kestrel.config import EngineConfig, TrainConfig
from kestrel.engine.engine import Engine
from kestrel.tokenizer import save_byte_tokenizer
from kestrel.train.checkpoint import STATE_FILE
from kestrel.train.loss_plot import plot_loss
from kestrel.train.objective import family_loss_sums, masked_loss
from kestrel.train.trainer import Trainer, lr_at, update_expert_biases
from kestrel.utils.errors import CheckpointError, ConfigError, TrainingDiverged


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytetok")
    save_byte_tokenizer(path)
    return str(path)


def _cfg(out, tok, **kw) -> TrainConfig:
    base = dict(
        out_dir=str(out),
        model="tiny",
        tokenizer=tok,
        steps=4,
        batch_rows=2,
        row_len=512,
        retrieval_lengths=(256,),
        warmup_steps=1,
        dsa_dense_steps=2,
        checkpoint_every=100,
        log_every=1,
        lr=3e-3,
        device="cpu",
        seed=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_steps_on_a_fixed_batch_lower_the_loss(tmp_path, byte_tok):
    trainer = Trainer(_cfg(tmp_path, byte_tok, dsa_dense_steps=0))
    batch = next(trainer.data)
    losses = [trainer.train_step(batch)[0] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.3, losses
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name


def test_a_step_with_the_loss_chunked_is_the_same(tmp_path, byte_tok, monkeypatch):
    """One training step with the LM head and loss chunked over tokens (forced, several chunks) and not: the same
    loss and the same gradients of every parameter as the optimizer gets them."""
    import kestrel.ops.loss as lm_loss

    results = []
    for above in (2**62, 0):
        monkeypatch.setattr(lm_loss, "CHUNK_ABOVE", above)
        monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 60_000)  # 234 of the step's 1024 tokens a chunk
        trainer = Trainer(_cfg(tmp_path / f"run{above}", byte_tok, dsa_dense_steps=0))
        grads = {}

        def capture(*a, step=trainer.opt.step, model=trainer.model, into=grads, **k):
            into.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return step(*a, **k)

        trainer.opt.step = capture
        results.append((trainer.train_step(next(trainer.data))[0], grads))
    (lm_plain, plain), (lm_chunked, chunked) = results
    assert abs(lm_plain - lm_chunked) < 1e-5
    assert plain.keys() == chunked.keys() and "lm_head.weight" in plain
    for name, g in plain.items():
        assert (chunked[name] - g).norm() <= 1e-4 * g.norm() + 1e-9, name


def _rows(batch) -> list:
    """A packed batch as batches of one row each (documents never cross rows)."""
    from dataclasses import replace

    R, bounds, out = batch.input_ids.shape[1], batch.cu_seqlens.tolist(), []
    for i in range(batch.input_ids.shape[0]):
        cuts = [b - i * R for b in bounds if i * R <= b <= (i + 1) * R]
        rows = {
            n: getattr(batch, n)[i : i + 1] for n in ("input_ids", "target_ids", "loss_mask", "loss_weight")
        }
        rows.update({n: getattr(batch, n)[i : i + 1] for n in ("valid_mask", "position_ids", "family_ids")})
        out.append(
            replace(
                batch,
                **rows,
                cu_seqlens=torch.tensor(cuts, dtype=batch.cu_seqlens.dtype),
                max_seqlen=max(b - a for a, b in zip(cuts, cuts[1:])),
                num_documents=len(cuts) - 1,
                num_loss_tokens=int(batch.loss_mask[i].sum()),
            )
        )
    return out


@pytest.mark.parametrize("dense", [True, False], ids=["dense-warmup", "sparse"])
def test_accumulated_batches_step_as_one_batch_of_their_rows(tmp_path, byte_tok, dense):
    """A step over two one-row batches (grad_accum) gets the gradients, the loss, the KL, the expert load and
    the family losses of a step over one batch of both rows: the loss is the weighted mean over all the step's
    loss tokens, not the mean of the batches' means (the rows hold different numbers of loss tokens)."""
    results = []
    for split in (False, True):
        trainer = Trainer(_cfg(tmp_path / f"run{split}", byte_tok, dsa_dense_steps=100 if dense else 0))
        batch = next(trainer.data)
        assert batch.loss_weight[0].sum() != batch.loss_weight[1].sum()  # a mean of means would differ
        grads = {}

        def capture(*a, step=trainer.opt.step, model=trainer.model, into=grads, **k):
            into.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return step(*a, **k)

        trainer.opt.step = capture
        figures = trainer.launch_step(_rows(batch) if split else batch).read()
        state = trainer.model.state_dict()
        bias = torch.cat([t.flatten() for n, t in state.items() if n.endswith("e_score_correction_bias")])
        results.append((figures, grads, bias))
    (whole, g_whole, b_whole), (split, g_split, b_split) = results
    assert whole[1] > 0 if dense else True  # the KL is in the loss during the warm-up
    torch.testing.assert_close(torch.tensor(split), torch.tensor(whole), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert g_whole.keys() == g_split.keys() and "lm_head.weight" in g_whole
    for name, g in g_whole.items():
        assert (g_split[name] - g).norm() <= 1e-4 * g.norm() + 1e-8, name
    assert b_whole.abs().sum() > 0 and torch.equal(b_split, b_whole)  # the loads of both rows at once


def test_the_loop_takes_grad_accum_batches_a_step(tmp_path, byte_tok):
    trainer = Trainer(_cfg(tmp_path, byte_tok, steps=2, grad_accum=2))
    trainer.train()
    assert [r["tokens"] for r in trainer.history] == [2 * 2 * 512, 4 * 2 * 512]
    twin = Trainer(_cfg(tmp_path / "twin", byte_tok))
    for _ in range(4):
        next(twin.data)
    assert torch.equal(next(trainer.data).input_ids, next(twin.data).input_ids)  # 4 batches used, no more
    with pytest.raises(ConfigError, match="grad_accum must be >= 1, got 0"):
        _cfg(tmp_path, byte_tok, grad_accum=0)
    with pytest.raises(ConfigError, match=r"lr must be > 0 and finite, got -0.1; .*row_len 512, got \[600\]"):
        _cfg(tmp_path, byte_tok, lr=-0.1, retrieval_lengths=(600,))
    with pytest.raises(ValueError, match="at least one batch"):
        trainer.launch_step([])


@pytest.mark.parametrize(
    "bad",
    [
        dict(lr=float("inf")),  # trained: the loss was NaN from the second step
        dict(time_budget_s=-5.0),  # trained one step and stopped
        dict(time_budget_s=0.0),  # read as no budget by the schedule, as a spent one by the loop
        dict(time_budget_s=float("nan")),  # silently no budget
    ],
)
def test_a_nonsense_lr_or_time_budget_is_refused(tmp_path, byte_tok, bad):
    with pytest.raises(ConfigError, match=f"{next(iter(bad))} must be > 0 and finite"):
        _cfg(tmp_path, byte_tok, **bad)


def test_one_step_gives_finite_nonzero_gradients(tmp_path, byte_tok):
    trainer = Trainer(_cfg(tmp_path, byte_tok))
    with torch.no_grad():  # AttnRes queries start at zero, which zeroes their norms' gradient
        for name, p in trainer.model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.1)
    trainer.opt.step = lambda *a, **k: None  # keep the gradients: inspect them instead of applying them
    trainer.opt.zero_grad = lambda *a, **k: None
    trainer.train_step(next(trainer.data))
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad or name.startswith("model.layers.0.self_attention_res_"):
            continue  # the router bias moves by the balancing rule; layer 0's attention mix has one source
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_checkpoint_serves_in_the_engine_with_the_same_logits(tmp_path, byte_tok):
    trainer = Trainer(_cfg(tmp_path, byte_tok))
    trainer.train()
    engine = Engine(EngineConfig(model=str(tmp_path / "checkpoint"), page_size=16))
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():  # the checkpoint stores bf16 but for a few tensors
            if not name.endswith(("A_log", "dt_bias", "gate.weight", "e_score_correction_bias")):
                p.copy_(p.to(torch.bfloat16).float())
        trainer.model.eval()
        want = trainer.model(ids)
        got = engine.model(ids)
    assert ((want - got).abs().max() / want.abs().max()).item() < 1e-5
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_continuing_a_checkpoint_keeps_its_tokenizer(tmp_path, byte_tok):
    """Without --tokenizer a checkpoint trains on with its own tokenizer (a new BPE would scramble the ids its
    weights know); a preset gets one trained into the run folder."""
    Trainer(_cfg(tmp_path / "first", byte_tok, steps=1)).train()
    ckpt = tmp_path / "first" / "checkpoint"
    more = Trainer(_cfg(tmp_path / "more", None, model=str(ckpt), steps=1))
    assert more.tokenizer_dir == ckpt and not (tmp_path / "more" / "tokenizer").exists()
    more.train()
    saved = (tmp_path / "more" / "checkpoint" / "tokenizer.json").read_text()
    assert saved == (ckpt / "tokenizer.json").read_text()


def test_resume_reaches_the_same_weights(tmp_path, byte_tok, capsys):
    straight = Trainer(_cfg(tmp_path / "a", byte_tok, steps=4))
    straight.train()
    first = Trainer(_cfg(tmp_path / "b", byte_tok, steps=2))
    first.train()
    resumed = Trainer(_cfg(tmp_path / "b", byte_tok, steps=4))
    assert resumed.step == 2
    err = capsys.readouterr().err
    assert "resuming" in err and "at step 2 of 4" in err and "changed since" not in err
    Trainer(_cfg(tmp_path / "b", byte_tok, steps=4, lr=1e-4))
    assert "changed since the saved run: lr " in capsys.readouterr().err
    resumed.train()
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert [r["loss"] for r in straight.history] == pytest.approx(
        [r["loss"] for r in resumed.history], abs=1e-5
    )


def test_a_resume_with_shorter_rows_packs_only_documents_that_fit(tmp_path, byte_tok, capsys):
    """A shorter --row-len on resume (allowed, as other knobs, with a line saying it changed): the restored data
    state's documents longer than the new rows were kept in the packer's buffer for good; they are skipped."""
    kw = dict(retrieval_weight=0.0, retrieval_lengths=(64,))
    Trainer(_cfg(tmp_path, byte_tok, steps=2, **kw)).train()
    resumed = Trainer(_cfg(tmp_path, byte_tok, steps=3, row_len=200, **kw))
    assert "changed since the saved run: row_len 512 -> 200" in capsys.readouterr().err
    assert resumed.data.num_skipped > 0 and all(len(d.ids) <= 200 for d in resumed.data._buffer)
    resumed.train()
    assert resumed.step == 3


def test_a_tokenizer_build_cut_short_is_built_again(tmp_path, monkeypatch):
    """A run stopped while it wrote its BPE left tokenizer.json alone, and the next run took it for the whole
    tokenizer (without its config: no pad token, "packing needs a tokenizer with a pad token")."""
    import kestrel.train.checkpoint as checkpoint_module

    build = checkpoint_module.build_tokenizer

    def cut_short(out_dir, **kwargs):
        build(out_dir, **kwargs)
        (Path(out_dir) / "tokenizer_config.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "build_tokenizer", cut_short)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_cfg(tmp_path, None))
    monkeypatch.setattr(checkpoint_module, "build_tokenizer", build)
    trainer = Trainer(_cfg(tmp_path, None))
    assert (
        tmp_path / "tokenizer" / "tokenizer_config.json"
    ).exists() and trainer.tokenizer.pad_token_id is not None


def test_resuming_with_another_tokenizer_is_refused(tmp_path, byte_tok):
    """Another tokenizer's ids mean other text to the weights: the run went on training with it, saying only that
    the option changed. The same tokenizer from another folder (or written another way) resumes."""
    import shutil

    Trainer(_cfg(tmp_path / "run", byte_tok, steps=2)).train()
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(byte_tok, same)
    (same / "tokenizer.json").write_text(
        json.dumps(json.loads((same / "tokenizer.json").read_text()), indent=4)
    )
    assert Trainer(_cfg(tmp_path / "run", str(same), steps=2)).step == 2
    shutil.copytree(byte_tok, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two bytes' ids swapped: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        CheckpointError, match=r"trained with the tokenizer in .*checkpoint, not the one in .*other"
    ):
        Trainer(_cfg(tmp_path / "run", str(other), steps=4))


def test_a_training_state_of_another_layout_is_one_clear_error(tmp_path, byte_tok):
    """A trainer_state.pt whose parameters do not fit the model (another model, or an older parameter layout)
    stops the resume with a CheckpointError that names the file, not a raw load_state_dict traceback."""
    Trainer(_cfg(tmp_path / "run", byte_tok, steps=1)).train()
    path = tmp_path / "run" / STATE_FILE
    state = torch.load(path, weights_only=False)
    state["model"] = {k.replace("in_proj", "qkv_proj"): v for k, v in state["model"].items()}
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="trainer_state.pt: this training state does not fit the model"):
        Trainer(_cfg(tmp_path / "run", byte_tok, steps=2))


def test_an_unreadable_training_state_is_one_clear_error(tmp_path, byte_tok):
    """A truncated trainer_state.pt (a run killed mid-save before saves went through a rename) or one of random
    bytes stops the resume with a CheckpointError naming the file; saving leaves no partial file behind."""
    Trainer(_cfg(tmp_path / "run", byte_tok, steps=1)).train()
    path = tmp_path / "run" / STATE_FILE
    assert not list((tmp_path / "run").glob("*.partial"))
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"\x80\x04not a torch file"):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="trainer_state.pt: the training state cannot be read"):
            Trainer(_cfg(tmp_path / "run", byte_tok, steps=2))


def test_time_budget_clock_survives_a_resume(tmp_path, byte_tok):
    """The budget's clock (which also drives the LR cosine) is saved: a resumed run keeps counting from where
    the first one stopped, and the first step of each run (compilation) is not counted."""
    first = Trainer(_cfg(tmp_path, byte_tok, steps=3, time_budget_s=1e6))
    summary = first.train()
    assert 0 < summary["seconds"] == pytest.approx(first.train_seconds) and summary["first_step_s"] > 0
    assert first.history[0]["seconds"] == 0.0  # the first step is outside the clock
    resumed = Trainer(_cfg(tmp_path, byte_tok, steps=5, time_budget_s=1e6))
    assert resumed.train_seconds == pytest.approx(first.train_seconds)
    resumed.train()
    seconds = [r["seconds"] for r in resumed.history]
    assert seconds == sorted(seconds) and seconds[3] == pytest.approx(first.train_seconds)
    assert resumed.train_seconds > first.train_seconds


def test_lr_follows_the_time_budget_when_it_ends_first(tmp_path, byte_tok):
    cfg = _cfg(tmp_path, byte_tok, steps=1000, warmup_steps=1, time_budget_s=100.0)
    assert lr_at(10, cfg, 0.0) > 0.99 * cfg.lr  # early by steps and by time
    assert lr_at(10, cfg, 50.0) == pytest.approx(cfg.lr * (0.1 + 0.9 * 0.5))  # half the budget: half-way
    assert lr_at(10, cfg, 100.0) == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # budget spent: the floor


def test_lr_schedule_and_bias_balancing(tmp_path, byte_tok):
    cfg = _cfg(tmp_path, byte_tok, steps=100, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(cfg.lr / 10) and lr_at(9, cfg) == pytest.approx(cfg.lr)
    assert lr_at(99, cfg) == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-2)
    trainer = Trainer(cfg)
    layer = next(i for i, t in enumerate(trainer.model.config.mlp_types) if t == "moe")
    ids = torch.zeros(40, 2, dtype=torch.long)  # every token on expert 0
    worst = update_expert_biases(trainer.model, {layer: ids}, rate=0.01)
    bias = trainer.model.model.layers[layer].mlp.gate.e_score_correction_bias
    assert bias[0] < 0 and (bias[1:] > 0).all()
    assert float(worst) == pytest.approx(bias.numel())  # max load / mean load: all of it on one of E experts


def test_retrieval_knobs_reach_the_data(tmp_path, byte_tok):
    """--retrieval-shared-prefix, --retrieval-shared-all and --retrieval-distractors go from the config to the
    retrieval family the batches are drawn from; a bad distractor range is a config error."""
    cfg = _cfg(
        tmp_path,
        byte_tok,
        retrieval_shared_prefix=0.5,
        retrieval_distractors=(2, 6),
        retrieval_shared_all=True,
    )
    trainer = Trainer(cfg)
    assert trainer.data.config.retrieval_shared_prefix == 0.5
    assert trainer.data.config.loss_weights == {"retrieval": 1.0}
    family = trainer.data._render.mixture.families["retrieval"]
    assert family.shared_prefix == 0.5 and family.settings["distractors"] == (2, 6) and family.shared_all
    with pytest.raises(ConfigError, match=r"retrieval_distractors.*got \(5, 2\)"):
        _cfg(tmp_path, byte_tok, retrieval_distractors=(5, 2))


def test_masked_loss_is_the_weighted_mean_of_the_token_losses(tmp_path, byte_tok):
    """A bool mask gives the plain mean over its positions; weights give the weighted mean (a token of weight 3
    counts as three); --retrieval-loss-weight reaches the data; zero or negative weights are config errors."""
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 7), torch.randint(0, 7, (5,))
    each = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    mask = torch.tensor([True, False, True, True, False])
    assert torch.allclose(masked_loss(logits, targets, mask), each[mask].mean())
    weight = torch.tensor([1.0, 0.0, 3.0, 1.0, 0.0])
    assert torch.allclose(masked_loss(logits, targets, weight), (each[0] + 3 * each[2] + each[3]) / 5)
    assert Trainer(_cfg(tmp_path, byte_tok, retrieval_loss_weight=4.0)).data.config.loss_weights == {
        "retrieval": 4.0
    }
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="retrieval_loss_weight"):
            _cfg(tmp_path, byte_tok, retrieval_loss_weight=bad)


def test_train_with_no_step_left_leaves_the_stream_where_it_was(tmp_path, byte_tok):
    """A finished run's train() trains nothing and moves no data: the batch thread it starts is wound back."""
    trainer = Trainer(_cfg(tmp_path, byte_tok, steps=2))
    trainer.train()
    before = trainer.data.state_dict()
    trainer.train()
    assert trainer.step == 2 and trainer.data.state_dict() == before


def test_the_loop_records_each_step_though_it_reads_them_a_step_late(tmp_path, byte_tok):
    """train() queues step n before it reads step n - 1's loss back: its history is still every step, in
    order, with the values that step-by-step training gives on the same batches (checkpoints between)."""
    cfg = _cfg(tmp_path / "loop", byte_tok, steps=5, checkpoint_every=2)
    looped = Trainer(cfg)
    looped.train()
    stepped = Trainer(_cfg(tmp_path / "steps", byte_tok, steps=5))
    expected = []
    for step in range(5):
        stepped.step = step
        expected.append(stepped.train_step(next(stepped.data), lr_at(step, cfg, 0.0)))
    assert [r["step"] for r in looped.history] == list(range(5))
    got = [r[key] for r in looped.history for key in ("loss", "indexer_kl", "max_expert_load")]
    assert got == pytest.approx([v for step in expected for v in step], rel=1e-5)
    assert all(r["seconds"] >= 0 for r in looped.history)
    # what the last checkpoint wrote is what the loop holds: every step read before it was saved
    assert json.loads((tmp_path / "loop" / "history.json").read_text()) == looped.history
    assert torch.load(tmp_path / "loop" / STATE_FILE, weights_only=False)["step"] == len(looped.history) == 5
    # a run its time budget stops saves every step it queued, the last one included
    budget = Trainer(_cfg(tmp_path / "budget", byte_tok, steps=50, time_budget_s=1e-6))
    budget.train()
    saved = json.loads((tmp_path / "budget" / "history.json").read_text())
    assert budget.step == len(budget.history) == len(saved) < 50 and saved == budget.history


def test_family_losses_are_each_familys_mean_on_the_mask():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([True, True, False, True, True, True])
    fams = torch.tensor([0, 0, 0, 2, -1, 2])
    sums, counts = family_loss_sums(losses, mask, fams, 3)
    got = sums / counts
    assert got[0] == 1.5 and got[1].isnan() and got[2] == 5.0  # family 1 had no token; -1 counts nowhere


def test_history_has_each_familys_loss_and_the_plot_shows_them(tmp_path, byte_tok):
    """The loop logs the LM loss of every family with loss tokens in a step's batch; their weighted mean over
    the batch's loss tokens is the step's loss (all weights 1 here); loss.png gets the per-family panel."""
    trainer = Trainer(_cfg(tmp_path, byte_tok, steps=3))
    trainer.train()
    names = set(trainer.data.family_names)
    for r in trainer.history:
        assert r["loss_by_family"] and set(r["loss_by_family"]) <= names
        assert min(r["loss_by_family"].values()) <= r["loss"] <= max(r["loss_by_family"].values())
    plot_loss(trainer.history, tmp_path / "loss.png")
    import matplotlib.image

    width = matplotlib.image.imread(tmp_path / "loss.png").shape[1]
    plot_loss(
        [{k: v for k, v in r.items() if k != "loss_by_family"} for r in trainer.history], tmp_path / "one.png"
    )
    assert width > 1.5 * matplotlib.image.imread(tmp_path / "one.png").shape[1]  # the family panel beside


def test_attention_pairs_by_document():
    """The attention accounting beside the MFU's convention (half the row a token): each packed document causal on
    its own, and at most top-k keys a query in sparse training; one pair's FLOPs are what `flops_per_token` counts
    per key of the row's half."""
    from kestrel.models.kimi import KimiForCausalLM
    from kestrel.presets import preset_config
    from kestrel.train.flops import attention_flops_per_pair, flops_per_token, visible_pairs_per_token

    assert visible_pairs_per_token([4]) == (1 + 2 + 3 + 4) / 4
    assert visible_pairs_per_token([4], topk=2) == (1 + 2 + 2 + 2) / 4
    assert visible_pairs_per_token([3, 1]) == (1 + 2 + 3 + 1) / 4
    assert visible_pairs_per_token([3, 1], topk=8) == visible_pairs_per_token([3, 1])
    model = KimiForCausalLM(preset_config("tiny"))
    per_pair = attention_flops_per_pair(model)
    assert per_pair > 0
    assert flops_per_token(model, 512) - flops_per_token(model, 256) == pytest.approx(
        per_pair * (512 - 256) / 2
    )


def test_a_diverged_run_stops_and_keeps_its_last_checkpoint(tmp_path, byte_tok):
    """A learning rate that blows the loss up to NaN: one clear error, and the good checkpoint is not overwritten."""
    Trainer(_cfg(tmp_path / "r", byte_tok, steps=2)).train()
    ckpt = tmp_path / "r" / "checkpoint"
    saved = {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}
    state = (tmp_path / "r" / STATE_FILE).read_bytes()
    blown = Trainer(_cfg(tmp_path / "r", byte_tok, steps=8, lr=1e10, warmup_steps=0))
    with pytest.raises(TrainingDiverged, match=r"NaN|nan|inf"):
        blown.train()
    assert {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())} == saved
    assert (tmp_path / "r" / STATE_FILE).read_bytes() == state
    with torch.no_grad():  # a save of weights gone NaN is refused as well, whatever the loss said
        next(blown.model.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="not saved"):
        blown.save()
    assert {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())} == saved


def test_a_run_diverged_before_its_first_save_says_it_has_no_checkpoint(tmp_path, byte_tok, capsys):
    """Said "its last checkpoint in .../checkpoint is kept" where there was none, and the next steps' NaN came
    on stdout as "0 queued steps could not be read back"."""
    blown = Trainer(_cfg(tmp_path / "b", byte_tok, steps=8, lr=1e10, warmup_steps=0))
    with pytest.raises(TrainingDiverged, match="the run stops here and it has saved no checkpoint") as info:
        blown.train()
    assert "is kept" not in str(info.value)
    out, err = capsys.readouterr()
    assert "could not be read back" not in out + err
    assert not math.isfinite(blown.history[-1]["loss"])  # the steps after the first NaN are recorded still


def test_a_save_cut_short_keeps_the_last_checkpoint_whole(tmp_path, byte_tok, monkeypatch):
    """A run killed (or out of disk) while it writes a checkpoint: the one before stays whole and loadable. The
    checkpoint was written in place, its old shards deleted first: a cut left a truncated or missing shard."""
    import kestrel.train.checkpoint as checkpoint_module
    from kestrel.models.loader import build_model

    run = tmp_path / "cut"
    Trainer(_cfg(run, byte_tok, steps=2)).train()
    ckpt = run / "checkpoint"
    saved = {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}
    write = checkpoint_module.save_checkpoint

    def cut_short(model, path, **kwargs):  # the weights half-written when the process dies
        write(model, path, **kwargs)
        weights = sorted(path.glob("*.safetensors"))[-1]
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", cut_short)
    with pytest.raises(OSError, match="No space"):
        Trainer(_cfg(run, byte_tok, steps=4)).train()
    assert {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())} == saved
    build_model(str(ckpt))
    monkeypatch.setattr(checkpoint_module, "save_checkpoint", write)
    trainer = Trainer(_cfg(run, byte_tok, steps=4))  # the next save replaces it, and leaves nothing beside it
    trainer.train()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    assert (ckpt / "tokenizer.json").exists()
    ckpt.rename(run / "checkpoint.old")  # killed between the swap's renames: the last one is put back
    assert Trainer(_cfg(run, byte_tok, steps=4)).step == 4 and (ckpt / "config.json").exists()


def test_an_interrupted_run_saves_its_steps_and_resumes_from_them(tmp_path, byte_tok, monkeypatch):
    """Ctrl-C (or SIGTERM through `kestrel train`) in the middle of a run: the steps done are saved."""
    trainer = Trainer(_cfg(tmp_path / "i", byte_tok, steps=4))
    launch, calls = trainer.launch_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return launch(*args, **kwargs)

    monkeypatch.setattr(trainer, "launch_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "i" / "checkpoint" / "config.json").exists()
    assert Trainer(_cfg(tmp_path / "i", byte_tok, steps=4)).step == 2


def test_a_one_step_run_has_no_rate_rather_than_zero(tmp_path, byte_tok):
    """The first step (compiling) is not timed: one step alone gives no tokens/s, not 0."""
    summary = Trainer(_cfg(tmp_path / "one", byte_tok, steps=1)).train()
    assert summary["tokens_per_s"] is None and summary["mfu_vs_989_tflops"] is None and summary["steps"] == 1
