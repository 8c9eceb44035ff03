"""Offline throughput: Quire ``LLM.generate`` against transformers' padded batched ``generate``.

Both run the same workload on the same locally built checkpoint (a ~7M-parameter Llama shape, fixed
seed, nothing downloaded): N requests with prompt and output lengths drawn uniformly from ranges, outputs
forced to their length with ``ignore_eos``. Prints output tokens per second for both and the ratio.

transformers runs the whole batch as one left-padded ``generate``, which must run to the longest output;
its throughput counts only the tokens the requests asked for (the padding work is real cost).

    hatch run bench-offline            # or: python benchmarks/offline_throughput.py --help
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import bench_checkpoint, random_workload, vocab_size


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine; the median counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, help="reuse or create the checkpoint in this folder")
    parser.add_argument("--in-process", dest="multiprocess", action="store_false",
                        help="run Quire's engine core in this process instead of its own")
    return parser.parse_args()


def run_quire(folder: Path, requests, args) -> float:
    from quire.offline import LLM, SamplingParams

    llm = LLM(folder, dtype=args.dtype, max_num_seqs=max(len(requests), 1), seed=args.seed,
              multiprocess=args.multiprocess)
    prompts = [prompt for prompt, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    return statistics.median(times)


def run_transformers(folder: Path, requests, args) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    model.generation_config.eos_token_id = None
    longest_prompt = max(len(p) for p, _ in requests)
    input_ids = torch.zeros(len(requests), longest_prompt, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(requests):  # left padding
        input_ids[row, longest_prompt - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, longest_prompt - len(prompt):] = 1
    max_new = max(n for _, n in requests)

    def generate(rows, new_tokens):
        with torch.inference_mode():
            return model.generate(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                                  max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    generate(slice(0, 2), 4)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = generate(slice(None), max_new)
        times.append(time.perf_counter() - start)
        assert out.shape[1] == longest_prompt + max_new
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_checkpoint(args.checkpoint or Path(scratch) / "bench-llama-7m")
        requests = random_workload(args.num_requests, args.prompt_len, args.output_len,
                                   vocab_size(folder), args.seed)
        num_output_tokens = sum(n for _, n in requests)
        print(f"workload: {len(requests)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
              f"outputs {args.output_len[0]}-{args.output_len[1]} tokens ({num_output_tokens} in all), "
              f"{args.dtype}, median of {args.repeats}")
        quire_time = run_quire(folder, requests, args)
        hf_time = run_transformers(folder, requests, args)
    quire_rate = num_output_tokens / quire_time
    hf_rate = num_output_tokens / hf_time
    print(f"quire        {quire_time:8.2f} s  {quire_rate:10.1f} output tok/s")
    print(f"transformers {hf_time:8.2f} s  {hf_rate:10.1f} output tok/s  (padded batch generate)")
    print(f"ratio quire / transformers: {quire_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
