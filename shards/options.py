"""The vocabulary both stages' command lines share: dtype names, and options declared once as dataclass fields.

A stage's config is a dataclass whose fields carry their default, help and, for a number, its valid range (`opt`);
a `Literal` annotation is the list of valid values. `check_options` refuses anything else in code, `typer_parameters`
turns the fields into the command's options (their help shows the range) and `config_file_parameter` reads the same
options from a TOML or JSON file, so `--help`, the CLI, the file and the config agree by construction.
This module lives in `shards` because it is the one package both stages import.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import numbers
import re
import types
import typing
from pathlib import Path
from typing import Literal, Optional

import torch

# One spelling of a dtype in every option of the product; the on-disk schema keeps torch's names.
Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}
# What torch.manual_seed takes (an unsigned 64-bit integer)
SEED_MAX = 2**64 - 1


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """'bf16' -> torch.bfloat16; anything else is refused naming the option and the valid names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{what} {name!r}: choose one of {', '.join(DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric option: finite, and within `low`..`high` where given (an end is included
    unless it is open)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # NaN compares false with every bound, and no option means anything by infinity
        return ((self.low is None or (value > self.low if self.low_open else value >= self.low))
                and (self.high is None or (value < self.high if self.high_open else value <= self.high)))

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if low and high:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low:
            return f"{'above' if self.low_open else 'at least'} {low}"
        if high:
            return f"{'below' if self.high_open else 'at most'} {high}"
        return "a finite number"


def _number(x: float | None) -> str:
    """`1.0` -> "1", `1e-07` -> "1e-07", None -> "" (no bound)."""
    if x is None:
        return ""
    return str(int(x)) if isinstance(x, int) or float(x).is_integer() else f"{x:g}"


def opt(default, help: str, *, at_least=None, above=None, at_most=None, below=None):
    """A config field with its help text and, for a number, its valid range: `at_least` / `above` are the closed /
    open lower end, `at_most` / `below` the upper one (a number is always finite). Lists and other mutable
    defaults are copied per instance."""
    assert at_least is None or above is None, "one lower end"
    assert at_most is None or below is None, "one upper end"
    metadata = {"help": help}
    if (at_least, above, at_most, below) != (None, None, None, None):
        metadata["range"] = Range(above if at_least is None else at_least, below if at_most is None else at_most,
                                  low_open=above is not None, high_open=below is not None)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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


def _parts(annotation) -> tuple[object, bool, bool]:
    """(the type of one value, whether None is allowed, whether the field is a list of them)."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = len(args) < len(typing.get_args(annotation)), args[0]
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], optional, True
    return annotation, optional, False


def _shown(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "a huge integer"
    return text if len(text) <= 40 else text[:37] + "..."


def number_problem(annotation, field: dataclasses.Field, value) -> str | None:
    """Why `value` cannot be the value of numeric `field` (a wrong kind of value, or outside its range), or None."""
    kind, optional, many = _parts(annotation)
    if kind not in (int, float) or (value is None and optional):
        return None
    if many and not isinstance(value, (list, tuple)):
        return f"{_shown(value)}: must be a list of numbers"
    valid = field.metadata.get("range", Range())
    for v in value if many else [value]:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral if kind is int else numbers.Real):
            return f"{_shown(v)}: must be {'an integer' if kind is int else 'a number'}"
        if isinstance(v, float) and not math.isfinite(v):
            return f"{_shown(v)}: must be a finite number" + (f" {valid}" if valid != Range() else "")
        if v not in valid:
            return f"{_shown(v)}: must be {valid}"
    return None


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


def check_options(config) -> None:
    """Refuse a value outside its field's choices or range, naming the option as the command line spells it:
    `--caption-dropout 1.5: must be in [0, 1]`. Every config's `__post_init__` starts with it."""
    check_choices(config)
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if problem := number_problem(hints[f.name], f, getattr(config, f.name)):
            raise ValueError(f"{flag(f.name)} {problem}")


def default_of(cls, name: str):
    """The default of field `name` of dataclass `cls`."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def help_of(cls, name: str) -> str:
    """Field `name`'s help, with its valid range when it has one (what `--help` shows)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    valid = f.metadata.get("range")
    return f.metadata["help"] + (f" Must be {valid}." if valid else "")


def install_extra(name: str) -> str:
    """The command that installs the optional dependencies `name` (pyproject's extras) into the checkout's
    environment, as `make install` installed the project."""
    return f"pip install -e '.[{name}]'"


def extras_help(extras: dict[str, str]) -> str:
    """A --help paragraph: each extra's install command on a line of its own, whole at any terminal width, with what
    needs it (`extras`: name -> what)."""
    width = max(len(install_extra(name)) for name in extras)
    return "Extras (optional dependencies; from the checkout):\n" + "\n".join(
        f"  {install_extra(name):<{width}}  {what}" for name, what in extras.items())


def shown(text: str) -> str:
    """`text` as help to print through typer: with rich formatting (typer's default), square brackets that rich
    would take for markup (the `[quant]` of an install command) are escaped."""
    import typer.core

    if not typer.core.HAS_RICH:
        return text
    from rich.markup import escape

    return escape(text)


def range_check(cls, name: str):
    """A click callback refusing what field `name` of `cls` refuses, for a command that takes the option without
    building `cls` (`python -m train plan --ema-decay`); None passes (the command's own default)."""
    import typer

    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    annotation = typing.get_type_hints(cls)[name]

    def check(value):
        if value is not None and (problem := number_problem(annotation, f, value)):
            raise typer.BadParameter(problem)
        return value
    return check


def typer_parameters(cls, names: typing.Iterable[str] | None = None, *, aliases: dict | None = None,
                     skip: typing.Container[str] = ()) -> list[inspect.Parameter]:
    """Keyword-only parameters for a typer command, one per field of dataclass `cls` (or of `names`, in that
    order), with the field's default and help; `aliases` gives a field other option names."""
    import typer

    hints = typing.get_type_hints(cls)
    names = list(names) if names is not None else [f.name for f in dataclasses.fields(cls)]
    params = []
    for name in names:
        if name in skip:
            continue
        annotation = hints[name]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = Optional[[a for a in typing.get_args(annotation) if a is not type(None)][0]]
        option = typer.Option(default_of(cls, name), *(aliases or {}).get(name, ()), help=shown(help_of(cls, name)))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option))
    return params


