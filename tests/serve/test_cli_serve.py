"""`kestrel serve` as a real process (prints the memory plan and the URL, answers, stops on Ctrl-C), its bad
arguments as one-line errors, and `kestrel chat` fed from stdin."""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import sys
import time

import httpx

from kestrel.presets import builtin_model
from kestrel.serve.cli import main
from tests.test_cli import assert_one_line_error, run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_answers_and_stops(tmp_path):
    port = _free_port()
    argv = ["--model", "tiny", "--port", str(port), "--max-running-requests", "4", "--page-size", "16"]
    argv += ["--kv-cache-gb", "0.01", "--served-model-name", "kimi-tiny", "--log-level", "warning"]
    argv += ["--warmup", "on"]  # auto skips it on the CPU
    proc = subprocess.Popen(
        [sys.executable, "-m", "kestrel.serve.cli", "serve", *argv],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(proc, port)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["kimi-tiny"]
        body = {"model": "kimi-tiny", "prompt": "hi", "max_tokens": 3}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "memory plan: 4 state slots" in err and f"http://127.0.0.1:{port}/v1" in err
    assert "warmed up in" in err
    assert "Traceback" not in err


def test_ctrl_c_ends_open_streams_with_an_error_event(tmp_path):
    """Ctrl-C with a stream open: the stream ends with an error event and [DONE] at once (it was cut after the
    5 s graceful timeout, with a CancelledError traceback in the log), the server exits 0, and no nanobind
    "leaked" lines follow (the interpreter's teardown is skipped once the engine is shut down)."""
    import threading

    port = _free_port()
    argv = ["--model", "tiny", "--port", str(port), "--max-running-requests", "2", "--page-size", "16"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kestrel.serve.cli", "serve", *argv, "--kv-cache-gb", "0.01"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events, started = [], threading.Event()

    def client():
        body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    try:
        _wait_healthy(proc, port)
        reader = threading.Thread(target=client)
        reader.start()
        assert started.wait(30)
    finally:
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    reader.join(10)
    assert events[-1] == "data: [DONE]" and "the server is shutting down" in events[-2], events[-3:]
    assert proc.returncode == 0 and time.monotonic() - stopped < 5, err
    assert "Traceback" not in err and "nanobind" not in err, err


def test_a_port_in_use_or_a_bad_host_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run(capsys, "serve", "--model", "tiny", "--port", str(port))
        assert_one_line_error(code, err, 1, f"cannot listen on 127.0.0.1:{port}: the port is in use")
    code, _, err = run(capsys, "serve", "--model", "tiny", "--host", "999.1.1.1", "--port", str(port))
    assert_one_line_error(code, err, 1, "cannot listen on 999.1.1.1")


def _wait_healthy(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 180  # a liveness bound: a loaded 2-core machine took ~60 s with --warmup on
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def test_serve_bad_arguments_are_one_line_errors(capsys, tmp_path):
    code, _, err = run(capsys, "serve", "--model", str(tmp_path / "missing"))
    assert_one_line_error(code, err, 1, "missing")
    code, _, err = run(capsys, "serve", "--port", "70000")
    assert_one_line_error(code, err, 2, "--port")
    # an origin with a trailing slash never equals what a browser sends: its pages would be refused unseen
    code, _, err = run(capsys, "serve", "--allowed-origins", "http://localhost:3000/")
    assert_one_line_error(code, err, 2, "--allowed-origins", "no path or trailing slash")
    code, _, err = run(capsys, "serve", "--max-running-requests", "0")
    assert_one_line_error(code, err, 2, "--max-running-requests")
    code, _, err = run(capsys, "serve", "--kv-cache-gb", "0")
    assert_one_line_error(code, err, 1, "--kv-cache-gb")
    code, _, err = run(capsys, "serve", "--tool-call-parser", "llama3_json")
    assert_one_line_error(code, err, 2, "--tool-call-parser", "kimi_k2")
    code, _, err = run(capsys, "serve", "--enable-auto-tool-choice")
    assert_one_line_error(code, err, 1, "needs --tool-call-parser")
    code, _, err = run(capsys, "serve", "--reasoning-parser", "o1")
    assert_one_line_error(code, err, 2, "--reasoning-parser", "qwen3")
    # -64 is a multiple of the page size: the engine's "must be a multiple of page_size" was no help
    code, _, err = run(capsys, "serve", "--checkpoint-interval", "-64")
    assert_one_line_error(code, err, 2, "--checkpoint-interval", "an integer >= 0")
    # the engine's config errors name the flags, not EngineConfig's fields (hicache_host_bytes)
    code, _, err = run(
        capsys, "serve", "--model", "tiny", "--hicache-disk-dir", str(tmp_path), "--hicache-disk-gb", "1"
    )
    assert_one_line_error(code, err, 1, "set --hicache-host-gb too")
    # a file is no tokenizer folder ("tokenizer folder not found" named a path that exists)
    (tmp_path / "tokenizer.json").write_text("{}")
    code, _, err = run(capsys, "serve", "--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json"))
    assert_one_line_error(code, err, 1, "is a file", "the folder that holds tokenizer.json")


def test_a_max_model_len_past_the_models_limit_is_one_line(capsys, monkeypatch):
    """--max-model-len past the model's context limit (tiny's 4096): one line naming the flag and both numbers,
    from serve and chat (serve started with the limit silently cut to the model's)."""
    import uvicorn

    def served(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn.Server, "run", served)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    words = ("--max-model-len 100000 is past", "limit of 4096 tokens", "at most 4096")
    code, _, err = run(
        capsys, "serve", "--model", "tiny", "--port", str(_free_port()), "--max-model-len", "100000"
    )
    assert_one_line_error(code, err, 1, *words)
    code, _, err = run(capsys, "chat", "--model", "tiny", "--max-model-len", "100000")
    assert_one_line_error(code, err, 1, *words)


def test_chat_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nagain\n"))
    assert main(["chat", "--max-new-tokens", "3", "--temperature", "0", "--page-size", "16"]) == 0
    out, err = capsys.readouterr()
    assert out.count("> ") == 4 and f"chatting with {builtin_model()}" in err
    assert out.endswith(
        "> \n"
    )  # at the end of input the last prompt's line is ended (the shell's starts anew)


def test_chat_with_the_largest_seed(capsys, monkeypatch):
    # each turn's seed is --seed plus the turn: past int64 it wraps instead of failing the first turn
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", "tiny", "--max-new-tokens", "2", "--seed", str(2**63 - 1)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_chat_template_that_is_not_there_is_one_line_at_start(capsys, tmp_path):
    """serve --chat-template names a file that is not there, or a template that cannot render: one line before the
    server listens, not a failure on the first chat request."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    missing = str(tmp_path / "none.jinja")
    code, _, err = run(capsys, "serve", "--model", "tiny", "--port", port, "--chat-template", missing)
    assert_one_line_error(code, err, 1, "none.jinja", "not a readable file")
    bad = "{{ raise_exception('no chats here') }}"
    code, _, err = run(capsys, "serve", "--model", "tiny", "--port", port, "--chat-template", bad)
    assert_one_line_error(code, err, 1, "--chat-template does not render", "no chats here")
