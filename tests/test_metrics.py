"""The server's /metrics counters (qspec/server/metrics.py) in Prometheus' text format: well formed, the histogram
cumulative, label values escaped."""

from __future__ import annotations

import re

from qspec.server.metrics import TTFT_BUCKETS, ServerMetrics

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*\{(?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\} -?[0-9.e+-]+(?:inf)?$')


def test_the_text_format() -> None:
    m = ServerMetrics('a "quoted"\\model\nname')
    for s in (0.003, 0.2, 0.2, 7.0, 100.0):
        m.first_token(s)
    m.queue(waiting=2, running=1, rejected=1)
    lines = m.render().splitlines()
    for ln in lines:
        assert ln.startswith("# HELP ") or ln.startswith("# TYPE ") or SAMPLE.match(ln), ln
    assert 'model_name="a \\"quoted\\"\\\\model\\nname"' in lines[2]
    buckets = [float(ln.rsplit(" ", 1)[1]) for ln in lines if "_bucket{" in ln]
    assert len(buckets) == len(TTFT_BUCKETS) + 1 and buckets == sorted(buckets) and buckets[-1] == 5
    count = next(ln for ln in lines if ln.startswith("qspec:time_to_first_token_seconds_count"))
    assert count.endswith(" 5") and any(ln.endswith(" 2") for ln in lines if "num_requests_waiting{" in ln)
