"""The scheduler alone (pure Python, fake pools): admission needs a slot and pages, FCFS without overtaking,
decode first, chunk budget, LIFO retraction, abort frees everything."""

from __future__ import annotations

from kestrel.engine.request import Request, Status
from kestrel.engine.sampling_params import SamplingParams
from kestrel.engine.scheduler import Scheduler


class Pages:
    def __init__(self, n, size=4):
        self.free_list, self.page_size = list(range(1, n + 1)), size

    @property
    def num_free_pages(self):
        return len(self.free_list)

    def pages_for(self, tokens):
        return -(-tokens // self.page_size)

    def alloc(self, n):
        if n > len(self.free_list):
            return None
        taken, self.free_list = self.free_list[:n], self.free_list[n:]
        return taken

    def free(self, pages):
        self.free_list += pages


class Slots:
    def __init__(self, n):
        self.free_list = list(range(1, n + 1))

    @property
    def num_free_slots(self):
        return len(self.free_list)

    def alloc(self):
        return self.free_list.pop() if self.free_list else None

    def free(self, s):
        self.free_list.append(s)


def req(rid, n_prompt, max_total=1000):
    return Request(rid, list(range(n_prompt)), SamplingParams(temperature=0), 0, max_total)


def finish_prefill(sched, batch, token=1):
    for c in batch.prefill:
        c.request.num_computed = c.end
        if c.samples:
            c.request.output_ids.append(token)
    for r in batch.decode:
        r.num_computed += 1
        r.output_ids.append(token)


def test_admission_needs_slot_and_pages_and_is_fcfs():
    pages, slots = Pages(6), Slots(2)
    s = Scheduler(pages, slots, chunked_prefill_size=100, max_running=8)
    a, b, c, d = req("a", 8), req("b", 30), req("c", 4), req("d", 4)
    for r in (a, b, c, d):
        s.add(r)
    batch = s.schedule()
    # a fits (2 pages); b needs 8 pages > 4 left, so it blocks c and d behind it (no overtaking)
    assert [ch.request.request_id for ch in batch.prefill] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "c", "d"]
    assert a.status is Status.RUNNING and a.slot is not None and len(a.pages) == 2


def test_decode_first_and_chunk_budget():
    s = Scheduler(Pages(100), Slots(4), chunked_prefill_size=10, max_running=4)
    a = req("a", 6)
    s.add(a)
    finish_prefill(s, s.schedule())
    assert a.in_decode
    b = req("b", 25)
    s.add(b)
    batch = s.schedule()
    assert batch.decode == [a]
    assert [(c.request.request_id, c.start, c.end) for c in batch.prefill] == [
        ("b", 0, 9)
    ]  # 10 - 1 decode token
    finish_prefill(s, batch)
    batch = s.schedule()
    assert batch.decode == [a] and (batch.prefill[0].start, batch.prefill[0].end) == (9, 18)


def test_retraction_is_lifo_and_requeues_first():
    pages = Pages(4, size=4)  # 16 tokens in all
    s = Scheduler(pages, Slots(4), chunked_prefill_size=100, max_running=4)
    a, b = req("a", 7), req("b", 7)
    s.add(a)
    s.add(b)
    finish_prefill(s, s.schedule())  # both prefilled: 2 pages each, pool empty
    assert pages.num_free_pages == 0
    finish_prefill(s, s.schedule())  # tokens 8 of a and b still fit their second page
    batch = s.schedule()  # a's 9th token needs a third page: b (newest) is retracted
    assert batch.decode == [a] and b.status is Status.WAITING and s.waiting[0] is b
    assert b.num_computed == 0 and b.slot is None and not b.pages and b.num_preemptions == 1
    assert b.output_ids  # kept: it will be recomputed with prompt + output


def test_abort_frees_everything():
    pages, slots = Pages(10), Slots(2)
    s = Scheduler(pages, slots, chunked_prefill_size=100, max_running=2)
    a, b = req("a", 5), req("b", 5)
    s.add(a)
    s.add(b)
    s.schedule()
    c = req("c", 5)
    s.add(c)
    s.abort(a)
    s.abort(c)
    assert a.finish_reason == "abort" and c.status is Status.FINISHED
    s.abort(b)
    assert pages.num_free_pages == 10 and slots.num_free_slots == 2 and not s.has_work()
