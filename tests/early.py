"""Child processes that start when collection ends and run beside the rest of the suite.

A few tests run a whole script in a child process: the engine's decode and dense prefill through Triton's
interpreter, about 105 s of one core. CI has two cores and the suite's Python runs on one, so such a test
registers its child here at import, marks itself `@pytest.mark.early(key)`, and waits for the child's result
when it runs; conftest.py starts the child of every selected, not-skipped test once collection is done, and
kills what is still running when the session ends. A test that runs without that start (its module imported
some other way) starts the child itself when it first asks for it.

On the 2-core CPU machine (session 24, clean clones, `.ci/run`): the whole suite 773 and 812 s serially, 683 s
with these two children early (one thread each); the GPU suite's CPU smoke run (servers, torch on two threads)
started early as well made it 949 s: a child that wants both cores slows the suite more than it saves.
Session 33: that smoke run early on one thread gave 813 s against 830 (noise) while the tests it ran beside
slowed 2-9x, so it stays in its fixture; decode_kernels_check's interpreted smoke run (~23 s) is a third child.

Output goes to temporary files, not pipes: a child that prints more than a pipe holds would otherwise block
until its test reads it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

_STARTERS: dict[str, Callable[[], Child]] = {}
_RUNNING: dict[str, Child] = {}


@dataclass
class Child:
    proc: subprocess.Popen
    stdout: IO[bytes]
    stderr: IO[bytes]

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(returncode, stdout, stderr) once the child has ended; on a timeout its process group is killed and
        subprocess.TimeoutExpired raised."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode, _read(self.stdout), _read(self.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the servers a script started go down with it
            self.proc.wait()


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def spawn(cmd: list[str], **kwargs) -> Child:
    """Popen(cmd) in its own process group, stdout and stderr into temporary files."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, **kwargs)
    return Child(proc, out, err)


def spawn_interpreted(cmd: list[str]) -> Child:
    """`spawn(cmd)` with Triton's interpreter on and one thread: the interpreter's work is Python's, and the
    suite runs on the other core meanwhile."""
    return spawn(cmd, env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})


def register(key: str, start: Callable[[], Child]) -> None:
    """Register how to start the child `key` (a test module, at import)."""
    _STARTERS[key] = start


def child(key: str) -> Child:
    """The child `key`: the one started when collection ended, or started now."""
    if key not in _RUNNING:
        _RUNNING[key] = _STARTERS[key]()
    return _RUNNING[key]


def start_selected(items) -> None:
    """Start the child of every collected test marked `early` and not skipped by a `skipif` mark."""
    for item in items:
        mark = item.get_closest_marker("early")
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        if mark is not None and not skipped and mark.args[0] in _STARTERS:
            child(mark.args[0])


def kill_all() -> None:
    for c in _RUNNING.values():
        c.kill()
