"""`python -m train plan MODEL`: the memory plan of a training setup, its options those of `PlanConfig` (the trainer's
own fields: the same names, defaults, help and checks) and a few of the command's (the bucket, the devices' memory)."""

from __future__ import annotations

import inspect
import json
from typing import Optional

import typer

from shards.options import typer_parameters
from train.families import PRESETS
from train.plan_config import GPU_MEMORY_HELP, PlanConfig, card_memory

# the options of `PlanConfig` the command takes, in --help's order (the rest do not change the plan)
OPTIONS = ("batch_size", "precision", "weights_dtype", "optimizer", "grad_checkpointing", "ema_decay", "ema_device",
           "world_size", "parallel", "fsdp_cpu_offload", "text_tokens", "lora_rank", "lora_targets", "adapter", "lokr_factor",
           "lokr_decompose_both", "controlnet", "controlnet_layers", "base_quant", "blocks_to_swap", "preservation",
           "i2v_probability", "expert", "references", "reference_size", "workers", "prefetch", "readahead", "device", "ranks_per_node", "host_memory")
EXIT_INPUT = 2  # as `python -m train`: bad options


def plan_command(model: str, *, resolution: int | None = None, bucket: str | None = None, frames: int | None = None,
                 cache: str | None = None, gpu_memory: str = "80GB", as_json: bool = False, **options) -> None:
    """Predict memory per device before launching: bytes by component, peak, verdict, largest batch. Options named
    like the trainer's mean the same and default the same."""
    from shards import FormatError, open_cache
    from train.families import get_preset
    from train.host_memory import refusal, return_freed_memory
    from train.plan import cached_batch, cached_references, format_plan, plan

    return_freed_memory()  # as the trainer's dry run: its baseline is measured the same way
    try:
        opened = open_cache(cache) if cache else None
        size = traced_bucket(model, resolution, bucket, frames, opened)
        buckets = list(opened.manifest.buckets()) if opened is not None else None
        if opened is not None and get_preset(model).references and options.get("references") is None \
                and options.get("reference_size") is None:  # an edit cache's own references, unless given
            options.update(cached_references(opened, size))
        # what it is doing goes to stderr: the plan (or its JSON) alone on stdout
        pc = PlanConfig(model, bucket=tuple(size) if size.frames else size[:2], gpu_memory=card_memory(gpu_memory), **options)
        # the loader's batches from the cache's own samples at the traced bucket (its largest unless told)
        batch = cached_batch(opened, pc, size if size in opened.manifest.buckets() else None) if opened is not None else None
        result = plan(pc, say=lambda message: typer.echo(message, err=True), buckets=buckets, batch=batch)
    except (ValueError, FormatError, FileNotFoundError) as e:  # the message says what to do; no traceback
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_INPUT) from None
    print(json.dumps(result, indent=1) if as_json else format_plan(result))
    host = result.get("host")
    if host is not None and not host["fits"]:  # the plan is printed, then refused: the same words as the trainer's
        typer.echo(f"error: {refusal(host)}", err=True)
        raise typer.Exit(EXIT_INPUT)


def traced_bucket(model: str, resolution: int | None, bucket: str | None, frames: int | None, cache=None):
    """The bucket a plan traces (`shards.Bucket`): --bucket (HxW, or a clip's FxHxW); else a square of --resolution
    pixels (default: the largest resolution of --cache, else the preset's base resolution), a clip of --frames frames
    when given; else, for a cache of clips (a `shards.Cache`), its largest clip bucket (the most pixels times frames)."""
    from shards import Bucket
    from train.families import get_preset

    if bucket is not None:
        if resolution is not None:
            raise ValueError("--bucket and --resolution both name the bucket: give one")
        parsed = Bucket.parse(bucket)
        if frames is not None and parsed.frames != frames:
            raise ValueError(f"--bucket {bucket} and --frames {frames} disagree: give the frames in --bucket (FxHxW) alone")
        return parsed
    if cache is not None:
        clips = [b for b in cache.manifest.buckets() if b.frames]
        if clips and resolution is None and frames is None:  # the clips the run will train on, not a square
            return max(clips, key=lambda b: (b.pixels * b.frames, b))
        resolutions = cache.spec.resolutions()
        resolution = resolution or (max(resolutions) if resolutions else None)
    side = resolution or get_preset(model).base_resolution
    return Bucket(side, side, frames or 0)


def _parameters() -> list[inspect.Parameter]:
    keyword = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Argument(..., help=f"Preset: {', '.join(PRESETS)}.")),
        *typer_parameters(PlanConfig, OPTIONS[:1]),
        inspect.Parameter("resolution", keyword, annotation=Optional[int], default=typer.Option(
            None, min=8, help="Square bucket of this many pixels a side (default: the largest resolution of --cache, else "
                              "the preset's base resolution).")),
        inspect.Parameter("bucket", keyword, annotation=Optional[str], default=typer.Option(
            None, help="Bucket HxW, or a clip's FRAMESxHxW, e.g. 81x480x832 (instead of --resolution).")),
        inspect.Parameter("frames", keyword, annotation=Optional[int], default=typer.Option(
            None, min=1, help="Plan a clip of this many frames at the --resolution square (a video model's; e.g. 81): its "
                              "latent frames x patches are the tokens traced.")),
        inspect.Parameter("cache", keyword, annotation=Optional[str], default=typer.Option(
            None, help="A cache built for the run (a directory or URL): the plan traces its largest resolution (a cache "
                       "of clips: its largest clip bucket) and gives the largest batch of each of its buckets; an edit "
                       "cache's references are those of the traced bucket's first sample, unless --references or "
                       "--reference-size say otherwise.")),
        *typer_parameters(PlanConfig, OPTIONS[1:]),
        inspect.Parameter("gpu_memory", keyword, annotation=str, default=typer.Option("80GB", help=GPU_MEMORY_HELP)),
        inspect.Parameter("as_json", keyword, annotation=bool, default=typer.Option(
            False, "--json", help="Print the figures as JSON.")),
    ]


plan_command.__signature__ = inspect.Signature(_parameters())
