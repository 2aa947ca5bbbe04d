"""Turns the logits rows of a step into tokens (and logprobs), each row with its request's parameters.

Legend: B sampled requests, V vocabulary. Penalties, temperature, top-k/top-p/min-p and the seeded noise are
batched ops (kestrel.ops.sampling); logit bias and allowed tokens (`_steer`, whose values are
`kestrel.ops.sampling.naive.steer_logits`') are kept per batch here; greedy rows take the argmax of the changed
logits.

`tokens()` stays on the device and never waits for it (its per-request values go up through pinned memory), so
the engine can sample a step it runs ahead of the host (`ahead`: outputs the request has that its output_ids do
not show yet; their last token, still on the device, is `pending` to the penalties). So does `logprob_rows()`, the
logprobs of the tokens on the device; `logprobs()` reads them on the host.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kestrel.engine.outputs import TokenLogprob
from kestrel.engine.request import Request
from kestrel.engine.scheduler import PrefillChunk
from kestrel.grammar.tokens import Grammar
from kestrel.ops.sampling import argmax as rows_argmax
from kestrel.ops.sampling import token_logprobs
from kestrel.ops.sampling.naive import apply_penalties, apply_penalties_at, greedy, process_logits, sample
from kestrel.utils.device import to_device_async

# Up to this many rows the penalties run over [B, V] with a dense seen mask, and the argmax of logits the sampler
# changed (penalties, early-stop bans) is torch's; past it only the seen tokens change (`apply_penalties_at`) and
# that argmax is Triton's (kestrel.ops.sampling; the same ids). On the H200 (session 42, mini at 4K, `kestrel bench
# decode --sampling penalties`; the overlap schedule): at batch 1 the step waits for the host, and the seen-tokens
# form with the Triton argmax made it slower, 1.97 against 1.69 ms; at 256 rows the device decides, 6.90 against
# 7.81 ms (the penalties alone at 64 / 256 rows, graph replays: 96 / 288 against 272 / 1041 us; at one row 53
# against 30).
PENALTIES_DENSE_MAX_ROWS = 16
# Grammar masks kept on the device (V bytes each: 256 of K3's 163,840-token vocabulary are 42 MB)
GRAMMAR_MASKS_KEPT = 256


# SamplingParams' penalty fields, in `apply_penalties`' order
_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def _needs_penalties(r: Request) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _steered(r: Request) -> bool:
    return r.params.logit_bias is not None or r.params.allowed_token_ids is not None


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)
        # id(request) -> (the request, its prompt's ids on the device), uploaded once for the penalties' seen tokens;
        # an entry lives while its request is in the penalized rows (holding it: its id is not reused meanwhile)
        self._prompts: dict[int, tuple[Request, torch.Tensor]] = {}
        # id(request) -> (the request, its logit_bias ids, values and allowed ids on the device), the same way
        self._steering: dict[int, tuple[Request, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._steer_batch: tuple | None = None  # (the steered rows' key, what they need), while they stay
        # (id(grammar), state, V) -> (the grammar, its banned tokens [V] bool on the device), the last
        # GRAMMAR_MASKS_KEPT used; (None, V, device) -> (None, no token banned), for the rows without a grammar
        self._grammar_masks: OrderedDict[tuple, tuple[Grammar | None, torch.Tensor]] = OrderedDict()

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], argmax: torch.Tensor | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if not reqs:
            return [], []
        tokens = self.tokens(logits, reqs, argmax=argmax)
        found = self.logprob_rows(logits, tokens, reqs)
        token_list = tokens.tolist()
        return token_list, self.logprobs(found, token_list, reqs)

    def tokens(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        ahead: int = 0,
        argmax: torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The next token of each request [B] int64, on the logits' device, with no host sync. logits [B, V] in
        any float dtype (the model's: what is computed on them is in fp32). argmax [B]: the logits rows'
        argmax where already computed (the runner's decode graph), taken for the greedy rows unless a penalty,
        a logit bias, allowed tokens or an early-stop ban change the logits. pending [B]: with ahead = 1, each
        request's output that is on the device only (the step in flight's token), which the penalties count."""
        dev = logits.device
        x = self._steer(logits, reqs)
        if any(_needs_penalties(r) for r in reqs):
            x = self._penalize(x, reqs, pending)  # fp32 out
        x = self._suppress_early_stops(x, reqs, ahead)
        x = self._constrain(x, reqs, ahead, owned=x is not logits)
        if argmax is not None and x is logits:
            tokens = argmax  # [B]; sampled rows overwritten below
        else:
            tokens = greedy(x) if len(reqs) <= PENALTIES_DENSE_MAX_ROWS else rows_argmax(x)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:  # the full-vocabulary sort and noise only for the rows that sample
            sub = [reqs[i] for i in rows]
            f = lambda vals, dt=torch.float32: to_device_async(torch.tensor(vals, dtype=dt), dev)  # noqa: E731
            idx = f(rows, torch.int64)
            probs = process_logits(
                x.index_select(0, idx),
                f([r.params.temperature for r in sub]),
                f([r.params.top_k for r in sub], torch.int64),
                f([r.params.top_p for r in sub]),
                f([r.params.min_p for r in sub]),
            )
            steps = [len(r.output_ids) + ahead for r in sub]
            drawn = sample(probs, f([r.seed for r in sub], torch.int64), f(steps, torch.int64))
            tokens = tokens.index_copy(0, idx, drawn)
        return tokens

    def _penalize(
        self, x: torch.Tensor, reqs: list[Request], pending: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`apply_penalties` (up to PENALTIES_DENSE_MAX_ROWS rows) or `apply_penalties_at` with each request's
        output counts and seen tokens (prompt and output), built on the device with no sync: each prompt uploaded
        once (kept while its request is penalized), the outputs from the host's lists in one copy, plus `pending`,
        the outputs not on the host yet; the parameters in another copy."""
        B, V = x.shape
        dev = x.device
        prompts = [self._prompt_ids(r, dev) for r in reqs]
        self._prompts = {id(r): (r, p) for r, p in zip(reqs, prompts)}  # these rows' own: the rest go
        out_rows = [i for i, r in enumerate(reqs) for _ in r.output_ids]
        out_ids = [t for r in reqs for t in r.output_ids]
        n, lens = len(out_ids), [p.numel() for p in prompts]
        up = to_device_async(torch.tensor(out_rows + out_ids + lens, dtype=torch.int64), dev)
        rows = torch.arange(B, device=dev)
        # the seen tokens: the counted ones first (each row's outputs, then the token still in flight), then each
        # row's prompt (repeats and all)
        in_flight_rows, in_flight = ([rows], [pending]) if pending is not None else ([], [])
        prompt_rows = rows.repeat_interleave(up[2 * n :], output_size=sum(lens))
        seen_rows = torch.cat([up[:n], *in_flight_rows, prompt_rows])
        seen_ids = torch.cat([up[n : 2 * n], *in_flight, *prompts])
        counted = n + B * len(in_flight)
        counts = torch.zeros(B, V, device=dev)
        counts.index_put_(
            (seen_rows[:counted], seen_ids[:counted]), torch.ones(counted, device=dev), accumulate=True
        )
        # [3, B]: one copy up for the three penalties
        params = to_device_async(
            torch.tensor([[getattr(r.params, k) for r in reqs] for k in _PENALTIES], dtype=torch.float32), dev
        )
        if B > PENALTIES_DENSE_MAX_ROWS:
            return apply_penalties_at(x, counts, seen_rows, seen_ids, *params)
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        seen.index_put_((seen_rows, seen_ids), torch.ones((), dtype=torch.bool, device=dev))
        return apply_penalties(x, counts, seen, *params)

    def _prompt_ids(self, r: Request, dev: torch.device) -> torch.Tensor:
        """r's prompt ids on the device: kept from an earlier step, or uploaded (no sync)."""
        req, kept = self._prompts.get(id(r), (None, None))
        return kept if req is r else to_device_async(torch.tensor(r.prompt_ids, dtype=torch.int64), dev)

    def _steer(self, x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logit_bias, then allowed_token_ids (`steer_logits`' values), before the penalties as in vLLM (a
        repetition penalty divides a biased logit), with no sync. What a batch needs (the bias's flat positions
        and values, the mask of the tokens not allowed) is made when the steered rows change and kept while they
        do not, so that a step pays three kernels: the fp32 copy, the bias added, the mask filled."""
        rows = [i for i, r in enumerate(reqs) if _steered(r)]
        if not rows:
            self._steering, self._steer_batch = {}, None
            return x
        key = (len(reqs), x.shape[1], *((i, id(reqs[i])) for i in rows))
        if self._steer_batch is None or self._steer_batch[0] != key:
            self._steer_batch = (key, self._prepare_steering(reqs, rows, x.shape[1], x.device))
        _, (_, flat, bias, ban) = self._steer_batch
        # contiguous, whatever the logits' strides: the bias goes in at flat positions
        x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if flat.numel():
            x.view(-1).index_add_(0, flat, bias)
        return x if ban is None else x.masked_fill_(ban, float("-inf"))

    def _prepare_steering(self, reqs: list[Request], rows: list[int], V: int, dev: torch.device) -> tuple:
        """(the steered requests, held so that their ids in the batch's key stay theirs; the bias's positions in
        the flattened [B, V] logits and its values; the [B, V] mask of the tokens not allowed, or None)."""
        kept = [self._steering_of(reqs[i], dev) for i in rows]
        self._steering = {id(k[0]): k for k in kept}  # these rows' own: the rest go
        nb, na = [k[1].numel() for k in kept], [k[3].numel() for k in kept]
        restricted = [i for i, k in zip(rows, kept) if k[0].params.allowed_token_ids is not None]
        n = len(rows)
        up = to_device_async(torch.tensor(rows + nb + na + restricted, dtype=torch.int64), dev)
        row_ids = up[:n]
        bias_rows = row_ids.repeat_interleave(up[n : 2 * n], output_size=sum(nb))
        flat = bias_rows * V + torch.cat([k[1] for k in kept])
        ban = None
        if restricted:
            ban = torch.zeros(len(reqs), V, dtype=torch.bool, device=dev)
            ban.index_fill_(0, up[3 * n :], True)
            allowed_rows = row_ids.repeat_interleave(up[2 * n : 3 * n], output_size=sum(na))
            allowed = (allowed_rows, torch.cat([k[3] for k in kept]))
            ban.index_put_(allowed, torch.zeros((), dtype=torch.bool, device=dev))
        return [k[0] for k in kept], flat, torch.cat([k[2] for k in kept]), ban

    def _steering_of(self, r: Request, dev: torch.device) -> tuple:
        """(r, its logit_bias ids [N] int64 and values [N] fp32, its allowed ids [M] int64) on the device: kept from
        an earlier step, or uploaded (no sync)."""
        kept = self._steering.get(id(r))
        if kept is not None and kept[0] is r:
            return kept
        bias = r.params.logit_bias or {}
        up = lambda vals, dt: to_device_async(torch.tensor(vals, dtype=dt), dev)  # noqa: E731
        return (
            r,
            up(list(bias), torch.int64),
            up(list(bias.values()), torch.float32),
            up(r.params.allowed_token_ids or [], torch.int64),
        )

    def _constrain(self, x: torch.Tensor, reqs: list[Request], ahead: int, owned: bool) -> torch.Tensor:
        """Structured outputs: the tokens a request's grammar does not allow next get -inf, last of all (the
        grammar's word is final). Each grammar state's banned tokens are found once on the host
        (`Grammar.allowed`) and uploaded once without a sync, then kept on the device while used (rows in the
        same state share them): a step stacks the rows' [V] masks (an empty one for a row without a grammar) and
        fills in one pass, in place where x is already this sampler's own fp32 copy (`owned`: the steering or the
        penalties made it). It had taken the constrained rows out and put them back, five passes over [B, V]."""
        if not any(r.grammar is not None for r in reqs):
            return x
        assert ahead == 0, "a grammar needs its request's last token on the host (the engine lands it first)"
        V, dev = x.shape[1], x.device
        # (a request finished by the step just landed is still sampled under the overlap schedule, its token
        # dropped: its row is left free)
        ban = torch.stack(
            [self._ban_of(r.grammar if not r.is_finished else None, r.grammar_state, V, dev) for r in reqs]
        )  # [B, V] bool
        if x.dtype != torch.float32:
            x = x.to(torch.float32)  # (a copy)
        elif not owned:
            x = x.clone()  # the model's logits: the logprobs read them as they are
        return x.masked_fill_(ban, float("-inf"))

    def _ban_of(self, grammar: Grammar | None, state: int, V: int, dev: torch.device) -> torch.Tensor:
        """[V] bool on the device: the tokens `grammar` does not allow in `state` (none without a grammar)."""
        key = (id(grammar), state, V) if grammar is not None else (None, V, dev)
        kept = self._grammar_masks.get(key)
        if kept is not None and kept[0] is grammar:
            self._grammar_masks.move_to_end(key)
            return kept[1]
        if grammar is None:
            ban = torch.zeros(V, dtype=torch.bool, device=dev)
        else:
            allowed = grammar.allowed(state)
            assert allowed.shape == (V,), (allowed.shape, V)
            ban = to_device_async(torch.from_numpy(~allowed), dev)
        self._grammar_masks[key] = (grammar, ban)  # (holding the grammar: its id is not reused meanwhile)
        if len(self._grammar_masks) > GRAMMAR_MASKS_KEPT:
            self._grammar_masks.popitem(last=False)
        return ban

    def _suppress_early_stops(self, x: torch.Tensor, reqs: list[Request], ahead: int = 0) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop token ids cannot be sampled (vLLM semantics), unless the
        request's grammar is complete (only EOS can follow: the grammar ends the output)."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            early = len(r.output_ids) + ahead < r.params.min_tokens
            if early and not (r.grammar is not None and r.grammar.is_complete(r.grammar_state)):
                eos = () if r.params.ignore_eos else self.eos_token_ids
                banned = [*r.params.stop_token_ids, *eos]
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return x
        where = to_device_async(torch.tensor([rows, cols]), x.device)
        return x.index_put(
            (where[0], where[1]), torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
        )

    def logprob_rows(self, raw: torch.Tensor, tokens: torch.Tensor, reqs: list[Request]) -> tuple | None:
        """The logprobs the requests ask for, on the device, with no host sync: of the model's distribution
        (before penalties and temperature, like vLLM's default), the sampled tokens' [b] and the top k [b, k]
        (values, ids), k the most any row asks for, for the rows that ask; None when no row does. tokens [B]
        on raw's device."""
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return None
        idx = to_device_async(torch.tensor(rows), raw.device) if len(rows) < len(reqs) else None
        k = max(reqs[i].params.logprobs for i in rows)
        return rows, *token_logprobs(raw, tokens, k, idx)

    @classmethod
    def record_prompt_logprobs(cls, chunks: list[tuple[PrefillChunk, torch.Tensor]]) -> None:
        """The prompt logprobs of a step's chunks that ask for them (`ModelRunner.prompt_logits`: each chunk with
        its positions' logits): position p's give prompt token p + 1's, appended to `Request.prompt_logprobs`
        after the None of the first token. Positions already recorded (a request preempted and computed again)
        are skipped."""
        for chunk, logits in chunks:
            req = chunk.request
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            first, last = len(req.prompt_logprobs) - 1, min(chunk.end, len(req.prompt_ids) - 1)
            if first < last:
                rows = logits[first - chunk.start : last - chunk.start]
                targets = req.prompt_ids[first + 1 : last + 1]
                req.prompt_logprobs += cls.prompt_logprobs(rows, targets, req.params.prompt_logprobs)

    @staticmethod
    def prompt_logprobs(
        logits: torch.Tensor, targets: list[int], k: int, rows: int = 1024
    ) -> list[TokenLogprob]:
        """Each row's target token's logprob and the top k (of the model's distribution, as `logprob_rows`), for
        the logits [n, V] of n prompt positions and the prompt tokens after them; `rows` at a time, so that a long
        chunk's fp32 log-softmax stays small."""
        out = []
        for a in range(0, len(targets), rows):
            ids = targets[a : a + rows]
            found = token_logprobs(logits[a : a + rows], to_device_async(torch.tensor(ids), logits.device), k)
            chosen, top_v, top_i = (t.tolist() for t in found)
            out += [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(ids, chosen, top_i, top_v)]
        return out

    @staticmethod
    def logprobs(found: tuple | None, tokens: list[int], reqs: list[Request]) -> list[TokenLogprob | None]:
        """`logprob_rows`' tensors (on the host, or read back here) as each request's TokenLogprob (None for the
        rows that ask for none)."""
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if found is None:
            return out
        rows, chosen, top_v, top_i = found
        chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            n = reqs[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
        return out
