"""Offline throughput: Quire ``LLM.generate`` against transformers' padded batched ``generate``.

Both run the same workload on the same locally built checkpoint (a ~7M-parameter Llama shape, fixed seed,
nothing downloaded): N requests with prompt and output lengths drawn uniformly from ranges, outputs forced
to their length with ``ignore_eos``. Prints output tokens per second for both and the ratio (medians over
repeats). transformers runs the whole batch as one left-padded ``generate``, which must run to the longest
output; its throughput counts only the tokens the requests asked for (the padding work is real cost).
The runners are those of ``quire bench throughput``.

    hatch run bench-offline            # or: python benchmarks/offline_throughput.py --help
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import bench_checkpoint, workload, workload_parser

from quire.cli.bench_offline import hf_throughput, quire_throughput
from quire.core.engine_args import EngineArgs


def parse_args():
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine; the median counts")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = str(bench_checkpoint(args.checkpoint or Path(scratch) / "bench-llama-7m"))
        requests = workload(folder, args.num_requests, args.prompt_len, args.output_len)
        num_output_tokens = sum(n for _, n in requests)
        print(f"workload: {len(requests)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
              f"outputs {args.output_len[0]}-{args.output_len[1]} tokens ({num_output_tokens} in all), "
              f"{args.dtype}, median of {args.repeats}")
        engine_args = EngineArgs(model=folder, dtype=args.dtype, max_num_seqs=len(requests))
        quire_time = statistics.median(quire_throughput(engine_args, requests) for _ in range(args.repeats))
        hf_time = statistics.median(hf_throughput(folder, requests, args.dtype, len(requests))
                                    for _ in range(args.repeats))
    quire_rate, hf_rate = num_output_tokens / quire_time, num_output_tokens / hf_time
    print(f"quire        {quire_time:8.2f} s  {quire_rate:10.1f} output tok/s")
    print(f"transformers {hf_time:8.2f} s  {hf_rate:10.1f} output tok/s  (padded batch generate)")
    print(f"ratio quire / transformers: {quire_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
