"""Which tokens run in the next step. Pure Python over two capacity limits: KDA state slots and KV pages.

Policy (FCFS, decode first):
1. every running request in decode gets one token; one whose next token needs a page it cannot get preempts
   the most recently admitted running request (LIFO), which frees its pages and slot and goes back to the
   front of the queue to be recomputed later (prompt + output so far): retraction instead of a crash;
2. the rest of the step's token budget (`chunked_prefill_size`) goes to prefill chunks: first the requests
   already prefilling, then new ones, admitted in arrival order only when a slot and the pages for all their
   tokens are free (the head of the queue blocks the rest: no overtaking).

A waiting request whose prompt starts with the whole prompt of a running request still prefilling (the n samples
of one prompt, a group of rollouts, the same prompt sent twice at once) waits until that prefill has saved its
prompt-end checkpoint, then resumes from it: the shared prompt is computed once, not once a request (SGLang's
in-batch prefix caching, vLLM's parallel sampling). The requests behind it may overtake it meanwhile, but not
take the slot and pages it will need.

With lower cache tiers (HiCache), a request whose cached prefix is partly in host memory or on disk first has it
loaded back to the GPU; it stays in the queue meanwhile and the requests behind it may overtake it. The load, and
the hold that keeps its prefix on the GPU until the request is admitted, are the cache's: no tensors here. At most
`LOADS_AHEAD` requests (and the head of the queue) hold loaded prefixes at once; if nothing can run because of
them, they let go.

`schedule_ahead` plans the decode step that follows one still on the device (the engine's overlap schedule): the
same requests, one position further, before the tokens of the step in flight are known. It only plans where the
plain schedule would run that same decode batch (nobody waiting who could be admitted now or by a slot that step
frees at its length limit, nobody prefilling) and every page can be had without preempting; otherwise the engine
lands the step in flight and schedules as usual.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kestrel.engine.request import Request, Status

LOADS_AHEAD = 8
ADMITTED, LOADING, BLOCKED = "admitted", "loading", "blocked"


@dataclass
class PrefillChunk:
    request: Request
    start: int  # first position computed in this step
    end: int  # one past the last
    # KDA checkpoints inside the chunk (start < position < end), each with the checkpoint slot its state goes
    # to: the engine fills this before the step, and the KDA layers save those states in the same forward
    saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk finishes the request's prefill, so the step samples its next token."""
        return self.end == self.request.num_tokens

    @property
    def prompt_logprobs(self) -> bool:
        """The step computes the logits of every position of the chunk: its request asks for its prompt's
        logprobs, and the chunk has positions whose next token is a prompt token."""
        return self.request.needs_prompt_logprobs and self.start < len(self.request.prompt_ids) - 1


@dataclass
class Batch:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def sampled(self) -> list[Request]:
        """Requests that get a new token from this step, in the order of the runner's logits rows."""
        return self.decode + [c.request for c in self.prefill if c.samples]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.end - c.start for c in self.prefill)


