"""Prometheus metrics after requests of known sizes."""

import random

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from quire.openai_server.metrics import ITL_BUCKETS, BatchHistogram
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
    labels = {"model_name": "quire-demo", **labels}
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


def test_batch_histogram_exposes_what_a_histogram_would():
    """Inter-token latencies are recorded a request at a time; the exposition must be a Histogram's
    (bounds inclusive, values past the last bound in +Inf), creation time aside."""
    name, doc = "quire:inter_token_latency_seconds", "Time between consecutive tokens."
    reference_registry, batch_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(name, doc, ["model_name"], buckets=ITL_BUCKETS, registry=reference_registry)
    batch = BatchHistogram(name, doc, ITL_BUCKETS, "m")
    batch_registry.register(batch)
    rng = random.Random(0)
    for _ in range(20):  # requests
        gaps = [rng.choice([*ITL_BUCKETS, 0.0, 1000.0]) if rng.random() < 0.3 else rng.expovariate(30)
                for _ in range(rng.randint(0, 50))]
        for gap in gaps:
            reference.labels("m").observe(gap)
        batch.observe_many(gaps)

    def exposed(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples if not s.name.endswith("_created")}

    expected, got = exposed(reference_registry), exposed(batch_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
