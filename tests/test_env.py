"""KESTREL_* variables: defaults, parsing, and a clear error that names a bad one."""

import os

import pytest

from kestrel.env import read_env


def test_defaults_and_parsing(monkeypatch):
    monkeypatch.delenv("KESTREL_KDA_RECURRENT_PREFILL", raising=False)
    assert read_env().kda_recurrent_prefill == 1024
    monkeypatch.setenv("KESTREL_KDA_RECURRENT_PREFILL", " 0 ")
    assert read_env().kda_recurrent_prefill == 0
    monkeypatch.delenv("KESTREL_KDA_CONV", raising=False)
    assert read_env().kda_conv == "auto"
    monkeypatch.setenv("KESTREL_KDA_CONV", "FLA")
    assert read_env().kda_conv == "fla"
    monkeypatch.delenv("KESTREL_KDA_DECODE", raising=False)
    assert read_env().kda_decode == "triton"
    monkeypatch.delenv("KESTREL_MOE_SORT_FIRST", raising=False)
    assert read_env().moe_sort_first is True
    monkeypatch.delenv("KESTREL_MOE_FUSE_SHARED", raising=False)
    assert read_env().moe_fuse_shared is True
    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", "0")
    assert read_env().moe_fuse_shared is False


@pytest.mark.parametrize(
    "name, value",
    [
        ("KESTREL_KDA_RECURRENT_PREFILL", "-1"),
        ("KESTREL_KDA_RECURRENT_PREFILL", "lots"),
        ("KESTREL_KDA_CONV", "cuda"),
        ("KESTREL_KDA_DECODE", "naive"),
    ],
)
def test_a_bad_value_is_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        read_env()


def test_env_overrides_restores_what_was_there(monkeypatch):
    from kestrel.env import env_field, env_overrides

    monkeypatch.setenv("KESTREL_PDL", "off")
    monkeypatch.delenv("KESTREL_GEMV", raising=False)
    with env_overrides({"KESTREL_PDL": "auto", "KESTREL_GEMV": "off"}):
        assert env_field("pdl") == "auto" and env_field("gemv") == "off"
    assert os.environ["KESTREL_PDL"] == "off" and "KESTREL_GEMV" not in os.environ


@pytest.mark.parametrize(
    "text, value", [("1", True), ("ON", True), (" yes ", True), ("true", True), ("0", False), ("off", False),
                    ("No", False), ("false", False), ("", True)],
)  # fmt: skip
def test_flags_read_their_words(monkeypatch, text, value):
    monkeypatch.setenv("KESTREL_MOE_FUSE_SHARED", text)  # default on: blank reads as the default
    assert read_env().moe_fuse_shared is value


@pytest.mark.parametrize(
    "name", ["KESTREL_MOE_FUSE_SHARED", "KESTREL_KDA_SAFE_GATE", "KESTREL_COMPILE_TRAIN"]
)
def test_a_flag_set_to_another_word_is_an_error(monkeypatch, name):
    """Before session 50 a flag set to anything but 1/true/yes/on read as off, silently."""
    monkeypatch.setenv(name, "perhaps")
    with pytest.raises(ValueError, match=f"{name}='perhaps': expected"):
        read_env()


def test_tritons_own_flag_keeps_tritons_rule(monkeypatch):
    from kestrel.env import env_field

    for text, on in (("y", True), ("1", True), ("whatever", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", text)
        assert env_field("triton_interpret") is on


def test_cuda_path_is_read_where_cuda_home_is_unset(monkeypatch):
    from kestrel.env import env_field

    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", "/opt/Cuda")
    assert env_field("cuda_home") == "/opt/Cuda"  # a path keeps its case
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda-12")
    assert env_field("cuda_home") == "/usr/local/cuda-12"


def test_every_bad_variable_is_named_at_once(monkeypatch):
    from kestrel.env import check_env, env_problems
    from kestrel.utils.errors import ConfigError

    check_env()  # the test environment reads
    monkeypatch.setenv("KESTREL_PDL", "maybe")
    monkeypatch.setenv("KESTREL_KDA_RECURRENT_PREFILL", "-3")
    problems = env_problems()
    assert len(problems) == 2 and "KESTREL_PDL='maybe'" in problems[1] and "RECURRENT_PREFILL" in problems[0]
    with pytest.raises(ConfigError, match=r"KESTREL_KDA_RECURRENT_PREFILL='-3'.*KESTREL_PDL='maybe'"):
        check_env()


def test_every_field_is_declared_described_and_labelled():
    """Env's fields, the declared variables and their descriptions are one list (kestrel env shows all three)."""
    import dataclasses

    from kestrel.env import VARIABLES, Env
    from kestrel.serve.env_report import variable_docs

    fields = [f.name for f in dataclasses.fields(Env)]
    assert sorted(fields) == sorted(VARIABLES)
    docs = variable_docs()
    assert sorted(docs) == sorted(fields)
    for field, variable in VARIABLES.items():
        assert variable.what and len(docs[field]) > 10, field
        assert not docs[field].startswith(variable.name), field  # "NAME: " is cut off
        if variable.kind == "choice":
            assert variable.default in variable.choices, field


def test_an_unknown_kestrel_variable_is_named_with_the_closest(monkeypatch, caplog):
    """A misspelt KESTREL_* variable would silently leave the default: check_env warns, naming the closest known
    one, and `kestrel env` lists it; ./run's KESTREL_VENV is known."""
    from kestrel.env import check_env, unknown_variables

    monkeypatch.setenv("KESTREL_PDLL", "off")
    monkeypatch.setenv("KESTREL_VENV", "/tmp/venv")
    assert unknown_variables() == ["KESTREL_PDLL is not a Kestrel variable (did you mean KESTREL_PDL?)"]
    with caplog.at_level("WARNING", logger="kestrel"):
        check_env()
    assert "KESTREL_PDLL is not a Kestrel variable" in caplog.text
    monkeypatch.delenv("KESTREL_PDLL")
    assert unknown_variables() == []


def test_the_topk_rows_switch_is_off_by_default(monkeypatch):
    """KESTREL_DSA_TOPK_ROWS (decode's CUDA top-k writes the pool rows too): off unless set on; untimed."""
    from kestrel.env import VARIABLES, env_field

    monkeypatch.delenv("KESTREL_DSA_TOPK_ROWS", raising=False)
    assert env_field("dsa_topk_rows") == "off" and read_env().dsa_topk_rows == "off"
    assert VARIABLES["dsa_topk_rows"].default == "off"
    for text, value in (("on", "on"), (" ON ", "on"), ("off", "off"), ("", "off")):
        monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", text)
        assert env_field("dsa_topk_rows") == value
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "auto")
    with pytest.raises(ValueError, match="KESTREL_DSA_TOPK_ROWS='auto': expected on \\| off"):
        read_env()
