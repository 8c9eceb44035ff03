"""The quire command: fast help, every command, exit codes (CliRunner and subprocesses)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quire.cli.main import app
from tests.servers import free_port

runner = CliRunner()
QUIRE = str(Path(sys.executable).parent / "quire")


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "serve", "--help"]])
def test_help_imports_no_heavy_library(argv):
    code = ("import sys\nfrom quire.cli.main import app\n"
            f"try:\n    app({argv!r})\nexcept SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'fastapi') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_serve_help_shows_the_server_options():
    result = subprocess.run([QUIRE, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: quire serve" in result.stdout
    for option in ("--served-model-name", "--api-key", "--max-num-queued-reqs", "--shutdown-timeout"):
        assert option in result.stdout


def test_version_and_env():
    version = runner.invoke(app, ["version"])
    assert version.exit_code == 0 and "quire-core" in version.stdout and "0.1.0" in version.stdout
    env = runner.invoke(app, ["env"])
    assert env.exit_code == 0
    for line in ("torch", "transformers", "python", "cpu", "gpu", "cpu kernels"):
        assert line in env.stdout
    assert "C++ CPU kernels" in env.stdout or "PyTorch fallback" in env.stdout


def test_generate_from_flags_and_files(llama_checkpoint, tmp_path):
    inline = runner.invoke(app, ["generate", str(llama_checkpoint), "-p", "def main():", "-p", "import os",
                                 "--max-tokens", "5", "--output-format", "jsonl"])
    assert inline.exit_code == 0, inline.stderr
    rows = [json.loads(line) for line in inline.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["def main():", "import os"]
    assert all(r["num_tokens"] <= 5 for r in rows)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x = 1"}\n{"messages": [{"role": "user", "content": "hi"}]}\nplain line\n')
    from_file = runner.invoke(app, ["generate", str(llama_checkpoint), "--input", str(prompts), "--max-tokens", "3",
                                    "--output-format", "jsonl"])
    assert from_file.exit_code == 0, from_file.stderr
    assert len(from_file.stdout.splitlines()) == 3
    assert runner.invoke(app, ["generate", str(llama_checkpoint)]).exit_code == 2
    assert runner.invoke(app, ["generate", str(llama_checkpoint), "-p", "x", "--max-tokens", "0"]).exit_code == 2


def test_run_batch_keeps_order_and_survives_bad_lines(llama_checkpoint, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": "anything", "prompt": "def f():", "max_tokens": 4}},
        "{this is not json",
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    target = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run-batch", "-i", str(source), "-o", str(target), str(llama_checkpoint)])
    assert result.exit_code == 0, result.stderr
    outputs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["a", None, "b", "c", "d"]
    assert outputs[0]["response"]["status_code"] == 200
    assert outputs[0]["response"]["body"]["object"] == "text_completion"
    assert outputs[1]["error"]["code"] == "invalid_request" and outputs[1]["response"] is None
    assert outputs[2]["response"]["body"]["object"] == "chat.completion"
    assert "url must be one of" in outputs[3]["error"]["message"]
    assert outputs[4]["response"]["status_code"] == 400
    assert "2 succeeded, 3 failed" in result.stderr


def test_chat_and_complete_quick_against_a_real_server(demo_server):
    url = demo_server.url("/v1")
    chat = runner.invoke(app, ["chat", "--url", url, "--quick", "What is the json module for?", "--stats",
                               "--max-tokens", "12"])
    assert chat.exit_code == 0, chat.stderr
    assert chat.stdout.strip() and "TTFT:" in chat.stderr and "tokens/s" in chat.stderr
    complete = runner.invoke(app, ["complete", "--url", url, "--quick", "The json module", "--max-tokens", "8",
                                   "--temperature", "0"])
    assert complete.exit_code == 0 and complete.stdout.strip()
    conversation = runner.invoke(app, ["chat", "--url", url, "--max-tokens", "6"],
                                 input="hello\nwhat next?\nexit\n")
    assert conversation.exit_code == 0 and conversation.stderr.count("> ") == 3
    unreachable = runner.invoke(app, ["chat", "--url", f"http://127.0.0.1:{free_port()}/v1", "--quick", "hi"])
    assert unreachable.exit_code == 1 and "cannot reach" in unreachable.stderr


def test_chat_image_becomes_an_inline_image_part(tmp_path):
    import base64

    from quire.cli.client import ClientError, image_part
    from tests.media_server import png_bytes

    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes())
    part = image_part(picture)
    assert part["type"] == "image_url"
    header, data = part["image_url"]["url"].split(",", 1)
    assert header == "data:image/png;base64" and base64.b64decode(data) == picture.read_bytes()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ClientError, match="does not look like an image"):
        image_part(tmp_path / "notes.txt")
    with pytest.raises(ClientError, match="cannot read"):
        image_part(tmp_path / "absent.jpg")


def test_chat_sends_the_image_with_the_first_message(demo_server, tmp_path):
    from tests.media_server import png_bytes

    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes())
    url = demo_server.url("/v1")
    # quire-demo takes text only: its refusal shows the image reached the server in the first message
    result = runner.invoke(app, ["chat", "--url", url, "--image", str(picture), "--quick", "What is it?"])
    assert result.exit_code == 1 and "400" in result.stderr and "text only" in result.stderr, result.stderr
    missing = runner.invoke(app, ["chat", "--url", url, "--image", str(tmp_path / "absent.png"), "--quick", "hi"])
    assert missing.exit_code == 1 and "cannot read" in missing.stderr


def test_chat_with_an_image_against_a_vision_language_server(llava_server, tmp_path):
    from tests.media_server import png_bytes

    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes())
    result = runner.invoke(app, ["chat", "--url", llava_server.url("/v1"), "--image", str(picture), "--quick",
                                 "What is it?", "--max-tokens", "4", "--temperature", "0"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()


def test_bench_serve_against_a_real_server(demo_server, tmp_path):
    result = runner.invoke(app, ["bench", "serve", "--base-url", demo_server.base_url, "--num-prompts", "12",
                                 "--random-input-len", "24", "--random-output-len", "8", "--request-rate", "50",
                                 "--max-concurrency", "4", "--output-json", str(tmp_path / "r.json"),
                                 "--plot", str(tmp_path / "latency.png")])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "Serving Benchmark Result" in result.stdout
    assert "Successful requests:                     12" in result.stdout
    for section in ("Time to First Token", "Time per Output Token", "Inter-token Latency"):
        assert section in result.stdout
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["completed"] == 12 and summary["total_output_tokens"] == 96
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"] and summary["mean_itl_ms"] > 0
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    sweep = runner.invoke(app, ["bench", "serve", "--base-url", demo_server.base_url, "--num-prompts", "6",
                                "--random-input-len", "16", "--random-output-len", "4", "--request-rates", "20,40",
                                "--plot", str(tmp_path / "sweep.png")])
    assert sweep.exit_code == 0 and sweep.stdout.count("Serving Benchmark Result") == 2
    assert (tmp_path / "sweep.png").is_file()
    chat = runner.invoke(app, ["bench", "serve", "--base-url", demo_server.base_url, "--endpoint",
                               "/v1/chat/completions", "--num-prompts", "4", "--random-input-len", "8",
                               "--random-output-len", "5", "--output-json", str(tmp_path / "chat.json")])
    assert chat.exit_code == 0, chat.stdout + chat.stderr
    summary = json.loads((tmp_path / "chat.json").read_text())
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 20
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]


def test_bench_latency_and_throughput_for_both_backends(llama_checkpoint, tmp_path):
    latency = runner.invoke(app, ["bench", "latency", "--model", str(llama_checkpoint), "--input-len", "8",
                                  "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1",
                                  "--num-iters", "3", "--output-json", str(tmp_path / "lat.json")])
    assert latency.exit_code == 0, latency.stderr
    assert "Avg latency:" in latency.stdout and "99% percentile latency:" in latency.stdout
    assert len(json.loads((tmp_path / "lat.json").read_text())["latencies"]) == 3
    for backend in ("quire", "hf"):
        result = runner.invoke(app, ["bench", "throughput", "--model", str(llama_checkpoint), "--backend", backend,
                                     "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                                     "--dataset-name", "fixed", "--output-json", str(tmp_path / f"{backend}.json")])
        assert result.exit_code == 0, result.stderr
        assert "Throughput:" in result.stdout and "Total num output tokens:  48" in result.stdout
        assert json.loads((tmp_path / f"{backend}.json").read_text())["num_requests"] == 6
    bad = runner.invoke(app, ["bench", "throughput", "--backend", "vllm"])
    assert bad.exit_code == 2


def test_serve_prints_its_url_and_stops_cleanly_on_sigterm(llama_checkpoint):
    port = free_port()
    server = subprocess.Popen([QUIRE, "serve", str(llama_checkpoint), "--host", "127.0.0.1", "--port", str(port),
                               "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.strip() == f"Quire is serving {llama_checkpoint} at http://127.0.0.1:{port}/v1"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()


def test_bench_serve_times_tokens_that_decode_to_no_text():
    from quire.cli.bench_serve import _carries_tokens

    assert _carries_tokens({"index": 0, "text": "", "finish_reason": None})  # e.g. half of a UTF-8 character
    assert _carries_tokens({"index": 0, "delta": {}, "finish_reason": None})
    assert _carries_tokens({"index": 0, "delta": {"content": "hi"}, "finish_reason": None})
    assert not _carries_tokens({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})


def test_each_rate_of_a_sweep_sends_fresh_prompts(monkeypatch):
    # the same prompts at the next rate would hit the server's prefix cache and skip their prefill
    from quire.cli import bench_serve

    class Response:
        text = ""  # /metrics: no speculative-decoding counters

        def raise_for_status(self):
            pass

        def json(self):
            return {"data": [{"id": "m"}], "vocab_size": 5000}

    class Client:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def get(self, path):
            return Response()

    prompts = []

    async def fake_benchmark(config, model, rate, headers, vocab_size):
        prompts.append(bench_serve._prompts(config, vocab_size))
        return [bench_serve.RequestResult(success=True, prompt_len=8, output_len=2, ttft=0.01, latency=0.02,
                                          itl=[0.01])], 1.0

    monkeypatch.setattr(bench_serve.httpx, "Client", Client)
    monkeypatch.setattr(bench_serve, "_benchmark", fake_benchmark)
    config = bench_serve.ServeBenchConfig(
        base_url="http://127.0.0.1:1", endpoint="/v1/completions", model=None, api_key=None, input_len=8,
        output_len=2, range_ratio=0.0, num_prompts=3, burstiness=1.0, max_concurrency=None, ignore_eos=True,
        percentile_metrics=["ttft"], metric_percentiles=[99.0], seed=0)
    assert bench_serve.run_serve_bench(config, [10.0, 20.0, 30.0], None, None) == 0
    first_tokens = [[prompt[:8] for prompt, _ in run] for run in prompts]
    assert len(first_tokens) == 3 and all(a != b for a, b in zip(first_tokens, first_tokens[1:]))
    assert not set(map(tuple, first_tokens[0])) & set(map(tuple, first_tokens[1]))


def _scripted_stream(pieces: list[bytes], status: bytes = b"200 OK"):
    """Run the benchmark's client for one request against a loopback server that answers with ``pieces``
    (the body's raw bytes, chunked encoding included), each sent on its own after a pause."""
    import asyncio

    from quire.cli import bench_serve

    async def main():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = bench_serve.ServeBenchConfig(
            base_url=f"http://127.0.0.1:{port}", endpoint="/v1/completions", model="m", api_key=None,
            input_len=4, output_len=3, range_ratio=0.0, num_prompts=1, burstiness=1.0, max_concurrency=None,
            ignore_eos=True, percentile_metrics=["ttft"], metric_percentiles=[99.0], seed=0)
        async with server:
            results, _ = await bench_serve._benchmark(config, "m", float("inf"), {}, 100)
        return results[0]

    return asyncio.run(main())


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_bench_serve_client_reads_events_split_anywhere():
    events = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
              b'data: {"choices":[{"index":0,"text":"b"}]}\r\n\r\n'  # CRLF pairs end events too
              b'data: {"choices":[{"index":0,"text":"c","finish_reason":"length"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}\n\n'
              b'data: [DONE]\n\n')
    body = _chunk(events[:30]) + _chunk(events[30:95]) + _chunk(events[95:]) + b"0\r\n\r\n"
    # the raw bytes cut mid chunk-header, mid event and mid JSON
    result = _scripted_stream([body[:7], body[7:50], body[50:121], body[121:]])
    assert result.success and not result.error
    assert result.output_len == 3 and len(result.itl) == 2  # three token events: a first token, two gaps
    assert 0 < result.ttft <= result.latency


def test_bench_serve_client_reports_errors():
    refused = _scripted_stream([_chunk(b'{"error":{"message":"no"}}') + b"0\r\n\r\n"], status=b"400 Bad Request")
    assert not refused.success and refused.error == "HTTP 400"
    failed = _scripted_stream([_chunk(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
                                      b'data: {"error":{"message":"the engine failed"}}\n\n')])
    assert not failed.success and failed.error == "the engine failed"
    cut = _scripted_stream([_chunk(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')])  # closed mid-stream
    assert not cut.success and "closed the connection early" in cut.error


def test_bench_serve_client_request_head():
    from quire.cli.bench_serve import _Target

    target = _Target.parse("http://[::1]:8000/prefix/", "/v1/completions", {"Authorization": "Bearer k"})
    assert (target.host, target.port, target.ssl) == ("::1", 8000, None)
    assert target.head.split(b"\r\n")[:2] == [b"POST /prefix/v1/completions HTTP/1.1", b"Host: [::1]:8000"]
    assert b"\r\nAuthorization: Bearer k\r\n" in target.head
    secure = _Target.parse("https://example.com", "/v1/chat/completions", {})
    assert secure.port == 443 and secure.ssl is not None and b"\r\nHost: example.com\r\n" in secure.head
