"""`--config FILE` of both stages under random input: whatever the file holds (wrong types, unknown keys, nested
objects, huge numbers, NaN and Infinity, bytes that are not UTF-8, nothing at all, a directory, no file), the command
refuses it with a usage error naming the file and the key, or builds the config, which refuses a bad value naming
the option. Never a traceback. The file is loaded as the command line loads it, in this process."""

import dataclasses
import json
import math
import random
import typing

import pytest
import typer
from typer.testing import CliRunner

import precompute.run
import train.loop
from precompute.__main__ import app as precompute_app
from precompute.config import PrecomputeConfig
from shards.options import default_of, flag
from train.__main__ import app as train_app
from train.config import TrainConfig

# the command line's usage errors (typer carries its own click)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
SEED = 20261125
COMMANDS = {}
STAGES = {"train": (train_app, TrainConfig, []), "precompute": (precompute_app, PrecomputeConfig, ["data"])}
SCALARS = [0, 1, -1, 7, 2**31, 2**64, 10**30, 0.5, -0.5, 1.5, 1e308, -1e-9, math.nan, math.inf, -math.inf, True, False, None,
           "", "abc", "1", "0.5", "nan", "tiny-sana", "tiny-sd3", "fp32", "bf16", "auto", "none", "off", "every-2", "é✓",
           "\u0000"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if kind < 0.7 or depth > 2:
        return rng.choice(SCALARS)
    if kind < 0.85:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["a", "steps", "lr"]): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def typed_value(rng: random.Random, cls, name: str):
    """A value of option `name`'s JSON type (a number for a number, one of the choices for a choice...), in range or not."""
    annotation = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return [typed_value_of(rng, args[0]) for _ in range(rng.randrange(3))]
    if args and len(args) < len(typing.get_args(annotation)) and rng.random() < 0.2:
        return None
    return typed_value_of(rng, args[0] if len(args) == 1 else annotation)


def typed_value_of(rng: random.Random, annotation):
    if annotation is bool:
        return rng.random() < 0.5
    if annotation is int:
        return rng.choice([0, 1, 2, -1, 3, 100, 2**63, 2**64])
    if annotation is float:
        return rng.choice([0.0, 0.1, 0.5, 1.0, 1.5, -0.5, 1e-9, 3.0, 1e308, math.nan, math.inf])
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    return rng.choice([*choices, *choices, "", "abc", "none", "every-2", "tiny-sd3", "tiny-sana", "\u0000", "é✓"])


def option_value(rng: random.Random, cls, name: str):
    """A value for option `name`: its default, a value of its type, or anything."""
    kind = rng.random()
    if kind < 0.15:
        return "data" if name == "data" else default_of(cls, name)
    if kind < 0.6:
        return typed_value(rng, cls, name)
    if kind < 0.75:
        return rng.choice([0, 1, -1, 0.0, 1.0, 0.999, -0.001, 1.001, math.nan, math.inf, 2**64, -(2**63)])
    return random_value(rng)


def file_text(rng: random.Random, cls) -> tuple[bytes, set[str]]:
    """A random config file's bytes and the keys of its object (empty when it holds no object)."""
    names = [f.name for f in dataclasses.fields(cls)]
    kind = rng.random()
    if kind < 0.8:
        keys = {rng.choice(names) if rng.random() < 0.85 else rng.choice(["wokers", "batch-size", "--lr", "", "config", "é"])
                for _ in range(rng.randint(1, 3))}
        # in sorted order: a set's order changes with the process's hash seed, and so would the values drawn
        data = {k: option_value(rng, cls, k) if k in names else random_value(rng) for k in sorted(keys)}
        return json.dumps(data).encode(), set(keys)
    raw = rng.choice([b"", b"   \n", b"\xff\xfe{}", b'{"steps": 1', b"[1, 2]", b'"steps"', b"null", b"NaN", b"1e400",
                      b"[" * 100_000, b'{"steps": 1, "steps": 2}', b'{"seed": ' + b"9" * 5000 + b"}",
                      b'\xef\xbb\xbf{"seed": 1}', b'{"seed": 1}\x00', '{"model": "\udc80"}'.encode("utf-8", "surrogatepass")])
    return raw, set()


