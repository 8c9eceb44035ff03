"""The engine's options on the offline ``quire`` commands (``generate``, ``run-batch``, ``bench latency``
and ``bench throughput``), generated from ``quire.core.EngineArgs``: each option is declared once and
spelled as on ``quire serve``.

``@with_engine_options`` gives a command function one typer option per ``EngineArgs`` field (under
"Engine options" in its help) through a generated signature; the function itself takes one
``engine_args: EngineArgs`` parameter instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer

from quire.core.engine_args import EngineArgs

PANEL = "Engine options (as on quire serve)"


def engine_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per ``EngineArgs`` field, annotated for typer (type, help, choices, parser)."""
    types = EngineArgs.field_types()
    parameters = []
    for field in dataclasses.fields(EngineArgs):
        meta = field.metadata
        kind = Literal[meta["choices"]] if meta["choices"] else types[field.name]
        if meta["parse"] is not None and typing.get_origin(kind) in (list, dict):
            kind = str  # one option value that ``parse`` turns into the list or dict (not a repeated option)
        if field.default is None:
            kind = kind | None
        info = typer.Option(help=meta["help"], rich_help_panel=PANEL, metavar=meta["metavar"],
                            parser=meta["parse"], show_default=field.default is not None)
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                            annotation=Annotated[kind, info]))
    return parameters


def with_engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command``'s own parameters (all but ``engine_args``) plus every engine option, for typer."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "engine_args"]
    names = [field.name for field in dataclasses.fields(EngineArgs)]

    @functools.wraps(command)
    def wrapper(**kwargs):
        options = {name: kwargs.pop(name) for name in names}
        return command(engine_args=EngineArgs(**options), **kwargs)

    signature = inspect.Signature([*own, *engine_parameters()])
    wrapper.__signature__ = signature
    wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    del wrapper.__wrapped__  # NOTE: typer must read the generated signature, not the command's own
    return wrapper


def with_model_tag(engine_args: EngineArgs, model_tag: str | None) -> EngineArgs:
    """A positional ``MODEL`` fills ``--model`` when that is unset (as on ``quire serve``)."""
    if engine_args.model is None and model_tag is not None:
        return dataclasses.replace(engine_args, model=model_tag)
    return engine_args
