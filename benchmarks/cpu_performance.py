"""Quire against transformers on the CPU, side by side in one run, on locally built checkpoints.

Sections (``--sections``, all by default):

- ``throughput``: offline throughput on the tiny (~7M) checkpoint and quire-demo (64 requests, prompts
  and outputs of 32-256 tokens) and the small (Qwen2.5-0.5B-shaped) one (32 requests, 128 + 128 tokens):
  Quire against transformers' padded batched ``generate`` and continuous-batching ``generate_batch``,
  with Quire's per-step time breakdown;
- ``decode``: batch-1 decode on the small checkpoint, with the memory-bandwidth bound;
- ``ttft``: time to first token for 128-4096-token prompts (small checkpoint);
- ``serving``: ``quire serve`` driven by 1-64 concurrent streaming clients, against offline throughput
  on the same workload;
- ``scaling``: throughput against batch size (with the per-step breakdown at batch 64 on the small
  checkpoint), KV-cache bytes per token and capacity.

All tables print as Markdown (docs/performance.md holds the last run). transformers' throughput counts
only the output tokens the requests asked for: its padded batch runs to the longest output. Wherever
transformers is the baseline it runs at bfloat16 and at float32 (Quire at bfloat16): on AVX2 machines
without bfloat16 instructions float32 is transformers' faster dtype, so every ratio has the stronger baseline.

    python benchmarks/cpu_performance.py [--sections throughput,decode] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from common import bench_checkpoint, workload

from quire.cli.bench_offline import hf_throughput

SECTIONS = ("throughput", "decode", "ttft", "serving", "scaling")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "quire-bench",
                        help="where the checkpoints are built once and kept")
    parser.add_argument("--serving-checkpoints", default="small,tiny",
                        help="the serving section's checkpoints (small, tiny or both)")
    return parser.parse_args()


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(_cell(value) for value in row) + " |")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


# -- Quire runs ------------------------------------------------------------------------------------

def quire_llm(path, **kwargs):
    from quire.offline import LLM

    return LLM(str(path), dtype="bfloat16", **kwargs)


def quire_run(llm, requests) -> tuple[float, dict]:
    """One timed run on a cold prefix cache; returns (seconds, per-step breakdown)."""
    from quire.offline import SamplingParams

    prompts = [prompt for prompt, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    engine = llm.llm_engine
    assert llm.reset_prefix_cache()
    engine.get_step_timings(reset=True)
    engine.reset_frontend_timings()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    breakdown = engine.get_step_timings()
    breakdown.update(engine.frontend_timings)
    breakdown["wall"] = elapsed
    return elapsed, breakdown


def quire_throughput(path, requests, repeats=2, max_num_seqs=None) -> tuple[float, dict]:
    llm = quire_llm(path, max_num_seqs=max_num_seqs or len(requests))
    llm.generate([requests[0][0]], use_tqdm=False)  # warm-up
    runs = [quire_run(llm, requests) for _ in range(repeats)]
    llm.shutdown()
    return min(runs, key=lambda run: run[0])


def hf_generate_batch(path, requests, dtype: str = "bfloat16") -> float:
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    config = GenerationConfig(max_new_tokens=max(n for _, n in requests), do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=512, page_size=128, max_batch_tokens=2048)
    start = time.perf_counter()
    model.generate_batch([prompt for prompt, _ in requests], generation_config=config,
                         continuous_batching_config=batching)
    return time.perf_counter() - start


def breakdown_rows(breakdown: dict) -> list[list]:
    phases = ("schedule", "prepare_inputs", "forward", "sampling", "update")
    engine_total = sum(breakdown[p] for p in phases)
    rows = [[p, breakdown[p] * 1000 / breakdown["num_steps"], 100 * breakdown[p] / engine_total] for p in phases]
    rows.append(["engine step (sum)", engine_total * 1000 / breakdown["num_steps"], 100.0])
    rows.append(["front end: output processing + detokenization (other process)",
                 breakdown["output_processing"] * 1000 / breakdown["num_steps"],
                 100 * breakdown["output_processing"] / engine_total])
    rows.append(["front end: waiting for the engine (IPC and engine time)",
                 breakdown["waiting"] * 1000 / breakdown["num_steps"], 100 * breakdown["waiting"] / engine_total])
    return rows


# -- sections ----------------------------------------------------------------------------------------

def section_throughput(tiny: Path, small: Path) -> None:
    from quire.core.demo import demo_model_path

    demo = demo_model_path()
    cases = [("tiny", tiny, workload(tiny, 64, (32, 256), (32, 256))),
             ("quire-demo", demo, workload(demo, 64, (32, 256), (32, 256))),
             ("small", small, workload(small, 32, (128, 128), (128, 128)))]
    for name, path, requests in cases:
        tokens = sum(n for _, n in requests)
        quire_time, breakdown = quire_throughput(path, requests)
        baselines = {}
        for dtype in ("bfloat16", "float32"):
            baselines[f"generate {dtype}"] = hf_throughput(str(path), requests, dtype, len(requests))
            baselines[f"generate_batch {dtype}"] = hf_generate_batch(str(path), requests, dtype)
        times = {"Quire bfloat16": quire_time, **{f"transformers {baseline}": seconds
                                                  for baseline, seconds in baselines.items()}}
        rows = [[engine, seconds, tokens / seconds, *(baseline / seconds for baseline in baselines.values())]
                for engine, seconds in times.items()]
        table(f"Offline throughput, {name} checkpoint, {len(requests)} requests (generate: padded)",
              ["engine", "seconds", "output tok/s", *(f"x {baseline}" for baseline in baselines)], rows)
        table(f"Quire per-step breakdown, {name} checkpoint ({breakdown['num_steps']} steps)",
              ["phase", "ms per step", "% of engine step"], breakdown_rows(breakdown))


def section_decode(small: Path, repeats: int = 3) -> None:
    """Batch-1 decode rates, each the median of ``repeats`` runs (the machines are shared and noisy)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quire.offline import SamplingParams

    prompt = [random.Random(0).randrange(3, 7000) for _ in range(32)]
    new_tokens = 64
    llm = quire_llm(small, max_num_seqs=4)
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    quire_rates = []
    for _ in range(repeats):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        times = out.metrics.token_times
        quire_rates.append((len(times) - 1) / (times[-1] - times[0]))
    llm.shutdown()
    hf_rates, weight_bytes = {}, {}
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(small, dtype=getattr(torch, dtype))
        hf_rates[dtype] = hf_decode_rates(model, torch.tensor([prompt]), new_tokens, repeats)
        weight_bytes[dtype] = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" not in n)
    bandwidth = stream_bandwidth()
    engines = {"Quire bfloat16": (quire_rates, weight_bytes["bfloat16"]),
               **{f"transformers generate {dtype}": (rates, weight_bytes[dtype]) for dtype, rates in hf_rates.items()}}
    hf_medians = {dtype: statistics.median(rates) for dtype, rates in hf_rates.items()}
    rows = []
    for engine, (rates, num_bytes) in engines.items():
        rate = statistics.median(rates)
        rows.append([engine, rate, *(rate / hf_median for hf_median in hf_medians.values()),
                     rate * num_bytes / bandwidth])
    table(f"Batch-1 decode, small checkpoint (median of {repeats} runs)",
          ["engine", "tokens/s", *(f"x transformers {dtype}" for dtype in hf_medians),
           "fraction of bandwidth bound"], rows)
    print("\nruns (tokens/s): " + "; ".join(f"{engine} {', '.join(f'{r:.2f}' for r in rates)}"
                                             for engine, (rates, _) in engines.items()))
    print(f"bandwidth bound: {bandwidth / 1e9:.1f} GB/s measured (sum over a 1 GiB tensor) / "
          f"{weight_bytes['bfloat16'] / 1e6:.0f} MB of weights read per token in bfloat16 = "
          f"{bandwidth / weight_bytes['bfloat16']:.1f} tokens/s (float32: twice the bytes, half the bound)")


