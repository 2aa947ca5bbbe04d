"""Every bad input gets an OpenAI error body {"error": {"message", "type", "param", "code"}} with the right status
and no traceback: 400 for anything wrong in the request, 401 without the API key, 404 for an unknown model or
route, 503 (with Retry-After) when overloaded."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from tests.serve.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    # Every error says its kind in `code` (range errors had null), so a client need not read the message.
    assert isinstance(body["error"]["code"], str) and body["error"]["code"], body
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


CHAT_CASES = {
    "invalid json": ("{not json", None, "invalid_json"),
    "not an object": ("[1, 2]", None, "invalid_json"),
    "messages missing": ({"model": MODEL}, "messages", "missing_parameter"),
    "messages empty": (_chat(messages=[]), "messages", None),
    "unknown field": (_chat(frobnicate=1), "frobnicate", "unknown_parameter"),
    "unknown message field": (
        _chat(messages=[{"role": "user", "content": "x", "nme": "a"}]),
        "messages.0.nme",
        "unknown_parameter",
    ),
    "temperature as string": (_chat(temperature="hot"), "temperature", "invalid_type"),
    "max_tokens as float": (_chat(max_tokens=2.5), "max_tokens", "invalid_type"),
    "stream as int": (_chat(stream=1), "stream", "invalid_type"),
    "content as number": (
        _chat(messages=[{"role": "user", "content": 5}]),
        "messages.0.content",
        "invalid_type",
    ),
    "image part": (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages.0.content.0.type",
        None,
    ),
    "tool turn without its call's id": (
        _chat(messages=[{"role": "tool", "content": "x"}]),
        "messages.0.tool_call_id",
        None,
    ),
    "a user turn without content": (
        _chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": None}]),
        "messages.1.content",
        "missing_parameter",
    ),
    "negative temperature": (_chat(temperature=-0.5), "temperature", "invalid_value"),
    "top_p zero": (_chat(top_p=0), "top_p", None),
    "n zero": (_chat(n=0), "n", None),
    "n too large": (_chat(n=1000), "n", "invalid_value"),
    "max_tokens zero": (_chat(max_tokens=0), "max_tokens", None),
    "presence_penalty": (_chat(presence_penalty=3), "presence_penalty", None),
    "top_logprobs too many": (_chat(logprobs=True, top_logprobs=21), "top_logprobs", None),
    "top_logprobs without logprobs": (_chat(top_logprobs=2), "top_logprobs", None),
    "empty stop string": (_chat(stop=[""]), "stop", None),
    # matched on the engine's thread against every token: 200,000 of them slowed every stream 14x
    "too many stop strings": (_chat(stop=[f"s{i}" for i in range(65)]), "stop", "invalid_value"),
    "a stop string too long": (_chat(stop=["x" * 1025]), "stop", "invalid_value"),
    "stream_options without stream": (_chat(stream_options={"include_usage": True}), "stream_options", None),
    "max_tokens beyond the context": (_chat(max_tokens=100_000), "max_tokens", "context_length_exceeded"),
    "max_completion_tokens beyond the context": (
        _chat(max_tokens=None, max_completion_tokens=100_000),
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "prompt beyond the context": (
        _chat(messages=[{"role": "user", "content": "x" * 5000}]),
        "messages",
        "context_length_exceeded",
    ),
    "tools with tool_choice auto (the default)": (
        _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        "tool_choice",
        "unsupported_value",
    ),
    "an assistant turn's tool call without its function": (
        _chat(
            messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, *USER]
        ),
        "messages.1.tool_calls.0.function",
        "missing_parameter",
    ),
    "response_format without its schema": (
        _chat(response_format={"type": "json_schema"}),
        "response_format.json_schema",
        None,
    ),
    "response_format of an unknown type": (
        _chat(response_format={"type": "grammar"}),
        "response_format.type",
        None,
    ),
    "two output constraints": (
        _chat(response_format={"type": "json_object"}, guided_regex="a"),
        "guided_regex",
        None,
    ),
    "unsupported schema keyword": (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
        "response_format.json_schema.schema",
        None,
    ),
    "bad guided regex": (_chat(guided_regex="(a"), "guided_regex", None),
    "logit_bias past 100": (_chat(logit_bias={"65": 101}), "logit_bias", "invalid_value"),
    "logit_bias key not an id": (_chat(logit_bias={"a": 1}), "logit_bias", "invalid_value"),
    "logit_bias key negative": (_chat(logit_bias={"-1": 1}), "logit_bias", "invalid_value"),
    "logit_bias key a huge number": (_chat(logit_bias={"9" * 5000: 1}), "logit_bias", "invalid_value"),
    "logit_bias naming a token twice": (_chat(logit_bias={"5": 1, "05": 2}), "logit_bias", "invalid_value"),
    "logit_bias value a string": (_chat(logit_bias={"65": "1"}), "logit_bias.65", None),
    "logit_bias past the vocabulary": (_chat(logit_bias={"999999": 1}), "logit_bias", "invalid_value"),
    "allowed_token_ids empty": (_chat(allowed_token_ids=[]), "allowed_token_ids", "invalid_value"),
    "allowed_token_ids past the cap": (
        _chat(allowed_token_ids=[1] * 262_145),
        "allowed_token_ids",
        "invalid_value",
    ),
    "allowed_token_ids past the vocabulary": (_chat(allowed_token_ids=[65, 5000]), "allowed_token_ids", None),
    # values past what the device takes: each once passed validation and failed the engine's step, and with it
    # every later request (the engine went unhealthy)
    "seed past int64": (_chat(seed=2**64 + 1), "seed", None),
    "seed at 2**63": (_chat(seed=2**63), "seed", None),
    "seed below int64": (_chat(seed=-(2**63) - 1), "seed", None),
    "top_k past int32": (_chat(top_k=10**20), "top_k", None),
    "stop_token_ids past int32": (_chat(stop_token_ids=[10**20]), "stop_token_ids", None),
    "stop_token_ids past the vocabulary": (_chat(stop_token_ids=[1, 999_999]), "stop_token_ids", None),
    "infinite temperature": (_chat(temperature=float("inf")), "temperature", None),
    "min_tokens above max_tokens": (_chat(min_tokens=5, max_tokens=2), "min_tokens", None),
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_bad_chat_requests_are_400(server, case):
    body, param, code = CHAT_CASES[case]
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30)
    err = assert_error(r, 400, param, code)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "message, param, given",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "content.0.type",
            "image_url",
        ),
        ({"role": "function", "content": "x"}, "role", "function"),
    ],
)
def test_unsupported_parts_and_roles_are_named(server, message, param, given):
    """An image part or a (deprecated) function message is refused naming what was sent (it read "Input should
    be 'text'", which does not say that images are what this server lacks)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(messages=[message]), timeout=30)
    err = assert_error(r, 400, f"messages.0.{param}", "unsupported_value")
    assert f"'{given}' is not supported" in err["message"]


COMPLETION_CASES = {
    "prompt missing": ({"model": MODEL}, "prompt"),
    "prompt mixed types": ({"prompt": [1, "a"]}, "prompt"),
    "prompt of bools": ({"prompt": [True, False]}, "prompt"),
    "token id out of range": ({"prompt": [1, 99999]}, "prompt"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "too long prompt": ({"prompt": "y" * 5000}, "prompt"),
    "suffix": ({"prompt": "a", "suffix": "b"}, "suffix"),
    "best_of": ({"prompt": "a", "best_of": 3}, "best_of"),
    "max_tokens 0 without echo": ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    "logprobs too many": ({"prompt": "a", "logprobs": 50}, "logprobs"),
    "negative seed type": ({"prompt": "a", "seed": "1"}, "seed"),
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_bad_completion_requests_are_400(server, case):
    body, param = COMPLETION_CASES[case]
    r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert_error(r, 400, param)


GENERATE_CASES = {
    "neither text nor ids": ({"sampling_params": {}}, "text"),
    "both text and ids": ({"text": "a", "input_ids": [1]}, "text"),
    "unknown sampling param": (
        {"text": "a", "sampling_params": {"max_tokens": 3}},
        "sampling_params.max_tokens",
    ),
    "bad max_new_tokens": (
        {"text": "a", "sampling_params": {"max_new_tokens": 0}},
        "sampling_params.max_new_tokens",
    ),
    "too long": (
        {"text": "a", "sampling_params": {"max_new_tokens": 10_000}},
        "sampling_params.max_new_tokens",
    ),
    "logit_bias key not an id": (
        {"text": "a", "sampling_params": {"logit_bias": {"x": 1}}},
        "sampling_params.logit_bias",
    ),
    "logit_bias past 100": (
        {"text": "a", "sampling_params": {"logit_bias": {"1": -200}}},
        "sampling_params.logit_bias",
    ),
    # the engine's checks (the vocabulary), named as the request spells them
    "logit_bias past the vocabulary": (
        {"text": "a", "sampling_params": {"logit_bias": {"1000": 1}}},
        "sampling_params.logit_bias",
    ),
    "allowed_token_ids past the vocabulary": (
        {"text": "a", "sampling_params": {"allowed_token_ids": [1, 1000]}},
        "sampling_params.allowed_token_ids",
    ),
    "stop_token_ids past the vocabulary": (
        {"text": "a", "sampling_params": {"stop_token_ids": [1000]}},
        "sampling_params.stop_token_ids",
    ),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_bad_generate_requests_are_400(server, case):
    body, param = GENERATE_CASES[case]
    assert_error(httpx.post(f"{server.url}/generate", json=body, timeout=30), 400, param)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("/v1/chat/completions", _chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
        ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs"),
        ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_a_bad_value_is_named_as_the_request_spells_it(server, route, body, param):
    """The engine's SamplingParams names its own fields (logprobs, max_tokens); the message names the field the
    request gave, as `param` does."""
    err = assert_error(httpx.post(f"{server.url}{route}", json=body, timeout=30), 400, param)
    assert err["message"].startswith(param + " "), err


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "/v1/chat/completions",
            _chat(max_tokens=None, max_completion_tokens=99_999),
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", _chat(max_tokens=99_999), "max_tokens"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": 99_999}},
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_a_max_tokens_beyond_the_context_is_named_as_sent(server, route, body, param):
    """The engine's message names its own max_tokens; the client reads the field it sent, as in `param`."""
    err = assert_error(httpx.post(f"{server.url}{route}", json=body, timeout=30), 400, param)
    assert f" {param} (99999) exceeds the context" in err["message"], err


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": [5000, 5001], "echo": True, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 5000]], "max_tokens": 1}, "prompt"),
        ("/generate", {"input_ids": [1, 5000]}, "input_ids"),
    ],
)
def test_a_prompt_token_id_past_the_vocabulary_is_named(server, route, body, param):
    """As vLLM's "Token id 5000 is out of vocabulary": the client learns which id, not only the range."""
    err = assert_error(httpx.post(f"{server.url}{route}", json=body, timeout=30), 400, param)
    assert err["message"].startswith("prompt token id 5000 is outside the model's vocabulary [0, 261)"), err


def test_extreme_seeds_serve_and_the_server_stays_healthy(server):
    """The int64 bounds are valid seeds, n > 1 included (the later samples' seeds are mixed, not seed + j, which
    overflowed past the top)."""
    for seed in (2**63 - 1, -(2**63)):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(seed=seed, n=3), timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_whole_numbers_sent_as_floats_are_taken(server):
    """Python's json writes 4.0 for a float holding 4 (max_tokens = budget / 2): such a number is a whole number,
    as JSON and vLLM's parsing have it, on every route; 2.5 stays a 400 (CHAT_CASES)."""
    base = {"temperature": 0, "seed": 7}
    as_int = httpx.post(
        f"{server.url}/v1/chat/completions", json=_chat(max_tokens=3, n=2, **base), timeout=60
    )
    as_float = httpx.post(
        f"{server.url}/v1/chat/completions", json=_chat(max_tokens=3.0, n=2.0, **base, top_k=5.0), timeout=60
    )
    assert as_int.status_code == as_float.status_code == 200, as_float.text
    assert [c["message"] for c in as_float.json()["choices"]] == [
        c["message"] for c in as_int.json()["choices"]
    ]
    assert as_float.json()["usage"]["completion_tokens"] == as_int.json()["usage"]["completion_tokens"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2.0, "logprobs": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) <= 2, r.text
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": "a", "sampling_params": {"max_new_tokens": 2.0, "stop_token_ids": [1.0]}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "seed": 1.5}), 400, "seed")
    # token-id lists too: a prompt, a batch of them, /generate's input_ids, /detokenize's tokens
    ids = {"prompt": [97, 98], "max_tokens": 2, "temperature": 0}
    want = httpx.post(f"{server.url}/v1/completions", json=ids, timeout=60).json()["choices"][0]["text"]
    for prompt in ([97.0, 98.0], [[97.0, 98]]):
        r = httpx.post(f"{server.url}/v1/completions", json={**ids, "prompt": prompt}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    r = httpx.post(f"{server.url}/generate", json={"input_ids": [97.0, 98.0]}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [97.0, 98]}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == "ab", r.text
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": [97.5]}), 400, "prompt")


def test_a_body_past_the_limit_is_413_before_it_is_read(make_server):
    """--max-request-mb: by the declared length, or while a chunked body (no length) streams in."""
    s = make_server(max_request_mb=0.01, max_running_requests=2)
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * 20_000}]))
    url = f"{s.url}/v1/chat/completions"
    err = assert_error(httpx.post(url, content=big, timeout=30), 413, code="request_too_large")
    assert "0.01 MiB" in err["message"] and "--max-request-mb" in err["message"]

    def chunked():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000].encode()

    assert_error(httpx.post(url, content=chunked(), timeout=30), 413, code="request_too_large")
    assert httpx.post(url, json=_chat(), timeout=30).status_code == 200  # under the limit


