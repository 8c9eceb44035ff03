"""The ``quire`` command. Every command imports what it needs when it runs, so ``--help`` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quire.cli.engine_options import with_engine_options, with_model_tag
from quire.core.engine_args import EngineArgs

app = typer.Typer(name="quire", help="Quire: serve, chat with, run and measure LLMs.", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]}, add_completion=False)
bench_app = typer.Typer(help="Measure latency, throughput and serving performance (vLLM's flags and output).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

UrlOption = Annotated[str, typer.Option(help="The server's OpenAI base URL.")]
ModelOption = Annotated[str | None, typer.Option("--model", help="Model name (default: the first served).")]
KeyOption = Annotated[str | None, typer.Option(envvar="QUIRE_API_KEY", help="API key for the server.")]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def serve(ctx: typer.Context):
    """Start the OpenAI-compatible server: quire serve [MODEL] [OPTIONS] (see quire serve --help)."""
    from quire.openai_server.cli import main as server_main

    server_main(list(ctx.args), prog="quire serve")


@app.command()
def chat(
    url: UrlOption = "http://localhost:8000/v1",
    model: ModelOption = None,
    api_key: KeyOption = None,
    system_prompt: Annotated[str | None, typer.Option(help="A system message to start with.")] = None,
    quick: Annotated[str | None, typer.Option(help="Send one message, print the reply and exit.")] = None,
    stats: Annotated[bool, typer.Option(help="Print time to first token and tokens per second.")] = False,
    max_tokens: Annotated[int | None, typer.Option(min=1)] = None,
    temperature: Annotated[float | None, typer.Option(min=0.0)] = None,
    image: Annotated[Path | None, typer.Option(help="An image file sent with the first message (for "
                                                    "vision-language models).")] = None,
):
    """Chat with a running server (a REPL keeping the conversation; Ctrl-D or 'exit' to leave)."""
    from quire.cli.client import run_chat

    raise typer.Exit(run_chat(url, model, api_key, system_prompt, quick, stats, max_tokens, temperature, image))


@app.command()
def complete(
    url: UrlOption = "http://localhost:8000/v1",
    model: ModelOption = None,
    api_key: KeyOption = None,
    quick: Annotated[str | None, typer.Option(help="Complete one prompt, print it and exit.")] = None,
    stats: Annotated[bool, typer.Option(help="Print time to first token and tokens per second.")] = False,
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    temperature: Annotated[float | None, typer.Option(min=0.0)] = None,
):
    """Complete prompts with a running server (a REPL, or --quick for one prompt)."""
    from quire.cli.client import run_complete

    raise typer.Exit(run_complete(url, model, api_key, quick, stats, max_tokens, temperature))


ModelTag = Annotated[str | None, typer.Argument(metavar="MODEL", show_default=False,
                                                   help="Checkpoint folder or GGUF file (same as --model; default: "
                                                        "SmolLM2-135M-Instruct if installed, else quire-demo).")]


@app.command()
@with_engine_options
def generate(
    engine_args: EngineArgs,
    model_tag: ModelTag = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    input: Annotated[Path | None, typer.Option("--input", "-i", exists=True, dir_okay=False,
                                                  help="Prompts: one per line, or JSONL with 'prompt' or "
                                                       "'messages'.")] = None,
    output_format: Annotated[str, typer.Option(help="text or jsonl.")] = "text",
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=-1)] = 0,
    n: Annotated[int, typer.Option(min=1)] = 1,
):
    """Generate offline (quire.offline.LLM) for prompts given inline or in a file (random sampling is
    seeded by --seed)."""
    from quire.cli.generate import run_generate

    raise typer.Exit(run_generate(with_model_tag(engine_args, model_tag), prompt, input, output_format, max_tokens,
                                  temperature, top_p, top_k, n))


@app.command("run-batch")
@with_engine_options
def run_batch(
    engine_args: EngineArgs,
    input_file: Annotated[Path, typer.Option("--input-file", "-i", exists=True, dir_okay=False,
                                             help="OpenAI batch input (JSONL).")],
    output_file: Annotated[Path, typer.Option("--output-file", "-o", help="Where to write the results.")],
    model_tag: ModelTag = None,
    max_inflight: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 256,
):
    """Run an OpenAI batch file offline (completions and chat completions), results in input order."""
    from quire.cli.run_batch import run_batch_file

    raise typer.Exit(run_batch_file(input_file, output_file, with_model_tag(engine_args, model_tag), max_inflight))


@app.command()
def version():
    """Print the versions of Quire's packages."""
    from quire.cli.info import print_versions

    print_versions()


@app.command()
def env():
    """Print versions, CPU features and GPUs, for bug reports."""
    from quire.cli.info import print_environment

    print_environment()


from quire.cli import bench as _bench  # noqa: E402  (registers the bench commands; imports nothing heavy)

_bench.register(bench_app)
