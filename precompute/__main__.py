"""`python -m precompute DATA --model PRESET --cache DIR`: encode a dataset into the shard cache.

`python -m precompute prompts CACHE --prompt TEXT` adds prompts to a built cache without its dataset."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import typer

from precompute.config import PrecomputeConfig
from precompute.prompts import PromptsConfig, add_prompts
from precompute.sources import KEY_HELP
from shards.options import config_file_parameter, extras_help, help_of, shown, typer_parameters
from shards.quiet import log_warnings

# Exit codes (README): 0 done; 1 more inputs skipped than --max-failure-fraction (the rest is cached); 2 bad
# arguments, input or cache (a damaged cache file included; nothing written that could be lost), any other error,
# or --repair left shards unrepaired; 3 another run is writing the cache; 4 the run would remove more than
# --max-removal-fraction, or DATA lists nothing (nothing removed, everything encoded kept); 130 / 143 stopped by
# Ctrl-C / SIGTERM (the shell's 128 + signal; what was committed is kept).
EXIT_FAILURES, EXIT_INPUT, EXIT_BUSY, EXIT_REMOVAL = 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM
SHORT_NAMES = {"model": ("--model", "-m"), "cache": ("--cache", "-c")}
EXIT_HELP = ("Exit codes: 0 done; 1 more inputs skipped than --max-failure-fraction; 2 bad arguments, input or cache (or "
             "--repair left shards unrepaired); 3 another run is writing the cache; 4 removal refused (see "
             "--max-removal-fraction) or DATA lists nothing; 130 / 143 stopped by Ctrl-C / SIGTERM.")
HELP = (__doc__.split("\n\n")[0] + "\n\nRe-running encodes only new or changed images (an image whose size and mtime are unchanged is not "
        "read); a killed run resumes where it stopped. " + EXIT_HELP +
        "\n\n`python -m precompute prompts CACHE --prompt TEXT` adds validation prompts to a built cache without DATA (see "
        "its --help); a DATA folder named `prompts` is given as ./prompts."
        "\n\nDATA may be a dataset file (.toml) of \\[\\[source]] tables, one per source; a run touches only the sources it "
        "lists. Keys: " + shown("; ".join(f"{k}: {v}" for k, v in KEY_HELP.items())) + "."
        "\n\n" + shown(extras_help({"remote": "DATA or --cache in s3://, gs://", "hf": "DATA as a Hugging Face dataset on disk"})))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is so that it stops as on Ctrl-C: the writer closes, the lock is let go."""


def _terminate(signum, frame) -> None:
    raise Terminated()


@contextmanager
def exit_codes(cache: Path | None = None):
    """Every stop of a command as one `error: ...` line and its exit code (README), never a traceback."""
    from precompute.removal import RemovalRefused
    from shards import CacheBusy

    rank = f" (rank {os.environ.get('RANK')})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        yield
    except KeyboardInterrupt as e:
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        typer.echo(f"error{rank}: {how}; what was committed is kept, and running it again resumes", err=True)
        raise typer.Exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED) from None
    except Exception as e:
        if isinstance(e, OSError) and e.filename is not None:
            # disk full, permission denied: the path (both of a rename) and what happened
            message = f"{e.filename}{f' -> {e.filename2}' if e.filename2 else ''}: {e.strerror}"
        elif isinstance(e, OSError) and e.strerror and cache is not None:
            message = f"{e.strerror} (working on the cache at {cache})"
        elif isinstance(e, (ValueError, OSError, CacheBusy)):  # our own messages, which say what to do
            message = str(e)
        else:
            message = f"{type(e).__name__}: {e}"
        typer.echo(f"error{rank}: {message}", err=True)
        code = EXIT_BUSY if isinstance(e, CacheBusy) else EXIT_REMOVAL if isinstance(e, RemovalRefused) else EXIT_INPUT
        raise typer.Exit(code) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def command(data: str, **options) -> None:
    from precompute.run import run

    log_warnings()
    options.pop("config", None)
    with exit_codes(options.get("cache")):
        config = PrecomputeConfig(data, **options)
        summary = run(config)
    if summary.get("unrepairable"):
        typer.echo(f"error: --repair left {len(summary['unrepairable'])} shard(s) unrepaired (listed above, with the inputs "
                   f"they miss); nothing was deleted", err=True)
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
    log_warnings()
    with exit_codes(cache):
        result = add_prompts(PromptsConfig(cache, **options))
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
                "encoded again. Exit codes: 0 done; 2 bad arguments, no cache, a damaged cache, or a text encoder other than "
                "the cache's; 3 another run is writing the cache; 130 / 143 stopped by Ctrl-C / SIGTERM (nothing added).")

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
