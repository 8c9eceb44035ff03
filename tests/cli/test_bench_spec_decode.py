"""Speculative-decoding figures in ``quire bench``: the server's /metrics counters (serve) and the engine's
scheduler statistics (latency, throughput), read before and after a run."""

import json
import types

import pytest

from quire.cli import bench_offline, bench_serve
from quire.cli.bench_spec_decode import SpecDecodeCounts
from quire.core.wire import SchedulerStats

NO_SPEC_METRICS = """\
# HELP quire:num_requests_running Requests in the running batch.
# TYPE quire:num_requests_running gauge
quire:num_requests_running{engine="0",model_name="m"} 0.0
"""


def spec_stats(drafts, draft_tokens, accepted, per_pos) -> SchedulerStats:
    return SchedulerStats(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                          spec_decode_num_accepted_tokens=accepted, spec_decode_num_accepted_tokens_per_pos=per_pos)


def server_metrics_text(stats_by_engine: dict[int, SchedulerStats]) -> str:
    """What the server's /metrics shows after these engines' latest statistics."""
    from quire.openai_server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    for engine_index, stats in stats_by_engine.items():
        metrics.record(stats, [], engine_index=engine_index)
    return metrics.render().decode()


def config(**changes) -> bench_serve.ServeBenchConfig:
    fields = dict(base_url="http://127.0.0.1:1", endpoint="/v1/completions", model=None, api_key=None,
                  input_len=8, output_len=2, range_ratio=0.0, num_prompts=2, burstiness=1.0, max_concurrency=None,
                  ignore_eos=True, percentile_metrics=["ttft"], metric_percentiles=[99.0], seed=0)
    return bench_serve.ServeBenchConfig(**{**fields, **changes})


def test_server_counters_are_summed_over_engines_and_differenced():
    before = SpecDecodeCounts.from_prometheus_text(server_metrics_text({0: spec_stats(2, 8, 3, [2, 1])}))
    assert before == SpecDecodeCounts(2, 8, 3, (2, 1))
    after = SpecDecodeCounts.from_prometheus_text(server_metrics_text(
        {0: spec_stats(10, 40, 25, [9, 7, 5, 4]), 1: spec_stats(2, 8, 3, [2, 1])}))
    assert after == SpecDecodeCounts(12, 48, 28, (11, 8, 5, 4))
    delta = after.since(before)
    assert delta == SpecDecodeCounts(10, 40, 25, (9, 7, 5, 4))
    assert delta.summary() == {
        "spec_decode_acceptance_rate": 62.5, "spec_decode_acceptance_length": 3.5, "spec_decode_num_drafts": 10,
        "spec_decode_draft_tokens": 40, "spec_decode_accepted_tokens": 25,
        "spec_decode_per_position_acceptance_rates": [0.9, 0.7, 0.5, 0.4]}


def test_positions_come_from_their_labels_whatever_the_order():
    text = """\
# TYPE quire:spec_decode_num_drafts_total counter
quire:spec_decode_num_drafts_total{model_name="a"} 4
quire:spec_decode_num_drafts_total{model_name="b"} 1
# TYPE quire:spec_decode_num_accepted_tokens_per_pos_total counter
quire:spec_decode_num_accepted_tokens_per_pos_total{position="2",model_name="a"} 1
quire:spec_decode_num_accepted_tokens_per_pos_total{position="0",model_name="a"} 3
quire:spec_decode_num_accepted_tokens_per_pos_total{position="0",model_name="b"} 1
"""
    assert SpecDecodeCounts.from_prometheus_text(text) == SpecDecodeCounts(5, 0, 0, (4, 0, 1))


@pytest.mark.parametrize("text", [NO_SPEC_METRICS, "", "not { prometheus"])
def test_metrics_without_spec_counters_read_as_none(text):
    assert SpecDecodeCounts.from_prometheus_text(text) is None


def test_no_drafts_no_summary():
    counts = SpecDecodeCounts.from_prometheus_text(server_metrics_text({0: SchedulerStats()}))
    assert counts == SpecDecodeCounts() and counts.summary() == {}


def test_result_block_shows_the_section_only_with_drafts(capsys):
    result = bench_serve.RequestResult(success=True, prompt_len=8, output_len=2, ttft=0.01, latency=0.02, itl=[0.01])
    summary = bench_serve.summarize(config(), 1.0, [result], 1.0)
    bench_serve.print_result_block(config(), summary)
    assert "Speculative Decoding" not in capsys.readouterr().out
    summary.update(SpecDecodeCounts(10, 40, 25, (9, 7, 5, 4)).summary())
    bench_serve.print_result_block(config(), summary)
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Speculative Decoding".center(50, "-"))
    assert [line.split() for line in lines[start + 1:]] == [
        ["Acceptance", "rate", "(%):", "62.50"], ["Acceptance", "length:", "3.50"], ["Drafts:", "10"],
        ["Draft", "tokens:", "40"], ["Accepted", "tokens:", "25"], ["Per-position", "acceptance", "(%):"],
        ["Position", "0:", "90.00"], ["Position", "1:", "70.00"], ["Position", "2:", "50.00"],
        ["Position", "3:", "40.00"], ["=" * 50]]


