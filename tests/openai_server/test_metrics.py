"""Prometheus metrics after requests of known sizes."""

import random

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from quire.core.outputs import RequestMetrics
from quire.core.wire import SchedulerStats
from quire.openai_server.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    BatchHistogram,
    ServerMetrics,
)
from tests.servers import ServerProcess

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 10, 8, 10


def samples(server):
    response = httpx.get(server.url("/metrics"), timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def value(values, name, **labels):
    labels = {"model_name": "quire-demo", "engine": "0", **labels}
    return values[(name, tuple(sorted(labels.items())))]


def test_counts_after_ten_requests_of_known_sizes():
    server = ServerProcess()
    try:
        for i in range(NUM_REQUESTS):
            response = httpx.post(server.url("/v1/completions"), timeout=60, json={
                "prompt": [100 + i + j for j in range(PROMPT_LEN)], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0})
            assert response.status_code == 200
        values = samples(server)
        assert value(values, "quire:prompt_tokens_total") == NUM_REQUESTS * PROMPT_LEN
        assert value(values, "quire:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
        assert value(values, "quire:request_success_total", finished_reason="length") == NUM_REQUESTS
        assert value(values, "quire:time_to_first_token_seconds_count") == NUM_REQUESTS
        assert value(values, "quire:inter_token_latency_seconds_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
        assert value(values, "quire:e2e_request_latency_seconds_count") == NUM_REQUESTS
        assert value(values, "quire:request_queue_time_seconds_count") == NUM_REQUESTS
        assert value(values, "quire:request_prompt_tokens_sum") == NUM_REQUESTS * PROMPT_LEN
        assert value(values, "quire:prefix_cache_queries_total") == NUM_REQUESTS * PROMPT_LEN
        assert value(values, "quire:num_requests_running") == 0
        assert value(values, "quire:num_requests_waiting") == 0
        assert value(values, "quire:kv_cache_usage_perc") == 0
        assert value(values, "quire:num_preemptions_total") == 0
    finally:
        server.stop()


def test_each_engine_has_its_own_series():
    """Data parallelism: gauges and cumulative counters follow each engine's own reports; a finished request
    counts under the engine that ran it."""
    metrics = ServerMetrics("quire-demo")
    metrics.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, num_preemptions=3), [], engine_index=1)
    metrics.record(SchedulerStats(num_running_reqs=1, num_preemptions=1),
                   [RequestMetrics(arrival_time=0.0, finish_reason="length", num_prompt_tokens=5, engine_index=1)],
                   engine_index=0)
    metrics.record(SchedulerStats(num_waiting_reqs=1, num_preemptions=4), [], engine_index=1)
    values = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
              for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples}
    assert [value(values, "quire:num_requests_running", engine=e) for e in "01"] == [1, 0]
    assert [value(values, "quire:num_requests_waiting", engine=e) for e in "01"] == [0, 1]
    assert [value(values, "quire:kv_cache_usage_perc", engine=e) for e in "01"] == [0, 0]
    assert [value(values, "quire:num_preemptions_total", engine=e) for e in "01"] == [1, 4]
    assert [value(values, "quire:prompt_tokens_total", engine=e) for e in "01"] == [0, 5]
    assert value(values, "quire:request_success_total", engine="1", finished_reason="length") == 1
    assert not any(name == "quire:request_success_total" and ("engine", "0") in labels for name, labels in values)


def test_speculative_decoding_counters_follow_the_engine_totals():
    """Each snapshot carries the engine's cumulative speculative-decoding counts; the counters add what is new,
    per position too, and the per-position counts sum to the accepted total."""
    metrics = ServerMetrics("quire-demo")
    metrics.record(SchedulerStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=8,
                                  spec_decode_num_accepted_tokens=5,
                                  spec_decode_num_accepted_tokens_per_pos=[2, 2, 1]), [], engine_index=0)
    metrics.record(SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                                  spec_decode_num_accepted_tokens=9,
                                  spec_decode_num_accepted_tokens_per_pos=[3, 3, 2, 1]), [], engine_index=0)
    values = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
              for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples}
    assert value(values, "quire:spec_decode_num_drafts_total", engine="0") == 3
    assert value(values, "quire:spec_decode_num_draft_tokens_total", engine="0") == 12
    assert value(values, "quire:spec_decode_num_accepted_tokens_total", engine="0") == 9
    per_pos = [value(values, "quire:spec_decode_num_accepted_tokens_per_pos_total", engine="0", position=str(p))
               for p in range(4)]
    assert per_pos == [3, 3, 2, 1] and sum(per_pos) == 9


@pytest.mark.parametrize("buckets", [ITL_BUCKETS, TTFT_BUCKETS, REQUEST_LATENCY_BUCKETS, TOKEN_BUCKETS])
def test_batch_histogram_exposes_what_a_histogram_would(buckets):
    """The server's histograms take values one at a time (``observe``) or a request's worth at a time
    (``observe_many``: inter-token latencies); the exposition must be a Histogram's (bounds inclusive, values
    past the last bound in +Inf), creation time aside."""
    name, doc = "quire:inter_token_latency_seconds", "Time between consecutive tokens."
    reference_registry, batch_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(name, doc, ["model_name", "engine"], buckets=buckets, registry=reference_registry)
    batch = BatchHistogram(name, doc, buckets, ["model_name", "engine"])
    batch_registry.register(batch)
    rng = random.Random(0)
    scale = buckets[len(buckets) // 2]
    for request in range(20):
        engine = str(request % 2)
        values = [rng.choice([*buckets, 0.0, 1e6]) if rng.random() < 0.3 else rng.expovariate(1 / scale)
                  for _ in range(rng.randint(0, 50))]
        for value in values:
            reference.labels("m", engine).observe(value)
        if request % 3:
            batch.labels("m", engine).observe_many(values)
        else:
            for value in values:
                batch.labels("m", engine).observe(value)

    def exposed(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples if not s.name.endswith("_created")}

    expected, got = exposed(reference_registry), exposed(batch_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
