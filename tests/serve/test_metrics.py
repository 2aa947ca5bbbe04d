"""The Prometheus text format written by `kestrel.serve.metrics`."""

from __future__ import annotations

import pytest

from kestrel.serve.metrics import Counter, Gauge, Histogram, Registry


def test_text_format():
    r = Registry()
    c = r.add(Counter("x_requests_total", "Requests.", ("finish_reason",)))
    c.inc(finish_reason="stop")
    c.inc(2, finish_reason='we"ird\n')
    r.add(Gauge("x_used", "Used.", fn=lambda: 3))
    h = r.add(Histogram("x_latency_seconds", "Latency.", buckets=(0.1, 1)))
    for v in (0.05, 0.1, 0.5, 7):
        h.observe(v)
    assert r.render() == (
        "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\n"
        'x_requests_total{finish_reason="stop"} 1\n'
        'x_requests_total{finish_reason="we\\"ird\\n"} 2\n'
        "# HELP x_used Used.\n# TYPE x_used gauge\nx_used 3\n"
        "# HELP x_latency_seconds Latency.\n# TYPE x_latency_seconds histogram\n"
        'x_latency_seconds_bucket{le="0.1"} 2\n'
        'x_latency_seconds_bucket{le="1"} 3\n'
        'x_latency_seconds_bucket{le="+Inf"} 4\n'
        "x_latency_seconds_sum 7.65\nx_latency_seconds_count 4\n"
    )


def test_misuse_is_refused():
    r = Registry()
    c = r.add(Counter("a_total", "A."))
    with pytest.raises(ValueError, match="go down"):
        c.inc(-1)
    with pytest.raises(ValueError, match="labels"):
        c.inc(reason="x")
    with pytest.raises(ValueError, match="already"):
        r.add(Gauge("a_total", "again"))


def test_a_registrys_labels_go_on_every_sample():
    """The served model's name on every series, first in its labels (vLLM's and SGLang's `model_name`, which
    their dashboards filter on); HELP and TYPE lines as they were."""
    r = Registry({"model_name": "m"})
    r.add(Counter("a_total", "A.", ("reason",))).inc(reason="stop")
    r.add(Gauge("b", "B.", fn=lambda: 2))
    r.add(Histogram("c_seconds", "C.", buckets=(1,))).observe(0.5)
    assert r.render() == (
        "# HELP a_total A.\n# TYPE a_total counter\n"
        'a_total{model_name="m",reason="stop"} 1\n'
        '# HELP b B.\n# TYPE b gauge\nb{model_name="m"} 2\n'
        "# HELP c_seconds C.\n# TYPE c_seconds histogram\n"
        'c_seconds_bucket{model_name="m",le="1"} 1\n'
        'c_seconds_bucket{model_name="m",le="+Inf"} 1\n'
        'c_seconds_sum{model_name="m"} 0.5\nc_seconds_count{model_name="m"} 1\n'
    )
