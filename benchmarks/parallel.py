"""Data and tensor parallelism on the CPU: DP=2 against DP=1 and TP=2 against TP=1, side by side in one run.

Parts (``--parts``, all by default), on locally built checkpoints (``--sizes``: tiny, small):

- ``dp-offline``: ``LLM.generate`` on a batch of requests, two engine cores with half the threads each
  against one engine core with all of them: output tokens/s;
- ``dp-served``: ``quire serve`` with the same two settings under ``--clients`` concurrent streaming clients
  (``--num-requests`` requests per run, each run bounded by ``--time-limit``): output tokens/s, requests/s,
  median TTFT;
- ``tp``: two tensor-parallel ranks with half the threads each against one process with all of them, on the
  small checkpoint, offline: the decode tokens/s of one request, and the output tokens/s of ``--tp-batch``
  requests at once.

``--num-threads`` is the total (default 2): Quire splits it between the engine cores (DP) and the ranks (TP).
The two sides of a comparison stay up side by side and their runs alternate (ABBA over ``--repeats``), so
that both see the same machine; tables show medians, and the ratio is the median of the paired runs'
ratios. Greedy sampling with ``ignore_eos`` and fixed lengths: both sides generate the same tokens. Every
offline run starts from an empty prefix cache; every served run sends prompts the servers have not seen.

    python benchmarks/parallel.py [--parts dp-offline dp-served tp] [--sizes tiny small] [--repeats 5]
                                  [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from common import bench_checkpoint, workload
from cpu_performance import quire_run, start_server, table

PARTS = ("dp-offline", "dp-served", "tp")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Fixed lengths: every request of a run has the same prompt and output length."""

    num_requests: int
    prompt_len: int
    output_len: int


# Big enough that a run takes seconds, not milliseconds (the small checkpoint is ~50x the tiny one's work).
WORKLOADS = {"tiny": Workload(num_requests=128, prompt_len=128, output_len=128),
             "small": Workload(num_requests=32, prompt_len=64, output_len=64)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--sizes", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS),
                        help="the checkpoints of the data-parallel parts (tp always runs the small one)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each side; medians count")
    parser.add_argument("--num-requests", type=int, help="requests per run (default: tiny 128, small 32)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: tiny 128, small 64)")
    parser.add_argument("--output-len", type=int, help="output tokens (default: tiny 128, small 64)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (dp-served)")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds one served run may take")
    parser.add_argument("--tp-batch", type=int, default=32, help="the requests at once of tp's batch row")
    parser.add_argument("--num-threads", type=int, default=2, help="the engine's CPU threads in all")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per engine core (both sides stay up)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "quire-bench",
                        help="where the checkpoints are built once and kept")
    parser.add_argument("--out", type=Path, help="also write the tables and every run as JSON here")
    return parser.parse_args()


def sized_workload(args, size: str) -> Workload:
    """The size's default workload with the command line's overrides."""
    default = WORKLOADS[size]
    return Workload(num_requests=args.num_requests or default.num_requests,
                    prompt_len=args.prompt_len or default.prompt_len,
                    output_len=args.output_len or default.output_len)


def alternate(runners: dict[str, Callable[[int], float]], repeats: int) -> dict[str, list[float]]:
    """``repeats`` runs of each runner (called with the repeat's index), ABBA order: neither side always
    goes first, so a drift in the machine's load does not favour one."""
    samples = {name: [] for name in runners}
    for repeat in range(repeats):
        order = list(runners.items())
        for name, runner in order if repeat % 2 == 0 else reversed(order):
            samples[name].append(runner(repeat))
    return samples


def paired_ratio(samples: dict[str, list[float]], baseline: str, other: str) -> float:
    return statistics.median(b / a for a, b in zip(samples[baseline], samples[other]))


class Report:
    """The printed tables, kept with every run's samples for ``--out``."""

    def __init__(self, args):
        settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        self.data = {"date": time.strftime("%Y-%m-%d %H:%M"), "settings": settings, "tables": []}

    def add(self, title: str, header: list[str], rows: list[list], runs: dict) -> None:
        table(title, header, rows)
        print("\nruns: " + "; ".join(f"{name} {', '.join(f'{value:.2f}' for value in values)}"
                                     for name, values in runs.items()))
        self.data["tables"].append({"title": title, "header": header, "rows": rows, "runs": runs})

    def write(self, path: Path | None) -> None:
        if path is not None:
            path.write_text(json.dumps(self.data, indent=2) + "\n")


