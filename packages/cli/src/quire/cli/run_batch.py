"""``quire run-batch``: an OpenAI batch file run offline, through the server's own request handling
(the app is called in-process, over no network), with a progress bar."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import httpx

SUPPORTED_URLS = ("/v1/completions", "/v1/chat/completions")


def parse_line(line: str) -> tuple[str | None, dict | None, str | None]:
    """``(custom_id, request, error)`` for one input line; a bad line gets an error, not an exception."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return None, None, f"the line is not valid JSON: {error.msg}"
    if not isinstance(record, dict):
        return None, None, "the line must be a JSON object"
    custom_id = record.get("custom_id")
    if record.get("method", "POST") != "POST":
        return custom_id, None, "method must be POST"
    if record.get("url") not in SUPPORTED_URLS:
        return custom_id, None, f"url must be one of {', '.join(SUPPORTED_URLS)}"
    body = record.get("body")
    if not isinstance(body, dict):
        return custom_id, None, "body must be a JSON object"
    if body.get("stream"):
        return custom_id, None, "streaming is not available in a batch"
    body = {k: v for k, v in body.items() if k != "model"}  # one model runs the whole batch
    return custom_id, {"url": record["url"], "body": body}, None


def _result(custom_id, response: httpx.Response | None = None, error: str | None = None) -> dict:
    result = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": None}
    if error is not None:
        result["error"] = {"code": "invalid_request", "message": error}
    else:
        result["response"] = {"status_code": response.status_code,
                              "request_id": response.headers.get("x-request-id"), "body": response.json()}
    return result


async def _run(lines: list[str], engine_args, max_inflight: int) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from quire.core.demo import default_model
    from quire.core.engine.async_llm import AsyncLLM
    from quire.openai_server.app import build_app
    from quire.openai_server.settings import ServerSettings

    engine = AsyncLLM.from_engine_args(engine_args)
    app = build_app(engine, ServerSettings(served_model_names=[engine_args.model or default_model().name]))
    limit = asyncio.Semaphore(max_inflight)
    results: list[dict | None] = [None] * len(lines)
    progress = Progress(TextColumn("run-batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                     timeout=None) as http:
            with progress:
                task = progress.add_task("requests", total=len(lines))

                async def one(row: int, line: str) -> None:
                    custom_id, request, error = parse_line(line)
                    if error is None:
                        async with limit:
                            response = await http.post(request["url"], json=request["body"])
                        results[row] = _result(custom_id, response)
                    else:
                        results[row] = _result(custom_id, error=error)
                    progress.advance(task)

                await asyncio.gather(*(one(row, line) for row, line in enumerate(lines)))
    finally:
        engine.shutdown()
    return results


def run_batch_file(input_file: Path, output_file: Path, engine_args, max_inflight: int) -> int:
    from quire.core.errors import QuireError

    lines = [line for line in input_file.read_text().splitlines() if line.strip()]
    try:
        results = asyncio.run(_run(lines, engine_args, max_inflight))
    except QuireError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    output_file.write_text("".join(json.dumps(result) + "\n" for result in results))
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"{len(results)} requests: {len(results) - failed} succeeded, {failed} failed; "
          f"results in {output_file}", file=sys.stderr)
    return 0
