"""`kestrel env`: versions, devices, fast paths and every variable; a bad variable listed beside the rest and
the exit status 1; a bad variable stops every other command before it runs, and an engine before it starts."""

from __future__ import annotations

import json

import pytest

from kestrel.env import VARIABLES
from kestrel.serve.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_report_lists_everything(capsys):
    code, out, err = run(capsys, "env")
    assert code == 0, err
    assert "torch " in out and "GPUs: " in out and "nvcc: " in out
    for path in ("kda", "attention", "dsa_topk", "pdl", "gemv"):
        assert f"\n  {path} " in out
    for variable in VARIABLES.values():
        assert f" {variable.name}" in out
    assert "kda         naive" in out  # on this CPU machine: the references


def test_the_report_as_json(capsys, monkeypatch):
    monkeypatch.setenv("KESTREL_GEMV", "OFF")
    code, out, _ = run(capsys, "env", "--json", "--device", "cpu")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"software", "device", "fast_paths", "variables", "unknown_variables"}
    assert report["fast_paths"]["device"] == "cpu" and report["software"]["torch"]
    gemv = next(r for r in report["variables"] if r["field"] == "gemv")
    assert gemv["set"] and gemv["value"] == "off" and gemv["text"] == "OFF" and gemv["default"] == "auto"


def test_a_bad_variable_is_listed_beside_the_rest(capsys, monkeypatch):
    monkeypatch.setenv("KESTREL_ATTN_BACKEND", "cuda")
    code, out, err = run(capsys, "env")
    assert code == 1
    assert (
        "* KESTREL_ATTN_BACKEND" in out
        and "ERROR KESTREL_ATTN_BACKEND='cuda': expected auto | torch | triton" in out
    )
    assert (
        "attention   error: KESTREL_ATTN_BACKEND='cuda'" in out
    )  # the fast path it picks, as its function fails
    assert "KESTREL_PDL" in out  # the rest still listed
    assert err.strip() == "kestrel: error: 1 bad environment variable"


@pytest.mark.parametrize("name", ["KESTREL_PDL", "pdl", "PDL"])
def test_one_variable_described(capsys, name):
    code, out, _ = run(capsys, "env", name)
    assert code == 0
    assert out.startswith("KESTREL_PDL = auto (the default)") and "takes: auto | off" in out
    assert "programmatic dependent launch" in out


def test_one_variable_as_json(capsys):
    code, out, _ = run(capsys, "env", "--json", "pdl")
    row = json.loads(out)
    assert code == 0 and row["name"] == "KESTREL_PDL" and row["field"] == "pdl" and "takes" in row


def test_an_unknown_variable_is_one_line(capsys):
    code, out, err = run(capsys, "env", "KESTREL_WARP_SPEED")
    assert code == 1 and not out
    assert err.startswith("kestrel: error: unknown variable 'KESTREL_WARP_SPEED' (known: KESTREL_KDA_BACKEND")
    code, out, err = run(capsys, "env", "")  # (it printed the whole report)
    assert code == 1 and not out and err.startswith("kestrel: error: unknown variable ''")


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_one_bad_variable_described_exits_1(capsys, monkeypatch, json_flag):
    """`kestrel env PDL` with KESTREL_PDL set to a value it does not take described it as an ERROR and exited 0,
    where the whole report exits 1."""
    monkeypatch.setenv("KESTREL_PDL", "bogus")
    code, out, err = run(capsys, "env", *json_flag, "pdl")
    assert code == 1 and "KESTREL_PDL" in out
    assert err.strip() == "kestrel: error: KESTREL_PDL='bogus': expected auto | off"


def test_a_bad_variable_stops_a_command_before_it_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "perhaps")
    code, out, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path / "t"))
    assert code == 1 and not out
    assert err.startswith("kestrel: error: bad environment variable: KESTREL_MOE_FUSE_SHARED='perhaps'")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


def test_a_bad_variable_stops_an_engine_before_it_starts(monkeypatch):
    """The server used to start, then fail its first request and every later one (session 50)."""
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.utils.errors import ConfigError

    monkeypatch.setenv("KESTREL_ATTN_BACKEND", "cuda")
    with pytest.raises(ConfigError, match="KESTREL_ATTN_BACKEND='cuda'"):
        Engine(EngineConfig(model="tiny"))


def test_the_servers_log_level_defaults_to_the_variable(monkeypatch):
    from kestrel.serve.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.log_level is None  # cmd_serve reads KESTREL_LOG_LEVEL then
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "debug"


def test_the_readme_lists_every_variable():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| variable (default) | what it picks |") :]
    table = table[: table.index("\n\n")]
    for field, variable in VARIABLES.items():
        if field not in ("triton_interpret",):  # Triton's own switch, for the tests
            assert f"`{variable.name}" in table, variable.name


@pytest.mark.parametrize("device, words", [("nonsense", "not a device"), ("mps", "not supported")])
def test_a_bad_device_is_one_line(capsys, device, words):
    code, out, err = run(capsys, "env", "--device", device)
    assert code == 1 and not out
    assert (
        err.startswith(f"kestrel: error: --device {device!r}: {words}") and len(err.strip().splitlines()) == 1
    )