def fake_server(monkeypatch, metrics_texts: list[str | None]):
    """A server whose /metrics answers the next of ``metrics_texts`` (None: HTTP 404), and a benchmark
    that sends nothing."""
    import httpx

    texts = iter(metrics_texts)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            text = next(texts)
            return httpx.Response(404) if text is None else httpx.Response(200, text=text)
        return httpx.Response(200, json={"data": [{"id": "m"}], "vocab_size": 100})

    client = httpx.Client

    def fake_client(**kwargs):
        return client(transport=httpx.MockTransport(answer), **kwargs)

    async def fake_benchmark(config, model, rate, headers, vocab_size):
        return [bench_serve.RequestResult(success=True, prompt_len=8, output_len=2, ttft=0.01, latency=0.02,
                                          itl=[0.01])], 1.0

    monkeypatch.setattr(bench_serve.httpx, "Client", fake_client)
    monkeypatch.setattr(bench_serve, "_benchmark", fake_benchmark)


def test_bench_serve_reports_each_rate_from_its_own_counter_deltas(monkeypatch, tmp_path, capsys):
    after_first = server_metrics_text({0: spec_stats(6, 24, 11, [5, 4, 2])})
    # the second rate's "after" reading has no counters (as if the server restarted without them)
    fake_server(monkeypatch, [server_metrics_text({0: spec_stats(2, 8, 3, [2, 1])}), after_first,
                              after_first, NO_SPEC_METRICS])
    output_json = tmp_path / "r.json"
    assert bench_serve.run_serve_bench(config(), [1.0, 2.0], output_json, None) == 0
    assert capsys.readouterr().out.count("Speculative Decoding") == 1
    first, second = json.loads(output_json.read_text())
    assert first["spec_decode_num_drafts"] == 4 and first["spec_decode_acceptance_length"] == 3.0
    assert first["spec_decode_acceptance_rate"] == 50.0
    assert first["spec_decode_per_position_acceptance_rates"] == [0.75, 0.75, 0.5]
    assert not any(key.startswith("spec_decode") for key in second)


def test_bench_serve_without_a_metrics_route_prints_no_section(monkeypatch, capsys):
    fake_server(monkeypatch, [None, None])
    assert bench_serve.run_serve_bench(config(), [1.0], None, None) == 0
    output = capsys.readouterr().out
    assert "Serving Benchmark Result" in output and "Speculative Decoding" not in output


class FakeLLM:
    """An offline LLM whose every ``generate`` verifies two drafts of three tokens, accepting 2 and 1."""

    def __init__(self):
        self.stats = None

    def generate(self, prompts, params, use_tqdm=True):
        counts = SpecDecodeCounts.from_scheduler_stats(self.stats)
        per_pos = list(counts.num_accepted_tokens_per_pos) or [0, 0, 0]
        per_pos[0] += 2
        per_pos[1] += 1
        self.stats = spec_stats(counts.num_drafts + 2, counts.num_draft_tokens + 6, counts.num_accepted_tokens + 3,
                                per_pos)

    def get_metrics(self):
        return types.SimpleNamespace(scheduler=self.stats, finished_requests=[])

    def shutdown(self):
        pass


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_bench_latency_reports_the_timed_iterations(monkeypatch, tmp_path, capsys, speculative_config):
    monkeypatch.setattr(bench_offline, "_llm", lambda engine_args: FakeLLM())
    monkeypatch.setattr(bench_offline, "_vocab_size", lambda path: 100)
    engine_args = types.SimpleNamespace(model="m", speculative_config=speculative_config)
    output_json = tmp_path / "lat.json"
    bench_offline.run_latency(engine_args, 4, 4, 2, 1, 1, 3, output_json)
    output = capsys.readouterr().out
    result = json.loads(output_json.read_text())
    if speculative_config is None:
        assert "Speculative" not in output
        return
    assert "Acceptance length:                       2.50" in output  # 1 + 9 accepted / 6 drafts
    assert "Acceptance rate (%):                     50.00" in output
    assert result["spec_decode_num_drafts"] == 6  # the warm-up's 2 are not counted
    assert result["spec_decode_per_position_acceptance_rates"] == [1.0, 0.5, 0.0]


def test_offline_run_without_drafts_says_so(capsys):
    engine_args = types.SimpleNamespace(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    bench_offline.print_spec_decode_result(engine_args, SpecDecodeCounts().summary())
    assert capsys.readouterr().out == "Speculative decoding: no proposals were verified in the timed run\n"


def test_engine_counts_before_any_step_are_zero():
    llm = FakeLLM()
    assert bench_offline._spec_decode_counts(llm) == SpecDecodeCounts()
