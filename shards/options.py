"""The vocabulary both stages' command lines share: dtype names, and options declared once as dataclass fields.

A stage's config is a dataclass whose fields carry their default and help (`opt`); a `Literal` annotation
is the list of valid values. `check_choices` refuses anything else in code, and `typer_parameters`
turns the fields into the command's options, so `--help`, the CLI and the config agree by construction.
This module lives in `shards` because it is the one package both stages import.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Literal, Optional

import torch

# One spelling of a dtype in every option of the product; the on-disk schema keeps torch's names.
Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """'bf16' -> torch.bfloat16; anything else is refused naming the option and the valid names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{what} {name!r}: choose one of {', '.join(DTYPES)}") from None


def opt(default, help: str):
    """A config field with its help text (lists and other mutable defaults are copied per instance)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def flag(name: str) -> str:
    """A field's command-line spelling: `batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def literal_choices(annotation) -> tuple:
    """The values of a `Literal[...]` annotation (also inside `Optional`), else ()."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return ()


def check_choices(config) -> None:
    """Refuse a value outside a `Literal` field's choices, naming the valid ones (as the CLI does)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        choices = literal_choices(hints[f.name])
        value = getattr(config, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if choices and v is not None and v not in choices:
                raise ValueError(f"{flag(f.name)} {v!r}: choose one of {', '.join(map(str, choices))}")


def default_of(cls, name: str):
    """The default of field `name` of dataclass `cls`."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def help_of(cls, name: str) -> str:
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["help"]


def typer_parameters(cls, names: typing.Iterable[str] | None = None, *, aliases: dict | None = None,
                     skip: typing.Container[str] = ()) -> list[inspect.Parameter]:
    """Keyword-only parameters for a typer command, one per field of dataclass `cls` (or of `names`, in that
    order), with the field's default and help; `aliases` gives a field other option names."""
    import typer

    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    params = []
    for name in names if names is not None else fields:
        if name in skip:
            continue
        annotation = hints[name]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = Optional[[a for a in typing.get_args(annotation) if a is not type(None)][0]]
        option = typer.Option(default_of(cls, name), *(aliases or {}).get(name, ()), help=fields[name].metadata["help"])
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option))
    return params


def config_file_parameter(cls) -> inspect.Parameter:
    """A `--config FILE` option for a command built from dataclass `cls`: the JSON file's values become the
    options' defaults (flags on the command line still win); keys that are not options are refused."""
    import json
    from pathlib import Path

    import typer

    names = {f.name for f in dataclasses.fields(cls)}

    def load(ctx, param, value):  # typer passes the click context
        if value:
            try:
                data = json.loads(Path(value).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise typer.BadParameter(f"{value}: {e}") from None
            if not isinstance(data, dict):
                raise typer.BadParameter(f"{value}: expected a JSON object of options")
            unknown = set(data) - names
            if unknown:
                raise typer.BadParameter(f"{value}: unknown options {sorted(unknown)}")
            ctx.default_map = {**(ctx.default_map or {}), **data}
        return value

    option = typer.Option(None, callback=load, is_eager=True, help="JSON file of options (flags given beside it win).")
    return inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=option)
