"""Every engine option is declared once (``EngineArgs``) and every front door takes it with the same
default: ``LLM(...)``, ``python -m quire.openai_server`` / ``quire serve``, and the offline ``quire``
commands."""

import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from quire.cli.main import app
from quire.core.engine_args import EngineArgs
from quire.offline.llm import LLM, engine_args
from quire.openai_server.cli import build_parser, settings_from_args

FIELDS = dataclasses.fields(EngineArgs)
QUIRE = str(Path(sys.executable).parent / "quire")


def flag(field) -> str:
    return "--" + field.name.replace("_", "-")


def other_value(field):
    """A valid value that differs from the default, to see the option arrive."""
    samples = {"dtype": "bfloat16", "scheduling_policy": "priority", "attention_backend": "triton", "device": "cpu",
               "model": "/models/x", "tokenizer": "/tokenizers/x", "gpu_memory_utilization": 0.5,
               "limit_mm_per_prompt": {"image": 7}, "allowed_media_domains": ["images.example", "cdn.example"],
               "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
               "data_parallel_address": "10.0.0.7", "pooler_config": {"pooling_type": "mean"}}
    if field.name in samples:
        return samples[field.name]
    if field.metadata["choices"]:
        return next(choice for choice in field.metadata["choices"] if choice != field.default)
    kind = EngineArgs.field_types()[field.name]
    return (not field.default) if kind is bool else kind(7)


def command_line_text(value) -> str:
    """A value as typed after its flag: JSON for a dict, comma-separated for a list."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def test_llm_takes_every_option_with_the_same_default():
    parameters = inspect.signature(LLM).parameters
    for field in FIELDS:
        assert parameters[field.name].default == field.default, field.name
        value = other_value(field)
        built = engine_args(value, {}) if field.name == "model" else engine_args(None, {field.name: value})
        assert getattr(built, field.name) == value, field.name
    with pytest.raises(TypeError, match="max_num_seqz"):
        engine_args(None, {"max_num_seqz": 4})


def test_the_server_parser_takes_every_option_with_the_same_default():
    parser = build_parser()
    defaults, _ = settings_from_args(parser.parse_args([]))
    assert defaults == EngineArgs()
    for field in FIELDS:
        value = other_value(field)
        argv = [flag(field) if value is True else f"--no-{flag(field)[2:]}"] if isinstance(value, bool) else [
            flag(field), command_line_text(value)]
        parsed, _ = settings_from_args(parser.parse_args(argv))
        assert getattr(parsed, field.name) == value, field.name


@pytest.mark.parametrize("command", [[sys.executable, "-m", "quire.openai_server", "--help"],
                                     [QUIRE, "serve", "--help"]])
def test_server_help_lists_every_option_and_default(command):
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    help_text = re.sub(r"\s+", " ", result.stdout)
    for field in FIELDS:
        assert flag(field) in help_text, field.name
        if field.default is not None:  # (a None default is explained in the option's help)
            anchor = f"--no-{flag(field)[2:]}" if isinstance(field.default, bool) else flag(field)
            entry = re.escape(anchor) + r"(?:(?! --).)*?\(default: " + re.escape(str(field.default)) + r"\)"
            assert re.search(entry, help_text), field.name


@pytest.mark.parametrize("path", [["generate"], ["run-batch"], ["bench", "latency"], ["bench", "throughput"]])
def test_offline_commands_take_every_option_with_the_same_default(path):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    options = {param.name: param for param in command.params}
    for field in FIELDS:
        assert options[field.name].default == field.default, (path, field.name)
        assert flag(field) in options[field.name].opts, (path, field.name)


def test_offline_commands_read_list_and_dict_options_as_one_value():
    from typer.testing import CliRunner

    from quire.cli.engine_options import with_engine_options

    received = []
    cli = typer.Typer()

    @cli.command()
    @with_engine_options
    def run(engine_args: EngineArgs):
        received.append(engine_args)

    @cli.command()
    def other():
        pass

    result = CliRunner().invoke(cli, ["run", "--allowed-media-domains", "a.example,b.example",
                                      "--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes", "1MiB"])
    assert result.exit_code == 0, result.output
    assert received[0].allowed_media_domains == ["a.example", "b.example"]
    assert received[0].limit_mm_per_prompt == {"image": 2} and received[0].max_image_bytes == 2**20