def load(stage: str, path) -> object:
    """What `python -m STAGE --config PATH` builds before it runs: the config, or the error it stops with."""
    app, cls, args = STAGES[stage]
    command = COMMANDS.setdefault(stage, typer.main.get_command(app))
    try:
        with command.make_context(stage, [*args, "--config", str(path)]) as ctx:
            options = {k: v for k, v in ctx.params.items() if k != "config"}
    except UsageError as e:
        return e
    try:
        return cls(**options)
    except ValueError as e:
        return e


def check(stage: str, path, keys: set[str]) -> None:
    outcome = load(stage, path)
    if isinstance(outcome, UsageError):
        message = outcome.format_message()
        assert str(path) in message, message
        if len(keys) == 1:
            assert next(iter(keys)) in message, message
    elif isinstance(outcome, ValueError):
        assert "--" in str(outcome) or "DATA" in str(outcome), outcome
    else:
        _, cls, _ = STAGES[stage]
        assert isinstance(outcome, cls)


@pytest.mark.parametrize("stage", STAGES)
def test_random_config_files_are_loaded_or_refused_naming_the_file_and_key(tmp_path, stage):
    rng = random.Random(f"{SEED}-{stage}")
    _, cls, _ = STAGES[stage]
    for i in range(150):
        raw, keys = file_text(rng, cls)
        path = tmp_path / f"options-{i}.json"
        path.write_bytes(raw)
        check(stage, path, keys)
    check(stage, tmp_path, set())  # a directory
    check(stage, tmp_path / "missing.json", set())


def toml_text(rng: random.Random, cls) -> tuple[bytes, set[str]]:
    """A random TOML file's bytes: keys of the options (or near them) with values written as JSON writes them
    (TOML for strings, numbers, booleans and arrays; not for null, NaN or objects), or damaged TOML."""
    raw, keys = file_text(rng, cls)
    if not keys:
        return rng.choice([raw, b"steps = ", b"[steps]\nsteps = 1\n", b"steps = 1\nsteps = 2\n", b"a.b = 1\n", b"steps = 1979-05-27\n",
                           b"lr = nan\n", b"lr = inf\n", b"seed = 99999999999999999999\n"]), set()
    data = json.loads(raw)
    # keys as written (a JSON escape would hide a key the message names as the file spells it)
    return "".join(f"{json.dumps(k, ensure_ascii=False)} = {json.dumps(v)}\n" for k, v in data.items()).encode(), keys


@pytest.mark.parametrize("stage", STAGES)
def test_random_toml_config_files_are_loaded_or_refused_naming_the_file_and_key(tmp_path, stage):
    rng = random.Random(f"{SEED}-{stage}-toml")
    _, cls, _ = STAGES[stage]
    for i in range(100):
        raw, keys = toml_text(rng, cls)
        path = tmp_path / f"options-{i}.toml"
        path.write_bytes(raw)
        check(stage, path, keys)


@pytest.mark.parametrize("stage", STAGES)
def test_random_option_values_in_code_are_taken_or_refused_naming_the_option(stage):
    rng = random.Random(f"{SEED}-{stage}-code")
    _, cls, args = STAGES[stage]
    hints = typing.get_type_hints(cls)
    numbers = [f.name for f in dataclasses.fields(cls) if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}
               or hints[f.name] == list[float]]
    assert len(numbers) >= 8
    for _ in range(150):
        name = rng.choice(numbers)
        value = option_value(rng, cls, name)
        try:
            config = cls(*args, **{name: value})
        except ValueError as e:
            assert str(e).startswith(flag(name)) or flag(name) not in str(e) and "--" in str(e), e
            continue
        taken = getattr(config, name)
        for v in taken if isinstance(taken, list) else [taken]:
            assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)), (name, value)


