"""What a structured-output constraint costs when serving: throughput of constrained against unconstrained
chat requests, and what compiling (and reusing) a grammar adds to the time to first token. The real server
(``python -m quire.openai_server``, started on the embedded ``quire-demo`` model with ``--dtype float32
--max-num-seqs 64`` unless ``--url`` names a running one) is driven over HTTP with httpx and asyncio.

1. Throughput: generated tokens per second (completion tokens over the run's wall time) at 1, 8 and 32
   concurrent requests, same prompt, ``--max-tokens`` 128, temperature 1.0 and fixed seeds. The constraint
   (``--structured-output``) is a JSON schema (an array of 8-16 objects of bounded fields), a regex (40-80
   dated lines) or a choice between long texts: each is too long to finish within ``--max-tokens``, so the
   constrained requests stop at the same length as the unconstrained ones (which set ``ignore_eos``).
   Runs alternate constrained / unconstrained; medians of ``--repeats`` pairs, and the median of the
   pairs' ratios. Target: constrained at least 0.8x unconstrained at 8 and 32 concurrent requests. Where
   the server has its debug routes (the one started here does), the engine's time per step in each phase
   (``/debug/step_timings``: schedule, which fills the grammar bitmasks, prepare_inputs, forward, sampling,
   which applies them, update, which advances the grammars) shows where a constrained step's time goes.
2. Compile time: streaming requests one at a time, ``max_tokens`` 4, interleaved. The time to first token
   (first content chunk) of constraints never seen before (each unique: a cache miss, so it compiles;
   median of ``--uncached-requests``), of ``--ttft-requests`` requests reusing one (cached) and of as many
   unconstrained ones; the difference of the last two medians (and the median of the alternating pairs'
   differences) is what a cached constraint adds. The compile seconds are the delta of the server's
   ``quire:structured_output_compile_seconds`` histogram. Target: a cached schema adds under 5 ms.

Figures are printed with PASS / FAIL against the targets (nothing is asserted).

    python benchmarks/structured_outputs.py [--structured-output json|regex|choice] [--repeats 3]
        [--concurrency 1 8 32] [--max-tokens 128] [--ttft-requests 20] [--uncached-requests 5]
        [--url http://HOST:PORT]

On a small machine the engine, the server and this client share the cores: run it on an otherwise idle
one. The load of other processes during each run is printed (from ``/proc``); where it is not near 0 the
figures are noise (on 2 cores one busy core can cut the engine's throughput threefold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.servers import ServerProcess, child_pids  # noqa: E402

MODEL = "quire-demo"
PROMPT = ("Write a JSON object listing twelve people: for each, a name, an age, a city, an email address and "
          "whether the account is active.")
REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
RUN_TIMEOUT = 900.0  # one throughput run, all its requests
THROUGHPUT_TARGET = 0.8  # constrained / unconstrained, at 8 and 32 concurrent requests
TTFT_TARGET_MS = 5.0  # what a cached schema may add to the time to first token
COMPILE_METRIC = "quire:structured_output_compile_seconds"
TICK = os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How many cores processes other than this benchmark (and the server it started) kept busy: the
    machine's noise, from ``/proc`` (with ``--url`` the server's own work counts as other load)."""

    def __init__(self, server_pid: int | None):
        self.pids = [os.getpid()] + ([server_pid, *child_pids(server_pid)] if server_pid else [])
        self.totals = [0.0, 0.0]  # other CPU seconds, wall seconds

    def snapshot(self) -> tuple[float, float, float]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / TICK  # all but idle and iowait
        ours = 0.0
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += (int(stat[11]) + int(stat[12])) / TICK
            except OSError:
                pass
        return busy, ours, time.monotonic()

    def cores_since(self, before: tuple[float, float, float]) -> float:
        """Cores that other processes kept busy on average since ``before`` (a ``snapshot``)."""
        busy, ours, now = self.snapshot()
        other, wall = max(0.0, (busy - before[0]) - (ours - before[1])), now - before[2]
        self.totals[0] += other
        self.totals[1] += wall
        return other / wall if wall > 0 else 0.0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structured-output", default="json", choices=("json", "regex", "choice"),
                        help="the kind of constraint")
    parser.add_argument("--repeats", type=int, default=3, help="constrained / unconstrained pairs per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=(1, 8, 32))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=2,
                        help="requests per throughput run at least (otherwise one per concurrent slot)")
    parser.add_argument("--ttft-requests", type=int, default=20, help="cached and unconstrained requests each")
    parser.add_argument("--uncached-requests", type=int, default=5,
                        help="first uses of new constraints (cache misses) timed")
    parser.add_argument("--url", help="use this running server (serving quire-demo) instead of starting one")
    return parser.parse_args()


