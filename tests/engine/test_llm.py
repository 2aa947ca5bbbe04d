"""The offline LLM API's chat(): conversations in, one output each; anything else is a clear ValueError."""

import dataclasses

import pytest
import torch

from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams
from kestrel.presets import builtin_model, preset_config
from kestrel.utils.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=128)


def test_chat_takes_one_conversation_or_several(llm):
    conv = [{"role": "user", "content": "hi"}]
    (one,) = llm.chat(conv, GREEDY, use_tqdm=False)
    both = llm.chat([conv, [{"role": "system", "content": "be brief"}, *conv]], GREEDY, use_tqdm=False)
    assert len(both) == 2
    assert both[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert both[1].prompt_token_ids != one.prompt_token_ids
    as_tuples = llm.chat((tuple(conv), [{"role": "assistant"}, *conv]), GREEDY, use_tqdm=False)  # content: ""
    assert as_tuples[0].prompt_token_ids == one.prompt_token_ids and len(as_tuples) == 2
    assert llm.chat(tuple(conv), GREEDY, use_tqdm=False)[0].prompt_token_ids == one.prompt_token_ids


def test_chat_template_kwargs_offline():
    """LLM.chat's chat_template_kwargs reach the template (vLLM's), the prompt being what it renders."""
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    llm = LLM("tiny", device="cpu", max_model_len=128, chat_template=template)
    conv = [{"role": "user", "content": "hi"}]
    (on,) = llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})
    (off,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert (
        llm.tokenizer.decode(on.prompt_token_ids) == "hi<think>"
        and llm.tokenizer.decode(off.prompt_token_ids) == "hi"
    )
    with pytest.raises(ValueError, match="chat_template_kwargs.tools cannot be given"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"tools": []})
    shown = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
    shown += "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    llm.tokenizer.set_chat_template(shown)
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    (with_tools,) = llm.chat(conv, GREEDY, use_tqdm=False, tools=tools)
    assert llm.tokenizer.decode(with_tools.prompt_token_ids) == "[get_time]hi"
    # as the server renders them: a function without parameters given an empty object's schema, [] as none
    llm.tokenizer.set_chat_template("{{ tools[0].function.parameters | tojson if tools else 'none' }}")
    (shown,) = llm.chat(conv, GREEDY, use_tqdm=False, tools=tools)
    assert llm.tokenizer.decode(shown.prompt_token_ids) == '{"type": "object", "properties": {}}'
    (empty,) = llm.chat(conv, GREEDY, use_tqdm=False, tools=[])
    assert llm.tokenizer.decode(empty.prompt_token_ids) == "none"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        None,
        5,
        ["hello"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [[{"role": "user", "content": "x"}], "y"],
    ],
    ids=["str", "empty", "none", "int", "list-of-str", "no-role", "bad-role", "mixed"],
)
def test_chat_refuses_what_is_not_a_conversation(llm, messages):
    with pytest.raises(ValueError, match=r"chat takes a conversation.*generate\(\)"):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.requests


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm, include):
    """As vLLM: the ids end with the stop token, the text without it (with include_stop_str_in_output, with it)."""
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the first time this token comes
    params = SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[ids[k]], include_stop_str_in_output=include
    )
    (out,) = llm.generate("abc", params, use_tqdm=False)[0].outputs
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert out.text == llm.tokenizer.decode(ids[: k + 1 if include else k])


@pytest.mark.parametrize(
    "prompts",
    [b"Hi", [b"Hi"], {"foo": 1}, [{"prompt": 5}], [{"prompt": "a", "prompt_token_ids": [1]}], []],
    ids=["bytes", "list-of-bytes", "dict-without-prompt", "dict-int-prompt", "dict-both", "empty"],
)
def test_generate_refuses_what_is_not_a_prompt(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.requests


def test_token_ids_from_numpy_or_torch_are_prompts(llm):
    """Tokenizers hand ids back as numpy arrays or tensors: {"prompt_token_ids": array} was numpy's "truth value
    of an array is ambiguous", a list of numpy integers "cannot read prompt"."""
    import numpy as np

    ids = [5, 6, 7]
    want = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (
        {"prompt_token_ids": np.array(ids)},
        {"prompt_token_ids": torch.tensor(ids)},
        [np.int64(i) for i in ids],
        [np.array(ids, dtype=np.int32)],
    ):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
        assert all(type(t) is int for t in out.prompt_token_ids)
    for bad in ({"prompt_token_ids": np.array([True, False])}, {"prompt_token_ids": np.array([1.5])}):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate(bad, GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("temperature", "0.5", "temperature must be a number"),
        ("top_p", "0.5", "top_p must be a number"),
        ("n", True, "n must be an integer"),
        ("max_tokens", True, "max_tokens must be an integer"),
        ("seed", 1.5, "seed must be an integer"),
        ("stop", 5, "stop must be a string or a list of strings, not 5"),  # TypeError: not iterable
        ("stop_token_ids", 7, "stop_token_ids must be a list of token ids, not 7"),
        ("stop_token_ids", [True], "stop_token_ids must be token ids"),  # was token 1
    ],
)
def test_sampling_params_of_the_wrong_type_name_their_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})