class Scheduler:
    def __init__(
        self,
        kv_pool,
        state_pool,
        chunked_prefill_size: int,
        max_running: int,
        cache=None,
        checkpoint_interval: int = 0,
    ):
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.cache, self.checkpoint_interval = cache, checkpoint_interval
        self.chunked_prefill_size, self.max_running = chunked_prefill_size, max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        # Waiting requests whose prefix was loaded from a lower tier: the node they keep locked, and the load.
        self.holds: dict[Request, tuple[object, object]] = {}

    # -- queue ------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request: Request) -> None:
        if request.status is Status.WAITING:
            self.waiting.remove(request)
            self._let_go(request)
        self.finish(request, "abort", None)

    def finish(self, request: Request, reason: str, stop_reason) -> None:
        """Mark finished, hand its cacheable prefix to the prefix cache, give back its slot and pages."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            if self.cache is not None and reason != "abort":
                self._cache_finished(request)
            self._release(request)
        request.status = Status.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason

    # -- one step ---------------------------------------------------------------------------------------
    def schedule_ahead(self, in_flight: list[Request]) -> Batch | None:
        """The decode batch after the in-flight decode step over `in_flight`, whose tokens the host has not read
        yet (their num_computed already counts that step). Requests finished meanwhile (aborted) and those that
        step brings to their length limit are left out; one that stops on a token it samples is found out only
        when the step lands, and its token from this batch is dropped. None where the plain schedule should
        decide the next step."""
        live = [r for r in in_flight if r.status is Status.RUNNING]
        last = {r for r in live if r.num_computed + 1 >= r.max_total_tokens}  # the step in flight ends them
        if self.waiting:
            admissible = len(self.running) < self.max_running and self.state_pool.num_free_slots > 0
            tiers = self.cache is not None and self.cache.tiers is not None
            if admissible or tiers or last:  # (`last` frees slots once the step lands)
                return None  # an admission or a lower-tier load may be due: the plain schedule decides
        if len(live) != len(self.running):
            return None  # a running request is not decoding: it needs a prefill chunk
        batch = Batch()
        for req in live:
            if req in last:
                continue
            if not self._ensure_pages(req, preempt=False):
                return None
            batch.decode.append(req)
        return batch if batch.decode else None

    def schedule(self) -> Batch:
        if self.cache is not None:
            self.cache.poll_loads()
        batch = Batch()
        for req in list(self.running):
            if req.status is Status.RUNNING and req.in_decode and self._ensure_pages(req):
                batch.decode.append(req)
        budget = self.chunked_prefill_size - len(batch.decode)
        for req in self.running:
            if budget <= 0:
                return batch
            if not req.in_decode and req.num_computed < req.num_tokens:
                budget -= self._add_chunk(batch, req, budget)
        i, leaders, reserved = 0, None, [0, 0]  # slots and pages kept for the waiting followers
        while budget > 0 and i < len(self.waiting):
            req = self.waiting[i]
            if self.cache is not None and not req.needs_prompt_logprobs:
                leaders = self._leaders() if leaders is None else leaders
                shared = self._follows(req, leaders)
                if shared:  # its prompt will be cached: the next ones may overtake, but not take its room
                    reserved[0] += 1
                    reserved[1] += self.kv_pool.pages_for(req.num_tokens) - shared // self.kv_pool.page_size
                    i += 1
                    continue
            verdict = self._admit(req, head=i == 0, reserved=reserved)
            if verdict == BLOCKED:
                break
            if verdict == LOADING:  # the next ones may overtake it
                i += 1
                continue
            req = self.waiting[i]
            del self.waiting[i]
            budget -= self._add_chunk(batch, req, budget)
        if batch.empty and not self.running and self.holds and not self.cache.loads:
            # Nothing runs and nothing is on its way: held prefixes may be what keeps the head out.
            head = self.waiting[0] if self.waiting else None
            for req in [r for r in self.holds if r is not head]:
                self._let_go(req)
        return batch

    def _leaders(self) -> list[tuple[Request, int]]:
        """The running requests still prefilling up to their prompt-end checkpoint, with its position."""
        ps, out = self.kv_pool.page_size, []
        for other in self.running:
            end = ((other.num_tokens - 1) // ps) * ps  # its prompt-end checkpoint (`_plan_checkpoints`)
            if other.num_computed < end and end in other.checkpoint_at:
                out.append((other, end))
        return out

    def _follows(self, req: Request, leaders: list[tuple[Request, int]]) -> int:
        """The tokens `req` shares with a leader (`_leaders`) whose prompt-end checkpoint it can resume from once
        saved, so that it waits for it; 0 for none. A follower keeps its leader (`Request.follows`): the prompts
        are compared once, not at every step."""
        if req.follows is not None:
            leader, end = req.follows
            if leader.status is Status.RUNNING and leader.num_computed < end:
                return end
            req.follows = None  # saved (or the leader went): admitted now, resuming from what the cache has
            return 0
        for leader, end in leaders:
            if end < req.num_tokens and req.prompt_ids[0] == leader.prompt_ids[0]:
                if _head(req, end) == _head(leader, end):
                    req.follows = (leader, end)
                    return end
        return 0

    def _add_chunk(self, batch: Batch, req: Request, budget: int) -> int:
        end = min(req.num_tokens, req.num_computed + budget)
        # Interval checkpoints are chunk boundaries: a chunk ends there and the state is the forward's own.
        # The branch and prompt-end checkpoints do not cut the chunk: the KDA layers save those states in the
        # same forward (PrefillChunk.saves, at the cost of computing the KDA layers over the chunk's tokens up
        # to them once more), so a cached turn's append stays one forward.
        every = self.checkpoint_interval
        end = min(
            [end] + [p for p in req.checkpoint_at if every and p % every == 0 and req.num_computed < p < end]
        )
        batch.prefill.append(PrefillChunk(req, req.num_computed, end))
        return end - req.num_computed

    def _admit(self, req: Request, head: bool = True, reserved: list[int] | tuple = (0, 0)) -> str:
        """`reserved`: the slots and pages kept for requests ahead of it in the queue (followers, `_follows`)."""
        slots, pages = reserved
        full = len(self.running) + slots >= self.max_running or self.state_pool.num_free_slots <= slots
        tiers = self.cache is not None and self.cache.tiers is not None
        if full and not tiers:  # (with lower tiers, a load may start before a slot frees)
            return BLOCKED
        reuse, node, branch, shared = 0, None, 0, []
        if self.cache is not None and not req.needs_prompt_logprobs:  # (its prompt's every logit is needed)
            match = self.cache.match(req.all_ids)
            if match.in_flight:
                return LOADING
            if match.needs_load:
                if len(self.holds) >= LOADS_AHEAD and not head and req not in self.holds:
                    return BLOCKED
                load = self.cache.load(match)
                if load is None:
                    return BLOCKED
                self._let_go(req)
                self.cache.lock(match.resume_node)
                self.cache.pin(match.resume_node)
                self.holds[req] = (match.resume_node, load)
                if match.in_flight:
                    return LOADING
            if full:
                return BLOCKED
            reuse, node, branch = match.resume_len, match.resume_node, match.kv_len
            shared = match.pages(reuse)
            self.cache.lock(node)
        elif full:
            return BLOCKED
        need = self.kv_pool.pages_for(req.num_tokens) - len(shared)
        if self.kv_pool.num_free_pages < need + pages and self.cache is not None:
            self.cache.evict_pages(need + pages - self.kv_pool.num_free_pages)
        if self.kv_pool.num_free_pages < need + pages:
            if self.cache is not None:
                self.cache.unlock(node)
            return BLOCKED
        if self.cache is not None:
            self.kv_pool.incref(shared)
            hold = self.holds.get(req)
            self.cache.record(req.num_tokens, reuse, hold[1] if hold is not None else None)
            self._let_go(req)
        req.slot = self.state_pool.alloc()
        req.pages = shared + self.kv_pool.alloc(need)
        req.num_computed = reuse
        if req.num_cached_tokens is None:  # (a preempted request's second admission reuses its own tokens)
            req.num_cached_tokens = min(reuse, len(req.prompt_ids))
            req.first_scheduled_time = time.monotonic()
        req.cache_node, req.restore_from = node, (node.checkpoint if node is not None else None)
        if req.restore_from is not None:
            self.cache.pin(node)  # until the engine copies it into the request's slot (or the request goes)
        req.checkpoint_at = self._plan_checkpoints(req, reuse, branch) if self.cache is not None else []
        req.status = Status.RUNNING
        self.running.append(req)
        return ADMITTED

    def _let_go(self, req: Request) -> None:
        """Drop the request's hold on a loaded prefix (the prefix stays cached, now evictable)."""
        hold = self.holds.pop(req, None)
        if hold is not None:
            self.cache.unpin(hold[0])
            self.cache.unlock(hold[0])

    def _plan_checkpoints(self, req: Request, reuse: int, branch: int) -> list[int]:
        """Where this request's prefill saves KDA checkpoints: every `checkpoint_interval` tokens (where its
        chunks end), at the branch point where it leaves the cached tree, and at the last page boundary before
        its last token."""
        ps, n = self.kv_pool.page_size, req.num_tokens
        points = {((n - 1) // ps) * ps, branch}
        if self.checkpoint_interval:
            points.update(range(self.checkpoint_interval, n, self.checkpoint_interval))
        return sorted(p for p in points if reuse < p < n and p % ps == 0)

    def _cache_finished(self, req: Request) -> None:
        """Insert the finished request's KV up to its decode-time checkpoint, with that checkpoint."""
        ps = self.kv_pool.page_size
        end = (req.num_computed // ps) * ps
        if req.track_slot is not None and req.track_len == end and end > 0:
            if self.cache.insert_with_checkpoint(req.all_ids[:end], req.pages, req.track_slot):
                req.track_slot = None  # now the tree's

    def _ensure_pages(self, req: Request, preempt: bool = True) -> bool:
        """Pages for every token up to the one this step computes (position num_computed); preempt (LIFO) to
        get them. False when `req` itself had to be preempted, or (preempt=False) a page could not be had."""
        while len(req.pages) < self.kv_pool.pages_for(req.num_computed + 1):
            page = self.kv_pool.alloc(1)
            if page is None and self.cache is not None and self.cache.evict_pages(1):
                page = self.kv_pool.alloc(1)
            if page is not None:
                req.pages += page
                continue
            if not preempt:
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Free the request's slot and pages and queue it first; it will recompute prompt + output."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if self.cache is not None:
            if req.restore_from is not None:  # admitted, never restored
                self.cache.unpin(req.cache_node)
            self.cache.unlock(req.cache_node)
            if req.track_slot is not None:
                self.cache.checkpoint_pool.free(req.track_slot)
        req.cache_node, req.restore_from, req.track_slot, req.track_len = None, None, None, 0
        if req.slot is not None:
            self.state_pool.free(req.slot)
            req.slot = None
        if req.pages:
            self.kv_pool.free(req.pages)
            req.pages = []


def _head(req: Request, n: int) -> list[int]:
    """The request's first n tokens (its prompt's alone where they suffice: no copy of prompt + output)."""
    return req.prompt_ids[:n] if n <= len(req.prompt_ids) else req.all_ids[:n]
