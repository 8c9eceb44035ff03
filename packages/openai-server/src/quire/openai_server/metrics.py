"""Prometheus metrics with the ``quire:`` prefix and vLLM's names and meanings, recorded in the server
process from the engine's per-step statistics and each finished request's timings."""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from quire.core.outputs import RequestMetrics
from quire.core.wire import SchedulerStats

# vLLM's buckets, with finer low buckets for the sub-10 ms latencies of small models on CPUs.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """One registry per server (no process-wide globals); ``record`` is called once per engine step."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("quire:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("quire:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("quire:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("quire:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("quire:generation_tokens", "Generated tokens of finished requests.")
        self.preemptions = counter("quire:num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_cache_queries = counter("quire:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("quire:prefix_cache_hits", "Tokens found in the prefix cache.")
        self._success = Counter("quire:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=registry)
        self.ttft = histogram("quire:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = BatchHistogram("quire:inter_token_latency_seconds", "Time between consecutive tokens.",
                                  ITL_BUCKETS, model_name)
        registry.register(self.itl)
        self.e2e = histogram("quire:e2e_request_latency_seconds", "Arrival to finish.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("quire:request_queue_time_seconds", "Arrival to first scheduling.",
                                    REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("quire:request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("quire:request_generation_tokens",
                                                   "Generated tokens per request.", TOKEN_BUCKETS)
        self.compile_seconds = histogram("quire:structured_output_compile_seconds",
                                         "Time to compile a structured-output grammar (cache misses).",
                                         COMPILE_BUCKETS)
        self._structured = Counter("quire:structured_output_requests", "Finished requests with a "
                                   "structured-output constraint, by grammar backend.",
                                   ["model_name", "backend"], registry=registry)
        self._engine_totals = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def record(self, stats: SchedulerStats | None, finished: list[RequestMetrics]) -> None:
        if stats is not None:
            self.running.set(stats.num_running_reqs)
            self.waiting.set(stats.num_waiting_reqs)
            self.kv_cache_usage.set(stats.kv_cache_usage)
            for name, counter in (("num_preemptions", self.preemptions),
                                  ("prefix_cache_queries", self.prefix_cache_queries),
                                  ("prefix_cache_hits", self.prefix_cache_hits)):
                total = getattr(stats, name)  # cumulative in the engine: add what is new
                if total > self._engine_totals[name]:
                    counter.inc(total - self._engine_totals[name])
                    self._engine_totals[name] = total
            for seconds in stats.structured_output_compile_seconds:
                self.compile_seconds.observe(seconds)
        for metrics in finished:
            self._record_request(metrics)

    def _record_request(self, metrics: RequestMetrics) -> None:
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generation_tokens.inc(metrics.num_generation_tokens)
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_generation_tokens)
        self._success.labels(self.model_name, metrics.finish_reason or "unknown").inc()
        if metrics.structured_output_backend is not None:
            self._structured.labels(self.model_name, metrics.structured_output_backend).inc()
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        if metrics.e2e_latency is not None:
            self.e2e.observe(metrics.e2e_latency)
        times = metrics.token_times
        self.itl.observe_many([later - earlier for earlier, later in zip(times, times[1:])])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BatchHistogram:
    """A histogram (one label: the model name) that takes a request's values in one call: inter-token
    latencies arrive a request's worth at a time, one per generated token, and ``Histogram.observe`` costs
    a lock and a walk of the buckets for each. Exposed exactly as a ``Histogram`` of the same name."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], model_name: str):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += sum(values)

    def collect(self):
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], buckets, total)
        family.samples.append(Sample(self.name + "_created", {"model_name": self.model_name}, self.created))
        return [family]
