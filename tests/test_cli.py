"""`kestrel` command line: the happy paths, and every bad input exiting non-zero with one line on stderr and no
traceback. Run in-process through `main` (fast), and a few cases through a real subprocess."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kestrel import presets
from kestrel.models.generate import generate
from kestrel.models.loader import build_model
from kestrel.presets import builtin_model
from kestrel.serve.cli import main
from kestrel.tokenizer import tokenizer_for

STATS = re.compile(r"^\[kestrel\] model=\S+ layers=[LSA]+ .* generated=\d+ tokens in ")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout, stderr of `kestrel argv...` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv: str, cwd: Path) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kestrel.serve.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(code: int, err: str, expected_code: int, *words: str):
    assert code == expected_code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(r"^kestrel( [a-z-]+)?: error: ", lines[0]), lines[0]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny kimi_k3 checkpoint written by `kestrel init-random` (with its byte tokenizer)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["init-random", "--preset", "tiny", "--out", str(path)]) == 0
    return path


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    shutil.copytree(checkpoint, tmp_path / "model")
    return tmp_path / "model"


# -- happy paths -------------------------------------------------------------------------------------------


def test_generate_builtin_model(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "Hello", "--max-new-tokens", "5", "--device", "cpu")
    assert code == 0, err
    model = build_model(builtin_model())  # the shipped demo model when installed, else tiny
    tokenizer = tokenizer_for(builtin_model())
    ids = generate(model, tokenizer.encode("Hello"), 5, eos_token_ids=model.config.eos_token_ids)
    assert out == tokenizer.decode(ids) + "\n"  # greedy by default: the reference generate()'s text
    prompt_tokens = len(tokenizer.encode("Hello"))
    assert STATS.match(err.strip()) and f"prompt={prompt_tokens} tokens" in err and "Traceback" not in err


def test_shipped_model_is_the_default_when_installed(capsys, checkpoint, monkeypatch):
    monkeypatch.setattr(presets, "shipped_model_dir", lambda: checkpoint)
    assert builtin_model() == "kestrel-demo"
    code, out, err = run(capsys, "generate", "--prompt", "Hi", "--max-new-tokens", "4", "--device", "cpu")
    assert code == 0, err
    assert "model=kestrel-demo" in err
    model, tokenizer = build_model(str(checkpoint)), tokenizer_for(str(checkpoint))
    ids = generate(model, tokenizer.encode("Hi"), 4, eos_token_ids=model.config.eos_token_ids)
    assert out == tokenizer.decode(ids) + "\n"


def test_shipped_model_missing_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(presets, "shipped_model_dir", lambda: None)
    assert builtin_model() == "tiny"
    code, _, err = run(capsys, "generate", "--model", "kestrel-demo", "--prompt", "x", "--device", "cpu")
    assert_one_line_error(code, err, 1, "kestrel-demo", "not in this install")


def test_generate_with_sampling_options(capsys):
    argv = ["generate", "--prompt", "Hi", "--max-new-tokens", "4", "--temperature", "0.8", "--top-p", "0.9"]
    code, out, err = run(capsys, *argv, "--top-k", "20", "--seed", "3", "--dtype", "bfloat16")
    assert code == 0, err
    assert STATS.match(err.strip()) and "dtype=torch.bfloat16" in err
    assert run(capsys, *argv, "--top-k", "20", "--seed", "3", "--dtype", "bfloat16")[1] == out  # seeded


def test_init_random_then_generate_chat(checkpoint, capsys):
    names = sorted(p.name for p in checkpoint.iterdir())
    assert "config.json" in names and "model.safetensors" in names and "tokenizer.json" in names
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "kimi_k3"
    code, out, err = run(
        capsys, "generate", "--model", str(checkpoint), "--chat", "--prompt", "hi", "--max-new-tokens", "3"
    )
    assert code == 0, err
    assert STATS.match(err.strip())
    prompt_tokens = int(re.search(r"prompt=(\d+) tokens", err).group(1))
    assert prompt_tokens > len("hi") + 2  # the chat template wrapped the prompt


def test_init_random_kimi_linear_format(tmp_path, capsys):
    code, _, err = run(
        capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path), "--format", "kimi_linear"
    )
    assert code == 0, err
    assert "kimi_linear" in err and "Traceback" not in err
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kimi_linear"
    model = build_model(str(tmp_path), dtype=torch.bfloat16)
    assert model.config.layer_pattern == "LLALLA" and model.lm_head.weight.dtype == torch.bfloat16


def test_init_random_keeps_a_checkpoint_unless_told(tmp_path, capsys):
    assert run(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path))[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path), "--seed", "1")
    assert (
        code != 0 and "already holds a checkpoint" in err and "--overwrite" in err and "Traceback" not in err
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    args = ["init-random", "--preset", "tiny", "--out", str(tmp_path), "--seed", "1", "--overwrite"]
    assert run(capsys, *args)[0] == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} != before
    mine = tmp_path / "mine"  # a folder holding only the user's tokenizer
    mine.mkdir()
    (mine / "tokenizer.json").write_text("{}")
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(mine))
    assert code != 0 and "tokenizer.json" in err and (mine / "tokenizer.json").read_text() == "{}"


def test_init_random_conditioned(tmp_path, capsys):
    """--init conditioned writes the conditioned scheme's weights (those of build_model with the same seed)."""
    code, _, err = run(
        capsys, *f"init-random --preset tiny --out {tmp_path} --dtype float32 --init conditioned".split()
    )
    assert code == 0, err
    saved = build_model(str(tmp_path)).model.embed_tokens.weight
    assert torch.equal(saved, build_model("tiny", init="conditioned").model.embed_tokens.weight)
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path), "--init", "he")
    assert code != 0 and "invalid choice: 'he'" in err and "Traceback" not in err


