"""The OpenAI-compatible endpoints through the real `openai` client, and the native and operations endpoints,
against a live server on the tiny model (byte tokenizer, random weights: the text is noise, the mechanics are
what is checked)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from kestrel.engine.sampling_params import child_seed
from tests.serve.conftest import MODEL, metric_samples

CHAT = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and choice.logprobs is None
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6 and r.usage.prompt_tokens > len("Hello there")


def test_chat_accepts_text_parts_and_max_completion_tokens(client):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_chat_accepts_names_and_empty_tool_calls(client):
    """What SDKs and agent frameworks send along: a participant's name, an assistant turn's empty tool_calls."""
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, *CHAT]
    sent = [{**plain[0], "name": "bob"}, {**plain[1], "tool_calls": []}, plain[2]]
    got = [
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=4, **GREEDY) for m in (plain, sent)
    ]
    assert got[0].choices[0].message.content == got[1].choices[0].message.content
    assert got[0].usage.prompt_tokens == got[1].usage.prompt_tokens


def test_completion_single_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(b"The sky is")
    # Two prompts (one as token ids) x n=2: choice index = prompt * n + sample.
    r2 = client.completions.create(
        model=MODEL, prompt=[[84, 104, 101], [65, 66]], max_tokens=4, n=2, seed=5, temperature=1.0
    )
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    assert r2.usage.prompt_tokens == 5 and r2.usage.completion_tokens == 16


def test_greedy_is_the_same_streamed_or_not(client):
    kw = dict(model=MODEL, prompt="stream me", max_tokens=12, **GREEDY)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **GREEDY)
    assert text == full.choices[0].message.content


def test_stream_with_continuous_usage(client):
    """vLLM's continuous_usage_stats: every chunk carries the usage so far, the completion tokens never fall, and
    the last chunk the total; without include_usage it adds nothing."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in (
        (client.chat.completions.create, {"messages": CHAT}),
        (client.completions.create, {"prompt": "count with me"}),
    ):
        chunks = list(create(model=MODEL, max_tokens=6, stream=True, stream_options=options, **kw, **GREEDY))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
        assert counts[-1] == 6 and chunks[-1].choices == []
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        quiet = list(
            create(model=MODEL, max_tokens=6, stream=True, stream_options={"continuous_usage_stats": True}, **kw,
                   **GREEDY)
        )  # fmt: skip
        assert all(c.usage is None for c in quiet) and quiet[-1].choices


def test_n_choices_in_a_stream_carry_their_index(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=11, temperature=1.0, stream=True
    )
    text, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        (c,) = chunk.choices
        text[c.index] += c.delta.content or ""
        if c.finish_reason:
            reasons[c.index] = c.finish_reason
    assert set(reasons) == {0, 1}
    full = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=11, temperature=1.0
    )
    assert [c.message.content for c in full.choices] == [text[0], text[1]]


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="roll the dice", max_tokens=10, temperature=1.0)
    a = client.completions.create(seed=42, **kw).choices[0].text
    b = client.completions.create(seed=42, **kw).choices[0].text
    c = client.completions.create(seed=43, **kw).choices[0].text
    assert a == b and a != c
    two = client.completions.create(seed=42, n=2, **kw).choices
    # the second sample's seed is child_seed(42, 1), not 43: seeds 42 and 43 share no sample
    second = client.completions.create(seed=child_seed(42, 1), **kw).choices[0].text
    assert two[0].text == a and two[1].text == second != c


def test_a_tiny_temperature_samples_greedily(client):
    """Below 1e-5 a temperature is greedy (the logits divided by 1e-40 were inf, their softmax NaN: token 0)."""
    kw = dict(model=MODEL, prompt="roll the dice", max_tokens=6)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for t in (1e-40, 5e-324, 1e-6):
        assert client.completions.create(temperature=t, seed=3, **kw).choices[0].text == greedy


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", "backslashreplace") == entry.token
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    # logprobs without alternatives
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs)
    streamed = list(
        client.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=2, stream=True, **GREEDY)
    )
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """OpenAI's completions (and vLLM's): `top_logprobs` always holds the sampled token, so up to logprobs + 1
    entries; logprobs=0 gives the sampled token alone (it gave {} for every token before)."""
    kw = dict(
        model=MODEL, prompt="abc", max_tokens=8, seed=3, temperature=2.0, extra_body={"ignore_eos": True}
    )
    lp = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    lp = client.completions.create(logprobs=1, **kw).choices[0].logprobs
    assert all(
        top[t] == v and len(top) <= 2 for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    )
    # at temperature 2, some sampled token is not the best one
    assert any(len(top) == 2 for top in lp.top_logprobs)


