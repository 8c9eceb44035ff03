"""What the streaming front end costs per token, with the engine taken out: the real server (uvicorn,
FastAPI, ``AsyncLLM``'s output processing and detokenization, SSE) over a scripted engine core that emits
one token for every running request each ``--step-ms``, and, as the baseline, a bare ASGI app under the
same uvicorn that streams chunks of the same shape on the same clock. ``quire bench serve``'s client drives
both (``--clients`` streaming clients, 2 x clients requests); runs alternate between the two servers and
the table shows medians of each process's CPU per streamed token (the server's from the scheduler's
per-thread run times, the client's from ``time.process_time``). The last line pairs each Quire run with the
bare run that follows it and gives the median of those ratios, which the machine's drift over the whole
series (minutes) moves less than it moves the medians.

The scripted core runs in the server's process, where the real engine core does not: its making and
encoding of each step's message (the engine core process's work in a real server; the front end's share,
decoding it, stays in) is timed on its own thread clock and shown apart. The front end's figure is the
server's CPU without it. The difference between that and the bare row is what Quire's own Python costs per
token; the bare row is what uvicorn and the sockets cost at least.

With ``--pin`` the servers run on the last CPU and the clients on the others. Unpinned, on a 2-core machine
the client can run on the server's core between its writes and evict what the server keeps in cache; the
figure then also measures how much each server suffers from that.

    python benchmarks/frontend_cost.py [--checkpoint DIR] [--clients 32] [--output-len 128] [--repeats 5] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bench_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.servers import free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="tokenizer and config to serve (default: the tiny one)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the scripted engine's step time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pin", action="store_true",
                        help="run the servers on the last CPU and this process (the clients) on the others, as in "
                             "a deployment whose clients are elsewhere")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


# -- the two servers (each runs in its own process: ``--serve quire|bare PORT``) ------------------------

class ScriptedEngineCore:
    """An engine-core client for ``AsyncLLM`` that runs no model: every ``step`` seconds each running
    request gets one token (a fixed function of the request and position), until its ``max_tokens``.
    Outputs round-trip through msgspec as the real core's do; ``engine_side_ns`` counts the thread CPU
    spent making and encoding them (what the engine core process does in a real server)."""

    engine_dead = False

    def __init__(self, max_model_len: int, step: float):
        import msgspec

        from quire.core.wire import EngineCoreOutputs

        self.max_model_len = max_model_len
        self.step = step
        self.requests: dict[str, list[int]] = {}
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.arrived = asyncio.Event()
        self.engine_side_ns = 0

    async def add_request_async(self, request) -> None:
        self.requests[request.request_id] = [request.sampling_params.max_tokens, 0,
                                             sum(request.prompt_token_ids) % 5000]
        self.arrived.set()

    async def abort_requests_async(self, request_ids) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    async def call_utility_async(self, method: str, *args):
        return None

    async def get_output_async(self):
        from quire.core.wire import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats

        while not self.requests:
            self.arrived.clear()
            await self.arrived.wait()
        await asyncio.sleep(self.step)
        started = time.thread_time_ns()
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[1] += 1
            finished = state[1] >= state[0]
            outputs.append(EngineCoreOutput(request_id, [100 + (state[2] + 31 * state[1]) % 5000],
                                            FinishReason.LENGTH if finished else None))
            if finished:
                del self.requests[request_id]
        message = EngineCoreOutputs(outputs, SchedulerStats(num_running_reqs=len(outputs)), time.time())
        encoded = self.encoder.encode(message)
        self.engine_side_ns += time.thread_time_ns() - started
        return self.decoder.decode(encoded)

    def shutdown(self) -> None:
        pass


def serve_quire(checkpoint: Path, port: int, step: float, report: Path) -> None:
    from quire.core.engine.async_llm import AsyncLLM
    from quire.core.engine_args import EngineArgs
    from quire.openai_server.server import event_loop_factory, serve
    from quire.openai_server.settings import ServerSettings

    config = EngineArgs(model=str(checkpoint), dtype="bfloat16").create_engine_config()
    settings = ServerSettings(served_model_names=[str(checkpoint)], host="127.0.0.1", port=port,
                              log_level="warning")

    core = ScriptedEngineCore(config.model.max_model_len, step)
    reports = 0

    def report_engine_side(*_) -> None:  # SIGUSR1: "<count> <engine_side_ns>" into ``report``
        nonlocal reports
        reports += 1
        report.write_text(f"{reports} {core.engine_side_ns}")

    signal.signal(signal.SIGUSR1, report_engine_side)

    async def main():
        engine = AsyncLLM(config, engine_core=core)
        return await serve(engine, settings)

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main())


def serve_bare(port: int, step: float) -> None:
    """uvicorn and an ASGI app with no framework: the least a Python server can spend per chunk."""
    import uvicorn

    waiting: list[asyncio.Future] = []

    async def clock():
        while True:
            await asyncio.sleep(step)
            ready, waiting[:] = list(waiting), []
            for future in ready:
                if not future.done():
                    future.set_result(None)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            ticking = None
            while (message := await receive())["type"] == "lifespan.startup":
                ticking = asyncio.ensure_future(clock())
                await send({"type": "lifespan.startup.complete"})
            ticking.cancel()
            return await send({"type": "lifespan.shutdown.complete"})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/completions":
            answer = b'{"status":"ok","data":[{"id":"bare"}],"vocab_size":8000}'
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": answer})
        max_tokens = json.loads(body)["max_tokens"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        loop = asyncio.get_running_loop()
        created = int(time.time())
        for i in range(max_tokens):
            tick = loop.create_future()
            waiting.append(tick)
            await tick
            finish = b'"length"' if i == max_tokens - 1 else b"null"
            chunk = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef-0","object":"text_completion",'
                     b'"created":%d,"model":"bare","choices":[{"index":0,"text":" tok","logprobs":null,'
                     b'"finish_reason":%s,"stop_reason":null}]}\n\n' % (created, finish))
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        usage = (b'data: {"id":"cmpl-0","object":"text_completion","created":%d,"model":"bare","choices":[],'
                 b'"usage":{"prompt_tokens":0,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                 b'data: [DONE]\n\n' % (created, max_tokens, max_tokens))
        await send({"type": "http.response.body", "body": usage, "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


# -- the measurement ------------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User and system time of a process, its finished threads included (clock ticks: 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def threads_cpu_seconds(pid: int) -> float:
    """On-CPU time of a process's live threads, in nanoseconds from the scheduler (``schedstat``): a run
    of a few hundred milliseconds is measured to well under a tick."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def engine_side_seconds(process: subprocess.Popen, report: Path, reports: list[int]) -> float:
    """The scripted core's own CPU so far (``serve_quire``'s SIGUSR1 report; ``reports`` counts them)."""
    reports[0] += 1
    process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fields = report.read_text().split() if report.exists() else []
        if fields and int(fields[0]) == reports[0]:
            return int(fields[1]) / 1e9
        time.sleep(0.01)
    raise RuntimeError("the Quire server did not report its scripted core's CPU")