def test_init_random_mxfp4_on_tiny_is_refused(tmp_path, capsys):
    """tiny's latent expert width (48) is not a multiple of the MX block (32): a clear error, no folder."""
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path / "m"), "--mxfp4")
    assert_one_line_error(code, err, 1, "routed_expert_hidden_size", "multiples of 32")
    assert not (tmp_path / "m").exists()


# -- bad input: exit non-zero, one line on stderr, no traceback --------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-new-tokens", "0"], ["--max-new-tokens", "0"]),
        (["--max-new-tokens", "-1"], ["--max-new-tokens", "-1"]),
        (["--max-new-tokens", "abc"], ["--max-new-tokens", "abc"]),
        (["--temperature", "-1"], ["--temperature"]),
        (["--temperature", "hot"], ["--temperature", "hot"]),
        (["--temperature", "inf"], ["--temperature", "finite"]),
        (["--top-p", "2"], ["--top-p"]),
        (["--top-p", "-0.5"], ["--top-p"]),
        (["--top-p", "0"], ["--top-p", "(0, 1]"]),
        (["--top-k", "-3"], ["--top-k", "-3"]),
        (["--top-k", "many"], ["--top-k", "many"]),
        (["--top-k", str(2**31)], ["--top-k", str(2**31)]),
        (["--dtype", "int8"], ["--dtype", "int8"]),
        (["--bogus"], ["--bogus"]),
    ],
    ids=[
        "tokens-0",
        "tokens-neg",
        "tokens-abc",
        "temp-neg",
        "temp-str",
        "temp-inf",
        "top-p-2",
        "top-p-neg",
        "top-p-0",
        "top-k-neg",
        "top-k-str",
        "top-k-big",
        "dtype",
        "flag",
    ],
)
def test_bad_generate_arguments(capsys, argv, words):
    code, out, err = run(capsys, "generate", "--prompt", "hi", *argv)
    assert_one_line_error(code, err, 2, *words)
    assert out == ""


