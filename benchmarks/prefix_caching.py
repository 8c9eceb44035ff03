"""Prefix caching: 32 requests sharing a 512-token prefix, with the prefix cache on and off.

Prints the median time to first token and the total time of each run, and the ratios. Same locally built
checkpoint, same workload, same process.

    python benchmarks/prefix_caching.py [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import bench_checkpoint


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; medians are reported")
    parser.add_argument("--checkpoint", type=Path, help="reuse or create the checkpoint in this folder")
    return parser.parse_args()


def run(folder: Path, prompts, args, enable_prefix_caching: bool) -> tuple[float, float]:
    """Median over repeats of (median time to first token, total time), each run on a cold cache."""
    from quire.offline import LLM, SamplingParams

    llm = LLM(folder, dtype=args.dtype, max_num_seqs=len(prompts), enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # warm-up
    ttfts, totals = [], []
    for _ in range(args.repeats):
        assert llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        totals.append(time.perf_counter() - start)
        ttfts.append(statistics.median(o.metrics.time_to_first_token for o in outputs))
    return statistics.median(ttfts), statistics.median(totals)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_checkpoint(args.checkpoint or Path(scratch) / "bench-llama-7m")
        rng = random.Random(0)
        prefix = [rng.randrange(3, 7000) for _ in range(args.prefix_len)]
        prompts = [prefix + [rng.randrange(3, 7000) for _ in range(args.suffix_len)]
                   for _ in range(args.num_requests)]
        print(f"{args.num_requests} requests: a shared {args.prefix_len}-token prefix, "
              f"{args.suffix_len} own tokens, {args.output_len} output tokens; {args.dtype}; "
              f"median of {args.repeats}")
        off_ttft, off_total = run(folder, prompts, args, enable_prefix_caching=False)
        on_ttft, on_total = run(folder, prompts, args, enable_prefix_caching=True)
    print(f"prefix cache off: median TTFT {off_ttft * 1000:8.1f} ms, total {off_total:6.2f} s")
    print(f"prefix cache on:  median TTFT {on_ttft * 1000:8.1f} ms, total {on_total:6.2f} s")
    print(f"speed-up with the cache: TTFT {off_ttft / on_ttft:.2f}x, total {off_total / on_total:.2f}x")


if __name__ == "__main__":
    main()
