"""The engine: requests in, tokens out, one step at a time (schedule, forward, sample, postprocess).

Single-threaded; `kestrel.engine.async_engine.AsyncEngine` runs it in its own thread for the server.

The overlap schedule (on unless `disable_overlap_schedule`): while a decode step runs on the device, the host
already launches the next one, whose input tokens are the device tensor the step in flight samples into, and
only then waits for the step in flight and post-processes it. The host's scheduling, staging and
post-processing hide behind the device's step instead of adding to it. It runs where the next step is the same
decode batch one position further (penalties count the token still in flight on the device; logprobs are
computed on the device and come up with the tokens); elsewhere a step runs, samples and lands before the next
is scheduled. A structured-output request's mask needs the token in flight: a batch with grammars launches the
next step's forward, lands the step in flight, then samples (`_land_then_sample`). A request that stops on a
sampled token (EOS, a stop token or string) has computed one more step by the time the host sees it: the token it
sampled is dropped, while its KV row and state (the stop token's own, correct) may go into the prefix cache with
the rest.
The next step is planned before the step in flight lands: a slot that a stop frees is taken one step later than
without the overlap (one that a length limit frees is known ahead, and the plain schedule takes it at once).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import uuid
import weakref
from dataclasses import dataclass

import torch

from kestrel.cache.hicache import HiCache
from kestrel.cache.kv_pool import KVPool
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import StatePool
from kestrel.chat_template import use_chat_template
from kestrel.config import EngineConfig
from kestrel.detokenize import IncrementalDetokenizer, StopStringMatcher
from kestrel.engine.checkpoints import Checkpoints
from kestrel.engine.memory import check_max_model_len, plan_memory
from kestrel.engine.outputs import StepOutput
from kestrel.engine.request import Request, Status
from kestrel.engine.runner import ModelRunner
from kestrel.engine.sampler import Sampler
from kestrel.engine.sampling_params import SamplingParams
from kestrel.engine.scheduler import Batch, Scheduler
from kestrel.env import check_env
from kestrel.grammar.regex import PatternError
from kestrel.grammar.tokens import GrammarCache, Vocabulary
from kestrel.layers.mla import dsa_topks, set_dense_attention
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model, model_config
from kestrel.tokenizer import Tokenizer, check_tokenizer_fits, tokenizer_for
from kestrel.utils.device import resolve_device, resolve_dtype, to_device_async, to_host_async
from kestrel.utils.errors import ConfigError, KestrelError

log = logging.getLogger("kestrel.engine")


class RequestError(KestrelError, ValueError):
    """A request the engine cannot take (too long, bad token ids, bad parameters): a 400 for the server,
    which reports `param` (the request field at fault) and `code` in its error body; a ValueError, as vLLM's
    offline API raises for a bad prompt."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class InFlight:
    """A decode step launched and not yet read back: its batch, its tokens on the device, their host copy (pinned
    on CUDA), the host copies of the logprobs its requests ask for (`Sampler.logprob_rows`' tuple, or None), and
    the event recorded after those copies (None on the CPU, where everything has run already)."""

    batch: Batch
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None
    logprobs: tuple | None = None


