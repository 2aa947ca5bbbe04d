"""kestrel.bench.profiling's busy share: the union of kernel intervals against their span."""

from __future__ import annotations

from kestrel.bench.profiling import busy_time


def test_busy_time_is_the_union_of_the_intervals():
    # overlapping (0-4, 2-5), nested (6-9 holds 7-8), touching (9-10), apart (12-13), given out of order
    spans = [(12.0, 13.0), (2.0, 5.0), (7.0, 8.0), (0.0, 4.0), (6.0, 9.0), (9.0, 10.0)]
    assert busy_time(spans) == (5.0 + 4.0 + 1.0, 13.0)
    assert busy_time([(1.0, 3.0)]) == (2.0, 2.0)
    assert busy_time([]) == (0.0, 0.0)
    # a long interval first, shorter ones inside it and past it: the union is not the sum
    assert busy_time([(0.0, 10.0), (1.0, 2.0), (3.0, 11.0)]) == (11.0, 11.0)