def start(kind: str, checkpoint: Path, step: float, report: Path,
          cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--checkpoint", str(checkpoint), "--report", str(report),
                                "--step-ms", str(step * 1000), "--serve", kind, str(port)],
                               preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {kind} server exited during start-up")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the {kind} server did not start in time")


def run_clients(base_url: str, model: str, clients: int, output_len: int, num_prompts: int, seed: int):
    from quire.cli.bench_serve import ServeBenchConfig, _benchmark, _run, summarize

    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]

    config = ServeBenchConfig(
        base_url=base_url, endpoint="/v1/completions", model=model, api_key=None, input_len=128,
        output_len=output_len, range_ratio=0.0, num_prompts=num_prompts, burstiness=1.0,
        max_concurrency=clients, ignore_eos=True, percentile_metrics=["itl"], metric_percentiles=[99.0],
        seed=seed)
    results, duration = _run(_benchmark(config, model, float("inf"), {}, vocab_size))
    return summarize(config, float("inf"), results, duration)


def main() -> None:
    args = parse_args()
    step = args.step_ms / 1000
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or bench_checkpoint(Path(scratch) / "bench-llama-7m")
        if args.serve:
            kind, port = args.serve
            if kind == "quire":
                return serve_quire(checkpoint, int(port), step, args.report)
            return serve_bare(int(port), step)
        report, reports = Path(scratch) / "engine-side", [0]
        server_cpus = None
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs at least two CPUs")
            server_cpus = {cpus[-1]}
            os.sched_setaffinity(0, set(cpus[:-1]))
        servers = {kind: start(kind, checkpoint, step, report, server_cpus) for kind in ("quire", "bare")}
        samples = {kind: {"server": [], "engine side": [], "client": [], "tok/s": []} for kind in servers}
        try:
            for _, url in servers.values():  # warm-up
                run_clients(url, str(checkpoint), args.clients, 2, args.clients, seed=1)
            for repeat in range(args.repeats):
                for kind, (process, url) in servers.items():
                    engine_side = engine_side_seconds(process, report, reports) if kind == "quire" else 0.0
                    server_cpu, client_cpu = threads_cpu_seconds(process.pid), time.process_time()
                    summary = run_clients(url, str(checkpoint), args.clients, args.output_len,
                                          2 * args.clients, seed=100 + repeat)
                    if summary["failed"]:
                        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
                    tokens = summary["total_output_tokens"]
                    server_cpu = threads_cpu_seconds(process.pid) - server_cpu
                    if kind == "quire":
                        engine_side = engine_side_seconds(process, report, reports) - engine_side
                    samples[kind]["server"].append(1e6 * (server_cpu - engine_side) / tokens)
                    samples[kind]["engine side"].append(1e6 * engine_side / tokens)
                    samples[kind]["client"].append(1e6 * (time.process_time() - client_cpu) / tokens)
                    samples[kind]["tok/s"].append(summary["output_throughput"])
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)
    pinned = "; servers pinned to one CPU, clients to the others" if args.pin else ""
    print(f"{args.clients} streaming clients, {2 * args.clients} requests x {args.output_len} tokens, one token "
          f"per chunk every {args.step_ms:g} ms; medians of {args.repeats} alternating runs{pinned}\n")
    print("| server | server CPU us per token | scripted core's engine-side CPU (not included) "
          "| client CPU us per token | streamed tok/s |")
    print("|---|---|---|---|---|")
    names = {"quire": "Quire (scripted engine core)", "bare": "bare ASGI app, same uvicorn"}
    medians = {kind: {k: statistics.median(v) for k, v in s.items()} for kind, s in samples.items()}
    for kind, m in medians.items():
        engine_side = f"{m['engine side']:.1f}" if kind == "quire" else "-"
        print(f"| {names[kind]} | {m['server']:.1f} | {engine_side} | {m['client']:.1f} | {m['tok/s']:,.0f} |")
    extra = medians["quire"]["server"] - medians["bare"]["server"]
    print(f"\nQuire's own per-token cost over the bare app: {extra:.1f} us "
          f"({medians['quire']['server'] / medians['bare']['server']:.2f}x the bare server's; with the scripted "
          f"core's engine-side work counted too: "
          f"{(medians['quire']['server'] + medians['quire']['engine side']) / medians['bare']['server']:.2f}x)")
    # each Quire run against the bare run right after it: the machine's drift between runs cancels
    ratios = sorted(q / b for q, b in zip(samples["quire"]["server"], samples["bare"]["server"]))
    print(f"Run by run (each Quire run over the bare run after it): median {statistics.median(ratios):.2f}x, "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)} pairs")

if __name__ == "__main__":
    main()
