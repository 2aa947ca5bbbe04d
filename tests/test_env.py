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