# -- the constraints ------------------------------------------------------------------------------------

def json_schema(tag: str | None = None) -> dict:
    """An object holding 8-16 people of bounded fields (well over 128 tokens); ``tag`` adds a property
    whose name makes the schema unique (a grammar-cache miss)."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 3, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "minLength": 2, "maxLength": 24},
            "email": {"type": "string", "minLength": 6, "maxLength": 40},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "email", "active"],
        "additionalProperties": False,
    }
    properties = {"people": {"type": "array", "items": person, "minItems": 8, "maxItems": 16}}
    if tag is not None:
        properties[f"batch_{tag}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def regex(tag: str | None = None) -> str:
    """40-80 lines of a date and a word (well over 128 tokens), after a unique literal if ``tag``."""
    prefix = f"run-{tag}: " if tag is not None else ""
    return prefix + r"(\d{4}-\d{2}-\d{2} [A-Z][a-z]{2,12}\n){40,80}"


def choices(tag: str | None = None) -> list[str]:
    """Four long texts (each far over 128 tokens), and a unique fifth if ``tag``."""
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
             "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
    texts = [f"option {k}: " + " ".join(words[(k * 7 + i) % len(words)] for i in range(400)) for k in range(4)]
    return texts + ([f"option {tag}"] if tag is not None else [])


def constraint_fields(kind: str, tag: str | None = None) -> dict:
    """The request fields that set a constraint of this kind."""
    if kind == "json":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "people", "schema": json_schema(tag)}}}
    if kind == "regex":
        return {"structured_outputs": {"regex": regex(tag)}}
    return {"structured_outputs": {"choice": choices(tag)}}


def request_body(constraint: dict | None, max_tokens: int, seed: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, "stream": stream}
    if constraint is None:
        body["ignore_eos"] = True  # unconstrained requests run to max_tokens, as the constrained ones do
    else:
        body.update(constraint)
    return body


# -- requests -------------------------------------------------------------------------------------------

async def complete(client: httpx.AsyncClient, body: dict) -> dict:
    response = await client.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"request failed ({response.status_code}): {response.text[:500]}")
    return response.json()


async def throughput_run(client: httpx.AsyncClient, constraint: dict | None, concurrency: int,
                         num_requests: int, max_tokens: int) -> tuple[float, list[int]]:
    """Generated tokens per second of ``num_requests`` requests, at most ``concurrency`` at a time, and each
    request's completion tokens."""
    slots = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> int:
        async with slots:
            answer = await complete(client, request_body(constraint, max_tokens, seed))
            return answer["usage"]["completion_tokens"]

    start = time.perf_counter()
    tokens = await asyncio.wait_for(asyncio.gather(*(one(1000 + i) for i in range(num_requests))), RUN_TIMEOUT)
    return sum(tokens) / (time.perf_counter() - start), list(tokens)


async def first_token_seconds(client: httpx.AsyncClient, body: dict) -> float:
    """Seconds from sending a streaming request to its first chunk with content (read to the end)."""
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"request failed ({response.status_code}): {(await response.aread())[:500]}")
        async for line in response.aiter_lines():
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("a streamed response had no content")
    return first


async def step_timings(client: httpx.AsyncClient) -> dict | None:
    """The engine's step timings since the last call (which resets them), or None without debug routes."""
    response = await client.get("/debug/step_timings", params={"reset": "true"})
    return response.json() if response.status_code == 200 else None


