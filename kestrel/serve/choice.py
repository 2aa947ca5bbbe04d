"""One choice of a response, built up from the engine's StepOutputs on the event loop: incremental
detokenization, stop-string truncation, token ids, logprobs and timing. Also the logprob formats of the
OpenAI APIs (chat: `logprobs.content[...]`; completions: `tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`).

The engine stops a request at a stop string on its own; here the text is cut before the stop string, holding
back any tail that may begin one so that a stream never shows part of it. Should the text here reach a stop
string before the engine does (whose detokenizer has no prompt ids as left context), the choice ends here and
the caller aborts the engine request. Both count a stop string only where it ends in the text of the
min_tokens-th token or later.
"""

from __future__ import annotations

import os
import time

from kestrel.detokenize import IncrementalDetokenizer, StopStringMatcher
from kestrel.engine.outputs import StepOutput, TokenLogprob
from kestrel.engine.sampling_params import SamplingParams
from kestrel.tokenizer import Tokenizer

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class ChoiceState:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        prefix: str = "",
        echo_only: bool = False,
    ):
        """`prefix`: the echoed prompt's text, which the choice's text starts with; `echo_only`: that text alone
        (max_tokens 0 with echo), the engine's one token not shown."""
        self.prompt_ids, self.echo_only = prompt_ids, echo_only
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # with prompt_logprobs, once computed
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        )
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.text = prefix  # what the client has been sent (echo puts the prompt first)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text_offsets: list[int] = []  # where each token's text starts in `text`
        self.decoded = len(prefix)  # the text decoded so far, stop-string tails held back or not
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0  # prompt tokens the prefix cache gave this choice's request
        self.scheduled_time: float | None = None  # when its request was first admitted (time.monotonic)

    def update(self, out: StepOutput) -> str:
        """Take one output; returns the text it adds."""
        if self.finished:  # ended here first; the engine's last words for it are not shown
            return ""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        self.scheduled_time = self.scheduled_time or out.scheduled_time
        if self.echo_only:  # the prompt alone, as vLLM's: its length reached
            if out.finished:
                self.finished, self.finish_reason = True, "length"
            return ""
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        if out.new_token_ids:
            self.first_token_time = self.first_token_time or time.monotonic()
            self.last_token_time = time.monotonic()
        piece = ""
        # Stop strings count only where they end in the text of the min_tokens-th token or later (as in the
        # engine): `early` is the piece's text made before it.
        early = 0
        before = len(self.token_ids) - len(out.new_token_ids)  # this choice's tokens before this output
        # a stop token's text (EOS or one of stop_token_ids) is not shown, as in vLLM, unless asked for
        shown = len(out.new_token_ids) - (out.stopped_by_token and not self.include_stop)
        for i, token in enumerate(out.new_token_ids[:shown]):  # one at a time: each token's own offset
            start, text = _add_token(self.detokenizer, token)
            self.text_offsets.append(self.decoded + start)
            piece, self.decoded = piece + text, self.decoded + len(text)
            if before + i + 1 < self.min_tokens:
                early = len(piece)
        self.text_offsets += [self.decoded] * (len(out.new_token_ids) - shown)
        if out.finished:
            piece += self.detokenizer.flush()
            if len(self.token_ids) < self.min_tokens:
                early = len(piece)
        stopped = False
        if self.matcher is not None:
            piece, stopped = self.matcher.feed(piece, early)
        if out.finished and self.matcher is not None and not stopped:
            piece += self.matcher.flush()
        self.text += piece
        if stopped:
            self.finished, self.finish_reason = True, "stop"
            # the string the text was cut at, also where it was found here before the engine found it
            self.stop_reason = self.matcher.matched
        elif out.finished:
            self.finished, self.finish_reason, self.stop_reason = True, out.finish_reason, out.stop_reason
        return piece


def _add_token(detokenizer: IncrementalDetokenizer, token: int) -> tuple[int, str]:
    """One token through the detokenizer: where its text starts in the text not yet emitted, and the text it
    emits (each token's offset, as OpenAI's `text_offset`)."""
    held = detokenizer.held()
    text = detokenizer.add([token])
    return _token_start(held, text or detokenizer.held()), text


def _token_start(before: str, after: str) -> int:
    """Where a token starts in the text not yet emitted, given that text without and with it (ending in U+FFFD
    while a character is incomplete): after what the two share. A token that continued an incomplete character
    and left it incomplete (the same text, one U+FFFD) starts where that character does; a U+FFFD that stays (an
    invalid byte) is a character of its own, and the token after it starts after it."""
    shared = len(os.path.commonprefix([before, after]))
    if shared == len(before) == len(after) and before.endswith("\ufffd"):
        return shared - 1
    return shared


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as text; bytes that are part of a UTF-8 character show as `\\xNN`."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def echo_logprobs(tokenizer: Tokenizer, choice: ChoiceState) -> dict:
    """The echoed prompt's part of a completions choice's `logprobs` (the completion's joins it with
    `join_logprobs`): each prompt token's logprob given the ones before it and the top k, the first token's null
    (as OpenAI's and vLLM's), offsets into the prompt's text as the detokenizer makes it (special tokens' text
    kept, as in the echoed text)."""
    ids, lps = choice.prompt_ids, choice.prompt_logprobs or [None]
    detok, offsets, decoded = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), [], 0
    for token in ids:
        start, text = _add_token(detok, token)
        offsets.append(decoded + start)
        decoded += len(text)
    rest = completion_logprobs(tokenizer, lps[1:], offsets[1:])
    first = {"tokens": [token_text(tokenizer, ids[0])], "token_logprobs": [None], "top_logprobs": [None]}
    return join_logprobs({**first, "text_offset": offsets[:1]}, rest)


def choice_logprobs(tokenizer: Tokenizer, choice: ChoiceState, echo: bool) -> dict:
    """A whole completions choice's `logprobs`: the echoed prompt's first where it was echoed."""
    own = completion_logprobs(tokenizer, choice.logprobs, choice.text_offsets)
    return join_logprobs(echo_logprobs(tokenizer, choice), own) if echo else own


def join_logprobs(first: dict, then: dict) -> dict:
    """Two completions `logprobs` objects as one: the echoed prompt's, then the completion's."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> list[dict]:
    """Entries of a chat choice's `logprobs.content`."""

    def entry(token_id: int, logprob: float) -> dict:
        b = tokenizer.token_bytes(token_id)
        return {
            "token": b.decode("utf-8", errors="backslashreplace"),
            "logprob": _lp(logprob),
            "bytes": list(b),
        }

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], offsets: list[int]) -> dict:
    """A completions choice's `logprobs` object. Each `top_logprobs` entry holds the sampled token as well as
    the top k (OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements"; vLLM puts it first): with logprobs=0 the sampled token alone, not {}."""

    def top(lp: TokenLogprob) -> dict[str, float]:
        pairs = [(lp.token_id, lp.logprob), *lp.top]
        return {token_text(tokenizer, t): _lp(v) for t, v in pairs}

    return {
        "tokens": [token_text(tokenizer, lp.token_id) for lp in logprobs],
        "token_logprobs": [_lp(lp.logprob) for lp in logprobs],
        "top_logprobs": [top(lp) for lp in logprobs],
        "text_offset": list(offsets),
    }
