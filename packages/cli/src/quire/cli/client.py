"""``quire chat`` and ``quire complete``: streaming clients of a running server (replies on stdout,
prompts, statistics and errors on stderr)."""

from __future__ import annotations

import base64
import json
import mimetypes
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


class ClientError(Exception):
    """Something the user should read: the server is unreachable or refused the request."""


def _http(url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600, connect=10))


def _first_model(http: httpx.Client) -> str:
    response = http.get("/models")
    _raise_for_error(response)
    return response.json()["data"][0]["id"]


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ClientError(f"the server answered {response.status_code}: {message}")


def stream_events(http: httpx.Client, path: str, body: dict) -> Iterator[dict]:
    """The JSON events of a server-sent-event stream, until ``[DONE]``."""
    with http.stream("POST", path, json={**body, "stream": True,
                                          "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            response.read()
            _raise_for_error(response)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            event = json.loads(line[6:])
            if "error" in event:
                raise ClientError(event["error"]["message"])
            yield event


class _Stats:
    def __init__(self):
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.num_tokens = 0

    def saw_text(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def report(self) -> str:
        elapsed = time.perf_counter() - self.start
        ttft = ((self.first_token or time.perf_counter()) - self.start) * 1000
        return (f"TTFT: {ttft:.1f} ms  TPS: {self.num_tokens / max(elapsed, 1e-9):.1f} tokens/s "
                f"({self.num_tokens} tokens in {elapsed:.2f} s)")


def _stream_reply(http, path, body, text_of, show_stats: bool) -> str:
    stats = _Stats()
    reply = []
    for event in stream_events(http, path, body):
        if event.get("usage"):
            stats.num_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            text = text_of(choice)
            if text:
                stats.saw_text()
                reply.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if show_stats:
        print(stats.report(), file=sys.stderr)
    return "".join(reply)


def _read_line(prompt: str) -> str | None:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        return None
    line = line.rstrip("\n")
    return None if line.strip() in ("exit", "quit") else line


def _sampling(max_tokens, temperature) -> dict:
    body = {}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    return body


def image_part(path: str | Path) -> dict:
    """An image file as an OpenAI ``image_url`` content part (inline, as a base64 ``data:`` URL)."""
    media_type = mimetypes.guess_type(str(path))[0]
    if media_type is None or not media_type.startswith("image/"):
        raise ClientError(f"{path} does not look like an image file (.png, .jpg, .webp, .gif, .bmp)")
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ClientError(f"cannot read {path}: {error.strerror}") from None
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def run_chat(url, model, api_key, system_prompt, quick, stats, max_tokens, temperature, image=None) -> int:
    """``image``: a file sent with the first user message (before its text)."""
    def session(http) -> None:
        pending_image = None if image is None else image_part(image)
        chosen = model or _first_model(http)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        turns = [quick] if quick is not None else iter(lambda: _read_line("> "), None)
        for text in turns:
            if not text.strip():
                continue
            content = text if pending_image is None else [pending_image, {"type": "text", "text": text}]
            pending_image = None
            messages.append({"role": "user", "content": content})
            reply = _stream_reply(http, "/chat/completions",
                                  {"model": chosen, "messages": messages, **_sampling(max_tokens, temperature)},
                                  lambda choice: choice.get("delta", {}).get("content"), stats)
            messages.append({"role": "assistant", "content": reply})

    return _run_session(url, api_key, session)


def run_complete(url, model, api_key, quick, stats, max_tokens, temperature) -> int:
    def session(http) -> None:
        chosen = model or _first_model(http)
        prompts = [quick] if quick is not None else iter(lambda: _read_line("> "), None)
        for prompt in prompts:
            if prompt:
                _stream_reply(http, "/completions",
                              {"model": chosen, "prompt": prompt, **_sampling(max_tokens, temperature)},
                              lambda choice: choice.get("text"), stats)

    return _run_session(url, api_key, session)


def _run_session(url, api_key, session) -> int:
    """Run an interactive client against the server; the exit status (errors go to stderr)."""
    try:
        with _http(url, api_key) as http:
            session(http)
        return 0
    except (httpx.HTTPError, ClientError) as error:
        print(f"error: {_describe(error, url)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _describe(error: Exception, url: str) -> str:
    if isinstance(error, httpx.ConnectError):
        return f"cannot reach a server at {url} (is `quire serve` running?)"
    return str(error)
