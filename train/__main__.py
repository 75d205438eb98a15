"""`python -m train`: train the diffusion transformer from a cache built by `python -m precompute`.

Also `python -m train export RUN --out DIR` (diffusers-format weights), `python -m train sample RUN
--prompt-cache CACHE` (images for cached prompts) and `python -m train plan MODEL` (memory plan); see their --help.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Literal

import typer

from shards import DamagedCache
from shards.options import Dtype, config_file_parameter, extras_help, help_of, range_check, shown, typer_parameters
from shards.quiet import log_warnings
from train.config import TrainConfig
from train.families import FAMILIES
from train.plan_command import plan_command

# torchrun's own parser would take `--run` for an abbreviation of its `--run-path`
OPTION_NAMES = {"run": ("--run-dir",)}
KOHYA_FAMILIES = ", ".join(f.title for f in FAMILIES if "kohya" in f.lora_formats)  # who writes kohya's layout


def command(**options) -> None:
    from train.loop import train

    options.pop("config", None)
    summaries = []
    _run(lambda: summaries.append(train(TrainConfig(**options))))
    signum = (summaries[0] or {}).get("signal") if summaries else None
    if signum:  # stopped early, its checkpoint written: a scheduler must not read "finished"
        raise typer.Exit(128 + signum)


command.__signature__ = inspect.Signature([config_file_parameter(TrainConfig),
                                           *typer_parameters(TrainConfig, aliases=OPTION_NAMES)])
# Exit codes (README): 0 done (or already finished); 2 bad options, cache or checkpoint, refused resume; 3 the cache's
# files are missing or damaged, or a sample failed its digest (a checkpoint was written first; the message says how to
# repair); 5 another process owns the run directory; 6 training diverged (non-finite steps in a row, or non-finite
# weights: nothing saved); 128 + N stopped by signal N after writing a checkpoint (143 SIGTERM, 130 SIGINT).
EXIT_INPUT, EXIT_DAMAGED = 2, 3
# export --push-to-hub: the export was written, its upload failed (the message says how to push it again)
EXIT_UPLOAD = 4
EXIT_BUSY, EXIT_DIVERGED = 5, 6

# what each extra of pyproject.toml is for, in --help (the options' help names the extra)
EXTRAS = {"quant": "--base-quant int8, fp8, nf4", "bf16": "--optimizer adamw-bf16", "8bit": "--optimizer adamw-8bit",
          "tensorboard": "--report-to tensorboard", "wandb": "--report-to wandb", "remote": "--cache s3://..., gs://..."}

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
# rich keeps a help paragraph's line breaks: the docstring's paragraphs are joined into lines first
app.command(help=re.sub(r"(?<!\n)\n(?!\n)", " ", __doc__.strip()) + "\n\n" + shown(extras_help(EXTRAS)))(command)

tools = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)


def like_train(name: str, default=None, help: str | None = None):
    """An option that means what `python -m train --NAME` means: its help, and its default unless another is
    given (None: the run's own value, for tools that read a run)."""
    return typer.Option(default, help=shown(help or help_of(TrainConfig, name)), callback=range_check(TrainConfig, name))


@tools.command("export")
def export_command(
    run: Path = typer.Argument(..., help="Run directory (its newest complete checkpoint) or one checkpoint directory."),
    out: Path = typer.Option(..., help="Output directory, replaced whole; the transformer goes to OUT/transformer in the diffusers "
                             "layout. A LoRA run's adapters go to OUT, as the family's pipeline loads them (pipe.load_lora_weights(OUT), or "
                             "PeftModel.from_pretrained for a pipeline without a LoRA loader). "
                             "A ControlNet run's ControlNet goes to OUT/controlnet (the family's ControlNet model class: "
                             "from_pretrained(OUT, subfolder=\"controlnet\")). Every export has a model card, OUT/README.md."),
    ema: bool = typer.Option(False, help="Export the EMA weights instead of the trained ones."),
    dtype: Dtype | None = typer.Option(None, help="Cast the weights: fp32, bf16 or fp16 (default: as trained)."),
    merge_lora: bool = typer.Option(False, help="A LoRA run: fold the adapters into the base weights and write the whole "
                                    "transformer to OUT/transformer (for pipelines without a LoRA loader)."),
    lora_format: Literal["diffusers", "kohya", "lycoris"] = typer.Option(
        "diffusers", help="A LoRA run's adapter format: diffusers (what the family's pipeline writes; peft's layout for "
                          "--adapter lokr and loha), kohya (LoRA, " + KOHYA_FAMILIES + " only; ComfyUI and kohya's tools "
                          "load it, and so does load_lora_weights) or lycoris (every adapter type, one file "
                          "adapter_lycoris.safetensors in the LyCORIS layout, which ComfyUI and LyCORIS load)."),
    push_to_hub: str | None = typer.Option(None, metavar="REPO", help="After exporting, upload OUT to this Hub model "
                                              "repository (owner/name; created if missing). Needs a login (hf auth login, "
                                              "formerly huggingface-cli login) or HF_TOKEN."),
    private: bool = typer.Option(False, help="With --push-to-hub: create the repository private."),
) -> None:
    """Write a checkpoint's transformer in the diffusers format (load it with `from_pretrained(OUT, subfolder="transformer")`),
    a LoRA run's adapters in the format its family's pipeline loads, or a ControlNet run's ControlNet (OUT/controlnet),
    with a model card; optionally push OUT to the Hub."""
    from train.export import UploadError, export
    from train.export import push_to_hub as push

    if private and not push_to_hub:
        raise typer.BadParameter("--private applies to --push-to-hub REPO", param_hint="--private")

    def go():
        written = export(run, out, ema=ema, dtype=dtype, merge_lora=merge_lora, lora_format=lora_format, hub_repo=push_to_hub)
        print(f"exported {written}")
        if push_to_hub:
            try:
                repo = push(out, push_to_hub, private=private)
            except UploadError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(EXIT_UPLOAD) from None
            print(f"pushed {out} to https://huggingface.co/{repo}")
    _run(go)


RUNS_OWN = " Default: the run's own setting."


@tools.command("sample")
def sample_command(
    run: Path = typer.Argument(..., help="Run directory (its newest complete checkpoint) or one checkpoint directory."),
    prompt_cache: str | None = typer.Option(None, help="Cache whose prompts.safetensors holds the prompts' embeddings "
                                            "(default: the run's own first --cache)."),
    validation_prompt: list[str] = typer.Option([], help="Prompt to sample (repeatable; default: every prompt in the cache)."),
    validation_bucket: list[str] = like_train("validation_bucket", []),
    validation_frames: int | None = like_train("validation_frames", help=help_of(TrainConfig, "validation_frames") + RUNS_OWN),
    validation_steps: int | None = like_train("validation_steps", help=help_of(TrainConfig, "validation_steps") + RUNS_OWN),
    guidance_scale: float | None = like_train("guidance_scale", help=help_of(TrainConfig, "guidance_scale") + RUNS_OWN),
    validation_seed: int | None = like_train("validation_seed", help=help_of(TrainConfig, "validation_seed") + RUNS_OWN),
    ema: bool = typer.Option(False, help="Sample with the EMA weights."),
    precision: Dtype | None = like_train("precision", help="Autocast precision of the transformer: fp32, bf16 or fp16." + RUNS_OWN),
    decode_device: Literal["cpu", "device"] | None = like_train(
        "decode_device", help="Decode on the cpu or on the device the transformer ran on (freed first)." + RUNS_OWN),
    out: Path | None = typer.Option(None, help="Output directory (default: RUN/samples/STEP/sample, with --ema "
                                    "RUN/samples/STEP/sample-ema, e.g. runs/MODEL/samples/00001000/sample: in the folder of "
                                    "the step, where a run of clips writes its validation videos, in a folder of its own "
                                    "that no validation writes to; outside the checkpoints, which the run rotates away)."),
) -> None:
    """Images for cached prompts from any checkpoint: one PNG per prompt and bucket (from a cache of clips, an mp4 each
    and their contact sheet), their paths on stdout (what it is
    doing on stderr). Options mean what the trainer's validation options mean."""
    from train.export import sample

    def go():
        for path in sample(run, prompt_cache, out, prompts=validation_prompt, buckets=validation_bucket,
                           frames=validation_frames, steps=validation_steps,
                           guidance=guidance_scale, seed=validation_seed, ema=ema, decode_device=decode_device,
                           precision=precision, say=lambda message: typer.echo(message, err=True)):
            print(path)
    _run(go)


tools.command("plan", help=inspect.cleandoc(plan_command.__doc__) + "\n\n"
              + shown(extras_help({k: EXTRAS[k] for k in ("quant", "bf16", "8bit")})))(plan_command)


def _run(fn) -> None:
    from train.state import RunBusy
    from train.step import Diverged

    log_warnings("%(levelname)s %(name)s: %(message)s")
    if hasattr(sys.stdout, "reconfigure"):  # a log file or a pipe gets each line as it is printed, not in blocks
        sys.stdout.reconfigure(line_buffering=True)
    try:
        fn()
    except (ValueError, FileNotFoundError, RunBusy, Diverged) as e:  # the message says what to do; no traceback
        typer.echo(f"error: {e}", err=True)
        # DamagedCache is a ValueError: exit 3, the repair is in the message
        raise typer.Exit(EXIT_DAMAGED if isinstance(e, DamagedCache) else EXIT_BUSY if isinstance(e, RunBusy)
                         else EXIT_DIVERGED if isinstance(e, Diverged) else EXIT_INPUT) from None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("export", "sample", "plan"):
        tools(prog_name="python -m train", args=sys.argv[1:])
    else:
        app(prog_name="python -m train")


if __name__ == "__main__":
    main()