# -- offline ---------------------------------------------------------------------------------------------

def quire_llm(path: Path, args, **parallel):
    from quire.offline import LLM

    return LLM(str(path), dtype=args.dtype, num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory,
               **parallel)


def offline_rate(llm, requests) -> float:
    """Output tokens/s of one ``LLM.generate`` over ``requests`` (a cold prefix cache)."""
    seconds, _ = quire_run(llm, requests)
    return sum(n for _, n in requests) / seconds


def decode_rate(llm, prompt: list[int], num_tokens: int) -> float:
    """Decode tokens/s of one request alone: the gaps between its tokens (the prefill left out)."""
    from quire.offline import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    times = llm.generate([prompt], params, use_tqdm=False)[0].metrics.token_times
    return (len(times) - 1) / (times[-1] - times[0])


def warm_up(llm, requests) -> None:
    quire_run(llm, [(prompt, 2) for prompt, _ in requests])  # every prompt's prefill, a short decode


def compare_offline(path: Path, args, shape: Workload) -> dict[str, list[float]]:
    """DP=1 and DP=2 output tokens/s on ``path``, alternating runs."""
    requests = workload(path, shape.num_requests, (shape.prompt_len,) * 2, (shape.output_len,) * 2)
    engines = {f"DP={n}": quire_llm(path, args, data_parallel_size=n, max_num_seqs=len(requests)) for n in (1, 2)}
    try:
        for llm in engines.values():
            warm_up(llm, requests)
        return alternate({name: lambda _, llm=llm: offline_rate(llm, requests) for name, llm in engines.items()},
                         args.repeats)
    finally:
        for llm in engines.values():
            llm.shutdown()


def part_dp_offline(args, checkpoints: dict[str, Path], report: Report) -> None:
    rows, runs = [], {}
    for size, path in checkpoints.items():
        samples = compare_offline(path, args, sized_workload(args, size))
        rows.append([size, statistics.median(samples["DP=1"]), statistics.median(samples["DP=2"]),
                     paired_ratio(samples, "DP=1", "DP=2")])
        runs.update({f"{size} {name}": values for name, values in samples.items()})
    report.add(f"Data parallelism offline, {args.num_threads} threads in all, {args.dtype} "
               f"({shapes(args, checkpoints)}; median of {args.repeats})",
               ["checkpoint", "DP=1 output tok/s", "DP=2 output tok/s", "DP=2 / DP=1"], rows, runs)


def shapes(args, checkpoints) -> str:
    return "requests x (prompt + output tokens): " + ", ".join(
        f"{size} {s.num_requests} x ({s.prompt_len} + {s.output_len})"
        for size, s in ((size, sized_workload(args, size)) for size in checkpoints))


def part_tp(args, small: Path, report: Report) -> None:
    shape = sized_workload(args, "small")
    requests = workload(small, args.tp_batch, (shape.prompt_len,) * 2, (shape.output_len,) * 2)
    engines = {f"TP={n}": quire_llm(small, args, tensor_parallel_size=n, max_num_seqs=len(requests))
               for n in (1, 2)}
    samples = {}
    try:
        for llm in engines.values():
            warm_up(llm, requests)
        batch_1 = alternate({name: lambda repeat, llm=llm: decode_rate(llm, requests[repeat % len(requests)][0],
                                                                        shape.output_len)
                             for name, llm in engines.items()}, args.repeats)
        batch_n = alternate({name: lambda _, llm=llm: offline_rate(llm, requests)
                             for name, llm in engines.items()}, args.repeats)
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = []
    for label, measured in ((f"batch 1, decode tok/s ({shape.output_len} tokens)", batch_1),
                            (f"batch {len(requests)}, output tok/s", batch_n)):
        rows.append([label, statistics.median(measured["TP=1"]), statistics.median(measured["TP=2"]),
                     paired_ratio(measured, "TP=1", "TP=2")])
        samples.update({f"{label.split(',')[0]} {name}": values for name, values in measured.items()})
    report.add(f"Tensor parallelism offline, small checkpoint, {args.num_threads} threads in all, {args.dtype} "
               f"({shape.prompt_len}-token prompts; median of {args.repeats})",
               ["run", "TP=1", "TP=2", "TP=2 / TP=1"], rows, samples)