class Engine:
    @contextlib.contextmanager
    def _allocating(self, smaller: str):
        """Buffers of the memory plan allocated: one that does not fit (or whose size overflows) is a ConfigError
        naming the options that shrink it, not a traceback."""
        try:
            yield
        # torch's OutOfMemoryError is a RuntimeError; a size past int64, a TypeError or an OverflowError
        except (RuntimeError, MemoryError, TypeError, OverflowError) as e:
            text = str(e).lower()
            if not any(w in text for w in ("alloc", "overflow")) and not isinstance(e, MemoryError):
                raise
            raise ConfigError(
                f"the memory plan does not fit the {self.device.type.upper()} memory ({self.plan.describe()}): "
                f"a smaller {smaller}"
            ) from None

    def __init__(
        self, config: EngineConfig, model: KimiForCausalLM | None = None, tokenizer: Tokenizer | None = None
    ):
        check_env()  # a bad KESTREL_* value: an error now, not at the first step that reads it
        self.config = config
        self.device = resolve_device(config.device) if model is None else model.lm_head.weight.device
        dtype = resolve_dtype(config.dtype, self.device) if model is None else model.lm_head.weight.dtype
        if model is None and config.max_model_len is not None:  # refused before the weights load
            check_max_model_len(model_config(config.model), config)
        self.model = model or build_model(config.model, dtype=dtype, device=self.device, seed=config.seed)
        self.model.eval()
        self.tokenizer = tokenizer or tokenizer_for(config.model, config.tokenizer)
        if config.chat_template is not None:
            use_chat_template(self.tokenizer, config.chat_template)
        mc = self.model.config
        check_tokenizer_fits(self.tokenizer, mc.vocab_size)
        self.plan = plan_memory(mc, config, dtype, self.device)
        log.info(self.plan.describe())
        with self._allocating("--kv-cache-gb, --mem-fraction or --max-running-requests"):
            self.kv_pool = KVPool(
                mc, self.plan.num_pages, config.page_size, dtype, self.device, config.index_key_dtype == "fp8"
            )
            self.state_pool = StatePool(mc, self.plan.num_slots, dtype, self.device)
        self.cache, self.checkpoints = None, None
        if config.enable_prefix_cache:
            with self._allocating("--num-checkpoints"):
                self.checkpoint_pool = StatePool(
                    mc, self.plan.num_checkpoints, dtype, self.device, zero_on_alloc=False
                )
            tiers = None
            if config.hicache_host_bytes:
                with self._allocating("--hicache-host-gb"):
                    tiers = HiCache(
                        self.kv_pool,
                        self.checkpoint_pool,
                        config.hicache_host_bytes,
                        config.hicache_disk_dir,
                        config.hicache_disk_bytes,
                    )
                log.info(
                    "hicache: %d host blocks of %d B%s",
                    tiers.host.num_blocks,
                    tiers.block_bytes,
                    f", disk tier in {tiers.disk.dir} ({config.hicache_disk_bytes} B)" if tiers.disk else "",
                )
            self.cache = RadixCache(self.kv_pool, self.checkpoint_pool, config.page_size, tiers)
            self.checkpoints = Checkpoints(
                self.cache, self.state_pool, self.checkpoint_pool, config.page_size
            )
        self.scheduler = Scheduler(
            self.kv_pool,
            self.state_pool,
            config.chunk_size(self.device.type),
            self.plan.num_slots,
            self.cache,
            config.checkpoint_interval,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            self.state_pool,
            self.plan.max_model_len,
            use_cuda_graph=not config.disable_cuda_graph,
            max_batch=min(config.cuda_graph_max_bs, self.plan.num_slots),
            checkpoint_pool=self.checkpoint_pool if self.cache is not None else None,
            short_graph_len=config.cuda_graph_short_len,
        )
        self.eos_token_ids = tuple(dict.fromkeys((*mc.eos_token_ids, *self.tokenizer.eos_token_ids)))
        self.sampler = Sampler(self.eos_token_ids)
        # structured outputs' grammars over the model's vocabulary (its bytes read on the first such request)
        self.grammars = GrammarCache(lambda: Vocabulary.of(self.tokenizer, mc.vocab_size, self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        # requests with stop strings: their text as it decodes, looked through for the stop strings
        self._detok: dict[str, tuple[IncrementalDetokenizer, StopStringMatcher]] = {}
        self._aborted: list[Request] = []
        self.overlap = not config.disable_overlap_schedule
        self.in_flight: InFlight | None = None  # the overlap schedule's step on the device
        self.runner.capture_graphs()

    def warm_up(self, prompt_tokens: int = 4096) -> float:
        """Run a few throwaway requests so that the first user request does not pay for the kernels' first
        compilation and autotuning (on the H200 a fresh server's first 10K-token turn took 9 s, the next ones
        0.15 s). Covers a long prefill (two sequences of different lengths submitted together: the chunked KDA
        form, and the DSA top-k once the prompt is longer than index_topk), a cache hit with a short append (the
        recurrent KDA form, checkpoint restore) and decode. Then the cache is flushed and the cache and
        preemption counters reset, so the engine looks untouched. Needs an idle engine; returns the seconds it
        took (0 where the context limit is below a few tokens: nothing to run)."""
        if self.has_unfinished():
            raise KestrelError("warm_up needs an idle engine (requests are running)")
        start = time.perf_counter()
        limit, vocab = self.plan.max_model_len, self.model.config.vocab_size
        if limit < 8:  # a prompt plus 4 tokens must fit
            return 0.0
        gen = torch.Generator().manual_seed(0)
        n = max(2, min(prompt_tokens, limit - 120))
        long = torch.randint(3, vocab, (n,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, seed=0)
        turns = [[long, long[: n // 2 + 17]]]
        if self.cache is not None and n + 110 < limit:  # the same history again with a short append: a hit
            turns.append([long + torch.randint(3, vocab, (100,), generator=gen).tolist()])
        for prompts in turns:
            for ids in prompts:
                self.add_request(ids, params, request_id=f"warm-up-{uuid.uuid4().hex}")
            while self.has_unfinished():
                self.step()
        if self.cache is not None:
            self.flush_cache()
            self.cache.reset_stats()
        self.scheduler.num_preemptions = 0
        return time.perf_counter() - start

    def set_dense_attention(self, dense: bool) -> None:
        """Dense attention over every visible token in the DSA layers (True), or the indexer's top-k (False).
        Call it with no request running. The cached prefixes were computed in the other mode, so they are
        flushed; the decode graphs captured the other mode's kernels, so they are captured again."""
        if self.has_unfinished():
            raise KestrelError("set_dense_attention needs an idle engine (requests are running)")
        modes = {k is None for k in dsa_topks(self.model)}
        if not modes or modes == {dense}:
            return  # no DSA layer, or already in that mode: keep the cache and the graphs
        set_dense_attention(self.model, dense)
        self.flush_cache()
        self.runner.recapture_graphs()

    # -- requests ---------------------------------------------------------------------------------------
    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the engine cannot take this prompt. Reads only immutable state (the plan and
        the vocabulary), so another thread may call it (the server validates before queueing)."""
        limit, vocab = self.plan.max_model_len, self.model.config.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        # the types through one set and the range through min/max (C loops: a 32K-token prompt in about a ms)
        if set(map(type, prompt_ids)) != {int} or not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            bad = next(t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab)
            what = f"outside the model's vocabulary [0, {vocab})" if type(bad) is int else "not an integer"
            raise RequestError(f"prompt token id {bad!r} is {what}", param="prompt")
        for name, largest in params.max_token_ids.items():
            if largest >= vocab:
                raise RequestError(f"{name} must name token ids in [0, {vocab}), not {largest}", param=name)
        if params.allowed_token_ids and params.min_tokens:
            banned = {*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)}
            allowed = params.allowed_token_ids  # (more allowed than banned: never all banned)
            if len(allowed) <= len(banned) and banned.issuperset(allowed):
                raise RequestError(
                    "allowed_token_ids are all stop tokens (EOS or stop_token_ids), which min_tokens bans: no "
                    "token could be sampled",
                    param="allowed_token_ids",
                )
        if params.structured_outputs is not None:
            self.grammar_of(params)
        if len(prompt_ids) >= limit:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the context limit is {limit} (prompt + output)",
                param="prompt",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"limit of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def grammar_of(self, params: SamplingParams):
        """The compiled grammar of a request's structured outputs (compiled once, then kept a while: the server
        calls this first in a worker thread); RequestError where it cannot be had. The spec holds on to what it
        compiled to here, so that `add_request` finds it even where the cache has let it go meanwhile (64 other
        patterns compiled in between: it was compiled again on the engine's thread, which stalled every stream)."""
        spec = params.structured_outputs
        if not self.eos_token_ids:
            raise RequestError(
                "structured outputs need an EOS token, and this model has none", param="structured_outputs"
            )
        cache, grammar = spec.__dict__.get("_compiled", (None, None))
        if cache is not None and cache() is self.grammars:
            return grammar
        try:
            grammar = self.grammars.get(spec.pattern)
        except PatternError as e:
            raise RequestError(f"structured outputs {spec.kind}: {e}", param="structured_outputs") from None
        # (a frozen dataclass: into its __dict__, as `pattern`'s cached_property does. The cache names the
        # vocabulary, and is held weakly: it refers to this engine, which a client's params must not keep alive;
        # the spec's copies and pickles leave the pin out)
        spec.__dict__["_compiled"] = (weakref.ref(self.grammars), grammar)
        return grammar

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_ids, params)
        limit = self.plan.max_model_len
        total = limit if params.max_tokens is None else len(prompt_ids) + params.max_tokens
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, list(prompt_ids), params, seed, total)
        if params.structured_outputs is not None:
            request.grammar = self.grammar_of(params)
            request.grammar_state = request.grammar.start
        self.requests[request_id] = request
        if params.stop:
            # stop strings are looked for in the text the client gets, special tokens' text in it or not (as
            # vLLM); always skipping them, a stop string such as "<|im_end|>" never stopped the request
            skip = params.skip_special_tokens
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip)
            self._detok[request_id] = detok, StopStringMatcher(params.stop)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self.scheduler.abort(request)
        self._detok.pop(request_id, None)
        self._aborted.append(request)
        return True

    def has_unfinished(self) -> bool:
        """Requests to run, or outputs to deliver, or loads from the lower cache tiers still to land (whose
        paths stay locked until a step sees them done)."""
        loads = self.cache is not None and bool(self.cache.loads)
        return self.scheduler.has_work() or bool(self._aborted) or loads or self.in_flight is not None

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one step and return its outputs. Under the overlap schedule a decode step's outputs come from the
        call after the one that launched it, which also launches the step after it where it can."""
        if self.in_flight is None:
            batch = self.scheduler.schedule()
            if batch.empty:
                if self.cache is not None:
                    self.cache.wait_for_loads()  # a queued request may be waiting for its prefix to come up
                return self._finish_outputs([])
            if self.checkpoints is not None:
                self.checkpoints.before_step(batch)
            logits = self.runner.forward(batch)
            self.sampler.record_prompt_logprobs(self.runner.prompt_logits)
            ahead = self.overlap and not batch.prefill
            if not ahead:
                tokens, logprobs = self.sampler(logits, batch.sampled, argmax=self.runner.argmax)
                self._advance(batch)
                return self._finish_outputs(self._record(batch.sampled, tokens, logprobs))
            self.in_flight = self._launch(batch, logits, ahead=0)
            self._advance(batch)
        landing, self.in_flight = self.in_flight, None
        nxt = self.scheduler.schedule_ahead(landing.batch.decode) if self.overlap else None
        if nxt is not None:
            ids = landing.tokens
            if len(nxt.decode) < len(landing.batch.decode):  # requests left out: their rows go
                keep = set(nxt.decode)
                rows = [i for i, r in enumerate(landing.batch.decode) if r in keep]
                ids = ids.index_select(0, to_device_async(torch.tensor(rows), ids.device))
            logits = self.runner.forward(nxt, decode_ids=ids)
            if any(r.grammar is not None for r in nxt.decode):
                return self._land_then_sample(landing, nxt, logits)
            self.in_flight = self._launch(nxt, logits, ahead=1, pending=ids)
            self._advance(nxt)
        return self._land(landing)

    def _land_then_sample(self, landing: InFlight, nxt: Batch, logits: torch.Tensor) -> list[StepOutput]:
        """Structured outputs under the overlap schedule: a grammar's mask for the next step needs the token in
        flight, but the next step's forward does not. With that forward already launched, land the step in flight
        (its tokens' copy was queued before the forward, so the wait ends while the forward runs), move each
        grammar past its token and make its next mask, then sample the next step as the plain schedule would
        (every output on the host: ahead 0). The host's landing and the grammars' work hide behind the forward;
        only the sampler waits for them. The step's positions and checkpoints are moved on first, as on the
        other paths, while every row still holds its slot (a request the landing finishes gives it back)."""
        self._advance(nxt)
        outputs = self._land(landing)
        # (where every request of it finished on the tokens just landed, nothing of it is anyone's: not sampled)
        if any(r.status is Status.RUNNING for r in nxt.decode):
            self.in_flight = self._launch(nxt, logits, ahead=0)
        return outputs

    def _launch(
        self, batch: Batch, logits: torch.Tensor, ahead: int, pending: torch.Tensor | None = None
    ) -> InFlight:
        """Sample a decode step on the device and start its tokens' copy to the host (the caller then does the
        step's bookkeeping that needs no token, `_advance`, ahead of the next step on the stream).
        pending: with ahead = 1, the tokens of the step in flight (its requests' outputs not on the host yet)."""
        tokens = self.sampler.tokens(logits, batch.decode, ahead, argmax=self.runner.argmax, pending=pending)
        found = self.sampler.logprob_rows(logits, tokens, batch.decode)
        if found is not None:
            # each copy is queued behind the last: the tokens' event, recorded after them, covers them all
            rows, *parts = found
            found = (rows, *(to_host_async(t)[0] for t in parts))
        host, copied = to_host_async(tokens)
        return InFlight(batch, tokens, host, copied, found)

    def _land(self, step: InFlight) -> list[StepOutput]:
        """Wait for an in-flight step's tokens and post-process them; requests that finished meanwhile (an abort,
        or a stop found by the step before) get nothing. A step launched after it whose requests have all
        finished by now is dropped unread: nothing in it is anyone's."""
        if step.copied is not None:
            step.copied.synchronize()
        tokens = step.host.tolist()
        logprobs = self.sampler.logprobs(step.logprobs, tokens, step.batch.decode)
        live = [
            (r, t, lp) for r, t, lp in zip(step.batch.decode, tokens, logprobs) if r.status is Status.RUNNING
        ]
        outputs = self._record([r for r, _, _ in live], [t for _, t, _ in live], [lp for _, _, lp in live])
        after = self.in_flight
        if after is not None and all(r.status is not Status.RUNNING for r in after.batch.decode):
            self.in_flight = None
        return self._finish_outputs(outputs)

    def _advance(self, batch: Batch) -> None:
        """What a step computed is in the cache now: positions move on, checkpoints are saved."""
        for req in batch.decode:
            req.num_computed += 1
        for chunk in batch.prefill:
            chunk.request.num_computed = chunk.end
        if self.checkpoints is not None:
            self.checkpoints.after_step(batch)

    def _record(self, reqs: list[Request], tokens: list[int], logprobs) -> list[StepOutput]:
        """Each request's new token (and logprob) appended, its stop conditions checked, its output built."""
        outputs = []
        for req, token, lp in zip(reqs, tokens, logprobs):
            req.output_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            self._check_stop(req, token)
            if req.grammar is not None and not req.is_finished:
                self._follow_grammar(req, token)
            outputs.append(self._output(req, [token], [lp] if lp is not None else None))
        return outputs

    def flush_cache(self) -> dict:
        """Drop every cached prefix no running request uses, in every tier; returns what was freed:
        flushed_pages (GPU KV pages), flushed_checkpoints (GPU checkpoint slots), flushed_host_bytes and
        flushed_disk_bytes."""
        keys = ("flushed_pages", "flushed_checkpoints", "flushed_host_bytes", "flushed_disk_bytes")
        if self.cache is None:
            return dict.fromkeys(keys, 0)

        def free() -> tuple[int, ...]:
            t = self._tier_stats()
            return (
                self.kv_pool.num_free_pages,
                self.checkpoint_pool.num_free_slots,
                -t.get("host_bytes_used", 0),
                -t.get("disk_bytes_used", 0),
            )

        before = free()
        self.cache.flush()
        return {key: after - b for key, after, b in zip(keys, free(), before)}

    def _tier_stats(self) -> dict:
        return self.cache.tiers.stats() if self.cache is not None and self.cache.tiers is not None else {}

    def _follow_grammar(self, req: Request, token: int) -> None:
        """Move a structured-output request's grammar past its new token and make its next mask now (its next
        step's sampler needs it): a pattern found too ambiguous to follow here (past the probe at its compile)
        ends the request (`abort`), not the engine."""
        try:
            state = req.grammar.advance(req.grammar_state, token)
            req.grammar.allowed(state)
            req.grammar_state = state  # (only a state whose mask could be made)
        except PatternError as e:
            log.warning("request %s: its structured output cannot go on: %s", req.request_id, e)
            self._finish(req, "abort", None)

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        # stops count from the min_tokens-th output on; a grammar's EOS at once (the sampler allows it before
        # min_tokens only where the grammar is complete: nothing else could follow)
        armed = len(req.output_ids) >= p.min_tokens
        if armed and token in p.stop_token_ids:
            return self._finish(req, "stop", token)
        if (armed or req.grammar is not None) and not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(req, "stop", None)
        if p.stop:
            hit = self._stop_string(req, token, armed)
            if hit is not None:
                return self._finish(req, "stop", hit)
        if req.num_tokens >= req.max_total_tokens:
            self._finish(req, "length", None)

    def _stop_string(self, req: Request, token: int, armed: bool) -> str | None:
        """The stop string this token's text completes, if any (armed: min_tokens are out). Every token is
        decoded, so a stop string begun before min_tokens and ended after counts (as in vLLM); one ended before
        does not. The matcher keeps only the tail a stop string may begin in."""
        detok, matcher = self._detok[req.request_id]
        new = detok.add([token])
        _, stopped = matcher.feed(new, 0 if armed else len(new))
        return matcher.matched if stopped else None

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self._detok.pop(req.request_id, None)

    def _output(self, req: Request, new_ids: list[int], new_lp) -> StepOutput:
        first = req.params.prompt_logprobs is not None and len(req.output_ids) == 1 and bool(new_ids)
        return StepOutput(
            req.request_id,
            new_ids,
            new_lp,
            req.is_finished,
            req.finish_reason,
            req.stop_reason,
            len(req.prompt_ids),
            len(req.output_ids),
            (list(req.prompt_logprobs) or [None]) if first else None,  # (a one-token prompt: no position)
            req.num_cached_tokens or 0,
            None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
            req.first_scheduled_time,
        )

    def _finish_outputs(self, outputs: list[StepOutput]) -> list[StepOutput]:
        for req in self._aborted:
            outputs.append(self._output(req, [], None))
        self._aborted.clear()
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    # -- introspection ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_free_pages": self.kv_pool.num_free_pages,
            "num_pages": self.kv_pool.num_pages,
            # the requests' pages: those the prefix cache holds alone come back on demand (but not those a load
            # from the host or disk is filling for a waiting request)
            "num_pages_in_use": self.kv_pool.pages_in_use(
                self.cache.num_pages - self.cache.num_loading_pages if self.cache else 0
            ),
            "num_free_slots": self.state_pool.num_free_slots,
            "num_slots": self.state_pool.num_slots,
            "num_preemptions": s.num_preemptions,
            "page_size": self.kv_pool.page_size,
            "max_model_len": self.plan.max_model_len,
            **self.cache_stats(),
        }

    def cache_stats(self) -> dict:
        if self.cache is None:
            return {"prefix_cache": False}
        c, ckpt = self.cache, self.checkpoint_pool
        rate = lambda hits: hits / c.query_tokens if c.query_tokens else 0.0
        used_ckpt = ckpt.num_slots - ckpt.num_free_slots
        state_bytes = self.plan.state_bytes_per_slot
        page_bytes = self.plan.kv_bytes_per_token * self.kv_pool.page_size
        t = self._tier_stats()
        stats = {
            "prefix_cache": True,
            "hicache": bool(t),
            "num_cached_pages": c.num_pages,
            "num_checkpoints_used": used_ckpt,
            "num_checkpoints": ckpt.num_slots,
            "num_host_checkpoints": t.get("host_checkpoints", 0),
            "num_disk_checkpoints": t.get("disk_checkpoints", 0),
            "cache_query_tokens": c.query_tokens,
            "cache_hit_tokens": c.hit_tokens,
            "cache_hit_rate": rate(c.hit_tokens),
            "cache_gpu_bytes_used": c.num_pages * page_bytes + used_ckpt * state_bytes,
            "cache_gpu_bytes": self.kv_pool.num_pages * page_bytes + ckpt.num_slots * state_bytes,
            "cache_host_bytes_used": t.get("host_bytes_used", 0),
            "cache_host_bytes": t.get("host_bytes", 0),
            "cache_disk_bytes_used": t.get("disk_bytes_used", 0),
            "cache_disk_bytes": t.get("disk_bytes", 0),
            "cache_num_loads": t.get("num_loads", 0),
        }
        for tier, hits in c.tier_hit_tokens.items():
            stats[f"cache_{tier}_hit_tokens"] = hits
            stats[f"cache_{tier}_hit_rate"] = rate(hits)
        return stats
