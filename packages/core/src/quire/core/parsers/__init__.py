"""Output parsers of the front end: tool calls and reasoning, text in and text out (no torch).

Tool calls: ``tool_calls`` (result types, the ``ToolParser`` contract, the ``TOOL_PARSERS`` registry and
``SafeToolParser``), one module per format (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``), and the
pieces they share (``json_scan``, ``streaming``). Reasoning: ``reasoning`` (``REASONING_PARSERS``).
"""
