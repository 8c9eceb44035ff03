"""Failures that must stay contained: a request the engine fails, requests that wait or run too long,
and the API process killed outright. Each ends with nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.openai_server.test_shutdown import start_streams, wait_for_running
from tests.servers import ServerProcess

pytestmark = pytest.mark.reliability


def assert_idle(server):
    response = httpx.post(server.url("/debug/check_idle"), timeout=10)
    assert response.status_code == 200, response.text
    state = httpx.get(server.url("/debug/state"), timeout=10).json()
    assert state["engine"]["num_free_blocks"] == state["engine"]["num_blocks"] - 1
    assert state["front_end"] == {"tracked_requests": 0, "open_collectors": 0, "http_requests_in_flight": 1}


def wait_idle(server, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if httpx.post(server.url("/debug/check_idle"), timeout=10).status_code == 200:
            break
        time.sleep(0.05)
    assert_idle(server)


def test_a_request_the_engine_fails_fails_alone():
    server = ServerProcess("--enable-debug-routes", env={"QUIRE_TEST_FAULTS": "fail_request=doomed,step_delay_ms=5"})
    try:
        results, threads = start_streams(server, 2, max_tokens=30)
        failed = httpx.post(server.url("/v1/completions"), timeout=30,
                            json={"prompt": "x", "max_tokens": 5, "request_id": "doomed-1"})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "generation_failed"
        with httpx.stream("POST", server.url("/v1/completions"), timeout=30, json={
                "prompt": "x", "max_tokens": 5, "request_id": "doomed-2", "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert '"generation_failed"' in events[0] and events[-1] == "data: [DONE]"
        for thread in threads:
            thread.join(timeout=60)
        assert results == {0: ("finished", "length"), 1: ("finished", "length")}
        assert httpx.get(server.url("/health"), timeout=5).status_code == 200
        wait_idle(server)
    finally:
        server.stop()


def test_requests_waiting_past_max_queue_time_get_a_retryable_503():
    server = ServerProcess("--enable-debug-routes", "--max-num-seqs", "1", "--max-queue-time", "0.5",
                           env={"QUIRE_TEST_FAULTS": "step_delay_ms=20"})
    try:
        results, threads = start_streams(server, 1, max_tokens=60)  # ~1.2 s holding the only seat
        wait_for_running(server, 1)
        started = time.monotonic()
        waited = httpx.post(server.url("/v1/completions"), timeout=30, json={"prompt": "y", "max_tokens": 5})
        assert waited.status_code == 503, waited.text
        assert waited.headers["retry-after"] and waited.json()["error"]["code"] == "server_overloaded"
        assert "max_queue_time" in waited.json()["error"]["message"]
        assert 0.5 <= time.monotonic() - started < 5
        threads[0].join(timeout=60)
        assert results == {0: ("finished", "length")}
        wait_idle(server)
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_requests_past_the_request_timeout_are_aborted(stream):
    server = ServerProcess("--enable-debug-routes", "--request-timeout", "1",
                           env={"QUIRE_TEST_FAULTS": "step_delay_ms=20"})
    try:
        started = time.monotonic()
        body = {"prompt": "z", "max_tokens": 500, "ignore_eos": True, "stream": stream}
        if stream:
            with httpx.stream("POST", server.url("/v1/completions"), timeout=30, json=body) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert response.status_code == 200
            assert '"request_timeout"' in events[-2] and events[-1] == "data: [DONE]"
        else:
            response = httpx.post(server.url("/v1/completions"), timeout=30, json=body)
            assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
        assert 1 <= time.monotonic() - started < 5
        wait_idle(server)
        quick = httpx.post(server.url("/v1/completions"), timeout=30, json={"prompt": "z", "max_tokens": 3})
        assert quick.status_code == 200
    finally:
        server.stop()


def test_sigkill_of_the_api_process_takes_the_engine_down_and_frees_everything():
    server = ServerProcess("--enable-debug-routes", env={"QUIRE_TEST_FAULTS": "step_delay_ms=20"})
    engine_pid = server.engine_pid()
    socket_dirs = {line.split("ipc://")[1].rsplit("/", 1)[0]
                   for line in Path(f"/proc/{engine_pid}/cmdline").read_text().split("\0") if "ipc://" in line}
    assert socket_dirs and all(Path(d).exists() for d in socket_dirs)
    results, threads = start_streams(server, 2, max_tokens=400)
    wait_for_running(server, 2)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{engine_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{engine_pid}"), "the engine outlived its API process by 10 s"
    for thread in threads:
        thread.join(timeout=10)
    assert all(outcome[0] == "disconnected" for outcome in results.values()), results
    with socket.socket() as probe:  # a restarted server can listen on the port again (as uvicorn binds it)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", server.port))
        probe.listen()
    assert not any(Path(d).exists() for d in socket_dirs), "the engine's socket files were left behind"
    server.stop()


SCRIPTED_TEXT = "Le café coûte 3€ — 中文字符 😀 e\u0301 fin."


@pytest.fixture(scope="module")
def scripted_server():
    """A server whose every output is SCRIPTED_TEXT's token ids (multi-byte characters split over byte
    tokens), whatever the model samples."""
    from tokenizers import Tokenizer

    from quire.core.demo import demo_model_path

    tokenizer = Tokenizer.from_file(str(demo_model_path() / "tokenizer.json"))
    ids = tokenizer.encode(SCRIPTED_TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == SCRIPTED_TEXT
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 10  # characters really are split
    server = ServerProcess("--enable-debug-routes",
                           env={"QUIRE_TEST_FAULTS": "step_delay_ms=10,script_output=" + ".".join(map(str, ids))})
    yield server, len(ids)
    server.stop()


@pytest.mark.parametrize("stop", [None, "中文字", "é c", " 😀"])
def test_multibyte_text_and_stop_strings_through_the_stream(scripted_server, stop):
    server, num_tokens = scripted_server
    expected = SCRIPTED_TEXT if stop is None else SCRIPTED_TEXT[:SCRIPTED_TEXT.index(stop)]
    body = {"prompt": "x", "max_tokens": num_tokens, "stop": [stop] if stop else None}
    whole = httpx.post(server.url("/v1/completions"), timeout=30, json=body).json()["choices"][0]
    assert whole["text"] == expected
    assert whole["finish_reason"] == ("length" if stop is None else "stop")
    deltas = []
    with httpx.stream("POST", server.url("/v1/completions"), timeout=30, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["text"])
    assert not any("\ufffd" in delta for delta in deltas), deltas
    # every delta extends the text without ever retracting: no partial stop string went out
    assert "".join(deltas) == expected, deltas
    assert len([d for d in deltas if d]) >= 3  # it really streamed piece by piece (steps are 10 ms apart)


def test_the_port_answers_while_the_model_loads():
    """Readiness and liveness during start-up: the port opens at once; /health 503 "loading", /live 200,
    other routes 503 with Retry-After; then everything is ready."""
    import subprocess
    import sys

    from tests.servers import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "quire.openai_server", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "QUIRE_TEST_FAULTS": "load_delay_ms=4000"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, seen = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                seen = httpx.get(base + "/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert seen is not None and seen.status_code == 503 and seen.json() == {"status": "loading"}
        assert httpx.get(base + "/live", timeout=2).status_code == 200
        busy = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
        assert busy.headers["retry-after"]
        while time.monotonic() < deadline and httpx.get(base + "/health", timeout=2).status_code != 200:
            time.sleep(0.1)
        answer = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert f"Quire is serving quire-demo at http://127.0.0.1:{port}/v1" in output
