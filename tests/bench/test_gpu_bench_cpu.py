"""The GPU benchmarks' CPU-side parts: the byte model of a decode step, and clear errors without CUDA."""

from __future__ import annotations

import pytest
import torch

from kestrel.bench.decode import step_bytes
from kestrel.models.loader import build_model
from kestrel.serve.cli import main
from kestrel.utils.errors import ConfigError


def test_decode_step_bytes_model():
    model = build_model("tiny", seed=0)
    c = model.config
    one = step_bytes(model, batch=1, context=4096)
    many = step_bytes(model, batch=64, context=4096)
    dense = step_bytes(model, batch=1, context=4096, dense=True)
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
    # DSA reads index_topk latent rows but scores every position's indexer key; dense reads every row
    assert one["mla_kv"] == len(c.mla_layer_ids) * c.index_topk * c.kv_cache_dim * 4
    assert one["indexer_keys"] == len(c.mla_layer_ids) * 4096 * c.index_head_dim * 4
    assert dense["mla_kv"] == len(c.mla_layer_ids) * 4096 * c.kv_cache_dim * 4 and dense["indexer_keys"] == 0
    assert many["kda_state"] == 64 * one["kda_state"] and many["experts"] > one["experts"]
    assert many["experts"] <= sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n) + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
@pytest.mark.parametrize("bench", ["decode", "kernels"])
def test_gpu_benchmarks_need_cuda(bench, capsys):
    assert main(["bench", bench]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]