def refused(stage: str, path) -> str:
    outcome = load(stage, path)
    assert isinstance(outcome, UsageError), outcome
    return outcome.format_message()


@pytest.mark.parametrize("stage", STAGES)
def test_each_kind_of_bad_file_says_what_is_wrong(tmp_path, stage):
    path = tmp_path / "options.json"
    for raw, said in ((b"", "is empty"), (b"\xff{}", "not UTF-8"), (b'{"seed": 1', "not valid JSON"), (b"[1]", "JSON object"),
                      (b'{"workers": 1, "workers": 2}', "'workers' is given twice"), (b"[" * 100_000, "nested too deeply"),
                      (b'{"wokers": 0}', "'wokers' (did you mean 'workers'?)"), (b'{"workers": "2"}', "workers '2': must be an integer"),
                      (b'{"workers": 1.5}', "workers 1.5: must be an integer"), (b'{"workers": -1}', "workers -1: must be at least 0"),
                      (b'{"workers": null}', "workers null: give a value"), (b'{"progress": "yes"}', "progress 'yes': must be true or false"),
                      (b'{"model": 5}', "model 5: must be a string"), (b'{"workers": [1]}', "workers [1]: must be an integer")):
        path.write_bytes(raw)
        message = refused(stage, path)
        assert message.count(str(path)) == 1 and said in message, (raw[:40], message)
    assert "No such file" in refused(stage, tmp_path / "missing.json")
    assert "Is a directory" in refused(stage, tmp_path)


def test_numbers_json_cannot_hold_as_options_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "options.json"
    for raw, said in ((b'{"lr": NaN}', "lr nan: must be a finite number above 0"), (b'{"lr": Infinity}', "lr inf: must be a finite"),
                      (b'{"lr": 1e400}', "lr inf: must be a finite"), (b'{"caption_dropout": 1.5}', "caption_dropout 1.5: must be in [0, 1]"),
                      (b'{"lr": ' + b"9" * 400 + b"}", "lr 999"), (b'{"seed": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
                      (b'{"cache_weight": 2}', "cache_weight 2: must be a list"), (b'{"cache_weight": [1, "x"]}', "cache_weight 'x'"),
                      (b'{"optimizer": "sgd"}', "optimizer 'sgd': choose one of adamw,"), (b'{"lr_end": {"a": 1}}', "lr_end {'a': 1}")):
        path.write_bytes(raw)
        message = refused("train", path)
        assert str(path) in message and said in message, (raw[:40], message)


def test_a_file_of_good_options_is_what_the_flags_would_give(tmp_path):
    path = tmp_path / "options.json"
    path.write_text(json.dumps({"lr": 1, "flow_shift": 3, "lora_rank": 4, "lora_alpha": None, "cache": ["a", "b"],
                                "cache_weight": [3, 1], "precondition_outputs": None, "run": str(tmp_path / "run")}))
    config = load("train", path)
    assert isinstance(config, TrainConfig), config
    assert (config.lr, config.flow_shift, config.lora_rank, config.lora_alpha) == (1.0, 3.0, 4, None)
    assert isinstance(config.lr, float) and config.cache_weight == [3.0, 1.0] and config.run == tmp_path / "run"


def test_the_commands_exit_2_on_a_bad_config_file_without_a_traceback(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(train.loop, "train", ran.append)
    monkeypatch.setattr(precompute.run, "run", ran.append)
    path = tmp_path / "options.json"
    wide = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}
    for app, args, raw, said in ((train_app, [], b'{"lr": [0.1]}', "lr [0.1]: must be a number"),
                                 (train_app, [], b"\xff", "not UTF-8"),
                                 (precompute_app, ["data"], b'{"max_upscale": "big"}', "max_upscale 'big': must be a number")):
        path.write_bytes(raw)
        result = CliRunner().invoke(app, [*args, "--config", str(path)], env=wide)
        assert result.exit_code == 2 and said in result.output and "options.json" in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert not ran