def test_usage_errors_are_one_line(capsys):
    assert_one_line_error(*run(capsys)[::2], 2, "COMMAND")
    assert_one_line_error(*run(capsys, "generate")[::2], 2, "--prompt")
    assert_one_line_error(*run(capsys, "serve-all")[::2], 2, "serve-all")
    assert_one_line_error(*run(capsys, "init-random", "--preset", "tiny")[::2], 2, "--out")


def test_nonexistent_model(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "nowhere", "no such checkpoint folder")


def test_model_is_a_file(capsys, checkpoint):
    code, _, err = run(capsys, "generate", "--model", str(checkpoint / "config.json"), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "got a file")


def test_malformed_config_json(capsys, broken):
    (broken / "config.json").write_text('{"model_type": "kimi_k3", ')
    code, _, err = run(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "config.json", "not valid JSON")


def test_config_with_a_bad_field(capsys, broken):
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["num_experts_per_token"] = 99
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "num_experts_per_token=99")


def test_truncated_weights(capsys, broken):
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "model.safetensors", "truncated")


def test_missing_tensor(capsys, broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["language_model.model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    code, _, err = run(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, 1, "missing (1): model.norm.weight")


def test_unknown_model_or_preset_name(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", "huge", "--prompt", "hi")
    assert_one_line_error(code, err, 1, "'huge'", "tiny")
    code, _, err = run(capsys, "init-random", "--preset", "huge", "--out", str(tmp_path / "m"))
    assert_one_line_error(code, err, 1, "unknown preset 'huge'")
    assert not (tmp_path / "m").exists()
    code, _, err = run(capsys, "init-random", "--preset", "demo", "--out", str(tmp_path / "m"))
    assert_one_line_error(code, err, 1, "--preset demo", "kestrel train --model demo")
    assert not (tmp_path / "m").exists()


def test_mxfp4_needs_k3_format(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "init-random",
        "--preset",
        "tiny",
        "--out",
        str(tmp_path / "m"),
        "--mxfp4",
        "--format",
        "kimi_linear",
    )
    assert_one_line_error(code, err, 1, "--mxfp4")
    assert not (tmp_path / "m").exists()


def test_init_random_bad_out(capsys, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(file))
    assert_one_line_error(code, err, 1, "--out", "not a folder")
    code, _, err = run(capsys, "init-random", "--preset", "tiny", "--out", str(file / "below"))
    assert_one_line_error(code, err, 1, "a_file")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta", ""])
def test_unknown_device(capsys, device):
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--device", device)
    assert_one_line_error(code, err, 1, "--device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda(capsys, device):
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--device", device)
    assert_one_line_error(code, err, 1, "CUDA is not available")


def test_empty_prompt_and_too_long_request(capsys):
    assert_one_line_error(*run(capsys, "generate", "--prompt", "")[::2], 1, "--prompt")
    limit = build_model(builtin_model()).config.max_position_embeddings
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--max-new-tokens", str(limit + 1))
    assert_one_line_error(code, err, 1, "--max-new-tokens", str(limit))


# -- the same through a real process ----------------------------------------------------------------------


def test_subprocess_generate_and_chat(checkpoint, tmp_path):
    code, out, err = run_subprocess("generate", "--prompt", "Hello", "--max-new-tokens", "3", cwd=tmp_path)
    assert code == 0, err
    assert out.endswith("\n") and STATS.match(err.strip().splitlines()[-1])
    code, out, err = run_subprocess(
        "generate",
        "--model",
        str(checkpoint),
        "--chat",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert STATS.match(err.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv, expected_code, word",
    [
        (["generate", "--model", "nowhere", "--prompt", "hi"], 1, "no such checkpoint folder"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "abc"], 2, "--max-new-tokens"),
        (["generate", "--prompt", "hi", "--device", "tpu"], 1, "--device"),
        (
            ["init-random", "--preset", "tiny", "--out", "m", "--mxfp4", "--format", "kimi_linear"],
            1,
            "--mxfp4",
        ),
    ],
    ids=["no-model", "bad-tokens", "bad-device", "mxfp4-format"],
)
def test_subprocess_errors(tmp_path, argv, expected_code, word):
    code, out, err = run_subprocess(*argv, cwd=tmp_path)
    assert_one_line_error(code, err, expected_code, word)
    assert out == ""


def test_subprocess_truncated_weights(broken, tmp_path):
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, _, err = run_subprocess("generate", "--model", str(broken), "--prompt", "hi", cwd=tmp_path)
    assert_one_line_error(code, err, 1, "truncated")


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "kestrel"
    if not script.exists():
        pytest.skip("the kestrel console script is not installed next to this python")
    proc = subprocess.run(
        [str(script), "generate", "--prompt", "hi", "--top-p", "2"], capture_output=True, text=True
    )
    assert_one_line_error(proc.returncode, proc.stderr, 2, "--top-p")


def test_builtin_model_default_only_where_a_model_is_loaded():
    from kestrel.serve.cli import build_parser

    parse = build_parser().parse_args
    for argv in (["generate", "--prompt", "x"], ["serve"], ["chat"]):
        args = parse(argv)
        assert args.model is None and args.builtin_model_default, argv  # main() fills in builtin_model()
    agent = parse(["bench", "agent", "--base-url", "http://127.0.0.1:1/v1"])
    assert agent.model is None and not getattr(
        agent, "builtin_model_default", False
    )  # the server's first model


def test_train_retrieval_distractors_argument(capsys):
    """`--retrieval-distractors LO,HI` (or N) parses to a range; anything else is a usage error naming it.
    `--retrieval-shared-all` is a switch."""
    from kestrel.serve.cli import build_parser

    def parse(*argv):
        return build_parser().parse_args(["train", "--out", "/nonexistent/run", *argv])

    assert parse("--retrieval-distractors", "2,8").retrieval_distractors == (2, 8)
    assert parse("--retrieval-distractors", "3").retrieval_distractors == (3, 3)
    assert parse().retrieval_distractors is None and not parse().retrieval_shared_all
    assert parse("--retrieval-shared-all").retrieval_shared_all
    for bad in ("8,2", "0,3", "a,b", "1,2,3"):
        with pytest.raises(SystemExit):
            parse("--retrieval-distractors", bad)
        assert "--retrieval-distractors" in capsys.readouterr().err


def test_train_retrieval_loss_weight_argument(capsys):
    """`--retrieval-loss-weight` is a finite positive number (default 1); 0, negatives, inf and words are usage
    errors naming it."""
    from kestrel.serve.cli import build_parser

    def parse(*argv):
        return build_parser().parse_args(["train", "--out", "/nonexistent/run", *argv])

    assert parse().retrieval_loss_weight == 1.0
    assert parse("--retrieval-loss-weight", "4").retrieval_loss_weight == 4.0
    for bad in ("0", "-2", "inf", "nan", "four"):
        with pytest.raises(SystemExit):
            parse("--retrieval-loss-weight", bad)
        assert "--retrieval-loss-weight" in capsys.readouterr().err


def test_train_out_that_is_a_file_is_named(capsys, tmp_path):
    """`kestrel train --out FILE` said only "[Errno 17] File exists: 'FILE'"."""
    file = tmp_path / "notes.txt"
    file.write_text("x")
    code, _, err = run(capsys, "train", "--out", str(file), "--model", "tiny")
    assert_one_line_error(code, err, 1, f"--out {file}: exists and is not a folder")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seed", "-1"], ["--seed must be in [0, "]),
        (
            ["--row-len", "8"],
            ["--row-len must be >= 16", "--retrieval-lengths must be shorter than --row-len 8"],
        ),
        (["--lr", "nan"], ["--lr must be > 0"]),
        (["--warmup-steps", "-5"], ["--warmup-steps must be >= 0"]),
        (["--retrieval-lengths", "0"], ["--retrieval-lengths: token counts must be positive"]),
        (["--retrieval-distractors", "1,40"], ["--retrieval-distractors must be"]),
        (["--tokenizer", "/nonexistent"], ["tokenizer folder not found"]),
    ],
)
def test_train_errors_name_their_flags_and_leave_no_folder(capsys, tmp_path, argv, words):
    """A value the trainer refuses is named by its flag (its config field was: `row_len must be >= 16`), and a run
    that never started leaves no empty --out folder behind."""
    out = tmp_path / "run"
    base = [
        "train",
        "--out",
        str(out),
        "--model",
        "tiny",
        "--steps",
        "1",
        "--batch-rows",
        "1",
        "--row-len",
        "256",
    ]
    code, _, err = run(capsys, *base, "--retrieval-lengths", "128", *argv)
    assert_one_line_error(code, err, 1, *words)
    assert not out.exists()


def test_resuming_a_run_at_or_past_its_steps_says_so_and_changes_nothing(capsys, tmp_path):
    """A resume whose --steps the run has reached exited 0 without a word (and rewrote train_summary.json as a run
    of no steps): equal steps say the run is complete, fewer are an error naming both; the folder stays as it is."""
    from kestrel.tokenizer import save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    out = tmp_path / "run"
    tok = str(tmp_path / "tok")
    argv = ["train", "--out", str(out), "--model", "tiny", "--tokenizer", tok, "--device", "cpu"]
    argv += ["--batch-rows", "2", "--row-len", "512", "--retrieval-lengths", "256", "--warmup-steps", "1"]
    assert run(capsys, *argv, "--steps", "2")[0] == 0

    def files() -> dict:
        return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    before = files()
    code, stdout, err = run(capsys, *argv, "--steps", "2")
    assert code == 0 and not stdout, err
    assert err.strip().splitlines() == [
        f"[kestrel] {out} is already complete at step 2: nothing to train "
        "(a larger --steps trains on from it)"
    ]
    assert files() == before
    code, _, err = run(capsys, *argv, "--steps", "1")
    assert_one_line_error(code, err, 1, "at step 2 already", "--steps 1", "--steps above 2")
    assert files() == before


def test_train_time_budget_argument(capsys):
    """`--time-budget-s` is a finite positive number: -5 trained one step, 0 and nan ran without a budget."""
    from kestrel.serve.cli import build_parser

    def parse(*argv):
        return build_parser().parse_args(["train", "--out", "/nonexistent/run", *argv])

    assert parse().time_budget_s is None
    assert parse("--time-budget-s", "90").time_budget_s == 90.0
    for bad in ("0", "-5", "inf", "nan", "ten"):
        with pytest.raises(SystemExit):
            parse("--time-budget-s", bad)
        assert "--time-budget-s" in capsys.readouterr().err


def test_text_that_is_not_utf8_is_one_line(checkpoint, capsys, monkeypatch):
    """A prompt in another encoding (Python reads its bytes as lone surrogates): one line naming the byte, not
    the tokenizer's traceback; in the chat the line is refused and the chat goes on."""
    import io

    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # how sys.argv and a POSIX-locale stdin hold it
    code, _, err = run(capsys, "generate", "--model", str(checkpoint), "--prompt", latin1)
    assert_one_line_error(code, err, 1, "--prompt is not valid UTF-8", "0xe9")
    code, _, err = run(capsys, "chat", "--model", str(checkpoint), "--system", latin1)
    assert_one_line_error(code, err, 1, "--system is not valid UTF-8")
    monkeypatch.setattr("sys.stdin", io.StringIO(latin1 + "\nhi\n"))
    code, out, err = run(capsys, "chat", "--model", str(checkpoint), "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in err, err
    assert "that line is not valid UTF-8 (byte 0xe9 at character 3); type it again" in err
    assert out.count("> ") == 3  # the bad line, "hi", and the end
    # a UTF-8 locale's stdin decodes strictly: input() raised UnicodeDecodeError, a traceback
    strict = io.TextIOWrapper(io.BytesIO(b"caf\xe9\nhi\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", strict)
    code, out, err = run(capsys, "chat", "--model", str(checkpoint), "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in err, err
    assert "that line is not valid UTF-8 (byte 0xe9 at character 3)" in err and out.count("> ") == 3


def test_seeds_and_workers_out_of_range_are_usage_errors(capsys):
    """A seed past int64 was a traceback from torch's generator; --data-workers -1 one from multiprocessing."""
    code, _, err = run(capsys, "generate", "--model", "tiny", "--prompt", "hi", "--seed", str(2**64))
    assert_one_line_error(code, err, 2, "--seed", "[-2**63, 2**63 - 1]")
    code, _, err = run(capsys, "train", "--out", "/tmp/unused", "--data-workers", "-1")
    assert_one_line_error(code, err, 2, "--data-workers")


def test_a_kv_cache_past_memory_is_one_line(capsys, monkeypatch):
    """--kv-cache-gb larger than the machine's memory: one line naming the plan and the flags (the allocator's
    traceback before)."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, _, err = run(capsys, "chat", "--model", "tiny", "--kv-cache-gb", "100000")
    assert_one_line_error(code, err, 1, "the memory plan does not fit the CPU memory", "--kv-cache-gb")


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--kv-cache-gb", "1e12"),  # a size past what torch can even compute
        ("--max-running-requests", "100000000000000000"),
        ("--num-checkpoints", "1000000000"),
        ("--hicache-host-gb", "100000"),
        ("--hicache-host-gb", "1e15"),
    ],
)
def test_every_pool_past_memory_is_one_line_naming_its_flag(capsys, monkeypatch, flag, value):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, _, err = run(capsys, "chat", "--model", "tiny", flag, value)
    assert_one_line_error(code, err, 1, "the memory plan does not fit the CPU memory", flag)


def test_eval_out_is_checked_before_the_run(capsys, tmp_path):
    """`kestrel eval --out` that cannot be written stops at once, naming it (it failed after the whole run)."""
    (tmp_path / "taken").mkdir()
    for out, words in (
        (tmp_path / "taken", ["--out", "is a folder"]),
        (tmp_path / "nowhere" / "eval.json", ["--out", "does not exist"]),
    ):
        code, stdout, err = run(capsys, "eval", "--model", "tiny", "--out", str(out))
        assert_one_line_error(code, err, 1, *words)
        assert stdout == ""


def test_eval_out_says_whether_the_run_completed(capsys, tmp_path, monkeypatch):
    """A run cut short (Ctrl-C after a family) leaves what it measured marked `"complete": false`, where it had
    looked like a finished result; a finished one says true."""
    import kestrel.train.evaluate as evaluate_module

    out = tmp_path / "eval.json"

    def cut(cfg, on_progress):
        on_progress({"model": cfg.model, "families": {"chain_sum": {"accuracy": 0.5}}, "retrieval": {}})
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "evaluate", cut)
    assert run(capsys, "eval", "--model", "tiny", "--out", str(out))[0] == 130  # as a shell's Ctrl-C
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and partial["families"] == {"chain_sum": {"accuracy": 0.5}}
    monkeypatch.setattr(
        evaluate_module, "evaluate", lambda cfg, on_progress: {"families": {}, "retrieval": {}}
    )
    monkeypatch.setattr(evaluate_module, "format_table", lambda result: "table")
    # the cut run's file is there: replaced only when asked (a finished result was replaced without a word)
    code, stdout, err = run(capsys, "eval", "--model", "tiny", "--out", str(out))
    assert_one_line_error(code, err, 1, f"--out {out} already exists", "--overwrite")
    assert json.loads(out.read_text()) == partial
    code, stdout, _ = run(capsys, "eval", "--model", "tiny", "--out", str(out), "--overwrite")
    assert code == 0 and json.loads(out.read_text())["complete"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]  # no .part left


def test_a_chat_template_that_refuses_is_one_line(broken, capsys):
    """Hugging Face templates raise on conversations they do not take (raise_exception): one line, no traceback."""
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = '{{ raise_exception("roles must alternate") }}'
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "generate", "--model", str(broken), "--chat", "--prompt", "hi")
    assert_one_line_error(code, err, 1, "chat template error", "roles must alternate")


def test_another_models_tokenizer_is_one_line_before_any_prompt(capsys, monkeypatch):
    """The shipped model's BPE tokenizer (4468 ids) beside tiny (261): refused when the engine starts, not at the
    first prompt."""
    import io

    from kestrel.presets import shipped_model_dir

    if shipped_model_dir() is None:
        pytest.skip("no shipped model in this tree")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code, _, err = run(capsys, "chat", "--model", "tiny", "--tokenizer", str(shipped_model_dir()))
    assert_one_line_error(code, err, 1, "the tokenizer has", "only 261", "--tokenizer")


def test_an_empty_api_key_is_refused(capsys):
    """`--api-key "$KEY"` with KEY unset: refused, not a server without authentication."""
    code, _, err = run(capsys, "serve", "--api-key", "")
    assert code == 2 and "--api-key" in err and "empty key" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["init-random", "--preset", "tiny"],
        ["train", "--model", "tiny", "--steps", "1", "--batch-rows", "1", "--row-len", "256"],
        ["eval", "--model", "tiny"],
        ["bench", "agent"],
        ["bench", "decode"],
    ],
)
def test_an_empty_out_is_refused(capsys, tmp_path, monkeypatch, argv):
    """`--out "$DIR"` with DIR unset: refused, not the current folder (init-random wrote a checkpoint there,
    train a whole run)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv, "--out", "")
    assert code == 2 and "--out" in err and "empty path" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_chat_without_a_chat_template_says_so_before_the_first_line(broken, capsys, monkeypatch):
    import io

    config = json.loads((broken / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    stdin = io.StringIO("hi\n")
    monkeypatch.setattr("sys.stdin", stdin)
    code, _, err = run(capsys, "chat", "--model", str(broken))
    assert_one_line_error(code, err, 1, "no chat template")
    assert stdin.read() == "hi\n"  # refused before reading a line


def _options(parser, name="kestrel"):
    """(command, option action) for every option of every command of the CLI."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _options(child, f"{name} {sub}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield name, parser, action


def test_every_option_says_what_it_is_and_its_default():
    """Each option of each command has a help line, and one with a default shows it in --help (many showed
    neither: `kestrel train --help` gave `--checkpoint-every CHECKPOINT_EVERY` and nothing more)."""
    from kestrel.serve.cli import build_parser

    undocumented, no_default = [], []
    for command, parser, action in _options(build_parser()):
        if not action.help:
            undocumented.append((command, action.option_strings[0]))
        default = action.default
        if default is None or default is False:
            continue
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        if "default" not in formatter.format_help():
            no_default.append((command, action.option_strings[0]))
    assert not undocumented, undocumented
    assert not no_default, no_default


def test_ctrl_c_in_the_chat_stops_the_reply_not_the_chat(checkpoint, capsys, monkeypatch):
    """Ctrl-C while a reply streams stops that reply and the chat takes the next line (it ended the whole chat
    with status 130); Ctrl-C at the prompt ends the chat with status 0."""
    import io
    import os
    import signal

    from kestrel.engine.engine import Engine

    real_step, calls = Engine.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 3:  # the first reply's third step: the user presses Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhello\n\n"))
    argv = ["chat", "--model", str(checkpoint), "--max-new-tokens", "40", "--temperature", "0"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and "Traceback" not in err, err
    replies = out.split("> ")[1:]
    assert len(replies) == 3, out  # "hi", "hello", then the empty line that ends it
    assert "[stopped]" in replies[0] and "[stopped]" not in replies[1], out
    assert len(calls) > 6  # the second reply ran its own steps
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the chat's handler is gone

    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, out, err = run(capsys, *argv)
    assert code == 0 and "Traceback" not in err, err
