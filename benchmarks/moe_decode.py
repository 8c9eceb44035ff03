"""Mixture-of-experts decode: Quire against transformers on a small Qwen3-MoE-shaped checkpoint, on the CPU.

The checkpoint (built once with a fixed seed, random bfloat16 weights; nothing is downloaded): hidden 512,
8 layers, 8 query and 2 KV heads of 64, 8 experts of width 1024 per layer with top-2 routing, vocabulary 8000
(116M parameters, 33M of them read per token). Decode tokens/s at batch 1 and 8 (prompts of 32 random ids,
64 greedy tokens each; Quire from its token timestamps, transformers as ``generate(64)`` minus ``generate(1)``,
the prefill), the median of ``--rounds`` runs, for Quire and transformers at bfloat16 and float32.

    python benchmarks/moe_decode.py [--batch-sizes 1,8] [--rounds 3] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS = 32, 64
DTYPES = ("bfloat16", "float32")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=Path.home() / ".cache" / "quire-bench" / "qwen3-moe",
                        help="reuse or create the checkpoint in this folder")
    return parser.parse_args()


def moe_checkpoint(folder: Path) -> Path:
    from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint, build_tokenizer

    spec = TinyModelSpec(model_type="qwen3_moe", vocab_size=8000, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         init_std=0.02, logit_std=4.0, dtype="bfloat16",
                         extra_config={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024,
                                       "norm_topk_prob": True})
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "qwen3_moe":
        return folder
    return build_checkpoint(folder, spec, build_tokenizer(spec.vocab_size))


def quire_rates(folder: Path, dtype: str, batch_size: int, prompts, rounds: int) -> list[float]:
    """Decode tokens/s over the batch: tokens after each request's first, over the span from the first
    request's first token to the last one's last."""
    from quire.offline import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, max_num_seqs=batch_size, max_model_len=PROMPT_LEN + NEW_TOKENS + 16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates = []
    for _ in range(rounds):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times = [output.metrics.token_times for output in outputs]
        span = max(t[-1] for t in times) - min(t[0] for t in times)
        rates.append(sum(len(t) - 1 for t in times) / span)
    llm.shutdown()
    return rates


def hf_rates(folder: Path, dtype: str, prompts, rounds: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    ids = torch.tensor(prompts)

    def elapsed(num_tokens):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                           min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    elapsed(2)  # warm-up
    return [len(prompts) * (NEW_TOKENS - 1) / (elapsed(NEW_TOKENS) - elapsed(1)) for _ in range(rounds)]


def main() -> None:
    args = parse_args()
    folder = moe_checkpoint(args.checkpoint)
    rng = random.Random(0)
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [[rng.randrange(3, 7900) for _ in range(PROMPT_LEN)] for _ in range(batch_size)]
        rates = {}
        for dtype in DTYPES:
            rates[f"Quire {dtype}"] = quire_rates(folder, dtype, batch_size, prompts, args.rounds)
            rates[f"transformers {dtype}"] = hf_rates(folder, dtype, prompts, args.rounds)
        medians = {engine: statistics.median(runs) for engine, runs in rates.items()}
        best_hf = max(medians[f"transformers {dtype}"] for dtype in DTYPES)
        for engine, runs in rates.items():
            rows.append((batch_size, engine, medians[engine], medians[engine] / best_hf,
                         ", ".join(f"{r:.1f}" for r in runs)))
    print(f"\n### MoE decode (Qwen3-MoE shape, 8 experts, top-2; median of {args.rounds} runs)\n")
    print("| batch | engine | tokens/s | x best transformers | runs |")
    print("|---|---|---|---|---|")
    for batch_size, engine, median, ratio, runs in rows:
        print(f"| {batch_size} | {engine} | {median:.1f} | {ratio:.2f} | {runs} |")


if __name__ == "__main__":
    main()
