"""``--quantization int8`` on the small checkpoint: batch-1 decode speed and greedy agreement with bfloat16.

The small checkpoint (benchmarks/common.py: Qwen2.5-0.5B's shapes, 387M parameters, random weights with a
fixed seed) runs at bfloat16, at bfloat16 with int8 weights, and at float32. Agreement is the share of the
bfloat16 run's first 32 greedy tokens (16 prompts) that another run reproduces before its first
difference, with position-by-position equality beside it; float32 against bfloat16 shows how sensitive the
checkpoint itself is to rounding. Decode is tokens/s of 128 greedy tokens at batch 1 (median of 3).

    python benchmarks/int8_quantization.py [--checkpoint DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_checkpoint, workload  # noqa: E402

RUNS = (("bfloat16", None), ("bfloat16", "int8"), ("float32", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="reuse or build the small checkpoint here")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    from quire.offline import LLM, SamplingParams

    folder = args.checkpoint or Path(tempfile.gettempdir()) / "quire-bench-small"
    checkpoint = bench_checkpoint(folder, "small")
    prompts = [{"prompt_token_ids": p} for p, _ in workload(checkpoint, 16, (16, 64), (32, 32), seed=1)]
    decode_prompt = prompts[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs, rates = {}, {}
    for dtype, quantization in RUNS:
        print(f"running {dtype} {quantization or ''}…", file=sys.stderr, flush=True)
        llm = LLM(str(checkpoint), dtype=dtype, quantization=quantization, num_threads=args.threads,
                  max_model_len=1024, max_num_seqs=16)
        outputs[dtype, quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        runs = []
        for _ in range(3):
            out = llm.generate([decode_prompt], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
                               use_tqdm=False)[0]
            times = out.metrics.token_times
            runs.append((len(times) - 1) / (times[-1] - times[0]))
        rates[dtype, quantization] = runs
        llm.shutdown()
    reference = outputs["bfloat16", None]
    print("\n### `--quantization int8`, small checkpoint (batch-1 decode: median of 3 runs of 128 tokens)\n")
    print("| weights | decode tokens/s | x bfloat16 | greedy agreement with bfloat16 (prefix) "
          "| same token, position by position |")
    print("|---|---|---|---|---|")
    base = statistics.median(rates["bfloat16", None])
    for key in RUNS:
        rate = statistics.median(rates[key])
        name = f"{key[0]}{' + int8 weights' if key[1] else ''}"
        print(f"| {name} | {rate:.2f} | {rate / base:.2f} | {prefix_agreement(reference, outputs[key]):.3f} | "
              f"{positional_agreement(reference, outputs[key]):.3f} |")
    print("\nruns (tokens/s): " + "; ".join(f"{k[0]} {k[1] or ''}: {', '.join(f'{r:.2f}' for r in v)}"
                                             for k, v in rates.items()))


def prefix_agreement(reference, other) -> float:
    matched = 0
    for expected, got in zip(reference, other):
        for mine, theirs in zip(got, expected):
            if mine != theirs:
                break
            matched += 1
    return matched / sum(len(ids) for ids in reference)


def positional_agreement(reference, other) -> float:
    same = sum(a == b for expected, got in zip(reference, other) for a, b in zip(expected, got))
    return same / sum(len(ids) for ids in reference)


if __name__ == "__main__":
    main()