def test_a_seed_past_int64_is_a_config_error():
    """LLM("tiny", seed=2**70) was torch's "Overflow when unpacking long long" from the weights' generator."""
    from kestrel.config import EngineConfig
    from kestrel.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"seed must be an integer in .*, got {2**70}"):
        EngineConfig(model="tiny", seed=2**70)
    assert EngineConfig(model="tiny", seed=-(2**63)).seed == -(2**63)


def test_page_size_zero_is_a_config_error_not_a_division_by_zero():
    from kestrel.config import EngineConfig
    from kestrel.utils.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="page_size must be >= 1"):
        EngineConfig(model="tiny", page_size=0)


def test_a_special_tokens_text_is_a_stop_string_where_it_is_not_skipped(llm):
    """As vLLM: stop strings are matched in the text as the request decodes it; with skip_special_tokens=False a
    special token's text ("<|im_end|>") stops the request, stop_reason the string."""
    loose = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, skip_special_tokens=False)
    (free,) = llm.generate("abc", loose, use_tqdm=False)[0].outputs
    k, special = next(
        (k, t) for k, t in enumerate(free.token_ids) if t >= 256
    )  # the byte tokenizer's specials
    stop = llm.tokenizer.decode([special], skip_special_tokens=False)
    params = dataclasses.replace(loose, stop=[stop])
    (out,) = llm.generate("abc", params, use_tqdm=False)[0].outputs
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free.token_ids[: k + 1]
    assert out.text == llm.tokenizer.decode(free.token_ids[:k], skip_special_tokens=False)


def test_a_stop_string_passed_over_before_min_tokens_is_not_where_the_text_is_cut(llm):
    """The text is cut at the stop string that stopped the request, not at an earlier one that ended before
    min_tokens and did not count."""
    loose = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    (free,) = llm.generate("abc", loose, use_tqdm=False)[0].outputs
    ids, text = free.token_ids, free.text
    # a printable character that shows up at least twice, as a token of its own both times
    k = next(
        k for k, t in enumerate(ids) if 32 <= t < 127 and ids.index(t) < k and ids[: k + 1].count(t) == 2
    )
    stop = chr(ids[k])
    (out,) = llm.generate("abc", dataclasses.replace(loose, stop=[stop], min_tokens=k + 1), use_tqdm=False)[
        0
    ].outputs
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == ids[: k + 1]
    assert out.text == llm.tokenizer.decode(ids[:k]) and out.text.count(stop) == 1
    assert text.startswith(out.text)


def test_a_max_model_len_past_the_models_limit_is_refused_before_the_weights_load(monkeypatch):
    """LLM(max_model_len=...) past the model's limit: an error naming both numbers, raised before any weights
    are built (it was silently cut to the model's limit)."""
    limit = preset_config("tiny").max_position_embeddings

    def no_build(*args, **kwargs):
        raise AssertionError("the weights were built before the limit was checked")

    monkeypatch.setattr("kestrel.engine.engine.build_model", no_build)
    with pytest.raises(
        ConfigError, match=f"max_model_len {4 * limit} .* limit of {limit} tokens: give at most"
    ):
        LLM("tiny", device="cpu", max_model_len=4 * limit)