def _stop_for(text: str) -> str:
    """A printable ASCII character a few characters into `text`."""
    return next(ch for ch in text[3:] if "!" <= ch <= "~")


def test_stop_strings_cut_the_text(client):
    kw = dict(model=MODEL, prompt="Once upon a time", **GREEDY)
    free = client.completions.create(max_tokens=48, **kw).choices[0].text
    stop = _stop_for(free)
    want = free[: free.index(stop)]
    r = client.completions.create(max_tokens=48, stop=[stop, "never-appears"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop
    streamed = list(client.completions.create(max_tokens=48, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    # the stop string in the last chunk, as in the whole response (vLLM's streams carry it too)
    assert (streamed[-1].choices[0].finish_reason, streamed[-1].choices[0].stop_reason) == ("stop", stop)
    assert all(c.choices[0].stop_reason is None for c in streamed[:-1])


def test_chat_stop_string(client):
    free = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, **GREEDY)
    text = free.choices[0].message.content
    stop = _stop_for(text)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, stop=stop, **GREEDY)
    assert r.choices[0].message.content == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=48, stop=stop, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    assert (streamed[-1].choices[0].finish_reason, streamed[-1].choices[0].stop_reason) == ("stop", stop)


def test_echo_puts_the_prompt_first(client):
    plain = client.completions.create(model=MODEL, prompt="echo this", max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt="echo this", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "echo this" + plain.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="echo this", max_tokens=4, echo=True, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_echo_with_logprobs_gives_the_prompts_logprobs(client, server):
    """As vLLM (and lm-evaluation-harness's loglikelihood requests): the prompt's tokens with their logprobs given
    the tokens before them (the first's null), then the completion's; max_tokens 0 gives the prompt's alone. The
    values are the model's own full forward's, though the prompt is in the prefix cache by then."""
    import torch

    prompt, k = "echo this, then more", 2
    ids = server.engine.tokenizer.encode(prompt)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=k, **GREEDY)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=k, echo=True, **GREEDY)
    lp, own = r.choices[0].logprobs, plain.choices[0].logprobs
    assert r.choices[0].text == prompt + plain.choices[0].text
    assert lp.tokens[len(ids) :] == own.tokens and lp.top_logprobs[len(ids) :] == own.top_logprobs
    assert lp.text_offset[len(ids) :] == [len(prompt) + o for o in own.text_offset]
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)]) and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(server.engine.model(torch.tensor(ids)).float(), -1)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-3
        assert 1 <= len(lp.top_logprobs[p]) <= k + 1  # the prompt's token and the top k
    only = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=k, echo=True, **GREEDY)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.choices[0].logprobs.tokens == lp.tokens[: len(ids)]
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=3, logprobs=k, echo=True, stream=True, **GREEDY)
    chunks = list(client.completions.create(**kw))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    chunks = list(client.completions.create(**{**kw, "prompt": ids, "max_tokens": 0}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens[: len(ids)]
    assert "".join(c.choices[0].text for c in chunks) == only.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # an id prompt's special tokens echo as their text (as vLLM's), and the offsets count it
    bos = server.engine.tokenizer.bos_token_id
    r = client.completions.create(model=MODEL, prompt=[bos, *ids], max_tokens=0, logprobs=0, echo=True)
    bos_text = server.engine.tokenizer.decode([bos], skip_special_tokens=False)
    assert r.choices[0].text == bos_text + prompt
    assert r.choices[0].logprobs.text_offset[:2] == [0, len(bos_text)]


def test_models(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-5")


def test_native_generate(server):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 5 and out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["prompt_tokens"] == 3
    # the same from token ids, with logprobs
    body = {
        "input_ids": [97, 98, 99],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    out2 = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    assert out2["output_ids"] == out["output_ids"] and out2["text"] == out["text"]
    assert [t for _, t in out2["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 2 for top in out2["meta_info"]["output_top_logprobs"])
    # batch
    batch = httpx.post(
        f"{server.url}/generate",
        json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}},
        timeout=30,
    ).json()
    assert isinstance(batch, list) and len(batch) == 2


def test_native_generate_takes_null_as_not_given(server):
    """As the OpenAI routes do: `"stream": null` was a 400."""
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    plain = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    nulls = {"stream": None, "return_logprob": None, "top_logprobs_num": None}
    r = httpx.post(f"{server.url}/generate", json={**body, **nulls}, timeout=30)
    assert r.status_code == 200, r.text
    assert (
        r.json()["output_ids"] == plain["output_ids"] and "output_token_logprobs" not in r.json()["meta_info"]
    )
    r = httpx.post(f"{server.url}/generate", json={**body, **nulls, "return_logprob": True}, timeout=30)
    assert len(r.json()["meta_info"]["output_token_logprobs"]) == 3, r.text


def test_native_generate_stream(server):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    full = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"] and last["index"] == 0


def test_health_and_server_info(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    # vLLM's probe and version routes
    assert (
        httpx.get(f"{server.url}/ping").json() == httpx.post(f"{server.url}/ping").json() == {"status": "ok"}
    )
    assert httpx.get(f"{server.url}/version").json() == {"version": server.info()["version"]}
    info = server.info()
    assert info["served_model_name"] == MODEL and info["healthy"]
    assert info["memory_plan"]["num_pages"] == info["stats"]["num_pages"]
    assert info["engine_config"]["page_size"] == 16 and info["model"]["layer_pattern"]
    for key in ("num_running", "num_waiting", "num_free_pages", "num_free_slots", "num_queued"):
        assert key in info["stats"]


@pytest.mark.parametrize(
    "path",
    ["/health", "/ping", "/version", "/v1/models", f"/v1/models/{MODEL}", "/get_server_info", "/metrics"],
)
def test_head_answers_where_get_does(server, path):
    """Health probes and uptime monitors that send HEAD got a 405."""
    got, head = httpx.get(f"{server.url}{path}"), httpx.head(f"{server.url}{path}")
    assert head.status_code == got.status_code == 200, head.text
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


FAMILIES = [
    ("kestrel_num_requests_running", "gauge"),
    ("kestrel_num_requests_waiting", "gauge"),
    ("kestrel_kv_pages_used", "gauge"),
    ("kestrel_kv_pages_cached", "gauge"),
    ("kestrel_kv_pages_total", "gauge"),
    ("kestrel_kv_cache_usage_perc", "gauge"),
    ("kestrel_state_slots_used", "gauge"),
    ("kestrel_state_slots_total", "gauge"),
    ("kestrel_time_to_first_token_seconds", "histogram"),
    ("kestrel_inter_token_latency_seconds", "histogram"),
    ("kestrel_e2e_request_latency_seconds", "histogram"),
    ("kestrel_prompt_tokens_total", "counter"),
    ("kestrel_generation_tokens_total", "counter"),
    ("kestrel_requests_total", "counter"),
    ("kestrel_http_responses_total", "counter"),
    ("kestrel_generation_tokens_per_second", "gauge"),
    ("kestrel_num_preemptions_total", "counter"),
    ("kestrel_request_queue_time_seconds", "histogram"),
    ("kestrel_request_prefill_time_seconds", "histogram"),
    ("kestrel_request_decode_time_seconds", "histogram"),
    ("kestrel_request_inference_time_seconds", "histogram"),
    ("kestrel_request_prompt_tokens", "histogram"),
    ("kestrel_request_generation_tokens", "histogram"),
]
SAMPLE = re.compile(r'^[a-z_][a-z0-9_]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eE]+(Inf)?$')


def test_metrics(server, client):
    client.completions.create(
        model=MODEL, prompt="count me " * 12, max_tokens=3, **GREEDY
    )  # a few whole pages
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in FAMILIES:
        assert f"# TYPE {name} {kind}\n" in text, name
    for line in text.splitlines():
        assert line.startswith("#") or SAMPLE.match(line), line
    values = _samples(text)
    assert values['kestrel_requests_total{finish_reason="length"}'] >= 1
    assert values["kestrel_generation_tokens_total"] >= 3
    assert values["kestrel_time_to_first_token_seconds_count"] >= 1
    assert values['kestrel_e2e_request_latency_seconds_bucket{le="+Inf"}'] >= 1
    stats = server.info()["stats"]
    assert values["kestrel_kv_pages_total"] == stats["num_pages"]
    # the finished request's pages stay in the prefix cache: used, and counted as cached
    assert values["kestrel_kv_pages_cached"] == stats["num_cached_pages"] > 0
    assert values["kestrel_kv_pages_used"] >= values["kestrel_kv_pages_cached"]
    # ... but not in use: an idle server's usage is 0, where used / total read as if the cache filled it
    server.wait_for_pools(server.pools())
    assert metric_samples(httpx.get(f"{server.url}/metrics").text)["kestrel_kv_cache_usage_perc"] == 0


def _samples(text: str) -> dict[str, float]:
    return metric_samples(text)


def test_a_prompt_sampled_n_times_counts_its_tokens_once(server, client):
    """Each choice is a finished request, but two prompts with n=2 add their prompt tokens once each (as usage
    does), not once per choice."""
    scrape = lambda: _samples(httpx.get(f"{server.url}/metrics").text)
    done = 'kestrel_requests_total{finish_reason="length"}'
    before = scrape()
    r = client.completions.create(
        model=MODEL, prompt=["count me once", "and me too"], n=2, max_tokens=3, **GREEDY
    )
    after = scrape()
    assert len(r.choices) == 4 and r.usage.prompt_tokens == len(b"count me once") + len(b"and me too")
    assert (
        after["kestrel_prompt_tokens_total"] - before["kestrel_prompt_tokens_total"] == r.usage.prompt_tokens
    )
    assert after[done] - before.get(done, 0) == 4
    added = lambda key: after[key] - before.get(key, 0)
    # the per-request histograms (vLLM's): each prompt once, each choice once, each choice's wait for a slot
    assert added("kestrel_request_prompt_tokens_count") == 2
    assert added("kestrel_request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert added("kestrel_request_generation_tokens_count") == 4
    assert added("kestrel_request_generation_tokens_sum") == r.usage.completion_tokens == 12
    assert added("kestrel_request_queue_time_seconds_count") == 4
    # and their phases from admission: prefill to the first token, decode to the last, inference both
    for phase in ("prefill", "decode", "inference"):
        assert added(f"kestrel_request_{phase}_time_seconds_count") == 4
    assert added("kestrel_request_inference_time_seconds_sum") == pytest.approx(
        added("kestrel_request_prefill_time_seconds_sum") + added("kestrel_request_decode_time_seconds_sum")
    )


def test_http_responses_are_counted_by_route_and_status(server, client):
    """Refusals never reached kestrel_requests_total (finished engine requests): they are counted here, by the
    route's template, unknown paths as one label."""

    def counts() -> dict[str, float]:
        samples = metric_samples(httpx.get(f"{server.url}/metrics").text)
        return {k: v for k, v in samples.items() if k.startswith("kestrel_http_responses_total{")}

    before = counts()
    client.completions.create(model=MODEL, prompt="ok", max_tokens=1, **GREEDY)
    httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    httpx.get(f"{server.url}/no/such/path/123")
    httpx.get(f"{server.url}/v1/models/{MODEL}")
    after = counts()

    def added(route: str, status: int) -> float:
        key = f'kestrel_http_responses_total{{route="{route}",status="{status}"}}'
        return after.get(key, 0) - before.get(key, 0)

    assert added("/v1/completions", 200) == 1 and added("/v1/completions", 400) == 2
    assert added("unmatched", 404) == 1 and added("/v1/models/{model:path}", 200) == 1


def test_usage_says_how_much_of_the_prompt_the_cache_gave(server):
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI's, which the agent benchmark reads) and /generate's
    `meta_info.cached_tokens` (SGLang's): 0 for a prompt seen first, whole pages of it when sent again; it was
    absent, though the cache had served the second send whole pages."""
    prompt = "cache me if you can: " + "abcdefghij" * 12  # unseen by every other test
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}, first
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0, again  # the server's pages: 16 tokens
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").completions.create(
        model=MODEL, prompt=[prompt, "another prompt, not cached"], max_tokens=2, n=2
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == cached  # the second prompt's 0, each prompt once
    r = httpx.post(f"{server.url}/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["meta_info"]["cached_tokens"] == cached, r.text


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(server, client):
    """OpenAI's logit_bias (string keys, as the client sends them) and vLLM's allowed_token_ids, on every route:
    +100 on a token makes it the greedy choice, -100 on the greedy tokens makes them never come, allowed ids are
    the only ones sampled; the logprobs stay the model's."""
    kw = dict(model=MODEL, prompt="steer me", max_tokens=8, **GREEDY)
    forced = client.completions.create(logit_bias={"120": 100}, **kw).choices[0]
    assert forced.text == "x" * 8

    def generate(**sampling) -> list[int]:
        body = {"text": "steer me", "sampling_params": {"max_new_tokens": 8, "temperature": 0, **sampling}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    plain = generate(ignore_eos=True)
    avoided = generate(ignore_eos=True, logit_bias={str(t): -100 for t in plain})
    assert len(avoided) == 8 and not set(avoided) & set(plain)
    assert generate(logit_bias={"121": 100}) == [121] * 8
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        logprobs=True,
        extra_body={"allowed_token_ids": [97, 98], "ignore_eos": True},
    ).choices[0]
    assert set(sampled.message.content) <= {"a", "b"} and len(sampled.message.content) == 12
    # the logprobs are the model's: those of the same tokens read back as the prompt's (echo)
    forced = client.completions.create(logit_bias={"120": 100}, logprobs=0, **{**kw, "max_tokens": 4})
    echoed = client.completions.create(
        model=MODEL, prompt="steer me" + forced.choices[0].text, max_tokens=0, echo=True, logprobs=0
    )
    want = echoed.choices[0].logprobs.token_logprobs[-4:]
    assert forced.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert max(want) < -1  # far from the top: not what the bias made of them


def test_continue_final_message_goes_on_with_the_given_start(server, client):
    """vLLM's continue_final_message: the last (assistant) message is left open and the reply goes on from it
    (its tokens are the prompt's); /tokenize gives those ids; with add_generation_prompt also true, a 400."""
    start = [*CHAT, {"role": "assistant", "content": "Sure, the answer is"}]
    body = {"model": MODEL, "messages": start, "continue_final_message": True}
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nSure, the answer is"
    assert r["tokens"] == server.engine.tokenizer.encode(text)
    reply = client.chat.completions.create(
        model=MODEL, messages=start, max_tokens=5, extra_body={"continue_final_message": True, **GREEDY["extra_body"]},
        temperature=0,
    )  # fmt: skip
    same = client.completions.create(model=MODEL, prompt=r["tokens"], max_tokens=5, **GREEDY)
    assert reply.choices[0].message.content == same.choices[0].text
    assert reply.usage.prompt_tokens == r["count"]
    for route in ("/v1/chat/completions", "/tokenize"):
        bad = {**body, "add_generation_prompt": True}
        r = httpx.post(f"{server.url}{route}", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    # /tokenize of a plain prompt has no template to apply them to
    r = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "hi", "continue_final_message": True}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_responses_api_through_the_openai_client(server, client):
    """OpenAI's Responses API, stateless and text only, through the client's typed objects: a string input, and
    messages with instructions, each the chat route's greedy reply; streamed, its typed events in order with
    the same text; a reply cut by max_output_tokens is `incomplete`; tools and previous_response_id are 400s."""
    kw = dict(model=MODEL, max_output_tokens=6, temperature=0)
    r = client.responses.create(input="Hello there", **kw)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    r2 = client.responses.create(input=messages, instructions="Be brief.", **kw)
    sys_chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *CHAT], max_tokens=6, temperature=0
    )
    assert r2.output_text == sys_chat.choices[0].message.content
    assert r2.usage.input_tokens == sys_chat.usage.prompt_tokens
    long = client.responses.create(input="Hello there", model=MODEL, max_output_tokens=3, temperature=0,
                                   extra_body={})  # fmt: skip
    cut = long.usage.output_tokens == 3  # (or an EOS came first)
    assert long.status == ("incomplete" if cut else "completed")
    assert (long.incomplete_details.reason if cut else long.incomplete_details) == (
        "max_output_tokens" if cut else None
    )
    events = list(client.responses.create(input="Hello there", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    assert (r.temperature, r.top_p, r.tool_choice, r.parallel_tool_calls) == (0.0, 1.0, "auto", True)
    # a conversation sent back as the client saves it (model_dump: the output items' `phase` and ids included),
    # with the parameters clients send that ask for nothing here
    turns = [{"role": "user", "content": "Hi"}, *[o.model_dump(mode="json") for o in r.output]]
    again = client.responses.create(
        input=[*turns, {"role": "user", "content": "more"}],
        safety_identifier="u1",
        prompt_cache_key="k",
        text={"format": {"type": "text"}, "verbosity": "medium"},
        **kw,
    )
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.input_tokens
    for bad, param in (
        ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # "auto": no tool-call parser here
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name"),  # the item's own flaw
        ({"input": [{"role": "user"}]}, "input.0.content"),
        ({"input": "x" * 5000}, "input"),  # past the context
    ):
        body = {"model": MODEL, "input": "hi", **bad}
        e = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text


def test_a_served_chat_template_renders_every_chat_route(make_server):
    """serve --chat-template (EngineConfig.chat_template): /tokenize, chat completions and the Responses API all
    render with it."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    s = make_server(chat_template=template)
    body = {"model": MODEL, "messages": CHAT}
    r = httpx.post(f"{s.url}/tokenize", json=body, timeout=30).json()
    assert r["tokens"] == s.engine.tokenizer.encode("<user>Hello there<assistant>")
    chat = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30).json()
    responses = httpx.post(
        f"{s.url}/v1/responses",
        json={"model": MODEL, "input": "Hello there", "max_output_tokens": 2},
        timeout=30,
    ).json()
    assert chat["usage"]["prompt_tokens"] == responses["usage"]["input_tokens"] == r["count"]