def test_decode_profile_categories():
    """--profile files each kernel under a category by its name: ours, fla-core's and cuBLAS's."""
    from kestrel.bench.decode import _category

    assert _category("_gate_up_kernel") == "moe"  # not KDA's gate
    assert _category("_sigmoid_gate_kernel") == "norm / activation / mix"
    assert _category("fused_recurrent_kda_fwd_kernel") == "kda"
    assert _category("void topk_rows_kernel<1, false, 1>(float const*)") == "dsa top-k"
    assert _category("_indexer_scores_kernel") == "dsa scores"
    assert _category("_decode_kernel") == "mla"
    assert _category("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "matmul"
    assert _category("void at::native::unrolled_elementwise_kernel<direct_copy>") == "copy / elementwise"
    assert _category("something_new") == "other"


def test_launch_floor_share():
    """--profile's launches against bytes: 244 launches of 0.93 us beside 1.77 GB at 4.27 TB/s (session 46's
    batch-1 step) are 0.227 ms beside 0.415 ms; off CUDA there is no graph to time a launch in."""
    from kestrel.bench.roofline import launch_floor_share, measure_launch_floor

    share = launch_floor_share(244, 0.93, 1.773e9, 4.274)
    assert share["launches_ms"] == pytest.approx(0.22692)
    assert share["bytes_ms_at_copy"] == pytest.approx(0.41484, rel=1e-4)
    assert share["mbu_if_added"] == pytest.approx(0.41484 / (0.41484 + 0.22692), rel=1e-4)
    if not torch.cuda.is_available():
        assert measure_launch_floor("cpu") is None


@pytest.mark.parametrize("sampling", ["logprobs", "penalties", "steer", "grammar"])
def test_decode_bench_requests_ask_for_what_sampling_names(sampling):
    """`bench decode --sampling`: the placed requests ask for top-5 logprobs, penalties or a logit_bias and
    allowed_token_ids, or follow a grammar, and the step is timed with the overlap schedule and without it (on
    the CPU at tiny sizes: the code runs, the figures mean nothing)."""
    from kestrel.bench.decode import SAMPLING, decode_bench, place_in_decode
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine

    placed = place_in_decode(Engine(EngineConfig(model="tiny", device="cpu")), 2, 16, 3, sampling=sampling)
    for request in placed:
        assert all(getattr(request.params, k) == v for k, v in SAMPLING[sampling].items()), request.params
        assert (request.grammar is not None) == (sampling == "grammar")
    result = decode_bench(
        "tiny", batches=(2,), contexts=(16,), steps=3, dense_contrast=False, device="cpu", sampling=sampling
    )
    (run,) = result["runs"]
    assert run["sampling"] == sampling
    assert run["step_ms"] > 0 and run["step_ms_no_overlap"] > 0
    if sampling == "grammar":
        assert set(run["grammar_new_states"]) == {"overlap", "no_overlap"}
        assert all(n >= 0 for n in run["grammar_new_states"].values())


def test_decode_bench_profile_times_the_host_step():
    """--profile also runs Engine.step() under cProfile: per step, the functions that took the host's time (on
    the CPU the replay's kernel profile is skipped: no graphs), the engine's step among them with the time under
    it at most the profiled wall time."""
    from kestrel.bench.decode import decode_bench

    result = decode_bench(
        "tiny", batches=(1,), contexts=(16,), steps=3, dense_contrast=False, device="cpu", profile=True
    )
    (run,) = result["runs"]
    host = run["host_profile"]
    assert host["steps"] == 3 and host["wall_ms_per_step"] > 0
    steps = [f for f in host["by_time_under"] if f["function"].endswith("(step)")]
    assert steps and steps[0]["calls_per_step"] == 1
    assert 0 < steps[0]["under_ms_per_step"] <= host["wall_ms_per_step"]
    assert all(f["own_ms_per_step"] <= f["under_ms_per_step"] + 1e-9 for f in host["by_own_time"])
    assert "profile" not in run


def test_decode_bench_on_an_engine_with_a_longer_limit():
    """`bench decode --max-model-len`: every point runs on an engine of that context limit (a server's default
    is the model's own); a limit too short for a point's requests is refused, naming the least it needs."""
    from kestrel.bench.decode import decode_bench
    from kestrel.config import EngineConfig

    result = decode_bench(
        "tiny", batches=(2,), contexts=(16,), steps=3, dense_contrast=False, device="cpu", max_model_len=512
    )
    (run,) = result["runs"]
    assert run["max_model_len"] == 512 and run["context"] == 16 and run["step_ms"] > 0
    # the engine's default short width recorded (too wide for this limit: no short graphs); the CPU replays none
    assert run["short_graph_len"] == EngineConfig.cuda_graph_short_len == 8192 and run["graph_width"] is None
    (engine,) = result["engines"]  # its start timed; no decode graphs on the CPU
    assert engine["max_model_len"] == 512 and engine["setup_s"] > 0 and engine["decode_graphs"] == 0
    assert engine["graph_gib"] == 0  # no capture on the CPU
    assert engine["graph_widths"] == []
    tight = decode_bench("tiny", batches=(1,), contexts=(16,), steps=3, dense_contrast=False, device="cpu")
    assert tight["runs"][0]["max_model_len"] == 16 + 3 + 64
    with pytest.raises(ConfigError, match="give at least 83"):
        decode_bench("tiny", batches=(1,), contexts=(16,), steps=3, device="cpu", max_model_len=82)


def test_decode_bench_refuses_a_short_limit_before_any_point_runs(monkeypatch, capsys):
    """A --max-model-len too short for a later context is refused before the first one runs (it raised a
    ValueError, a traceback, after the points before it had run and were lost), naming the flag."""
    import kestrel.bench.decode as decode

    monkeypatch.setattr(decode, "measure_ceilings", lambda device: pytest.fail("the benchmark ran"))
    with pytest.raises(ConfigError, match="--max-model-len 100 .* give at least 131"):
        decode.decode_bench("tiny", batches=(1,), contexts=(16, 64), steps=3, device="cpu", max_model_len=100)
    with pytest.raises(ConfigError, match="--steps 99999 leaves no room"):
        decode.decode_bench("tiny", batches=(1,), contexts=(16,), steps=99999, device="cpu")
    argv = "bench decode --model tiny --contexts 16,64 --steps 3 --max-model-len 100".split()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-model-len 100" in err


@pytest.mark.parametrize("bench", ["decode", "kernels"])
def test_gpu_benchmarks_check_out_before_they_run(bench, tmp_path, monkeypatch, capsys):
    """An --out that cannot be written is refused before the benchmark runs (it failed after minutes of GPU
    work, the result lost); a decode --out ending in .png would be replaced by the PNG drawn beside it."""
    import kestrel.bench.decode as decode
    import kestrel.bench.kernels as kernels

    ran = []
    monkeypatch.setattr(decode, "decode_bench", lambda *a, **k: ran.append(a) or {"runs": []})
    monkeypatch.setattr(kernels, "kernels_bench", lambda *a, **k: ran.append(a) or {})
    for out in (tmp_path / "missing" / "x.json", tmp_path):
        assert main(["bench", bench, "--out", str(out)]) == 1
        assert "--out" in capsys.readouterr().err
    if bench == "decode":
        assert main(["bench", bench, "--out", str(tmp_path / "d.png")]) == 1
        assert "give the JSON's name" in capsys.readouterr().err
    assert not ran