def hf_decode_rates(model, ids, new_tokens: int, repeats: int) -> list[float]:
    """transformers' batch-1 decode tokens/s, ``repeats`` times: a one-token generate (the prefill) is
    subtracted from a ``new_tokens`` one."""
    import torch

    def hf_time(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    hf_time(2)
    return [(new_tokens - 1) / (hf_time(new_tokens) - hf_time(1)) for _ in range(repeats)]


def stream_bandwidth() -> float:
    import torch

    data = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, read once per sum
    data.sum()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        runs.append(time.perf_counter() - start)
    return data.numel() * 4 / min(runs)


def section_ttft(small: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from quire.offline import SamplingParams

    rng = random.Random(1)
    llm = quire_llm(small, max_model_len=8192, enable_prefix_caching=False)
    models = {dtype: AutoModelForCausalLM.from_pretrained(small, dtype=getattr(torch, dtype))
              for dtype in ("bfloat16", "float32")}
    rows = []
    for length in (128, 256, 512, 1024, 2048, 4096):
        prompt = [rng.randrange(3, 7000) for _ in range(length)]
        llm.generate([prompt[:8]], SamplingParams(max_tokens=1), use_tqdm=False)
        quire = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics.time_to_first_token
        hf = {}
        for dtype, model in models.items():
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, pad_token_id=0)
            hf[dtype] = time.perf_counter() - start
        rows.append([length, quire * 1000, hf["bfloat16"] * 1000, hf["bfloat16"] / quire, hf["float32"] * 1000,
                     hf["float32"] / quire, length / quire])
    llm.shutdown()
    table("Time to first token, small checkpoint, Quire bfloat16",
          ["prompt tokens", "Quire ms", "transformers bfloat16 ms", "speed-up", "transformers float32 ms",
           "speed-up", "Quire prompt tok/s"], rows)


def section_serving(tiny: Path, small: Path, checkpoints=("small", "tiny")) -> None:
    """Closed-loop streaming clients against ``quire serve`` (each sends its next request when the last
    one ends; 2 x clients requests), and the same workload offline: capped at the same number in flight
    (what the server can reach at best, so the ratio is the cost of HTTP, streaming and IPC) and all at
    once (a bigger batch than the clients can form). One server per table and one capped offline engine
    per row stay up side by side, and their runs alternate back to back (``SERVING_REPEATS`` pairs at 32
    clients, the acceptance figure; the table shows medians), so that both sides of a pair see the same
    machine: on a shared 2-core machine the load of other tenants moves either figure by 20-30% from
    one minute to the next. Every served run sends prompts the server has not seen (its prefix cache
    would otherwise skip their prefill); every offline run starts from an empty prefix cache. The last
    table streams 4 tokens per chunk (``--stream-interval 4``; its ITL is the gap between chunks)."""
    cases = (("small", small, 64, (1, 8, 32, 64), ()),
             ("tiny", tiny, 128, (1, 4, 16, 32, 64), ()),
             ("tiny", tiny, 128, (32,), ("--stream-interval", "4")))
    for name, path, output_len, clients, server_args in [case for case in cases if case[0] in checkpoints]:
        rows, notes = [], []
        server = start_server(path, server_args)
        try:
            for concurrency in clients:
                requests = workload(path, max(2 * concurrency, 8), (128, 128), (output_len, output_len))
                tokens = sum(n for _, n in requests)
                llm = quire_llm(path, max_num_seqs=concurrency)
                try:
                    llm.generate([requests[0][0]], use_tqdm=False)  # warm-up
                    serve_benchmark(server, path, concurrency, requests, warm_up=True)
                    summaries, capped = [], []
                    for repeat in range(SERVING_REPEATS if concurrency == 32 else 1):
                        summaries.append(serve_benchmark(server, path, concurrency, requests,
                                                         seed=1000 * concurrency + repeat))
                        capped.append(tokens / quire_run(llm, requests)[0])
                finally:
                    llm.shutdown()
                ratios = [s["output_throughput"] / c for s, c in zip(summaries, capped)]
                summary = sorted(summaries, key=lambda s: s["output_throughput"])[len(summaries) // 2]
                served = summary["output_throughput"]
                at_once = tokens / quire_throughput(path, requests, repeats=1)[0]
                if len(summaries) > 1:
                    notes.append(f"{concurrency} clients, paired runs (served / offline): " + ", ".join(
                        f"{s['output_throughput']:.0f} / {c:.0f} = {r:.2f}"
                        for s, c, r in zip(summaries, capped, ratios)))
                rows.append([concurrency, served, statistics.median(capped), statistics.median(ratios), at_once,
                             served / at_once, summary["median_ttft_ms"], summary["p99_ttft_ms"],
                             summary["median_itl_ms"], summary["p99_itl_ms"], summary["p99_e2el_ms"]])
        finally:
            server.stop()
        flags = f", server {' '.join(server_args)}" if server_args else ""
        table(f"Serving, {name} checkpoint{flags} (128-token prompts, {output_len} output tokens, "
              f"2 x clients requests, at least 8)",
              ["clients", "served tok/s", "offline, same cap", "served / offline", "offline, all at once",
               "served / all at once", "median TTFT ms", "p99 TTFT ms", "median ITL ms", "p99 ITL ms",
               "p99 E2E ms"], rows)
        for note in notes:
            print(f"\n{note} (the row shows the medians)")


SERVING_REPEATS = 5


def serve_benchmark(server, path: Path, concurrency: int, requests, seed: int = 0, warm_up: bool = False) -> dict:
    """One closed-loop run of ``requests``' shapes against ``server`` with prompts drawn from ``seed``;
    ``warm_up``: one short round instead (the first batch of each shape is slower everywhere)."""
    from quire.cli.bench_serve import ServeBenchConfig, _benchmark, _run, summarize

    config = ServeBenchConfig(
        base_url=server.base_url, endpoint="/v1/completions", model=None, api_key=None,
        input_len=len(requests[0][0]), output_len=2 if warm_up else requests[0][1], range_ratio=0.0,
        num_prompts=concurrency if warm_up else len(requests), burstiness=1.0, max_concurrency=concurrency,
        ignore_eos=True, percentile_metrics=["ttft", "itl", "e2el"], metric_percentiles=[99.0],
        seed=1 if warm_up else seed)
    results, duration = _run(_benchmark(config, str(path), float("inf"), {}, 7000))
    return summarize(config, float("inf"), results, duration)


def start_server(path: Path, server_args=()):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.servers import ServerProcess

    return ServerProcess(str(path), "--served-model-name", str(path), "--dtype", "bfloat16", *server_args)


def section_scaling(tiny: Path, small: Path) -> None:
    from quire.core.config import ModelConfig

    for name, path, sizes in (("tiny", tiny, (1, 4, 16, 64, 256)), ("small", small, (1, 4, 16, 64))):
        rows = []
        llm = quire_llm(path, max_num_seqs=max(sizes))
        breakdowns = {}
        for batch in sizes:
            requests = workload(path, batch, (32, 32), (64, 64), seed=batch)
            quire_run(llm, requests)  # warm-up for this batch's shapes
            seconds, breakdowns[batch] = quire_run(llm, requests)
            rows.append([batch, batch * 64 / seconds])
        llm.shutdown()
        table(f"Throughput against batch size, {name} checkpoint (32-token prompts, 64 output tokens)",
              ["requests at once", "output tok/s"], rows)
        if name == "small":
            table(f"Quire per-step breakdown, small checkpoint, batch 64 ({breakdowns[64]['num_steps']} steps)",
                  ["phase", "ms per step", "% of engine step"], breakdown_rows(breakdowns[64]))
    rows = []
    for name, path in (("tiny", tiny), ("small", small)):
        config = ModelConfig.from_hf(path, dtype="bfloat16")
        per_token = config.kv_bytes_per_token
        rows.append([name, per_token, (4 * 2**30) // per_token, (4 * 2**30) // per_token // config.max_model_len])
    table("KV cache per token (bfloat16) and capacity of a 4 GiB budget",
          ["checkpoint", "bytes per token", "tokens in 4 GiB", "full-length sequences"], rows)


def main() -> None:
    args = parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    tiny = bench_checkpoint(args.cache_dir / "tiny", "tiny")
    small = bench_checkpoint(args.cache_dir / "small", "small")
    print(f"# Quire CPU performance ({time.strftime('%Y-%m-%d')})\n\ncheckpoints: {tiny}, {small}")
    runners = {"throughput": lambda: section_throughput(tiny, small), "decode": lambda: section_decode(small),
               "ttft": lambda: section_ttft(small),
               "serving": lambda: section_serving(tiny, small, args.serving_checkpoints.split(",")),
               "scaling": lambda: section_scaling(tiny, small)}
    for section in sections:
        started = time.perf_counter()
        runners[section]()
        print(f"\n({section}: {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
