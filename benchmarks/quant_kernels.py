"""Quire's quantized linear kernels (``quire.kernels.quant``) against float32 ``F.linear`` on the same weight
dequantized, on the CPU.

Batch 1 (decode) is bound by memory bandwidth: it reports GB/s of weight bytes read (``weight.nbytes / time``)
for each (the float32 weight reads 4 bytes per element, a Q4_0 one 0.56). Batches of 7 to 512 report GFLOP/s
(``2 * M * N * K / time``). Each figure is the median of several timed runs; the last column is the time of
``F.linear`` divided by the kernel's (above 1: the quantized kernel is faster).

On a machine shared with other busy processes, wall-clock times of multi-threaded calls measure mostly the
scheduler (a parallel region waits for its descheduled thread); ``--threads 1 --clock thread`` then times
one core's work by the thread's CPU time.

    python benchmarks/quant_kernels.py [--types Q8_0,Q4_K] [--batches 1,7,32] [--isa avx2] [--repeats 7]
                                       [--threads 1 --clock thread]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from quire.kernels import quant

# [out_features, in_features]: a 135M-parameter model's MLP (down, up) and its output layer; the K-quants need
# in_features % 256 == 0, so they run 1536x768 in place of 1536x576
SHAPES = {"576x1536": (576, 1536), "1536x576": (1536, 576), "1536x768": (1536, 768), "49152x576": (49152, 576)}
DEFAULT_CASES = [
    ("576x1536", ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "INT8")),
    ("1536x576", ("Q8_0", "Q4_0", "Q4_1", "INT8")),
    ("1536x768", ("Q4_K", "Q6_K")),
    ("49152x576", ("Q8_0",)),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="", help="only these types (comma-separated)")
    parser.add_argument("--batches", default="1,7,32,64,512", help="rows of x (comma-separated)")
    parser.add_argument("--isa", default=None, help="force a C++ path: avx512, avx2 or scalar")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per figure (the median is shown)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="x's dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", default="wall", choices=("wall", "thread"),
                        help="wall-clock time, or the calling thread's CPU time (only meaningful with --threads 1)")
    return parser.parse_args()


def random_weight(qtype: str, out_features: int, in_features: int, generator: torch.Generator):
    """Random bytes with finite, sensibly scaled fp16 scales (their values do not change the speed)."""
    if qtype == "INT8":
        return quant.quantize_int8(torch.randn(out_features, in_features, generator=generator) * 0.02)
    block_size, type_size = quant.QUANT_TYPES[qtype]
    raw = torch.randint(0, 256, (out_features, in_features // block_size, type_size), dtype=torch.uint8,
                        generator=generator)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    for offset in {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
        raw[:, :, offset:offset + 2] = scale
    return quant.QuantizedWeight.from_gguf_bytes(qtype, raw.reshape(out_features, -1), out_features, in_features)


def median_seconds(fn, repeats: int, clock=time.perf_counter, min_seconds: float = 0.02) -> float:
    """Median over ``repeats`` samples of the time of one call (each sample loops for at least ``min_seconds``)."""
    fn()
    start, calls = clock(), 0
    while clock() - start < min_seconds:
        fn()
        calls += 1
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        samples.append((clock() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    args = parse_args()
    only = set(filter(None, args.types.split(",")))
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    print(f"quantized kernels: {quant.quant_kernel_isa(args.isa)}, {torch.get_num_threads()} threads, x {args.dtype}, "
          f"{args.clock} clock")
    print("\n| shape | type | M | kernel | F.linear fp32 | speedup |")
    print("|---|---|---|---|---|---|")
    for shape_name, types in DEFAULT_CASES:
        out_features, in_features = SHAPES[shape_name]
        for qtype in types:
            if only and qtype not in only:
                continue
            weight = random_weight(qtype, out_features, in_features, generator)
            dense = quant.dequantize(weight)
            for rows in batches:
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                x32 = x.float()
                ours = functools.partial(quant.quant_linear, x, weight, isa=args.isa)
                ours = median_seconds(ours, args.repeats, clock)
                theirs = median_seconds(functools.partial(F.linear, x32, dense), args.repeats, clock)
                if rows == 1:
                    cells = [f"{weight.nbytes / ours / 1e9:.1f} GB/s", f"{dense.nbytes / theirs / 1e9:.1f} GB/s"]
                else:
                    flops = 2 * rows * out_features * in_features
                    cells = [f"{flops / ours / 1e9:.1f} GFLOP/s", f"{flops / theirs / 1e9:.1f} GFLOP/s"]
                print(f"| {shape_name} | {qtype} | {rows} | {cells[0]} | {cells[1]} | {theirs / ours:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
