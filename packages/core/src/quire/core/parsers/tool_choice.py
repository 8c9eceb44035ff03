"""``tools``, ``tool_choice`` and the tool messages of a chat request (server or ``LLM.chat``): checked
(``ValidationError`` naming the field), and turned into what the engine needs: the tool definitions for the
chat template, and for a named or ``required`` tool choice the structured-output schema that makes the
model's output the calls.

``tool_choice`` (OpenAI's meaning): ``none`` (no calls; the tools still reach the template), ``auto`` (the
default with tools: the model's text is parsed by the ``--tool-call-parser``, unconstrained),
``required`` (the output is constrained to a JSON array of ``{"name", "parameters"}`` calls of the given
tools: one unless ``parallel_tool_calls``), or ``{"type": "function", "function": {"name": ...}}`` (the
output is constrained to that function's parameters).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from quire.core.errors import ValidationError
from quire.core.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass
class ToolRequest:
    """A request's tools, as checked: the definitions, and how calls are made."""

    tools: list[dict[str, Any]]  # OpenAI function tools, for the chat template
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True

    @property
    def parameters(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or _EMPTY_PARAMETERS for t in self.tools}

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint of a named or required choice (None otherwise)."""
        # compact JSON (no optional whitespace): arguments as an API returns them, and no tokens spent on blanks
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters[self.named], disable_any_whitespace=True)
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"]} for name, schema in self.parameters.items()]
            item = calls[0] if len(calls) == 1 else {"anyOf": calls}
            array = {"type": "array", "items": item, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None


def tool_request(messages: list[dict[str, Any]], tools: list | None, tool_choice: str | dict | None = None,
                 parallel_tool_calls: bool | None = None, auto_available: bool = False) -> ToolRequest | None:
    """Check ``tools``, ``tool_choice`` and the messages' tool calls; None when the request has no tools.
    ``auto_available``: a tool parser is configured (``auto`` needs one)."""
    check_tool_messages(messages)
    choice = tool_choice
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise ValidationError("tools must be a list of function tools", param="tools")
        if choice not in (None, "none"):
            raise ValidationError("tool_choice needs tools", param="tool_choice")
        return None
    tools = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValidationError(f"tools define {duplicate!r} twice", param="tools")
    parallel = parallel_tool_calls is not False
    if choice is None or choice == "auto":
        if not auto_available:
            raise ValidationError('tool_choice "auto" needs the server to run with --tool-call-parser (or send '
                                  'tool_choice "required", "none" or a named function)', param="tool_choice")
        return ToolRequest(tools, "auto", parallel=parallel)
    if choice in ("none", "required"):
        return ToolRequest(tools, choice, parallel=parallel)
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValidationError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
        name = function.get("name")
        if name not in names:
            raise ValidationError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                                  param="tool_choice.function.name")
        return ToolRequest(tools, "named", named=name, parallel=parallel)
    raise ValidationError(f'tool_choice must be "none", "auto", "required" or a named function; got {choice!r}',
                          param="tool_choice")


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValidationError(f'{param} must be {{"type": "function", "function": {{...}}}}', param=f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValidationError(f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValidationError(f"{param}.function.name must be 1-64 letters, digits, '_', '.' or '-'; got {name!r}",
                              param=f"{param}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict)
                                   or parameters.get("type", "object") != "object"):
        raise ValidationError(f"{param}.function.parameters must be a JSON schema of an object",
                              param=f"{param}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValidationError(f"{param}.function.description must be a string", param=f"{param}.function.description")
    return {"type": "function", "function": function}


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Assistant tool calls are well formed; every tool message answers a call made before it."""
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # the renderer names a malformed message
        role = message.get("role")
        extra = message
        if role == "assistant" and extra.get("tool_calls"):
            calls = extra["tool_calls"]
            if not isinstance(calls, list):
                raise ValidationError(f"messages[{index}].tool_calls must be a list",
                                      param=f"messages[{index}].tool_calls")
            for number, call in enumerate(calls):
                param = f"messages[{index}].tool_calls[{number}]"
                if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                    raise ValidationError(f"{param} needs an id", param=f"{param}.id")
                call_ids.add(call["id"])
        elif role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise ValidationError(f"messages[{index}] (role tool) must answer a tool call of an earlier "
                                      f"assistant message: tool_call_id {call_id!r} is not one",
                                      param=f"messages[{index}].tool_call_id")
