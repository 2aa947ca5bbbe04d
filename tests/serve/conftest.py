"""A real uvicorn server on a free loopback port, in a background thread, serving the tiny preset."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kestrel.config import EngineConfig
from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.engine import Engine
from kestrel.serve.api import build_app

MODEL = "tiny"


def metric_samples(text: str) -> dict[str, float]:
    """/metrics' samples by name and labels, e.g. 'kestrel_requests_total{finish_reason="length"}', without the
    `model_name` label every sample carries (checked here)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        label = f'model_name="{MODEL}"'
        assert label in key, line
        key = key.replace("{" + label + "}", "").replace(label + ",", "")
        out[key] = float(value)
    return out


class RunningServer:
    def __init__(
        self,
        api_key: str | None = None,
        max_request_mb: float = 64,
        allowed_origins: list[str] | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        served_model_names: list[str] | None = None,
        **engine_kw,
    ):
        engine_kw.setdefault("page_size", 16)
        engine_kw.setdefault("max_running_requests", 64)
        self.engine = Engine(EngineConfig(model=MODEL, **engine_kw))
        self.async_engine = AsyncEngine(self.engine)
        app = build_app(
            self.async_engine,
            served_model_names or MODEL,
            api_key=api_key,
            max_request_mb=max_request_mb,
            allowed_origins=allowed_origins,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def info(self, headers=None) -> dict:
        return httpx.get(f"{self.url}/get_server_info", headers=headers, timeout=10).json()

    def pools(self, headers=None) -> tuple[int, int, int, int]:
        """Free KV pages, free state slots, running and queued requests."""
        s = self.info(headers)["stats"]
        return (
            s["num_free_pages"] + s.get("num_cached_pages", 0),
            s["num_free_slots"],
            s["num_running"],
            s["num_queued"],
        )

    def wait_for_pools(self, want, headers=None, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (got := self.pools(headers)) != want:
            assert time.monotonic() < deadline, f"pools {got} did not return to {want}"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.async_engine.shutdown()


@pytest.fixture(scope="session")
def server():
    s = RunningServer()
    yield s
    s.close()


@pytest.fixture
def make_server():
    started = []

    def make(**kw) -> RunningServer:
        started.append(RunningServer(**kw))
        return started[-1]

    yield make
    for s in started:
        s.close()


def force_responses_reply(monkeypatch, text: str) -> None:
    """The Responses API takes no regex: make its requests' reply `text` (a regex of it, as the chat route's
    structured_outputs gives one), for tests of formats the tiny model does not write by itself."""
    from kestrel.serve.responses_protocol import ResponsesRequest

    force_reply(monkeypatch, ResponsesRequest, text)


def force_reply(monkeypatch, request_class: type, text: str) -> None:
    """Make the reply of every request of `request_class` (a route's request body) `text`, by a regex of it."""
    import re

    from kestrel.engine.sampling_params import StructuredOutputsParams

    made = request_class.to_sampling_params

    def forced(self):
        params = made(self)
        params.structured_outputs = StructuredOutputsParams(regex=re.escape(text))
        return params

    monkeypatch.setattr(request_class, "to_sampling_params", forced)
