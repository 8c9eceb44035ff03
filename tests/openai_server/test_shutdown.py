"""SIGTERM drains; engine death fails in-flight requests and takes the server down with a non-zero status."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.servers import ServerProcess, child_pids

SLOW = {"QUIRE_TEST_FAULTS": "step_delay_ms=20"}


def stream_completion(server, results, index, max_tokens=40):
    """Consume one streaming completion; record its finish reason, or the error it ended with."""
    try:
        with httpx.stream("POST", server.url("/v1/completions"), timeout=60, json={
                "prompt": f"x{index}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as response:
            finish = None
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        results[index] = ("error", chunk["error"]["code"])
                        return
                    finish = chunk["choices"][0]["finish_reason"] or finish
            results[index] = ("finished", finish)
    except httpx.HTTPError as error:
        results[index] = ("disconnected", type(error).__name__)


def start_streams(server, count, max_tokens=40):
    results = {}
    threads = [threading.Thread(target=stream_completion, args=(server, results, i, max_tokens)) for i in range(count)]
    for thread in threads:
        thread.start()
    return results, threads


def wait_for_running(server, count, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = httpx.get(server.url("/debug/state"), timeout=5).json()
        if state["engine"]["num_running_reqs"] >= count:
            return
        time.sleep(0.05)
    raise AssertionError("requests did not start")


def assert_no_children(server):
    assert not (os.path.exists(f"/proc/{server.process.pid}") and child_pids(server.process.pid))


def test_sigterm_drain_lets_in_flight_requests_finish():
    server = ServerProcess("--enable-debug-routes", "--shutdown-timeout", "30", env=SLOW)
    engine_pid = server.engine_pid()
    results, threads = start_streams(server, 3)
    wait_for_running(server, 3)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(server.url("/v1/completions"), json={"prompt": "late", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503
    assert httpx.get(server.url("/health"), timeout=10).status_code == 503
    for thread in threads:
        thread.join(timeout=60)
    assert results == {i: ("finished", "length") for i in range(3)}
    assert server.process.wait(timeout=30) == 0
    assert not os.path.exists(f"/proc/{engine_pid}")


def test_sigterm_without_a_drain_timeout_aborts_in_flight_requests():
    server = ServerProcess("--enable-debug-routes", env=SLOW)
    results, threads = start_streams(server, 2, max_tokens=400)
    wait_for_running(server, 2)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=15) == 0
    assert time.monotonic() - started < 10
    for thread in threads:
        thread.join(timeout=30)
    assert all(outcome in {("finished", "abort")} or outcome[0] == "disconnected" for outcome in results.values())


@pytest.mark.parametrize("stream", [True, False])
def test_engine_death_fails_requests_and_stops_the_server(stream):
    server = ServerProcess("--enable-debug-routes", env=SLOW)
    try:
        if stream:
            results, threads = start_streams(server, 2, max_tokens=400)
        else:
            outcome = {}

            def call():
                outcome["response"] = httpx.post(server.url("/v1/completions"), timeout=60, json={
                    "prompt": "x", "max_tokens": 400, "ignore_eos": True})
            threads = [threading.Thread(target=call)]
            threads[0].start()
        wait_for_running(server, 2 if stream else 1)
        os.kill(server.engine_pid(), signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert time.monotonic() - killed < 5, "in-flight requests took more than 5 s to fail"
        if stream:
            assert all(result == ("error", "engine_dead") for result in results.values()), results
        else:
            assert outcome["response"].status_code == 500
            assert outcome["response"].json()["error"]["code"] == "engine_dead"
        try:
            assert httpx.get(server.url("/health"), timeout=5).status_code == 503
        except httpx.ConnectError:
            pass  # already gone: also fine
        assert server.process.wait(timeout=10) != 0
        assert time.monotonic() - killed < 10
        assert_no_children(server)
    finally:
        server.stop()