def test_tokenizing_holds_up_no_other_request(make_server):
    """A prompt being tokenized (seconds for megabytes of text) runs off the event loop: /health answers
    meanwhile. The tokenizer is held on an event here, so nothing depends on timing."""
    import threading

    s = make_server(max_running_requests=2)
    release, entered = threading.Event(), threading.Event()
    tokenizer = s.app.state.server.tokenizer
    real = tokenizer.encode

    def held(text, *a, **kw):
        if text == "hold me":
            entered.set()
            assert release.wait(30)
        return real(text, *a, **kw)

    tokenizer.encode = held
    try:
        body = {"model": MODEL, "prompt": "hold me", "max_tokens": 2}
        slow = threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/completions", json=body, timeout=60))
        slow.start()
        assert entered.wait(30)
        assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200  # while the prompt is held
    finally:
        release.set()
        tokenizer.encode = real
    slow.join(30)


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(model="gpt-5"), timeout=30)
    assert_error(r, 404, "model", "model_not_found")
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=30)
    assert_error(r, 404, "model", "model_not_found")


def test_unknown_route_and_wrong_method(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_a_client_gone_before_its_whole_body_is_no_server_error(server, caplog):
    caplog.set_level(logging.INFO, logger="kestrel.serve")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s.sendall(f'{head}Content-Length: 1000\r\n\r\n{{"prompt": '.encode())
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if r.name == "kestrel.serve"]:
        assert time.monotonic() < deadline, "the server logged nothing about the request"
        time.sleep(0.05)
    assert all(r.levelno < logging.ERROR for r in caplog.records), caplog.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key(make_server):
    s = make_server(api_key="sekret", max_running_requests=4)
    url = f"{s.url}/v1/chat/completions"
    assert_error(httpx.post(url, json=_chat(), timeout=30), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer wrong"}
    assert_error(httpx.post(url, json=_chat(), headers=bad, timeout=30), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{s.url}/v1/models", headers={"Authorization": "sekret"}), 401)
    assert_error(httpx.get(f"{s.url}/get_server_info"), 401)
    assert_error(httpx.post(f"{s.url}/generate", json={"text": "a"}), 401)
    good = {"Authorization": "Bearer sekret"}
    assert httpx.post(url, json=_chat(), headers=good, timeout=30).status_code == 200
    assert httpx.get(f"{s.url}/v1/models", headers=good).status_code == 200
    assert_error(httpx.get(f"{s.url}/version"), 401)
    # open without a key: health checks and Prometheus scrapes
    assert httpx.get(f"{s.url}/health").status_code == 200
    assert httpx.get(f"{s.url}/ping").status_code == httpx.post(f"{s.url}/ping").status_code == 200
    assert httpx.get(f"{s.url}/metrics").status_code == 200


def _stats(server) -> dict:
    return server.info()["stats"]


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_overload_is_503_with_retry_after(make_server):
    s = make_server(max_running_requests=1, max_queued_requests=1)
    base = s.pools()
    long = {"stream": True, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    url = f"{s.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        with a.stream("POST", url, json=_chat(**long)) as held:
            assert held.status_code == 200
            _wait(lambda: _stats(s)["num_running"] == 1)  # holds the only slot
            with b.stream("POST", url, json=_chat(**long)) as queued:
                assert queued.status_code == 200
                _wait(lambda: _stats(s)["num_queued"] == 1)  # waits for it
                r = httpx.post(url, json=_chat(), timeout=30)
                err = assert_error(r, 503, code="overloaded")
                assert r.headers["retry-after"] == "1" and "overloaded" in err["message"]
                r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
                assert_error(r, 503, code="overloaded")
    # both streams closed: their requests are aborted and the server takes requests again
    s.wait_for_pools(base)
    assert httpx.post(url, json=_chat(), timeout=30).status_code == 200


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize and /detokenize: the ids a completion of the same prompt (or chat) is fed, back to text;
    bad requests named."""

    def post(path, **body):
        return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30)

    prompt = "Kestrel tokenizes this, é and all."
    done = post("/v1/completions", prompt=prompt, max_tokens=1).json()
    got = post("/tokenize", prompt=prompt).json()
    assert got["count"] == len(got["tokens"]) == done["usage"]["prompt_tokens"] and got["max_model_len"] > 0
    assert post("/detokenize", tokens=got["tokens"]).json() == {"prompt": prompt}
    chat = post("/v1/chat/completions", messages=USER, max_tokens=1).json()
    opened = post("/tokenize", messages=USER).json()
    assert opened["count"] == chat["usage"]["prompt_tokens"]
    assert post("/tokenize", messages=USER, add_generation_prompt=False).json()["count"] < opened["count"]
    assert_error(post("/tokenize"), 400, "prompt")
    assert_error(post("/tokenize", prompt="a", messages=USER), 400, "prompt")
    assert_error(post("/tokenize", messages=[]), 400, "messages")
    nothing = [{"role": "user", "content": None}]
    assert_error(post("/tokenize", messages=nothing), 400, "messages.0.content", "missing_parameter")
    assert_error(post("/detokenize", tokens=[1, 10**9]), 400, "tokens")
    assert_error(post("/detokenize", tokens=[-1]), 400, "tokens")
    assert_error(post("/detokenize", tokens="abc"), 400, "tokens")
    assert_error(post("/tokenize", prompt="a", model="nope"), 404, "model", "model_not_found")


def test_allowed_origins_answer_a_browsers_preflight(server, make_server):
    """`--allowed-origins`: a listed origin's preflight and request carry CORS headers; another origin's, and
    every origin on a server without the flag (the default), do not."""
    page = "http://localhost:3000"
    preflight = {
        "Origin": page,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    cors = make_server(allowed_origins=[page], api_key="k")
    for s, allowed in ((cors, True), (server, False)):
        r = httpx.options(f"{s.url}/v1/completions", headers=preflight, timeout=30)
        assert (r.headers.get("access-control-allow-origin") == page) is allowed, r.headers
        headers = {"Origin": page, "Authorization": "Bearer k"}
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200 and ("access-control-allow-origin" in r.headers) is allowed
    r = httpx.options(
        f"{cors.url}/v1/completions", headers={**preflight, "Origin": "http://evil.test"}, timeout=30
    )
    assert "access-control-allow-origin" not in r.headers
