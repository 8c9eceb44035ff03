"""Does ``torch.compile`` pay for the linear layers of a decode step on this CPU? The small checkpoint's
shapes (Qwen2.5-0.5B: hidden 896, MLP 4864, 24 layers; fused QKV and gate/up as Quire runs them) in
bfloat16, at batch 1 and 32: eager ``F.linear`` (what transformers runs), the same function under
``torch.compile`` (inductor, weights frozen as constants, as for inference), and Quire's own kernel
(``linear_bf16``, the C++ CPU kernels). Prints the median step time of each, interleaved, and the
compile time.

    python benchmarks/torch_compile.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from quire.kernels import cpu_extension

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down: [out, in]
LAYERS = 24


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    return parser.parse_args()


def step_function(weights):
    """One decode step's linears (each layer's four, in order; the input of each is a slice of the last
    output, so nothing is left for a compiler to drop)."""
    def step(x):
        for qkv, o, gate_up, down in weights:
            h = F.linear(x, qkv)[:, :896]
            h = F.linear(h, o)
            h = F.linear(h, gate_up)[:, :4864]
            x = F.linear(h, down)
        return x
    return step


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).mul_(0.03).to(torch.bfloat16) for n, k in SHAPES] for _ in range(LAYERS)]
    kernels = cpu_extension.load()
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants (what inference compilation does)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}\n")
    print("| batch | eager F.linear ms | torch.compile ms | Quire linear_bf16 ms | compile / eager | "
          "Quire / compile | compile time s |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 32):
        x = torch.randn(batch, 896).to(torch.bfloat16)
        eager = step_function(weights)
        with torch.no_grad():
            compiled = torch.compile(step_function(weights), dynamic=False)
            started = time.perf_counter()
            compiled(x)
            compile_seconds = time.perf_counter() - started
            runners = {"eager": eager, "compiled": compiled}
            if kernels is not None:
                def quire(x):
                    for qkv, o, gate_up, down in weights:
                        h = kernels.linear_bf16(x, qkv, None)[:, :896]
                        h = kernels.linear_bf16(h, o, None)
                        h = kernels.linear_bf16(h, gate_up, None)[:, :4864]
                        x = kernels.linear_bf16(h, down, None)
                    return x
                runners["quire"] = quire
            times = {name: [] for name in runners}
            for run in runners.values():
                run(x)  # warm-up
            for _ in range(args.repeats):
                for name, run in runners.items():
                    started = time.perf_counter()
                    run(x)
                    times[name].append(time.perf_counter() - started)
        ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
        quire_ms = ms.get("quire", float("nan"))
        print(f"| {batch} | {ms['eager']:.1f} | {ms['compiled']:.1f} | {quire_ms:.1f} | "
              f"{ms['compiled'] / ms['eager']:.2f} | {quire_ms / ms['compiled']:.2f} | {compile_seconds:.0f} |")


if __name__ == "__main__":
    main()
