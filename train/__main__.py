"""`python -m train`: train the diffusion transformer from a cache built by `python -m precompute`.

Also `python -m train export RUN --out DIR` (diffusers-format weights), `python -m train sample RUN
--prompt-cache CACHE` (images for cached prompts) and `python -m train plan MODEL` (memory plan); see their --help.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys
import typing
from pathlib import Path
from typing import List, Literal, Optional

import typer

from shards import CorruptSample
from train.config import Precision, TrainConfig
from train.presets import PRESETS

# torchrun's own parser would take `--run` for an abbreviation of its `--run-path`
OPTION_NAMES = {"run": ("--run-dir",)}


def load_config(ctx: typer.Context, param, value: Optional[Path]):
    """Options from a JSON file become defaults; flags on the command line still win."""
    if value:
        data = json.loads(Path(value).read_text())
        unknown = set(data) - {f.name for f in dataclasses.fields(TrainConfig)}
        if unknown:
            raise typer.BadParameter(f"{value}: unknown options {sorted(unknown)}")
        ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


def command(**options) -> None:
    from train.loop import train

    options.pop("config", None)
    _run(lambda: train(TrainConfig(**options)))


def _signature() -> inspect.Signature:
    hints = typing.get_type_hints(TrainConfig)
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, callback=load_config, is_eager=True, help="JSON file of options."))]
    for f in dataclasses.fields(TrainConfig):
        annotation = hints[f.name]
        if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            annotation = Optional[[a for a in typing.get_args(annotation) if a is not type(None)][0]]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                        default=typer.Option(default, *OPTION_NAMES.get(f.name, ()), help=f.metadata["help"])))
    return inspect.Signature(params)


command.__signature__ = _signature()
# Exit codes (README): 0 done (or already finished); 2 bad options, cache or checkpoint, refused resume; 3 the cache's
# files are missing or a sample failed its digest (a checkpoint was written first; the message says how to repair).
EXIT_INPUT, EXIT_DAMAGED = 2, 3

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=__doc__)(command)

tools = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)
# Fixed sets of values (typer refuses anything else, listing them)
PlanOptimizer = Literal["adamw", "adamw-bf16", "adamw-8bit", "came", "came-8bit", "adafactor"]


@tools.command("export")
def export_command(
    run: Path = typer.Argument(..., help="Run directory (its newest complete checkpoint) or one checkpoint directory."),
    out: Path = typer.Option(..., help="Output directory; the transformer goes to OUT/transformer in the diffusers layout. "
                             "A LoRA run's adapters go to OUT (pipe.load_lora_weights(OUT); PixArt: PeftModel.from_pretrained)."),
    ema: bool = typer.Option(False, help="Export the EMA weights instead of the trained ones."),
    dtype: Optional[Precision] = typer.Option(None, help="Cast the weights: fp32, bf16 or fp16 (default: as trained)."),
    merge_lora: bool = typer.Option(False, help="A LoRA run: fold the adapters into the base weights and write the whole "
                                    "transformer to OUT/transformer (for pipelines without a LoRA loader, e.g. PixArt-Sigma's)."),
) -> None:
    """Write a checkpoint's transformer in the diffusers format (load it with `from_pretrained(OUT, subfolder="transformer")`),
    or a LoRA run's adapters in the format its family's pipeline loads."""
    from train.export import export

    _run(lambda: print(f"exported {export(run, out, ema=ema, dtype=dtype, merge_lora=merge_lora)}"))


@tools.command("sample")
def sample_command(
    run: Path = typer.Argument(..., help="Run directory (its newest complete checkpoint) or one checkpoint directory."),
    prompt_cache: Path = typer.Option(..., help="Cache whose prompts.safetensors holds the prompts' embeddings."),
    prompt: List[str] = typer.Option([], help="Prompt to sample (repeatable; default: every prompt in the cache)."),
    bucket: List[str] = typer.Option([], help="Bucket HxW (repeatable; default: the cache's 3 most populous)."),
    steps: int = typer.Option(20, help="Sampler steps."),
    guidance: float = typer.Option(4.5, help="Classifier-free guidance scale."),
    seed: int = typer.Option(0, help="Seed of the initial noise (fixed per prompt and bucket)."),
    ema: bool = typer.Option(False, help="Sample with the EMA weights."),
    precision: Precision = typer.Option("bf16", help="Autocast precision of the transformer: fp32, bf16 or fp16."),
    decode_device: Literal["cpu", "device"] = typer.Option("cpu", help="Decode on the cpu or on the device the transformer ran on (freed first)."),
    out: Optional[Path] = typer.Option(None, help="Output directory (default: CHECKPOINT/samples)."),
) -> None:
    """Images for cached prompts from any checkpoint: one PNG per prompt and bucket."""
    from train.export import sample

    def go():
        for path in sample(run, prompt_cache, out, prompts=prompt, buckets=bucket, steps=steps, guidance=guidance, seed=seed,
                           ema=ema, decode_device=decode_device, precision=precision):
            print(path)
    _run(go)


@tools.command("plan")
def plan_command(
    model: str = typer.Argument(..., help=f"Preset: {', '.join(PRESETS)}."),
    batch: int = typer.Option(1, help="Samples per batch on each device."),
    resolution: Optional[int] = typer.Option(None, help="Square bucket of this many pixels a side (default 1024, 256 for tiny-*)."),
    bucket: Optional[str] = typer.Option(None, help="Bucket HxW (instead of --resolution)."),
    precision: Precision = typer.Option("bf16", help="Compute precision: fp32, bf16 or fp16."),
    weights_dtype: Literal["fp32", "bf16"] = typer.Option("fp32", help="Weights (and gradients, optimizer states) dtype: fp32 or bf16."),
    optimizer: PlanOptimizer = typer.Option("adamw", help="adamw, adamw-bf16, adamw-8bit, came, came-8bit (planning only: no maintained "
                                                "implementation to train with) or adafactor."),
    grad_ckpt: str = typer.Option("off", help="Gradient checkpointing: off, all or every-K."),
    ema: Literal["off", "device", "cpu"] = typer.Option("off", help="EMA on the device, on the cpu, or off."),
    world_size: int = typer.Option(1, help="Number of devices."),
    parallel: Literal["ddp", "fsdp"] = typer.Option("ddp", help="ddp (replicated) or fsdp (sharded over --world-size)."),
    cpu_offload: bool = typer.Option(False, help="FSDP CPU offload of parameters, gradients and optimizer states."),
    text_tokens: Optional[int] = typer.Option(None, help="Caption tokens to plan for (default: the preset's limit, 300; SD3 77 + 256)."),
    gpu_memory: str = typer.Option("80GB", help="Memory of one device, e.g. 48GB."),
    lora_rank: int = typer.Option(0, help="Plan LoRA fine-tuning with adapters of this rank on the frozen base (0: full fine-tuning); "
                                          "--weights-dtype is then the base's dtype."),
    lora_targets: List[str] = typer.Option([], help="LoRA target modules (repeatable; default: the family's attention projections)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Predict memory per device before launching: bytes by component, peak, verdict, largest batch."""
    from train.plan import PlanConfig, format_plan, parse_bytes, plan
    from train.validate import parse_bucket

    def go():
        size = tuple(parse_bucket(bucket)) if bucket else (resolution or (256 if model.startswith("tiny") else 1024),) * 2
        result = plan(PlanConfig(model, batch=batch, bucket=tuple(size), precision=precision, weights_dtype=weights_dtype,
                                 optimizer=optimizer, grad_ckpt=grad_ckpt, ema=ema, world_size=world_size, parallel=parallel,
                                 cpu_offload=cpu_offload, text_tokens=text_tokens, gpu_memory=parse_bytes(gpu_memory),
                                 lora_rank=lora_rank, lora_targets=tuple(lora_targets)))
        print(json.dumps(result, indent=1) if as_json else format_plan(result))
    _run(go)


def _run(fn) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        fn()
    except (ValueError, FileNotFoundError) as e:  # CorruptSample is a ValueError: exit 3, the repair is in the message
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_DAMAGED if isinstance(e, CorruptSample) else EXIT_INPUT)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("export", "sample", "plan"):
        tools(prog_name="python -m train", args=sys.argv[1:])
    else:
        app(prog_name="python -m train")


if __name__ == "__main__":
    main()
