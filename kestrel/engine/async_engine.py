"""The engine behind an asyncio server: `Engine.step()` runs in its own thread, so the event loop never waits on
the model.

The Engine is not thread-safe, so the engine thread is the only one that touches it (apart from the pure
`Engine.validate_request`). Callers put commands (add, abort) on a list under a condition variable; the engine
thread takes them before each step, and sleeps on the condition while there is nothing to do. Outputs go back
with `loop.call_soon_threadsafe` into one asyncio.Queue per request group (the n choices of one HTTP request
share a queue). If a step raises, every open stream fails with `EngineDead` and the engine stays dead
(`healthy` is False): a crashed step may have left the caches inconsistent, so nothing is retried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from kestrel.engine.engine import Engine, RequestError
from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.utils.errors import KestrelError

log = logging.getLogger("kestrel.engine")


class Overloaded(KestrelError):
    """Too many requests are waiting for a slot: the server answers 503 with Retry-After."""


class EngineDead(KestrelError):
    """The engine thread stopped (a step raised, or the server is shutting down)."""


class RequestGroup:
    """The engine requests of one client request (n choices, or a batch of prompts), read as one stream.

    `async for index, output in group` yields each member's StepOutputs in arrival order, tagged with the
    member's index, until every member has finished. `close()` aborts members that have not finished (the
    client went away); it is safe to call more than once."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = request_ids
        self.arrival_time = time.monotonic()
        # called (on the event loop) with (index, output) for each output that comes after close(): the aborted
        # members' last words, which nobody iterates any more (the server's metrics read their queue time)
        self.on_late: Callable[[int, StepOutput], None] | None = None
        self._owner, self._loop = owner, loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._open = set(request_ids)
        self._closed = False

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return self._index[item.request_id], item

    def abort(self, index: int) -> None:
        """Stop one member early (e.g. the server found a stop string first); its final output still comes."""
        self._owner.abort(self.request_ids[index])

    def close(self) -> None:
        for rid in list(self._open):
            self._owner.abort(rid)
        self._open.clear()
        self._closed = True
        while not self._queue.empty():  # come, not read
            self._late(self._queue.get_nowait())

    # -- called on the event loop by the engine thread -------------------------------------------------
    def _put(self, item: StepOutput | BaseException) -> None:
        if self._closed:
            self._late(item)
        else:
            self._queue.put_nowait(item)

    def _late(self, item: StepOutput | BaseException) -> None:
        if self.on_late is None or not isinstance(item, StepOutput):
            return
        try:
            self.on_late(self._index[item.request_id], item)
        except Exception:  # noqa: BLE001 - the step's outputs for every other group are delivered after this
            log.exception("a closed request group's late-output hook failed")


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued: int | None = None):
        self.engine = engine
        self.max_queued = engine.config.max_queued_requests if max_queued is None else max_queued
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._commands: list[tuple] = []
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group, until its final output
        self._num_pending_adds = 0  # adds not yet handed to the engine
        self._num_waiting = 0  # the engine's waiting queue, as of the last command drain or step
        self._num_running = 0  # its running requests, as of the same
        self._stopping = False
        self._stats = engine.stats()  # replaced (never mutated) by the engine thread after each step
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._thread.start()

    # -- caller side (the event loop) ------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stats(self) -> dict:
        """The engine's counters as of its last step, plus the server-side queue."""
        with self._cond:
            queued = self._num_waiting + self._num_pending_adds
        return {**self._stats, "num_queued": queued, "max_queued_requests": self.max_queued}

    def submit(
        self, requests: Sequence[tuple[list[int], SamplingParams]], request_id: str | None = None
    ) -> RequestGroup:
        """Queue a group of requests, all or none. Raises RequestError (bad request), Overloaded or EngineDead
        here, in the caller, before anything is queued. A lone request is named `request_id`; the members of
        a larger group `request_id-0`, `request_id-1`, ..."""
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        if not requests:
            raise RequestError("no prompts to complete", param="prompt")
        for prompt_ids, params in requests:
            self.engine.validate_request(prompt_ids, params)
        most = self.engine.config.max_running_requests + self.max_queued  # an idle engine's slots and queue
        if len(requests) > most:
            # the culprit: n where it is one prompt's samples (its n requests share the prompt's list), else prompt
            prompts = len({id(prompt_ids) for prompt_ids, _ in requests})
            raise RequestError(
                f"this request needs {len(requests)} sequences (prompts x n), more than the server runs and queues "
                f"at once ({self.engine.config.max_running_requests} + {self.max_queued})",
                param="n" if prompts == 1 else "prompt",
            )
        ids = [request_id] if len(requests) == 1 else [f"{request_id}-{i}" for i in range(len(requests))]
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDead(self._dead_message())
            # those beyond what the engine's free slots take at its next step wait: at most max_queued of them
            free = max(0, self.engine.config.max_running_requests - self._num_running)
            ahead = self._num_waiting + self._num_pending_adds
            queued = max(0, ahead - free)
            if ahead + len(requests) - free > self.max_queued:
                raise Overloaded(
                    f"the server is overloaded: {queued} requests are waiting (at most {self.max_queued}); "
                    "retry later"
                )
            if any(rid in self._groups for rid in ids):
                raise RequestError(f"request id {request_id!r} is already in use")
            group = RequestGroup(self, ids, loop)
            for rid, (prompt_ids, params) in zip(ids, requests):
                self._groups[rid] = group
                self._commands.append(("add", rid, list(prompt_ids), params))
            self._num_pending_adds += len(requests)
            self._cond.notify()
        return group

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StepOutput]:
        """One request's outputs. Errors of `submit` are raised at the first iteration; leaving the loop
        early aborts the request."""
        group = self.submit([(prompt_ids, params)], request_id)
        try:
            async for _, output in group:
                yield output
        finally:
            group.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (or every member of a group, by the group's id). Unknown ids are ignored."""
        with self._cond:
            if request_id in self._groups:
                members = [request_id]
            else:
                members = [rid for rid in self._groups if rid.startswith(request_id + "-")]
            for rid in members:
                self._commands.append(("abort", rid))
            self._cond.notify()

    def flush_cache(self) -> concurrent.futures.Future:
        """Ask the engine thread to drop every cached prefix no running request uses, in every tier; the future's
        result is `Engine.flush_cache()`'s dict of what was freed (await it with asyncio.wrap_future)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDead(self._dead_message())
            self._commands.append(("flush", None, future))
            self._cond.notify()
        return future

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after its current step); open streams fail with EngineDead."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self._fail_all("the server is shutting down")

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"the engine failed and cannot serve requests ({type(self.error).__name__}: {self.error})"
        return "the server is shutting down"

    # -- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                    for command in commands:
                        self._apply(command)
                    drained = engine.stats()
                    self._num_waiting, self._num_running = drained["num_waiting"], drained["num_running"]
                outputs = engine.step() if engine.has_unfinished() else []
                stats = engine.stats()
                with self._cond:
                    self._num_waiting, self._num_running = stats["num_waiting"], stats["num_running"]
                    self._stats = stats
                    deliveries = self._route(outputs)
                self._deliver(deliveries)
        except BaseException as e:  # noqa: BLE001 - the thread must never die silently
            log.exception("engine step failed; the server is now unhealthy")
            self.error = e
            self._fail_all(self._dead_message())

    def _apply(self, command: tuple) -> None:
        kind, rid = command[0], command[1]
        if kind == "flush":
            command[2].set_result(self.engine.flush_cache())
        elif kind == "add":
            self._num_pending_adds -= 1
            if rid not in self._groups:  # aborted and failed before it got here
                return
            try:
                self.engine.add_request(command[2], command[3], rid)
            except Exception as e:  # validated already; a race such as a reused id ends up here
                group = self._groups.pop(rid)
                self._deliver([(group, e)])
        else:
            self.engine.abort(rid)

    def _route(self, outputs: list[StepOutput]) -> list[tuple[RequestGroup, StepOutput]]:
        routed = []
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            if out.finished:
                del self._groups[out.request_id]
            routed.append((group, out))
        return routed

    @staticmethod
    def _deliver(items: list[tuple[RequestGroup, StepOutput | BaseException]]) -> None:
        """One callback per event loop per step, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for group, item in items:
            by_loop.setdefault(group._loop, []).append((group, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, message: str) -> None:
        with self._cond:
            groups = list(dict.fromkeys(self._groups.values()))
            self._groups.clear()
            for command in self._commands:
                if command[0] == "flush":
                    command[2].set_exception(EngineDead(message))
            self._commands.clear()
            self._num_pending_adds = 0
        self._deliver([(g, EngineDead(message)) for g in groups])


def _put_all(batch: list[tuple[RequestGroup, StepOutput | BaseException]]) -> None:
    for group, item in batch:
        group._put(item)
