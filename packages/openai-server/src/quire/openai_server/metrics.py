"""Prometheus metrics with the ``quire:`` prefix and vLLM's names and meanings, recorded in the server
process from the engine's per-step statistics and each finished request's timings."""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
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
    """One registry per server (no process-wide globals); ``record`` is called once per engine step.

    Every series carries the labels ``model_name`` and ``engine`` (the data-parallel rank of the engine core,
    as a string: "0" with one engine), as vLLM's do: scheduler gauges and counters come from that engine's
    own latest ``SchedulerStats``, and a finished request's counts and timings go to the engine that ran it.
    """

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def histogram(name, doc, buckets):
            family = BatchHistogram(name, doc, buckets, labels)
            registry.register(family)
            return family

        self.families = {
            "running": Gauge("quire:num_requests_running", "Requests in the running batch.", labels,
                             registry=registry),
            "waiting": Gauge("quire:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=registry),
            "kv_cache_usage": Gauge("quire:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                    labels, registry=registry),
            "prompt_tokens": Counter("quire:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=registry),
            "generation_tokens": Counter("quire:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=registry),
            "num_preemptions": Counter("quire:num_preemptions", "Requests preempted by the scheduler.", labels,
                                       registry=registry),
            "prefix_cache_queries": Counter("quire:prefix_cache_queries", "Tokens looked up in the prefix cache.",
                                            labels, registry=registry),
            "prefix_cache_hits": Counter("quire:prefix_cache_hits", "Tokens found in the prefix cache.", labels,
                                         registry=registry),
            "spec_decode_num_drafts": Counter("quire:spec_decode_num_drafts", "Speculative verification steps "
                                              "(one per request with proposals).", labels, registry=registry),
            "spec_decode_num_draft_tokens": Counter("quire:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                                                    labels, registry=registry),
            "spec_decode_num_accepted_tokens": Counter("quire:spec_decode_num_accepted_tokens",
                                                       "Proposed tokens accepted.", labels, registry=registry),
            "ttft": histogram("quire:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
            "itl": histogram("quire:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS),
            "e2e": histogram("quire:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS),
            "queue_time": histogram("quire:request_queue_time_seconds", "Arrival to first scheduling.",
                                    REQUEST_LATENCY_BUCKETS),
            "request_prompt_tokens": histogram("quire:request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_BUCKETS),
            "request_generation_tokens": histogram("quire:request_generation_tokens",
                                                   "Generated tokens per request.", TOKEN_BUCKETS),
            "compile_seconds": histogram("quire:structured_output_compile_seconds",
                                         "Time to compile a structured-output grammar (cache misses).",
                                         COMPILE_BUCKETS),
        }
        self.success = Counter("quire:request_success", "Finished requests by finish reason.",
                               [*labels, "finished_reason"], registry=registry)
        self.structured = Counter("quire:structured_output_requests", "Finished requests with a "
                                  "structured-output constraint, by grammar backend.", [*labels, "backend"],
                                  registry=registry)
        self.accepted_per_pos = Counter("quire:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens "
                                        "accepted, by their position in the proposal (0: the first).",
                                        [*labels, "position"], registry=registry)
        self.lora_info = Gauge("quire:lora_requests_info", "LoRA adapters of the running and of the waiting "
                               "requests (comma-separated labels) and max_lora; the value is when they were "
                               "reported (Unix time).",
                               [*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                               registry=registry)
        self._engines: dict[int, EngineSeries] = {}
        self.engine(0)  # one engine's series exist (at zero) before its first step

    def engine(self, engine_index: int) -> EngineSeries:
        """The series of one engine core (made on first use: engines are known by their reports)."""
        series = self._engines.get(engine_index)
        if series is None:
            series = self._engines[engine_index] = EngineSeries(self, str(engine_index))
        return series

    def record(self, stats: SchedulerStats | None, finished: list[RequestMetrics], *,
               engine_index: int = 0) -> None:
        if stats is not None:
            self.engine(engine_index).record_stats(stats)
        for metrics in finished:
            self.engine(metrics.engine_index).record_request(metrics)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineSeries:
    """One engine core's labelled series, bound once (``labels()`` costs a lock and a lookup per call)."""

    def __init__(self, metrics: ServerMetrics, engine: str):
        self.labels = (metrics.model_name, engine)
        for key, family in metrics.families.items():
            setattr(self, key, family.labels(*self.labels))
        self.success, self.structured = metrics.success, metrics.structured
        self._engine_totals = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                               "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                               "spec_decode_num_accepted_tokens": 0}
        self._accepted_per_pos_totals: list[int] = []
        self._accepted_per_pos_family = metrics.accepted_per_pos
        self._lora_info_family = metrics.lora_info
        self._lora_info_labels: tuple[str, ...] | None = None  # this engine's current series
        self._gauges: tuple | None = None  # the running, waiting and KV-cache gauges' values last set

    def record_stats(self, stats: SchedulerStats) -> None:
        gauges = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
        if gauges != self._gauges:  # a gauge's set takes a lock: most steps change none of them
            self._gauges = gauges
            self.running.set(stats.num_running_reqs)
            self.waiting.set(stats.num_waiting_reqs)
            self.kv_cache_usage.set(stats.kv_cache_usage)
        for name, total in self._engine_totals.items():
            new_total = getattr(stats, name)  # cumulative in the engine: add what is new
            if new_total > total:
                getattr(self, name).inc(new_total - total)
                self._engine_totals[name] = new_total
        for position, total in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            if position == len(self._accepted_per_pos_totals):
                self._accepted_per_pos_totals.append(0)
            if total > self._accepted_per_pos_totals[position]:
                self._accepted_per_pos_family.labels(*self.labels, str(position)).inc(
                    total - self._accepted_per_pos_totals[position])
                self._accepted_per_pos_totals[position] = total
        for seconds in stats.structured_output_compile_seconds:
            self.compile_seconds.observe(seconds)
        if stats.max_loras:
            self._record_lora_info(stats)

    def _record_lora_info(self, stats: SchedulerStats) -> None:
        labels = (*self.labels, str(stats.max_loras), ",".join(stats.running_lora_adapters),
                  ",".join(stats.waiting_lora_adapters))
        if self._lora_info_labels not in (None, labels):
            self._lora_info_family.remove(*self._lora_info_labels)  # one series per engine: the latest
        self._lora_info_labels = labels
        self._lora_info_family.labels(*labels).set_to_current_time()

    def record_request(self, metrics: RequestMetrics) -> None:
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generation_tokens.inc(metrics.num_generation_tokens)
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_generation_tokens)
        self.success.labels(*self.labels, metrics.finish_reason or "unknown").inc()
        if metrics.structured_output_backend is not None:
            self.structured.labels(*self.labels, metrics.structured_output_backend).inc()
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        if metrics.e2e_latency is not None:
            self.e2e.observe(metrics.e2e_latency)
        times = metrics.token_times
        self.itl.observe_many([later - earlier for earlier, later in zip(times, times[1:])])


class BatchHistogram:
    """A labelled histogram for the server's one thread: ``prometheus_client``'s ``Histogram.observe`` takes a
    lock for the sum and for the bucket and walks the buckets in Python, for every value (a request's
    inter-token latencies are one per generated token); here a value is a bisection and two additions, and
    ``observe_many`` takes a request's worth in one call. Exposed exactly as a ``Histogram`` of the same name
    and labels; ``labels(...)`` gives the child that ``observe`` and ``observe_many`` are called on."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labelnames: list[str]):
        self.name, self.documentation = name, documentation
        self.labelnames = list(labelnames)
        self.bounds = list(buckets)
        self._children: dict[tuple[str, ...], _BatchHistogramChild] = {}

    def labels(self, *values: str) -> _BatchHistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _BatchHistogramChild(self.bounds)
        return child

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, count in zip([*self.bounds, float("inf")], counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(list(values), buckets, total)
            family.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, values)),
                                         child.created))
        return [family]


class _BatchHistogramChild:
    """One label set's buckets of a ``BatchHistogram``."""

    def __init__(self, bounds: list[float]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """Each value in the first bucket whose bound is >= it: counted bucket by bucket on the values sorted
        (in C), not value by value (a request's inter-token latencies mostly share a few buckets)."""
        if not values:
            return
        ordered, counts = sorted(values), self.counts
        below = 0  # values counted so far: those <= the previous bound
        for index, bound in enumerate(self.bounds):
            upto = bisect.bisect_right(ordered, bound, below)
            counts[index] += upto - below
            below = upto
            if below == len(ordered):
                break
        counts[-1] += len(ordered) - below
        self.sum += sum(values)
