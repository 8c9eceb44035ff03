"""What the process boundary costs: offline throughput of ``LLM`` with the engine core in-process and
in its own process (ZMQ + msgspec), on the same workload and checkpoint, alternating runs; the ratio is
the median of the paired runs' ratios.

With the engine's threads on every core, the front end's work (receiving, detokenizing) in the other
process competes with them; ``--num-threads N`` sets the engine's threads (for example one fewer than
the cores).

    python benchmarks/engine_process_overhead.py [--checkpoint DIR] [--num-threads N]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from common import bench_checkpoint, workload, workload_parser


def parse_args():
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-threads", type=int, help="the engine's CPU threads (default: one per core)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from quire.offline import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_checkpoint(args.checkpoint or Path(scratch) / "bench-llama-7m")
        requests = workload(folder, args.num_requests, args.prompt_len, args.output_len)
        prompts = [prompt for prompt, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        num_tokens = sum(n for _, n in requests)
        engines = {name: LLM(folder, dtype=args.dtype, max_num_seqs=len(requests), multiprocess=mp,
                             num_threads=args.num_threads)
                   for name, mp in (("in-process", False), ("own process", True))}
        times = {name: [] for name in engines}
        for llm in engines.values():
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
        for llm in engines.values():
            llm.shutdown()
    threads = args.num_threads or "one per core"
    print(f"{len(requests)} requests, {num_tokens} output tokens, {args.dtype}, engine threads: {threads}, "
          f"median of {args.repeats}")
    rates = {name: num_tokens / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"engine core {name:12s} {rate:10.1f} output tok/s")
    ratio = statistics.median(a / b for a, b in zip(times["in-process"], times["own process"]))
    print(f"own process / in-process: {ratio:.3f}x (boundary cost {max(0.0, 1 - ratio) * 100:.1f}%)")


if __name__ == "__main__":
    main()
