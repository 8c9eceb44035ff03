"""GPU figures for benchmarks/gpu_check.sh: kernel microbenchmarks and Quire against transformers.

- ``kernels``: device copy bandwidth (the roofline), paged decode attention's bandwidth as a fraction of
  it, and the prefill attention kernel's TFLOP/s beside PyTorch's ``scaled_dot_product_attention`` on the
  same (dense, causal) shapes;
- ``e2e``: on the locally built Qwen2.5-0.5B-shaped checkpoint in bfloat16, offline throughput of Quire
  against transformers' padded batched ``generate``, and batch-1 decode speed of both.

Timings are medians of CUDA-event-timed repeats after warm-ups. Writes ``summary.json`` and ``summary.md``
to ``--out`` and prints the Markdown.

    python benchmarks/gpu_benchmarks.py --out DIR [--sections kernels,e2e]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from common import bench_checkpoint, workload


def timed_ms(fn, repeats: int = 20, warmups: int = 3) -> float:
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def paged_cache(num_seqs, seq_len, num_kv_heads, head_dim, block_size=16, dtype=torch.bfloat16):
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    order = torch.randperm(num_blocks - 1, device="cuda") + 1  # scattered blocks, as after a while of serving
    tables = order.view(num_seqs, blocks_per_seq).to(torch.int32)
    return cache, tables


def decode_attention(copy_bw: float) -> list[dict]:
    from quire.kernels.triton_ops.attention import paged_decode

    rows = []
    # (requests, context, query heads, KV heads, head size): Llama-3-8B-like heads, then fewer longer contexts
    for num_seqs, seq_len, num_heads, num_kv_heads, head_dim in ((64, 4096, 32, 8, 128), (8, 16384, 32, 8, 128),
                                                                 (256, 1024, 14, 2, 64)):
        cache, tables = paged_cache(num_seqs, seq_len, num_kv_heads, head_dim)
        query = torch.randn(num_seqs, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
        ms = timed_ms(functools.partial(paged_decode, query, cache[0], cache[1], tables, seq_lens, head_dim**-0.5,
                                        seq_len))
        kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_dim * cache.element_size()
        bandwidth = kv_bytes / (ms / 1e3)
        rows.append({"requests": num_seqs, "context": seq_len, "heads": f"{num_heads}/{num_kv_heads}x{head_dim}",
                     "ms": ms, "GB/s": bandwidth / 1e9, "fraction_of_copy": bandwidth / copy_bw})
    return rows


def prefill_attention() -> list[dict]:
    import torch.nn.functional as F

    from quire.kernels.triton_ops.attention import paged_prefill

    rows = []
    for num_seqs, seq_len, num_heads, num_kv_heads, head_dim in ((4, 2048, 32, 8, 128), (1, 8192, 32, 8, 128)):
        cache, tables = paged_cache(num_seqs, seq_len, num_kv_heads, head_dim)
        query = torch.randn(num_seqs * seq_len, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
        starts = (torch.arange(num_seqs + 1, device="cuda") * seq_len).to(torch.int32)
        ms = timed_ms(functools.partial(paged_prefill, query, cache[0], cache[1], tables, seq_lens, starts,
                                        head_dim**-0.5, seq_len), repeats=10)
        flops = 2 * num_seqs * seq_len * seq_len * head_dim * num_heads  # QK^T and PV, causal half of each
        q4 = query.view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)
        kv = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, dtype=torch.bfloat16, device="cuda")
        sdpa_ms = timed_ms(functools.partial(F.scaled_dot_product_attention, q4, kv, kv, is_causal=True,
                                             enable_gqa=True), repeats=10)
        rows.append({"requests": num_seqs, "prompt": seq_len, "heads": f"{num_heads}/{num_kv_heads}x{head_dim}",
                     "ms": ms, "TFLOP/s": flops / (ms / 1e3) / 1e12, "sdpa_ms": sdpa_ms,
                     "sdpa TFLOP/s": flops / (sdpa_ms / 1e3) / 1e12})
    return rows


def hf_generate_seconds(model, requests, batch_size: int) -> float:
    from quire.cli.bench_offline import hf_generate_batch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        hf_generate_batch(model, requests[i:i + batch_size])
    torch.cuda.synchronize()
    return time.perf_counter() - start


def quire_seconds(llm, requests) -> float:
    from quire.offline import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    return elapsed


def end_to_end(cache_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from quire.offline import LLM

    path = bench_checkpoint(cache_dir / "small", "small")
    requests = workload(path, 256, (128, 512), (128, 256))
    output_tokens = sum(n for _, n in requests)
    single = workload(path, 1, (32, 32), (256, 256), seed=1)

    # NOTE: tensor_parallel_size=1 named: the GPU check is the one-device case of tensor parallelism (the
    # machine has one GPU; several ranks on CUDA (NCCL) are refused for now)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=256, max_model_len=2048,
              max_num_batched_tokens=8192, tensor_parallel_size=1)
    quire_seconds(llm, requests[:32])  # warm-up
    quire_time = quire_seconds(llm, requests)
    quire_single = quire_seconds(llm, single)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    model.generation_config.eos_token_id = None
    hf_generate_seconds(model, requests[:4], 4)  # warm-up
    hf_time = hf_generate_seconds(model, requests, 64)
    hf_single = hf_generate_seconds(model, single, 1)
    return {
        "workload": f"{len(requests)} requests, prompts 128-512, outputs 128-256 tokens ({output_tokens} in all)",
        "quire_tok_s": output_tokens / quire_time, "hf_generate_tok_s": output_tokens / hf_time,
        "throughput_ratio": hf_time / quire_time,
        "quire_batch1_tok_s": 256 / quire_single, "hf_batch1_tok_s": 256 / hf_single,
        "batch1_ratio": hf_single / quire_single,
    }


def markdown(results: dict) -> str:
    lines = [f"# Quire GPU check: {results['device']}", ""]
    if "copy_GB_s" in results:
        lines += [f"Device copy bandwidth (read + write): {results['copy_GB_s']:,.0f} GB/s", "",
                  "| decode: requests | context | heads | ms | GB/s | of copy bandwidth |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['requests']} | {r['context']} | {r['heads']} | {r['ms']:.3f} | {r['GB/s']:,.0f} | "
                  f"{r['fraction_of_copy']:.0%} |" for r in results["decode"]]
        lines += ["", "| prefill: requests | prompt | heads | ms | TFLOP/s | SDPA ms | SDPA TFLOP/s |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['requests']} | {r['prompt']} | {r['heads']} | {r['ms']:.3f} | {r['TFLOP/s']:.0f} | "
                  f"{r['sdpa_ms']:.3f} | {r['sdpa TFLOP/s']:.0f} |" for r in results["prefill"]]
    if "e2e" in results:
        e = results["e2e"]
        lines += ["", f"End to end, Qwen2.5-0.5B-shaped checkpoint, bfloat16, tensor_parallel_size=1: {e['workload']}",
                  "",
                  "| | Quire | transformers generate | ratio |", "|---|---|---|---|",
                  f"| offline throughput (output tok/s) | {e['quire_tok_s']:,.0f} | {e['hf_generate_tok_s']:,.0f} | "
                  f"{e['throughput_ratio']:.2f}x |",
                  f"| batch-1 decode (tok/s) | {e['quire_batch1_tok_s']:,.0f} | {e['hf_batch1_tok_s']:,.0f} | "
                  f"{e['batch1_ratio']:.2f}x |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="kernels,e2e")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/quire-bench"))
    args = parser.parse_args()
    sections = args.sections.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name()}
    if "kernels" in sections:
        copy_bw = copy_bandwidth()
        results.update(copy_GB_s=copy_bw / 1e9, decode=decode_attention(copy_bw), prefill=prefill_attention())
        print(markdown(results), flush=True)
    if "e2e" in sections:
        results["e2e"] = end_to_end(args.cache_dir)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
