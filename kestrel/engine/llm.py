"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, call-compatible with vLLM's `LLM.generate`
for the common arguments (and accepting SGLang-style sampling dicts such as {"max_new_tokens": 32})."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

from tqdm import tqdm

from kestrel.config import EngineConfig
from kestrel.detokenize import StopStringMatcher
from kestrel.engine.engine import Engine
from kestrel.engine.outputs import CompletionOutput, RequestOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.presets import builtin_model

_SGLANG_NAMES = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"}


def as_sampling_params(value) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        kwargs = {_SGLANG_NAMES.get(k, k): v for k, v in value.items()}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return SamplingParams(**kwargs)
    raise TypeError(f"sampling_params must be SamplingParams or a dict, got {type(value).__name__}")


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """model: a checkpoint folder or preset name; None is the built-in model (kestrel-demo when installed)."""
        self.engine = Engine(EngineConfig(model=model or builtin_model(), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._calls = 0  # generate() calls: their request ids

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id lists, or dicts
        with "prompt" / "prompt_token_ids". sampling_params: one for all, or one per prompt."""
        items = _normalize_prompts(prompts)
        params = (
            sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(items)
        )
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        params = [as_sampling_params(p) for p in params]
        results, children = [], {}
        self._calls += 1
        limit = self.engine.plan.max_model_len
        try:  # a bad prompt or a failed step aborts this call's requests: the LLM stays usable
            for i, ((text, ids), p) in enumerate(zip(items, params)):
                if ids is None:
                    ids = self.tokenizer.encode(text)
                if p.max_tokens is not None and len(ids) < limit < len(ids) + p.max_tokens:
                    # as vLLM's offline API: the output stops at the context limit ("length"), where one long
                    # prompt had failed the whole call (the server's requests get a 400, as vLLM's server does)
                    p = dataclasses.replace(p, max_tokens=limit - len(ids))
                results.append(RequestOutput(f"{self._calls}-{i}", text, ids, [None] * p.n))
                for j, child in enumerate(p.children()):
                    # ids of this call: an aborted request leaves the engine at its next step
                    rid = self.engine.add_request(ids, child, f"{self._calls}-{i}-{j}")
                    children[rid] = (i, j, child)
            self._run(children, results, use_tqdm)
        except BaseException:
            for rid in children:
                self.engine.abort(rid)
            raise
        return results

    def _run(self, children: dict, results: list[RequestOutput], use_tqdm: bool) -> None:
        """Step the engine until every request of `children` (id -> (prompt, sample, params)) has finished."""
        tokens = {rid: [] for rid in children}
        logprobs = {rid: [] for rid in children}
        texts: dict[int, str] = {}  # token id -> its text, for the logprobs' decoded_token
        bar = tqdm(total=len(children), desc="generate", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id not in children:  # an earlier call's, aborted when that call failed
                    continue
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.new_logprobs or []
                i, j, p = children[out.request_id]
                if out.prompt_logprobs is not None:  # (each of the prompt's n samples computes the same)
                    results[i].prompt_logprobs = self._decoded(out.prompt_logprobs, texts)
                if j == 0:
                    results[i].num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    lps = self._decoded(logprobs[out.request_id], texts)
                    results[i].outputs[j] = self._completion(j, tokens[out.request_id], lps, out, p)
                    bar.update(1)
        bar.close()

    def _decoded(self, lps: list, texts: dict[int, str]) -> list:
        """`lps` with each entry's token text (vLLM's `Logprob.decoded_token`), decoded once a token a call."""
        for lp in lps:
            if lp is not None:
                for t in lp:
                    if t not in texts:
                        texts[t] = self.tokenizer.decode([t], skip_special_tokens=False)
                lp.set_texts(texts)
        return lps

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer()`)."""
        return self.tokenizer

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them. As vLLM's:
        `continue_final_message` leaves the last message open for the model to go on with;
        `add_generation_prompt` (true unless given, or continuing) opens the assistant's turn;
        `chat_template_kwargs` are more variables for the chat template (such as `enable_thinking`); `tools`
        (OpenAI's function definitions) go to templates that show them. The reply is the model's text: calls in
        its own format are read by the server's tool-call parser, not here."""
        sequence = (list, tuple)
        if isinstance(messages, sequence) and messages and isinstance(messages[0], dict):
            convs = [messages]
        else:
            convs = list(messages) if isinstance(messages, sequence) else [messages]
        if not convs or not all(isinstance(c, sequence) and c and all(map(_is_message, c)) for c in convs):
            raise ValueError(
                'chat takes a conversation, a list of {"role": ..., "content": ...} dicts, or a list of '
                f"conversations, not {_preview(messages)} (a plain prompt goes to generate())"
            )
        options = dict(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        prompts = [self.tokenizer.apply_chat_template(list(c), **options) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _completion(self, index, ids, lps, out, p: SamplingParams) -> CompletionOutput:
        """The finished choice: its text without its stop string or stop token's text (unless
        include_stop_str_in_output), its ids with the stop token (as vLLM's)."""
        shown = ids[:-1] if out.stopped_by_token and not p.include_stop_str_in_output else ids
        text = self.tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens)
        if isinstance(out.stop_reason, str):
            matcher = StopStringMatcher(p.stop, p.include_stop_str_in_output)
            # a stop string ended by the tokens before the min_tokens-th did not count
            early = len(
                self.tokenizer.decode(shown[: p.min_tokens - 1], skip_special_tokens=p.skip_special_tokens)
            )
            text, stopped = matcher.feed(text, early if p.min_tokens > 1 else 0)
            text += "" if stopped else matcher.flush()
        return CompletionOutput(
            index, text, ids, out.finish_reason, out.stop_reason, lps if p.logprobs is not None else None
        )


def _is_message(m) -> bool:
    """A dict with a role (its content may be absent: the chat template reads "")."""
    return isinstance(m, dict) and isinstance(m.get("role"), str)


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _normalize_prompts(prompts) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompts, str):
        return [(prompts, None)]
    if isinstance(prompts, dict):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)) or not prompts:
        raise ValueError(
            "prompts must be a string, token ids, or a non-empty list of them (bytes: decode them)"
        )
    flat = _token_ids(prompts)
    if flat is not None:
        return [(None, flat)]
    items = []
    for p in prompts:
        if isinstance(p, str):
            items.append((p, None))
        elif isinstance(p, dict):
            text, ids = p.get("prompt"), p.get("prompt_token_ids")
            if ids is not None:
                ids = _token_ids(ids)
                if ids is None:
                    raise ValueError(f'"prompt_token_ids" must be a list of token ids, not {_preview(p)}')
            if (text is None) == (ids is None) or not isinstance(text, (str, type(None))):
                raise ValueError(f'a prompt dict holds "prompt" (a string) or "prompt_token_ids", not {p!r}')
            items.append((text, ids))
        elif (ids := _token_ids(p)) is not None:
            items.append((None, ids))
        else:
            raise ValueError(f"cannot read prompt {_preview(p)}")
    return items


def _token_ids(value) -> list[int] | None:
    """`value` as a list of token ids, where it is a sequence of integers (Python's, numpy's, or an integer
    array or tensor, as tokenizers return them; not bools); else None. (An array in "prompt_token_ids" was numpy's
    "truth value of an array is ambiguous"; numpy integers in a list, "cannot read prompt".)"""
    if isinstance(value, (str, bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        return None
    items = list(value)
    if any(
        isinstance(t, bool) or getattr(t, "dtype", None) is not None and "bool" in str(t.dtype) for t in items
    ):
        return None
    try:
        return [operator.index(t) for t in items]
    except TypeError:
        return None