def test_the_offline_api_stops_at_the_context_limit_as_vllms(llm):
    """One prompt whose max_tokens pass the context limit ends there ("length"), where it failed the whole call;
    a prompt past the limit itself is a ValueError (as vLLM's); `from kestrel import LLM, SamplingParams` works,
    and request ids differ from one call to the next."""
    import kestrel

    assert kestrel.LLM is LLM and kestrel.SamplingParams is SamplingParams
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a, b = llm.generate([list(range(3, 123)), [5, 6]], params, use_tqdm=False)  # 120 of the 128
    assert (len(a.outputs[0].token_ids), a.outputs[0].finish_reason) == (8, "length")
    assert len(b.outputs[0].token_ids) == 50
    (c,) = llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    assert len({a.request_id, b.request_id, c.request_id}) == 3
    assert c.outputs[0].cumulative_logprob is None and llm.get_tokenizer() is llm.tokenizer  # vLLM's names
    (d,) = llm.generate([[5, 6]], dataclasses.replace(GREEDY, logprobs=0), use_tqdm=False)
    assert d.outputs[0].cumulative_logprob == sum(lp.logprob for lp in d.outputs[0].logprobs) <= 0
    with pytest.raises(ValueError, match="context limit"):
        llm.generate([list(range(3, 131))], GREEDY, use_tqdm=False)


def test_offline_logprobs_read_as_vllms_dicts(llm):
    """vLLM's offline logprobs are, per position, a dict token id -> Logprob(logprob, rank, decoded_token), the
    sampled token among them; code written for them (`lps[i][tok].logprob`, `.items()`) reads ours the same."""
    from kestrel.engine.outputs import Logprob

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (res,) = llm.generate(["hello there"], params, use_tqdm=False)
    out = res.outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 4
    for tok, lps in zip(out.token_ids, out.logprobs):
        assert tok in lps and isinstance(lps[tok], Logprob)
        assert lps[tok].logprob == lps.logprob and list(lps)[0] == tok  # the taken token first
        assert lps[tok].rank == 1  # greedy: the best
        assert lps[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        ranked = sorted((v.rank, t, v.logprob) for t, v in lps.items())
        assert [r for r, _, _ in ranked] == [1, 2, 3] and len(lps) == 3
        assert [v for _, _, v in ranked] == sorted((v for _, _, v in ranked), reverse=True)
    assert out.cumulative_logprob == pytest.approx(
        sum(lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs))
    )
    first, *rest = res.prompt_logprobs
    assert first is None and len(rest) == len(res.prompt_token_ids) - 1
    for tok, lps in zip(res.prompt_token_ids[1:], rest):
        assert lps[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        # the top 2 ranked by their logprobs; the prompt's token ranked where it is among them, else unranked
        top = sorted(((v.logprob, t) for t, v in lps.items() if v.rank is not None), reverse=True)
        assert [lps[t].rank for _, t in top] == [1, 2]
        assert lps[tok].rank is None or lps[tok].logprob == top[lps[tok].rank - 1][0]
        assert lps[tok].rank is not None or lps[tok].logprob <= top[-1][0]


def test_request_output_says_what_the_cache_gave(llm):
    """RequestOutput.num_cached_tokens (vLLM's): 0 the first time a prompt is seen, whole pages of it after."""
    prompt = [7 + i % 50 for i in range(90)]
    (a,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (b,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    page = llm.engine.kv_pool.page_size
    assert a.num_cached_tokens == 0
    assert 0 < b.num_cached_tokens < len(prompt) and b.num_cached_tokens % page == 0


@pytest.mark.skipif(builtin_model() != "kestrel-demo", reason="the shipped demo model is not in this install")
def test_the_demo_model_goes_on_with_a_started_reply():
    """continue_final_message on the shipped model: given the first step of a worked chain sum, it goes on to the
    answer it gives the question alone (greedy)."""
    demo = LLM("kestrel-demo", device="cpu")
    question = [
        {
            "role": "user",
            "content": "State the final answer to the following arithmetic problem: 27 - 64 - 11 - 18 =",
        }
    ]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    (whole,) = demo.chat(question, greedy, use_tqdm=False)
    assert whole.outputs[0].text == "27 - 64 = -37\n-37 - 11 = -48\n-48 - 18 = -66\nAnswer: -66"
    started = [*question, {"role": "assistant", "content": "27 - 64 = -37\n"}]
    (rest,) = demo.chat(started, greedy, use_tqdm=False, continue_final_message=True)
    assert "27 - 64 = -37\n" + rest.outputs[0].text == whole.outputs[0].text
    with pytest.raises(ValueError, match="cannot both be true"):
        demo.chat(started, greedy, use_tqdm=False, add_generation_prompt=True, continue_final_message=True)
