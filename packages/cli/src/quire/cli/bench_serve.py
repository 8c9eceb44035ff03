"""``quire bench serve``: drive a running server and report vLLM's "Serving Benchmark Result" block."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import ssl
import sys
import time
import urllib.parse
from pathlib import Path

import httptools
import httpx
import msgspec
import numpy as np

from quire.cli.bench_spec_decode import print_spec_decode_section, read_spec_decode_counts


@dataclasses.dataclass
class ServeBenchConfig:
    base_url: str
    endpoint: str
    model: str | None
    api_key: str | None
    input_len: int
    output_len: int
    range_ratio: float
    num_prompts: int
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    percentile_metrics: list[str]
    metric_percentiles: list[float]
    seed: int


@dataclasses.dataclass
class RequestResult:
    success: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def run_serve_bench(config: ServeBenchConfig, rates: list[float], output_json: Path | None,
                    plot: Path | None) -> int:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with httpx.Client(base_url=config.base_url, headers=headers, timeout=30) as http:
        try:
            models = http.get("/v1/models")
            models.raise_for_status()
            model = config.model or models.json()["data"][0]["id"]
            tokenizer_info = http.get("/tokenizer_info").json()
        except httpx.HTTPError as error:
            print(f"error: cannot reach a server at {config.base_url}: {error}", file=sys.stderr)
            return 1
        vocab_size = tokenizer_info.get("vocab_size", 1000)
        runs = []
        for index, rate in enumerate(rates):
            # each rate gets its own prompts: repeating the previous rate's would hit the server's prefix cache
            rate_config = dataclasses.replace(config, seed=config.seed + index)
            counts_before = read_spec_decode_counts(http)
            results, duration = _run(_benchmark(rate_config, model, rate, headers, vocab_size))
            summary = summarize(config, rate, results, duration)
            counts_after = read_spec_decode_counts(http)
            if counts_before is not None and counts_after is not None:
                summary.update(counts_after.since(counts_before).summary())
            print_result_block(config, summary)
            runs.append({"summary": summary, "results": results})
    if output_json is not None:
        data = [run["summary"] for run in runs]
        output_json.write_text(json.dumps(data[0] if len(data) == 1 else data, indent=2) + "\n")
    if plot is not None:
        from quire.cli.plots import plot_latencies, plot_rate_sweep

        if len(runs) > 1:
            plot_rate_sweep([run["summary"] for run in runs], plot)
        else:
            plot_latencies(runs[0]["results"], plot)
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def _prompts(config: ServeBenchConfig, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(config.seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - config.range_ratio)), int(center * (1 + config.range_ratio))))

    return [([rng.randrange(3, vocab_size) for _ in range(length(config.input_len))], length(config.output_len))
            for _ in range(config.num_prompts)]


async def _arrivals(count: int, rate: float, burstiness: float, seed: int):
    """Yield ``count`` times, spaced as a Poisson process (burstiness 1), a gamma process, or at once."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        yield i
        if rate == float("inf") or i == count - 1:
            continue
        if burstiness == 0:
            await asyncio.sleep(1.0 / rate)
        else:
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def _benchmark(config: ServeBenchConfig, model: str, rate: float, headers: dict, vocab_size: int):
    prompts = _prompts(config, vocab_size)
    limit = asyncio.Semaphore(config.max_concurrency or len(prompts))
    target = _Target.parse(config.base_url, config.endpoint, headers)
    start = time.perf_counter()
    tasks = []
    async for i in _arrivals(len(prompts), rate, config.burstiness, config.seed):
        tasks.append(asyncio.create_task(_one(target, config, model, *prompts[i], limit)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


REQUEST_TIMEOUT_SECONDS = 600


@dataclasses.dataclass
class _Target:
    host: str
    port: int
    ssl: ssl.SSLContext | None
    path: str
    head: bytes  # the request line and the headers every request shares

    @classmethod
    def parse(cls, base_url: str, endpoint: str, headers: dict) -> _Target:
        url = urllib.parse.urlsplit(base_url)
        secure = url.scheme == "https"
        port = url.port or (443 if secure else 80)
        path = url.path.rstrip("/") + endpoint
        host = url.netloc.rpartition("@")[2]  # as written: brackets around IPv6, the port if given
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                 "Accept: text/event-stream", *(f"{k}: {v}" for k, v in headers.items())]
        return cls(url.hostname, port, ssl.create_default_context() if secure else None, path,
                   "\r\n".join(lines).encode("latin-1") + b"\r\n")


async def _one(target: _Target, config: ServeBenchConfig, model: str, prompt: list[int], output_len: int,
               limit: asyncio.Semaphore) -> RequestResult:
    body = {"model": model, "max_tokens": output_len, "stream": True, "ignore_eos": config.ignore_eos,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if config.endpoint == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
    payload = msgspec.json.encode(body)
    result = RequestResult(success=False, prompt_len=len(prompt))
    async with limit:
        loop = asyncio.get_running_loop()
        stream = _EventStream(result, loop.create_future())
        transport = None
        try:
            stream.start = stream.last = time.perf_counter()
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: stream, target.host, target.port, ssl=target.ssl),
                REQUEST_TIMEOUT_SECONDS)
            transport.write(target.head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            await asyncio.wait_for(stream.done, REQUEST_TIMEOUT_SECONDS)
        except (TimeoutError, OSError) as error:
            result.error = result.error or type(error).__name__
        finally:
            if transport is not None:
                transport.close()
        result.success = not result.error
        return result


class _EventStream(asyncio.Protocol):
    """One streamed request on its own connection. httptools (C, from uvicorn[standard]) parses the
    response and undoes the chunked encoding; events are timed and read in its callbacks, as the bytes
    arrive, with no task woken per event: on a machine the benchmark shares with the server, every
    core-second the client spends is taken from the server."""

    def __init__(self, result: RequestResult, done: asyncio.Future):
        self.result = result
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.start = self.last = self.now = 0.0
        self.status = 0
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._finish(f"bad HTTP response: {error}")

    def connection_lost(self, exc) -> None:
        self._finish(f"the server closed the connection early ({exc or 'EOF'})")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status != 200:
            self._finish(f"HTTP {self.status}")

    def on_body(self, body: bytes) -> None:
        if self.done.done():
            return
        if b"\r" in body:  # events may also end in CRLF pairs
            body = body.replace(b"\r\n", b"\n")
        *events, self.pending = (self.pending + body).split(b"\n\n")
        result = self.result
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            parsed = _decode_event(event[6:])
            if parsed.error is not None:
                return self._finish(parsed.error.get("message", "error"))
            if parsed.usage:
                result.output_len = parsed.usage.completion_tokens
            if parsed.choices and _carries_tokens(parsed.choices[0]):
                if result.ttft == 0.0:
                    result.ttft = self.now - self.start
                else:
                    result.itl.append(self.now - self.last)
                self.last = self.now

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.result.latency = time.perf_counter() - self.start
            self.done.set_result(None)

    def _finish(self, error: str) -> None:
        if not self.done.done():
            self.result.error = error
            self.done.set_result(None)


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Event(msgspec.Struct):
    """The fields of a streamed chunk the benchmark reads (msgspec skips the rest unparsed)."""

    choices: list[dict] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_event = msgspec.json.Decoder(_Event).decode


def _carries_tokens(choice: dict) -> bool:
    # Every chunk but a chat stream's opening role announcement carries tokens, even when they decode
    # to no text yet (part of a multi-byte character, or ids the tokenizer renders as nothing).
    return "role" not in (choice.get("delta") or {})


def _run(coroutine):
    """Run the load on uvloop where it is installed (it comes with uvicorn[standard]): on a machine the
    benchmark shares with the server, each event the client handles takes CPU from the server."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def summarize(config: ServeBenchConfig, rate: float, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_len for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    summary = {
        "request_rate": rate if rate != float("inf") else "inf", "max_concurrency": config.max_concurrency,
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": sorted({r.error for r in results if r.error}),
    }
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for metric, samples in values.items():
        samples_ms = np.array(samples or [0.0]) * 1000
        summary[f"mean_{metric}_ms"] = float(samples_ms.mean())
        summary[f"median_{metric}_ms"] = float(np.median(samples_ms))
        summary[f"std_{metric}_ms"] = float(samples_ms.std())
        for p in config.metric_percentiles:
            summary[f"p{p:g}_{metric}_ms"] = float(np.percentile(samples_ms, p))
    return summary


_SECTIONS = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
             "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def print_result_block(config: ServeBenchConfig, summary: dict) -> None:
    def row(label, value, fmt="{:<10.2f}"):
        print(f"{label:<40} " + fmt.format(value))

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", summary["completed"], "{:<10}")
    row("Failed requests:", summary["failed"], "{:<10}")
    if config.max_concurrency is not None:
        row("Maximum request concurrency:", config.max_concurrency, "{:<10}")
    row("Request rate configured (RPS):", summary["request_rate"], "{:<10}")
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", summary["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for metric in config.percentile_metrics:
        if metric not in _SECTIONS:
            continue
        title, short = _SECTIONS[metric]
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", summary[f"mean_{metric}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{metric}_ms"])
        for p in config.metric_percentiles:
            row(f"P{p:g} {short} (ms):", summary[f"p{p:g}_{metric}_ms"])
    print_spec_decode_section(summary)
    print("=" * 50)
