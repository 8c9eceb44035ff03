"""How much of the engine's throughput a small co-running process takes: the tiny checkpoint offline
(``--requests`` requests of 128 + 128 tokens, at most 32 in flight) alone, and next to a process that
spins ``--busy-ms`` in every ``--period-ms`` (by default 2 in 16: an eighth of one core, a sixteenth of a
2-core machine, about what the streaming front end and a benchmark client take while 32 clients stream
the tiny model). Runs alternate alone / shared; the table shows medians and the per-pair ratio.

A ratio well under ``1 - share`` means the engine loses more than the CPU the other process uses: its
OpenMP threads wait at the end of each parallel region for the one the OS displaced. This is the
yardstick for that amplification (see docs/performance.md, serving the tiny model).

    python benchmarks/interference.py [--repeats 5] [--busy-ms 2] [--period-ms 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bench_checkpoint, workload
from cpu_performance import quire_llm, quire_run


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--period-ms", type=float, default=16.0)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "quire-bench")
    parser.add_argument("--burn", nargs=2, type=float, help=argparse.SUPPRESS)
    return parser.parse_args()


def burn(busy: float, period: float) -> None:
    """Spin ``busy`` seconds, sleep the rest of ``period``, forever (the co-running process)."""
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < busy:
            pass
        time.sleep(max(0.0, period - busy))


def main() -> None:
    args = parse_args()
    if args.burn:
        return burn(*args.burn)
    busy, period = args.busy_ms / 1000, args.period_ms / 1000
    share = busy / period / (os.cpu_count() or 1)
    tiny = bench_checkpoint(args.cache_dir / "tiny", "tiny")
    requests = workload(tiny, args.requests, (128, 128), (128, 128))
    tokens = sum(n for _, n in requests)
    llm = quire_llm(tiny, max_num_seqs=32)
    alone, shared = [], []
    try:
        quire_run(llm, requests)  # warm-up
        for _ in range(args.repeats):
            alone.append(tokens / quire_run(llm, requests)[0])
            burner = subprocess.Popen([sys.executable, __file__, "--burn", str(busy), str(period)])
            try:
                time.sleep(0.3)
                shared.append(tokens / quire_run(llm, requests)[0])
            finally:
                burner.kill()
                burner.wait()
    finally:
        llm.shutdown()
    ratios = [s / a for s, a in zip(shared, alone)]
    print(f"tiny offline, {args.requests} x 128 + 128 tokens, 32 in flight; the other process spins "
          f"{args.busy_ms:g} ms every {args.period_ms:g} ms ({share:.1%} of {os.cpu_count()} cores); "
          f"medians of {args.repeats} alternating pairs\n")
    print("| engine alone tok/s | next to the other process tok/s | shared / alone | CPU share taken |")
    print("|---|---|---|---|")
    print(f"| {statistics.median(alone):,.0f} | {statistics.median(shared):,.0f} | "
          f"{statistics.median(ratios):.3f} | {share:.3f} |")
    print("\npairs (shared / alone): " + ", ".join(f"{s:.0f} / {a:.0f} = {r:.2f}"
                                                  for s, a, r in zip(shared, alone, ratios)))
    print(f"throughput lost per unit of CPU taken: {(1 - statistics.median(ratios)) / share:.1f}x")


if __name__ == "__main__":
    main()
