"""scripts/gpu_train_demo.sh's `ship` (on the device) and `unpack` (here): a stage's checkpoint goes out in one
call and comes back whole, or `unpack` says what is missing, so the next stage can start on another machine."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_train_demo.sh"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _demo(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


def _finished_run(root: Path) -> Path:
    """A run folder as `start` leaves it: a checkpoint of two shards with its index, a log, the wall clock."""
    ckpt = root / "run-a" / "checkpoint"
    ckpt.mkdir(parents=True)
    for i, name in enumerate(SHARDS):
        (ckpt / name).write_bytes(bytes([i]) * 1000)
    index = {"weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "config.json").write_text("{}")
    (root / "run-a" / "train.log").write_text("step 1\n")
    (root / "run-a" / "wall_start").write_text("100.0")
    (root / "run-a" / "wall_end").write_text("652.25")
    return root / "run-a"


def test_ship_then_unpack_rebuilds_the_checkpoint(tmp_path):
    run, out = _finished_run(tmp_path), tmp_path / "out"
    out.mkdir()
    shipped = _demo("ship", RUN=str(run), OUT=str(out))
    assert shipped.returncode == 0, shipped.stderr
    assert sorted(p.name for p in out.iterdir()) == [*SHARDS, "run-a-meta.tgz"]

    unpacked = _demo("unpack", str(out), str(tmp_path / "back"))
    assert unpacked.returncode == 0, unpacked.stderr
    back = tmp_path / "back"
    for name in (*SHARDS, "model.safetensors.index.json", "config.json"):
        assert (back / "checkpoint" / name).read_bytes() == (run / "checkpoint" / name).read_bytes()
    assert json.loads((back / "wall.json").read_text()) == {"process_wall_s": 552.2}
    assert (back / "train.log").read_text() == "step 1\n"


def test_unpack_names_a_missing_shard(tmp_path):
    run, out = _finished_run(tmp_path), tmp_path / "out"
    out.mkdir()
    assert _demo("ship", RUN=str(run), OUT=str(out)).returncode == 0
    (out / SHARDS[1]).unlink()
    unpacked = _demo("unpack", str(out), str(tmp_path / "back"))
    assert unpacked.returncode != 0
    assert SHARDS[1] in unpacked.stderr


def test_unpack_without_records_says_so(tmp_path):
    unpacked = _demo("unpack", str(tmp_path), str(tmp_path / "back"))
    assert unpacked.returncode != 0
    assert "meta.tgz" in unpacked.stderr
    assert not (tmp_path / "back").exists()