async def compile_histogram(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the server's compile-seconds histogram."""
    text = (await client.get("/metrics")).text
    values = {}
    for suffix in ("sum", "count"):
        found = re.search(rf"^{re.escape(COMPILE_METRIC)}_{suffix}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        values[suffix] = float(found.group(1)) if found else 0.0
    return values["sum"], values["count"]


# -- the two measurements -------------------------------------------------------------------------------

async def measure_compile(client: httpx.AsyncClient, kind: str, num_requests: int, num_misses: int) -> dict:
    """TTFTs of first uses of new constraints (misses), of the first one reused (cached) and of unconstrained
    requests, one request at a time, interleaved; and the compile seconds the server reported meanwhile."""
    def new_constraint() -> dict:
        return constraint_fields(kind, uuid.uuid4().hex[:12])

    async def ttft(constraint: dict | None, seed: int) -> float:
        return await first_token_seconds(client, request_body(constraint, 4, seed, stream=True))

    before = await compile_histogram(client)
    reused = new_constraint()
    misses, cached, plain = [await ttft(reused, 1)], [], []
    for i in range(max(num_requests, num_misses - 1)):
        if i < num_requests:
            cached.append(await ttft(reused, 10 + i))
            plain.append(await ttft(None, 10 + i))
        if len(misses) < num_misses:
            misses.append(await ttft(new_constraint(), 1))
    for name, values in (("first uses", misses), ("cached", cached), ("unconstrained", plain)):
        print(f"  TTFT {name} (ms): " + ", ".join(f"{1e3 * value:.0f}" for value in values), flush=True)
    after = before
    for _ in range(50):  # compile seconds come with the engine's stats after the compile: wait up to 5 s
        after = await compile_histogram(client)
        if after[1] - before[1] >= len(misses):
            break
        await asyncio.sleep(0.1)
    return {"uncached": statistics.median(misses), "num_misses": len(misses), "cached": statistics.median(cached),
            "plain": statistics.median(plain), "paired": statistics.median(c - p for c, p in zip(cached, plain)),
            "compile_seconds": after[0] - before[0], "compiles": after[1] - before[1]}


async def measure_throughput(client: httpx.AsyncClient, kind: str, args, load: OtherLoad) -> dict:
    constraint = constraint_fields(kind)
    results = {}
    for concurrency in args.concurrency:
        num_requests = max(concurrency, args.min_requests)
        runs = {"constrained": [], "unconstrained": []}
        tokens = {"constrained": [], "unconstrained": []}
        steps = {"constrained": [], "unconstrained": []}
        noise = []
        for _ in range(args.repeats):
            for mode, fields in (("constrained", constraint), ("unconstrained", None)):
                await step_timings(client)
                before = load.snapshot()
                rate, counts = await throughput_run(client, fields, concurrency, num_requests, args.max_tokens)
                noise.append(load.cores_since(before))
                timings = await step_timings(client)
                runs[mode].append(rate)
                tokens[mode] += counts
                if timings and timings.get("num_steps"):
                    steps[mode].append(timings)
        results[concurrency] = {"runs": runs, "tokens": tokens, "steps": steps, "num_requests": num_requests}
        ratios = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"])]
        print(f"  concurrency {concurrency}: constrained {', '.join(f'{r:.0f}' for r in runs['constrained'])} "
              f"tok/s; unconstrained {', '.join(f'{r:.0f}' for r in runs['unconstrained'])} tok/s; "
              f"ratios {', '.join(f'{r:.2f}' for r in ratios)}; other processes' load "
              f"{', '.join(f'{n:.1f}' for n in noise)} cores", flush=True)
    return results


async def warm_up(client: httpx.AsyncClient, kind: str, max_tokens: int) -> float:
    """Load the grammar libraries and compile the throughput constraint, then one batch of each mode; return
    the first constrained request's time to first token (a server's first such request pays the set-up)."""
    constraint = constraint_fields(kind)
    await first_token_seconds(client, request_body(None, 4, 0, stream=True))
    cold = await first_token_seconds(client, request_body(constraint, 4, 0, stream=True))
    for fields in (constraint, None):
        await throughput_run(client, fields, 8, 8, max_tokens // 4)
    return cold


async def benchmark(base_url: str, args, load: OtherLoad) -> tuple[dict, dict]:
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, max_keepalive_connections=max(args.concurrency))
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
        started = time.perf_counter()
        cold = await warm_up(client, args.structured_output, args.max_tokens)
        print(f"warm-up done in {time.perf_counter() - started:.1f} s (first constrained request's TTFT "
              f"{cold:.2f} s)", flush=True)
        print("time to first token, one request at a time:", flush=True)
        before = load.snapshot()
        compile_result = await measure_compile(client, args.structured_output, args.ttft_requests,
                                               args.uncached_requests)
        print(f"  other processes' load {load.cores_since(before):.1f} cores", flush=True)
        compile_result["cold"] = cold
        print("throughput runs (constrained, unconstrained alternating):", flush=True)
        throughput = await measure_throughput(client, args.structured_output, args, load)
    return compile_result, throughput


def pair_ratio(result: dict) -> float:
    """The median of the alternating runs' constrained / unconstrained throughput ratios."""
    runs = result["runs"]
    return statistics.median(c / u for c, u in zip(runs["constrained"], runs["unconstrained"]))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_steps(throughput: dict) -> None:
    """The engine's milliseconds per step in each phase (medians over the runs), where it reported them."""
    if not any(result["steps"]["constrained"] for result in throughput.values()):
        return
    phases = ("schedule", "prepare_inputs", "forward", "sampling", "update")
    print("\nengine time per step (ms, medians over the runs; schedule fills the bitmasks, sampling applies "
          "them, update advances the grammars):\n")
    print("| concurrent requests | run | steps | " + " | ".join(phases) + " | total |")
    print("|---|---|---|" + "---|" * (len(phases) + 1))
    for concurrency, result in throughput.items():
        for mode in ("unconstrained", "constrained"):
            runs = result["steps"][mode]
            if not runs:
                continue
            per_step = {phase: statistics.median(1e3 * run[phase] / run["num_steps"] for run in runs)
                        for phase in phases}
            total = statistics.median(1e3 * sum(run[p] for p in phases) / run["num_steps"] for run in runs)
            print(f"| {concurrency} | {mode} | {statistics.median(run['num_steps'] for run in runs):.0f} | "
                  + " | ".join(f"{per_step[p]:.2f}" for p in phases) + f" | {total:.2f} |")


def report(args, compile_result: dict, throughput: dict) -> None:
    kind = args.structured_output
    print(f"\n{MODEL} over HTTP, {kind} constraint, max_tokens {args.max_tokens}, temperature 1.0, fixed seeds; "
          f"medians of {args.repeats} alternating constrained / unconstrained runs\n")
    print("| concurrent requests | requests per run | unconstrained tok/s | constrained tok/s | "
          "constrained / unconstrained | tokens per request (unconstr. / constr.) | target >= 0.8x |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, result in throughput.items():
        runs, tokens = result["runs"], result["tokens"]
        plain, constrained = statistics.median(runs["unconstrained"]), statistics.median(runs["constrained"])
        ratio = pair_ratio(result)
        target = verdict(ratio >= THROUGHPUT_TARGET) if concurrency >= 8 else "-"
        print(f"| {concurrency} | {result['num_requests']} | {plain:,.0f} | {constrained:,.0f} | {ratio:.2f} | "
              f"{statistics.mean(tokens['unconstrained']):.0f} / {statistics.mean(tokens['constrained']):.0f} | "
              f"{target} |")
    report_steps(throughput)
    c = compile_result
    added_ms = (c["cached"] - c["plain"]) * 1e3
    paired_ms = c["paired"] * 1e3
    print(f"\ntime to first token, one request at a time, streaming, {kind} constraint:\n")
    print("| request | TTFT ms (median) |")
    print("|---|---|")
    print(f"| (a) first use of a new constraint (cache miss: compiles), {c['num_misses']} constraints | "
          f"{c['uncached'] * 1e3:.1f} |")
    print(f"| (b) one constraint reused (cached), {args.ttft_requests} requests | {c['cached'] * 1e3:.1f} |")
    print(f"| (c) unconstrained, same prompt, {args.ttft_requests} requests | {c['plain'] * 1e3:.1f} |")
    print(f"\ncached constraint adds (b) - (c) = {added_ms:.2f} ms to TTFT: {verdict(added_ms < TTFT_TARGET_MS)} "
          f"(target < {TTFT_TARGET_MS:g} ms)")
    print(f"median of the {args.ttft_requests} alternating pairs' differences (cached - unconstrained): "
          f"{paired_ms:.2f} ms ({verdict(paired_ms < TTFT_TARGET_MS)})")
    print(f"first use adds (a) - (b) = {(c['uncached'] - c['cached']) * 1e3:.1f} ms")
    compiles = max(c["compiles"], 1)
    print(f"{COMPILE_METRIC}: {c['compiles']:.0f} compile(s) (expected {c['num_misses']}: the misses only), "
          f"{c['compile_seconds'] * 1e3:.1f} ms in all, {c['compile_seconds'] * 1e3 / compiles:.1f} ms each")
    print(f"the run's first constrained request (in a fresh server it loads the grammar libraries and builds the "
          f"tokenizer tables): TTFT {c['cold'] * 1e3:.0f} ms")
    throughput_ok = all(pair_ratio(result) >= THROUGHPUT_TARGET for n, result in throughput.items() if n >= 8)
    print(f"\noverall: throughput {verdict(throughput_ok)}, cached TTFT {verdict(added_ms < TTFT_TARGET_MS)}")


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    server = None if args.url else ServerProcess("--dtype", "float32", "--max-num-seqs", "64",
                                                   "--enable-debug-routes")
    base_url = args.url or server.base_url
    load = OtherLoad(None if server is None else server.process.pid)
    try:
        compile_result, throughput = asyncio.run(benchmark(base_url.rstrip("/"), args, load))
    finally:
        if server is not None:
            server.stop()
    report(args, compile_result, throughput)
    other, wall = load.totals
    print(f"\nother processes kept {other / wall:.1f} of {os.cpu_count()} cores busy on average while measuring "
          "(noise: the figures are trustworthy only near 0)")
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
