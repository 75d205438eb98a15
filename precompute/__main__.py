"""`python -m precompute DATA --model PRESET --cache DIR`: encode a dataset into the shard cache."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from precompute.presets import PRESETS, TEXT_ENCODERS

# Exit codes (README): 0 done; 1 more inputs skipped than --max-failure-fraction (the rest is cached); 2 bad
# arguments, input or cache (nothing written that could be lost); 3 another run is writing the cache; 4 the run
# would remove more than --max-removal-fraction (nothing removed, everything encoded kept).
EXIT_FAILURES, EXIT_INPUT, EXIT_BUSY, EXIT_REMOVAL = 1, 2, 3, 4

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(help=__doc__ + "\n\nRe-running encodes only new or changed images (an image whose size and mtime are unchanged "
             "is not read); a killed run resumes where it stopped. Exit codes: 0 done; 1 more inputs skipped than "
             "--max-failure-fraction; 2 bad arguments, input or cache; 3 another run is writing the cache; 4 removal refused "
             "(see --max-removal-fraction).")
def cli(
    data: str = typer.Argument(..., help="A folder of images with sidecar captions (x.jpg + x.txt/.caption) or a "
                               "metadata.jsonl/.csv (file_name, text); or webdataset tars: a .tar, a folder of tars, "
                               "a brace pattern data-{0000..0099}.tar, or http(s) URLs."),
    model: str = typer.Option("tiny-sana", "--model", "-m", help=f"Preset: {', '.join(PRESETS)}."),
    cache: Optional[Path] = typer.Option(None, "--cache", "-c", help="Cache directory to create or extend (default: cache/MODEL, where `make train` looks)."),
    text_encoder: Optional[str] = typer.Option(None, help=f"Override the preset's text encoder: {', '.join(TEXT_ENCODERS)}."),
    pretrained: Optional[str] = typer.Option(None, help="Local directory (diffusers layout: vae/, text_encoder/, tokenizer/; "
                                             "SD3 adds text_encoder_2/3, tokenizer_2/3) or Hub id to load the encoders from "
                                             "instead of the preset's."),
    drop_t5: bool = typer.Option(False, help="SD3 presets: leave T5 out (CLIP-L + CLIP-G only), as StableDiffusion3Pipeline "
                                 "does with text_encoder_3=None; its tokens are zeros in training and inference."),
    max_length: Optional[int] = typer.Option(None, help="Token limit of a caption (default: the preset's; SD3's T5 part: 256)."),
    batch_size: Optional[int] = typer.Option(None, help="Images per VAE batch, one bucket per batch (default: 16 on CUDA, 1 on CPU)."),
    text_batch_size: int = typer.Option(64, help="Captions per text-encoder batch."),
    workers: int = typer.Option(2, help="DataLoader worker processes that read, decode and resize images."),
    storage_dtype: str = typer.Option("bfloat16", help="Dtype of cached latents and embeddings: bfloat16, float16 or float32."),
    vae_dtype: Optional[str] = typer.Option(None, help="VAE compute dtype (default: float32 on CPU; the preset's on CUDA)."),
    text_dtype: Optional[str] = typer.Option(None, help="Text-encoder compute dtype (default: float32 on CPU; bfloat16 on CUDA)."),
    force_fp16: bool = typer.Option(False, help="Allow float16 for encoders that overflow in it (SDXL VAE, T5); only for fp16-fixed weights."),
    max_upscale: float = typer.Option(2.0, help="Skip images needing more upscaling than this to cover their bucket (reason too_small)."),
    allow_upscale: bool = typer.Option(False, help="Never skip small images; upscale them."),
    extreme_aspect: str = typer.Option("skip", help="Images whose aspect ratio lies beyond the bucket table: skip or clamp (crop into the extreme bucket)."),
    max_pixels: int = typer.Option(178_956_970, help="Refuse images with more pixels than this (decompression bombs)."),
    caption_column: str = typer.Option("text", help="Caption column of metadata.jsonl/.csv (a string or a list of captions)."),
    caption_key: List[str] = typer.Option(["caption", "text", "prompt"], help="Keys of a tar sample's .json whose values are captions (repeatable); all found are encoded."),
    validation_prompt: List[str] = typer.Option([], help="A prompt to encode for validation images (repeatable)."),
    validation_file: Optional[Path] = typer.Option(None, help="A file of validation prompts, one per line."),
    allow_pipe: bool = typer.Option(False, help="Allow pipe: URLs, which run a shell command (checked on every URL a brace pattern expands to)."),
    allow_removal: bool = typer.Option(False, help="Remove cached samples whose inputs are gone even when DATA lists no input or "
                                       "more than --max-removal-fraction of the cache would go. Samples whose input failed to "
                                       "read, or whose tar or folder could not be listed completely, are never removed."),
    max_removal_fraction: float = typer.Option(0.5, help="Refuse (exit 4) to remove more than this share of the cache's samples "
                                               "in one run without --allow-removal; what was encoded is kept."),
    max_failure_fraction: float = typer.Option(0.1, help="Exit non-zero when more than this fraction of inputs was skipped."),
    max_shard_mb: int = typer.Option(128, help="Target shard size in MiB."),
    check_disk: bool = typer.Option(True, help="Estimate the cache size first and refuse if the disk is short."),
    repair: bool = typer.Option(False, help="Re-encode exactly the samples of shards that are missing or fail their checks "
                                "(python -m shards verify lists them), from the same DATA and options that built the cache; "
                                "each repaired shard keeps its samples' order, so training runs resume on it."),
    progress: bool = typer.Option(True, help="Show the progress bar and the summary."),
) -> None:
    from precompute.run import RemovalRefused, main
    from shards import CacheBusy

    logging.basicConfig(level=logging.WARNING)
    cache = cache or Path("cache") / model
    prompts = list(validation_prompt)
    if validation_file:
        prompts += [line.strip() for line in validation_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        summary = main(
            data, model, cache, text_encoder=text_encoder, pretrained=pretrained, drop_t5=drop_t5, max_length=max_length,
            batch_size=batch_size,
            text_batch_size=text_batch_size, workers=workers, storage_dtype=storage_dtype, vae_dtype=vae_dtype,
            text_dtype=text_dtype, force_fp16=force_fp16, max_upscale=max_upscale, allow_upscale=allow_upscale,
            extreme_aspect=extreme_aspect, max_pixels=max_pixels, caption_column=caption_column,
            caption_keys=tuple(caption_key), validation_prompts=tuple(prompts), allow_pipe=allow_pipe,
            allow_removal=allow_removal, max_removal_fraction=max_removal_fraction, max_shard_mb=max_shard_mb, check_disk=check_disk, repair=repair, progress=progress,
        )
    except (CacheBusy, RemovalRefused, ValueError, FileNotFoundError, OSError) as e:
        rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        typer.echo(f"error{rank}: {e}", err=True)
        raise typer.Exit(EXIT_BUSY if isinstance(e, CacheBusy) else EXIT_REMOVAL if isinstance(e, RemovalRefused) else EXIT_INPUT)
    if summary and summary.get("unrepairable"):
        raise typer.Exit(EXIT_INPUT)
    if summary and summary.get("failure_fraction", 0.0) > max_failure_fraction:
        typer.echo(f"error: {summary['failure_fraction']:.1%} of inputs were skipped, over --max-failure-fraction "
                   f"{max_failure_fraction:.1%}; see {cache / 'failures.jsonl'}", err=True)
        raise typer.Exit(EXIT_FAILURES)


if __name__ == "__main__":
    app(prog_name="python -m precompute")
    sys.exit(0)
