"""``quire generate``: offline generation through ``quire.offline.LLM``."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def read_prompts(prompts: list[str] | None, input_file: Path | None) -> list:
    """Inline prompts, then the file's: plain lines, or JSONL objects with "prompt" or "messages"."""
    items: list = list(prompts or [])
    if input_file is not None:
        for number, line in enumerate(input_file.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                record = json.loads(line)
                if "messages" in record:
                    items.append(record["messages"])
                elif "prompt" in record:
                    items.append(record["prompt"])
                else:
                    raise ValueError(f"{input_file}:{number}: a JSON line needs 'prompt' or 'messages'")
            else:
                items.append(line)
    return items


def run_generate(engine_args, prompts, input_file, output_format, max_tokens, temperature, top_p, top_k,
                 n) -> int:
    if output_format not in ("text", "jsonl"):
        print("error: --output-format must be text or jsonl", file=sys.stderr)
        return 2
    try:
        items = read_prompts(prompts, input_file)
    except (ValueError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not items:
        print("error: give --prompt or --input", file=sys.stderr)
        return 2
    from quire.core.errors import QuireError
    from quire.offline import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n)
        llm = LLM(**dataclasses.asdict(engine_args))
        chat_rows = [i for i, item in enumerate(items) if isinstance(item, list)]
        text_rows = [i for i, item in enumerate(items) if not isinstance(item, list)]
        outputs = dict(zip(text_rows, llm.generate([items[i] for i in text_rows], params) if text_rows else []))
        outputs.update(zip(chat_rows, llm.chat([items[i] for i in chat_rows], params) if chat_rows else []))
        llm.shutdown()
    except QuireError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for row, item in enumerate(items):
        output = outputs[row]
        for completion in output.outputs:
            if output_format == "jsonl":
                print(json.dumps({"prompt": item, "index": completion.index, "text": completion.text,
                                  "finish_reason": completion.finish_reason,
                                  "num_tokens": len(completion.token_ids)}))
            else:
                print(completion.text)
    return 0
