"""The relay's /metrics text (deploy/replica_metrics.py): every replica's samples labelled with its id, and
the unlabelled sums a single server would report; the result parses as Prometheus text."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phasewise.deploy.replica_metrics import merge_metrics

pytestmark = pytest.mark.ray


def _text(requests: float, usage: float, le1: float) -> str:
    return f"""# HELP phasewise:requests_finished_total Finished requests.
# TYPE phasewise:requests_finished_total counter
phasewise:requests_finished_total{{model_name="m",finished_reason="stop"}} {requests}
# HELP phasewise:kv_cache_usage_perc KV-cache usage.
# TYPE phasewise:kv_cache_usage_perc gauge
phasewise:kv_cache_usage_perc{{model_name="m"}} {usage}
# HELP phasewise:e2e_request_latency_seconds End-to-end latency.
# TYPE phasewise:e2e_request_latency_seconds histogram
phasewise:e2e_request_latency_seconds_bucket{{le="1.0",model_name="m"}} {le1}
phasewise:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="m"}} {requests}
phasewise:e2e_request_latency_seconds_count{{model_name="m"}} {requests}
phasewise:e2e_request_latency_seconds_sum{{model_name="m"}} 2.5
"""


def test_each_replica_labelled_and_the_sums_unlabelled():
    merged = merge_metrics({"SERVE_REPLICA::a": _text(3, 0.5, 1), "SERVE_REPLICA::b": _text(4, 0.25, 2)})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(merged) for s in f.samples}
    stop = (("finished_reason", "stop"), ("model_name", "m"))
    assert samples[("phasewise:requests_finished_total", stop)] == 7
    assert samples[("phasewise:requests_finished_total", (*stop, ("replica", "SERVE_REPLICA::a")))] == 3
    assert samples[("phasewise:kv_cache_usage_perc", (("model_name", "m"),))] == 0.375       # a ratio: the mean
    assert samples[("phasewise:e2e_request_latency_seconds_bucket", (("le", "1.0"), ("model_name", "m")))] == 3
    assert samples[("phasewise:e2e_request_latency_seconds_sum", (("model_name", "m"),))] == 5.0
    assert merged.count("# TYPE phasewise:e2e_request_latency_seconds histogram") == 1
    assert len(samples) == 3 * 6


def test_one_replica_alone_and_none():
    one = merge_metrics({"r": "# TYPE x counter\nx_total 2.0\n"})
    assert one.splitlines() == ["# TYPE x counter", 'x_total{replica="r"} 2.0', "x_total 2.0"]
    assert merge_metrics({}) == "\n"