# -- served ----------------------------------------------------------------------------------------------

def served_run(server, path: Path, clients: int, shape: Workload, seed: int, time_limit: float) -> dict:
    """One closed-loop run of ``shape.num_requests`` streaming requests, ``clients`` at a time, with prompts
    drawn from ``seed``; TimeoutError past ``time_limit`` seconds, RuntimeError if a request failed."""
    from quire.cli.bench_serve import ServeBenchConfig, _benchmark, _run, summarize

    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    config = ServeBenchConfig(
        base_url=server.base_url, endpoint="/v1/completions", model=str(path), api_key=None,
        input_len=shape.prompt_len, output_len=shape.output_len, range_ratio=0.0, num_prompts=shape.num_requests,
        burstiness=1.0, max_concurrency=clients, ignore_eos=True, percentile_metrics=["ttft"],
        metric_percentiles=[99.0], seed=seed)
    results, duration = _run(asyncio.wait_for(_benchmark(config, str(path), float("inf"), {}, vocab_size),
                                              time_limit))
    summary = summarize(config, float("inf"), results, duration)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def compare_served(path: Path, args, shape: Workload) -> dict[str, list[dict]]:
    """The summaries of alternating served runs against a DP=1 and a DP=2 server of ``path``."""
    server_args = ("--dtype", args.dtype, "--num-threads", str(args.num_threads),
                   "--kv-cache-memory", args.kv_cache_memory)
    servers = {}
    try:
        for n in (1, 2):
            servers[f"DP={n}"] = start_server(path, (*server_args, "--data-parallel-size", str(n)))
        warm = dataclasses.replace(shape, num_requests=args.clients)  # one wave: the first is slower
        for server in servers.values():
            served_run(server, path, args.clients, warm, 1, args.time_limit)
        summaries = {name: [] for name in servers}

        def run(name: str, repeat: int) -> float:
            summaries[name].append(served_run(servers[name], path, args.clients, shape, 1000 + repeat,
                                              args.time_limit))
            return summaries[name][-1]["output_throughput"]

        alternate({name: lambda repeat, name=name: run(name, repeat) for name in servers}, args.repeats)
        return summaries
    finally:
        for server in servers.values():
            server.stop()


def part_dp_served(args, checkpoints: dict[str, Path], report: Report) -> None:
    rows, runs = [], {}
    for size, path in checkpoints.items():
        summaries = compare_served(path, args, sized_workload(args, size))
        samples = {name: [s["output_throughput"] for s in values] for name, values in summaries.items()}
        for name, values in summaries.items():
            rows.append([size, name, statistics.median(samples[name]),
                         statistics.median(s["request_throughput"] for s in values),
                         statistics.median(s["median_ttft_ms"] for s in values),
                         paired_ratio(samples, "DP=1", name)])
        runs.update({f"{size} {name} output tok/s": values for name, values in samples.items()})
    report.add(f"Data parallelism served, {args.clients} streaming clients, {args.num_threads} threads in all, "
               f"{args.dtype} ({shapes(args, checkpoints)}; median of {args.repeats})",
               ["checkpoint", "server", "output tok/s", "requests/s", "median TTFT ms", "x DP=1"], rows, runs)


def main() -> None:
    args = parse_args()
    dp_sizes = set(args.sizes) if {"dp-offline", "dp-served"} & set(args.parts) else set()
    sizes = dp_sizes | ({"small"} if "tp" in args.parts else set())
    checkpoints = {size: bench_checkpoint(args.cache_dir / size, size) for size in WORKLOADS if size in sizes}
    dp_checkpoints = {size: path for size, path in checkpoints.items() if size in dp_sizes}
    print(f"# Data and tensor parallelism ({time.strftime('%Y-%m-%d')})\n\ncheckpoints: "
          + ", ".join(str(path) for path in checkpoints.values()))
    report = Report(args)
    runners = {"dp-offline": lambda: part_dp_offline(args, dp_checkpoints, report),
               "dp-served": lambda: part_dp_served(args, dp_checkpoints, report),
               "tp": lambda: part_tp(args, checkpoints["small"], report)}
    for part in args.parts:
        started = time.perf_counter()
        runners[part]()
        print(f"\n({part}: {time.perf_counter() - started:.0f} s)")
        report.write(args.out)


if __name__ == "__main__":
    main()
