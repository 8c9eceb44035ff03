"""An agent loop with the ``openai`` SDK: the model calls a tool, the loop runs it and sends the result back,
and the model answers from it.

The tools read the real standard library of this Python (quire-demo was trained to call them):
``lookup(name)`` (the first paragraph of a docstring), ``signature(name)`` and ``list_members(module)``.

    quire serve --tool-call-parser hermes &
    python examples/tool_calling.py                                   # "What does os.path.join do?"
    python examples/tool_calling.py "How do I call shutil.copyfile?" --base-url http://localhost:8000/v1
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pydoc
import re
from typing import NamedTuple

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The docstring summary of a module, class or function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "signature", "description": "The call signature of a function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "list_members", "description": "The public classes and functions of a module.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}},
]
MAX_MEMBERS = 12
MAX_SUMMARY_CHARS = 320


def _resolve(name: str):
    found = pydoc.locate(name)
    if found is None:
        raise LookupError(f"no module, class or function is called {name!r}")
    return found


def lookup(name: str) -> str:
    paragraph = (inspect.getdoc(_resolve(name)) or "").split("\n\n")[0]
    summary = re.sub(r"\s+", " ", paragraph).strip()
    if len(summary) > MAX_SUMMARY_CHARS:
        summary = summary[:MAX_SUMMARY_CHARS].rsplit(" ", 1)[0] + " ..."
    return summary or f"{name} has no docstring"


def signature(name: str) -> str:
    return f"{name}{inspect.signature(_resolve(name))}"


def list_members(module: str) -> str:
    found = _resolve(module)
    if not inspect.ismodule(found):
        raise LookupError(f"{module} is not a module")
    names = [name for name, value in vars(found).items() if not name.startswith("_")
             and (inspect.isclass(value) or inspect.isroutine(value))
             and getattr(value, "__module__", None) == found.__name__]
    return ", ".join(names[:MAX_MEMBERS]) + (", ..." if len(names) > MAX_MEMBERS else "")


FUNCTIONS = {"lookup": lookup, "signature": signature, "list_members": list_members}


def run_tool(name: str, arguments: str) -> str:
    """Run one call; a failure is reported to the model as the result, as an agent would."""
    try:
        return FUNCTIONS[name](**json.loads(arguments))
    except Exception as error:  # noqa: BLE001 - any failure of a tool goes back to the model
        return f"error: {type(error).__name__}: {error}"


class AgentRun(NamedTuple):
    messages: list[dict]  # the whole conversation: question, calls, tool results, answer
    finish_reason: str | None  # of the last completion; "stop" when the model answered
    answer: str | None


def run_agent(client, question: str, model: str | None = None, max_rounds: int = 4,
              max_tokens: int = 256) -> AgentRun:
    """Ask ``question`` with the tools offered; run every call the model makes and send the results back,
    until it answers without calling (at most ``max_rounds`` completions). ``client`` is an ``openai.OpenAI``."""
    model = model or client.models.list().data[0].id
    messages = [{"role": "user", "content": question}]
    choice = None
    for _ in range(max_rounds):
        choice = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=max_tokens).choices[0]
        calls = choice.message.tool_calls or []
        messages.append({"role": "assistant", "content": choice.message.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]} if calls else {"role": "assistant", "content": choice.message.content})
        if not calls:
            return AgentRun(messages, choice.finish_reason, choice.message.content)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c.function.name, c.function.arguments)}
                     for c in calls]
    return AgentRun(messages, choice.finish_reason if choice else None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What does os.path.join do?")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"))
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--max-rounds", type=int, default=4)
    args = parser.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    run = run_agent(client, args.question, args.model, args.max_rounds)
    for message in run.messages:
        for call in message.get("tool_calls", []):
            print(f"call    {call['function']['name']}({call['function']['arguments']})")
        if message["role"] == "tool":
            print(f"result  {message['content']}")
        elif message.get("content"):
            print(f"{message['role']:<8}{message['content']}")
    if run.answer is None:
        print(f"(no answer after {args.max_rounds} rounds; last finish_reason {run.finish_reason})")


if __name__ == "__main__":
    main()