def _file_value(annotation, field: dataclasses.Field, value):
    """`value` read from a config file as field `field` takes it (a float for a float field), or ValueError saying
    why not."""
    kind, optional, many = _parts(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError("null: give a value (leave the key out for the default)")
    if many:
        if not isinstance(value, list):
            raise ValueError(f"{_shown(value)}: must be a list (the option is repeatable), e.g. [{_example(value)}]")
        return [_file_value(kind, field, v) for v in value]
    choices = literal_choices(kind)
    if choices:
        if value not in choices or not isinstance(value, str):
            raise ValueError(f"{_shown(value)}: choose one of {', '.join(choices)}")
        return value
    wanted = {bool: (bool, "true or false"), int: (int, "an integer"), float: ((int, float), "a number"),
              str: (str, "a string"), Path: (str, "a path (a string)")}.get(kind)
    if wanted is None:
        raise AssertionError(f"no file reading for {kind}")
    if not isinstance(value, wanted[0]) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{_shown(value)}: must be {wanted[1]}")
    if kind is Path and "\0" in value:
        raise ValueError(f"{_shown(value)}: a path holds no NUL character")
    if kind is float:
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"{_shown(value)}: too large for a number") from None
    if problem := number_problem(kind, field, value):
        raise ValueError(problem)
    return value


def _example(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # a TOML date, say
        return _shown(value)


def _parse_json(text: str, where: str) -> object:
    def no_repeats(pairs):
        keys = [k for k, _ in pairs]
        if repeated := sorted({k for k in keys if keys.count(k) > 1}):
            raise ValueError(f"{where}: {repeated[0]!r} is given twice")
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); a TOML file's name ends in .toml") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be a file of options") from None
    except ValueError as e:  # a repeated key, or an integer of more digits than Python reads
        raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object of options, e.g. {{\"steps\": 100}}; it holds {type(data).__name__}")
    return data


def _parse_toml(text: str, where: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # a repeated key too
        at = re.search(r"at line (\d+)", str(e))
        lines = text.splitlines()
        line = lines[int(at.group(1)) - 1] if at and 0 < int(at.group(1)) <= len(lines) else ""
        raise ValueError(f"{where}: not valid TOML ({e})" + (f": {_shown(line)}" if line.strip() else "")) from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be a file of options") from None
    except ValueError as e:  # an integer of more digits than Python reads
        raise ValueError(f"{where}: {e}") from None


def read_config_file(cls, path) -> dict:
    """The options file `path` gives dataclass `cls`'s fields: TOML if its name ends in .toml, else JSON; a table
    (object) whose keys are the field names (the flags' names with underscores), each value of the field's type and
    within its range. Anything else raises ValueError naming the file and key; an unknown key names the closest one."""
    where = f"--config {path}"
    toml = str(path).lower().endswith(".toml")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        example = "steps = 100" if toml else '{"steps": 100}'
        raise ValueError(f"{where} is empty: write the options as {'TOML' if toml else 'a JSON object'}, e.g. {example}")
    data = _parse_toml(text, where) if toml else _parse_json(text, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - set(fields)):
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k.replace("-", "_").lstrip("_"),
                                                                                               fields, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"{where}: unknown options {', '.join(hints)}; keys are option names with underscores")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        try:
            values[key] = _file_value(hints[key], fields[key], value)
        except ValueError as e:
            raise ValueError(f"{where}: {key} {e}") from None
    return values


def config_file_parameter(cls) -> inspect.Parameter:
    """A `--config FILE` option for a command built from dataclass `cls`: the file's values become the
    options' defaults (flags on the command line still win); see `read_config_file` for what is refused."""
    import typer

    def load(ctx, param, value):  # typer passes the click context
        if value:
            try:
                data = read_config_file(cls, value)
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
            ctx.default_map = {**(ctx.default_map or {}), **data}
        return value

    option = typer.Option(None, callback=load, is_eager=True, help="File of options, TOML (its name ends in .toml) or JSON: "
                          "keys are the flags' names with underscores, e.g. lora_rank = 16 (flags given beside it win).")
    return inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=option)
