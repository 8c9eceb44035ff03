"""Offline benchmarks: ``quire bench latency`` and ``quire bench throughput`` (Quire or transformers)."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)


def make_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)``; with ``range_ratio`` r, lengths are uniform in
    ``[len * (1 - r), len * (1 + r)]`` (r = 0: fixed lengths)."""
    rng = random.Random(seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    return [([rng.randrange(3, vocab_size) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def _model_path(engine_args) -> str:
    if engine_args.model is not None:
        return engine_args.model
    from quire.core.demo import default_model

    return str(default_model().path)


def _llm(engine_args):
    from quire.offline import LLM

    return LLM(**dataclasses.asdict(engine_args))


def _vocab_size(model_path: str) -> int:
    """From a checkpoint folder's config.json or a GGUF file's metadata (the default model is one)."""
    from quire.core.config import ModelConfig

    return ModelConfig.from_path(model_path).vocab_size


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2) + "\n")


def run_latency(engine_args, input_len, output_len, batch_size, n, num_iters_warmup, num_iters, output_json):
    from quire.offline import SamplingParams

    path = _model_path(engine_args)
    llm = _llm(engine_args)
    prompts = [prompt for prompt, _ in make_requests(batch_size, input_len, output_len, 0.0, _vocab_size(path), 0)]
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=output_len, ignore_eos=True)
    print(f"batch of {batch_size}, {input_len} prompt and {output_len} output tokens, n={n}", file=sys.stderr)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    counts_before = _spec_decode_counts(llm)
    latencies = []
    for _ in range(num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    spec_decode = _spec_decode_counts(llm).since(counts_before).summary()
    llm.shutdown()
    percentiles = {p: float(np.percentile(latencies, p)) for p in PERCENTILES}
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for p, value in percentiles.items():
        print(f"{p}% percentile latency: {value} seconds")
    print_spec_decode_result(engine_args, spec_decode)
    _write_json(output_json, {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
                              "percentiles": {str(p): v for p, v in percentiles.items()}, **spec_decode})


def run_throughput(engine_args, backend, dataset_name, input_len, output_len, range_ratio, num_prompts,
                   hf_max_batch_size, output_json):
    path = _model_path(engine_args)
    ratio = range_ratio if dataset_name == "random" else 0.0
    requests = make_requests(num_prompts, input_len, output_len, ratio, _vocab_size(path), engine_args.seed)
    spec_decode = {}
    if backend == "quire":
        elapsed, spec_decode = quire_throughput(engine_args, requests)
    else:
        elapsed = hf_throughput(path, requests, engine_args.dtype, hf_max_batch_size or len(requests))
    num_prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    num_output_tokens = sum(n for _, n in requests)
    total = num_prompt_tokens + num_output_tokens
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{num_output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {num_prompt_tokens}")
    print(f"Total num output tokens:  {num_output_tokens}")
    if backend == "quire":
        print_spec_decode_result(engine_args, spec_decode)
    _write_json(output_json, {"backend": backend, "elapsed_time": elapsed, "num_requests": len(requests),
                              "total_num_tokens": total, "requests_per_second": len(requests) / elapsed,
                              "tokens_per_second": total / elapsed,
                              "output_tokens_per_second": num_output_tokens / elapsed, **spec_decode})


def quire_throughput(engine_args, requests) -> tuple[float, dict]:
    """Seconds to generate ``requests``, and the speculative-decoding figures of that run (empty without
    drafts)."""
    from quire.offline import SamplingParams

    llm = _llm(engine_args)
    prompts = [prompt for prompt, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    counts_before = _spec_decode_counts(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    spec_decode = _spec_decode_counts(llm).since(counts_before).summary()
    llm.shutdown()
    return elapsed, spec_decode


def _spec_decode_counts(llm):
    """The engine's cumulative speculative-decoding counters, from the scheduler statistics its last step
    reported: ``LLM.get_metrics`` has them whether the engine core runs in this process or its own."""
    from quire.cli.bench_spec_decode import SpecDecodeCounts

    return SpecDecodeCounts.from_scheduler_stats(llm.get_metrics().scheduler)


def print_spec_decode_result(engine_args, spec_decode: dict) -> None:
    """With a speculative config, the timed run's acceptance figures (``SpecDecodeCounts.summary``)."""
    from quire.cli.bench_spec_decode import print_spec_decode_section

    if engine_args.speculative_config is None:
        return
    if not spec_decode:
        print("Speculative decoding: no proposals were verified in the timed run")
        return
    print_spec_decode_section(spec_decode)


def hf_throughput(path: str, requests, dtype: str, batch_size: int) -> float:
    """transformers' ``generate`` on left-padded batches, each running to its longest output. The
    requested output tokens are what counts; padding and overrun are the backend's real cost."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model.generation_config.eos_token_id = None
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    hf_generate_batch(model, [(requests[0][0], 2)])  # warm-up
    start = time.perf_counter()
    for batch in batches:
        hf_generate_batch(model, batch)
    return time.perf_counter() - start


def hf_generate_batch(model, batch) -> None:
    """One left-padded ``generate`` call for ``(prompt ids, output length)`` pairs, on the model's device,
    running to the longest output."""
    import torch

    longest = max(len(prompt) for prompt, _ in batch)
    input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(batch):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt):] = 1
    with torch.inference_mode():
        model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                       do_sample=False, pad_token_id=0, max_new_tokens=max(n for _, n in batch))
