"""`python -m precompute DATA --model PRESET --cache DIR`: encode a dataset into the shard cache.

`python -m precompute prompts CACHE --prompt TEXT` adds prompts to a built cache without its dataset."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path

import typer

from precompute.config import PrecomputeConfig
from precompute.prompts import PromptsConfig, add_prompts
from precompute.sources import KEY_HELP
from shards.options import config_file_parameter, help_of, typer_parameters

# Exit codes (README): 0 done; 1 more inputs skipped than --max-failure-fraction (the rest is cached); 2 bad
# arguments, input or cache (nothing written that could be lost); 3 another run is writing the cache; 4 the run
# would remove more than --max-removal-fraction (nothing removed, everything encoded kept).
EXIT_FAILURES, EXIT_INPUT, EXIT_BUSY, EXIT_REMOVAL = 1, 2, 3, 4
SHORT_NAMES = {"model": ("--model", "-m"), "cache": ("--cache", "-c")}
HELP = (__doc__.split("\n\n")[0] + "\n\nRe-running encodes only new or changed images (an image whose size and mtime are unchanged is not "
        "read); a killed run resumes where it stopped. Exit codes: 0 done; 1 more inputs skipped than --max-failure-fraction; "
        "2 bad arguments, input or cache; 3 another run is writing the cache; 4 removal refused (see --max-removal-fraction)."
        "\n\n`python -m precompute prompts CACHE --prompt TEXT` adds validation prompts to a built cache without DATA (see "
        "its --help); a DATA folder named `prompts` is given as ./prompts."
        "\n\nDATA may be a dataset file (.toml) of \\[\\[source]] tables, one per source; a run touches only the sources it "
        "lists. Keys: " + "; ".join(f"{k}: {v}" for k, v in KEY_HELP.items()) + ".")


def command(data: str, **options) -> None:
    from precompute.removal import RemovalRefused
    from precompute.run import run
    from shards import CacheBusy

    logging.basicConfig(level=logging.WARNING)
    options.pop("config", None)
    try:
        config = PrecomputeConfig(data, **options)
        summary = run(config)
    except (CacheBusy, RemovalRefused, ValueError, FileNotFoundError, OSError) as e:
        rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        typer.echo(f"error{rank}: {e}", err=True)
        raise typer.Exit(EXIT_BUSY if isinstance(e, CacheBusy) else EXIT_REMOVAL if isinstance(e, RemovalRefused) else EXIT_INPUT)
    if summary.get("unrepairable"):
        raise typer.Exit(EXIT_INPUT)
    if summary.get("failure_fraction", 0.0) > config.max_failure_fraction:  # ranks other than 0 have no summary
        typer.echo(f"error: {summary['failure_fraction']:.1%} of inputs were skipped, over --max-failure-fraction "
                   f"{config.max_failure_fraction:.1%}; see {config.cache / 'failures.jsonl'}", err=True)
        raise typer.Exit(EXIT_FAILURES)


DATA = inspect.Parameter("data", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                         default=typer.Argument(..., help=help_of(PrecomputeConfig, "data")))
command.__signature__ = inspect.Signature([DATA, config_file_parameter(PrecomputeConfig),
                                           *typer_parameters(PrecomputeConfig, skip=("data",), aliases=SHORT_NAMES)])

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=HELP)(command)


def prompts_command(cache: Path, **options) -> None:
    from shards import CacheBusy

    logging.basicConfig(level=logging.WARNING)
    try:
        result = add_prompts(PromptsConfig(cache, **options))
    except (CacheBusy, ValueError, FileNotFoundError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_BUSY if isinstance(e, CacheBusy) else EXIT_INPUT)
    typer.echo(f"{cache}: {len(result['added'])} prompt(s) added, {len(result['cached'])} already cached")
    for what in ("added", "cached"):
        for text in result[what]:
            typer.echo(f"  {'added' if what == 'added' else 'already cached'}: {text}")


CACHE = inspect.Parameter("cache", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path,
                          default=typer.Argument(..., help=help_of(PromptsConfig, "cache")))
prompts_command.__signature__ = inspect.Signature([CACHE, *typer_parameters(PromptsConfig, skip=("cache",))])
PROMPTS_HELP = ("Encode prompts into a built cache's prompt store, for validation images and `python -m train sample`, without "
                "the cache's dataset. Only the text encoder(s) are loaded, as the cache records them (preset, text encoder, token "
                "limit, dropped T5, dtype, weights); one that differs from the cache's fingerprint is refused, naming the field. "
                "Prompts are encoded as stage one's --validation-prompt encodes them; those already cached are kept and not "
                "encoded again. Exit codes: 0 done; 2 bad arguments, no cache, or a text encoder other than the cache's; 3 "
                "another run is writing the cache.")

prompts_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
prompts_app.command(help=PROMPTS_HELP)(prompts_command)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "prompts":
        prompts_app(prog_name="python -m precompute prompts", args=sys.argv[2:])
    else:
        app(prog_name="python -m precompute")


if __name__ == "__main__":
    main()
    sys.exit(0)
