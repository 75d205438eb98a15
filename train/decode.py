"""Latents to pictures (and a clip's latents to videos, `train.video`), away from the training device.

The VAE's decoder is rebuilt from the recipe stage one recorded in the cache manifest (class, weights
source, latent scaling) and runs in a background process on the CPU by default, so the training
process never holds VAE weights; `Decoder(..., device=cuda)` decodes in-process on the device instead,
for runs that release training memory first. Sample grids are labelled PNGs written atomically.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from shards import Cache, DecoderRecipe
from shards.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from PIL import Image

LABEL_WIDTH = 240
TITLE_HEIGHT = 28


def decoder_recipe(cache: Cache) -> DecoderRecipe:
    """The cache's decoder recipe, weights stored in the cache given by their full path."""
    recipe = cache.spec.decoder
    if recipe is None:
        raise ValueError(f"{cache.root} records no VAE decoder; re-run this version's `make precompute` on it (only what is missing is encoded)")
    return recipe.located(cache.root)


def load_decoder(recipe: DecoderRecipe, device: torch.device) -> torch.nn.Module:
    """The VAE of `recipe` with its encoder dropped: only the decoder's weights stay in memory."""
    import diffusers

    cls = getattr(diffusers, recipe.vae_class)
    vae = cls.from_pretrained(recipe.source, subfolder=recipe.subfolder, revision=recipe.revision)
    # an empty module, not None: some VAEs count the encoder's layers whenever they decode
    vae.encoder = torch.nn.Module()
    if hasattr(vae, "quant_conv"):
        vae.quant_conv = None
    return vae.to(device).eval().requires_grad_(False)


def unscale(recipe: DecoderRecipe, latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) latents, or a clip's (B, C, T, h, w), as the cache stores them -> the VAE's latent z (float32), as
    the family's pipeline undoes its normalisation before decoding."""
    z = latents.float()
    if recipe.latents_mean is None:
        return unfold(z / recipe.scaling_factor + recipe.shift_factor, recipe.patch)
    shape = (1, len(recipe.latents_mean), *[1] * (z.dim() - 2))
    mean = torch.tensor(recipe.latents_mean).view(shape).to(z.device, z.dtype)
    inverse_std = 1.0 / torch.tensor(recipe.latents_std).view(shape).to(z.device, z.dtype)
    return unfold(z / inverse_std + mean, recipe.patch)  # the pipelines' own expression: stored as (z - mean) * (1 / std)


def unfold(z: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C * p * p, h, w) latents whose p x p patches are folded into channels (the recipe's `patch`) -> the VAE's
    (B, C, h * p, w * p)."""
    if patch == 1:
        return z
    b, c, h, w = z.shape
    z = z.reshape(b, c // patch**2, patch, patch, h, w).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c // patch**2, h * patch, w * patch)


@torch.inference_mode()
def decode(vae: torch.nn.Module, recipe: DecoderRecipe, latents: torch.Tensor) -> list:
    """(B, C, h, w) cached-scale latents -> PIL images."""
    from PIL import Image

    z = unscale(recipe, latents.to(vae.device))
    if recipe.frame_axis:  # a video VAE: the image is one frame, (B, C, 1, h, w) in and out
        pixels = vae.decode(z[:, :, None]).sample[:, :, 0].float().clamp(-1, 1)
    else:
        pixels = vae.decode(z).sample.float().clamp(-1, 1)
    pixels = ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(p) for p in pixels]


@torch.inference_mode()
def decode_clip(vae: torch.nn.Module, recipe: DecoderRecipe, latents: torch.Tensor) -> np.ndarray:
    """(1, C, T, h, w) cached-scale latents of a clip -> its frames (F, H, W, 3) uint8, decoded by the video VAE."""
    if not recipe.frame_axis:
        raise ValueError(f"the cache's decoder, {recipe.vae_class}, decodes images; its latents have no frame axis")
    pixels = vae.decode(unscale(recipe, latents.to(vae.device))).sample[0].float().clamp(-1, 1)  # (3, F, H, W)
    return ((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()


def grid(title: str, rows: list[tuple[str, list]]) -> Image.Image:
    """One row per label; images of different sizes are centred in equal cells (None: an empty cell)."""
    from PIL import Image, ImageDraw

    cols = max(len(images) for _, images in rows)
    cell_w = max(im.width for _, images in rows for im in images if im is not None)
    heights = [max(im.height for im in images if im is not None) for _, images in rows]
    canvas = Image.new("RGB", (LABEL_WIDTH + cols * (cell_w + 4), TITLE_HEIGHT + sum(h + 4 for h in heights)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((6, 8), title, fill="black")
    y = TITLE_HEIGHT
    for (label, images), h in zip(rows, heights):
        draw.multiline_text((6, y + 4), "\n".join(textwrap.wrap(label, 36)[:8]), fill="black")
        for j, im in enumerate(images):
            if im is None:
                continue
            x = LABEL_WIDTH + j * (cell_w + 4) + (cell_w - im.width) // 2
            canvas.paste(im, (x, y + (h - im.height) // 2))
        y += h + 4
    return canvas


def render(vae, recipe: DecoderRecipe, job: dict) -> Path:
    """Decode a job's rows of latents and write its grid; returns the PNG's path. A job of clips (`fps` set) writes
    each row's clip as `<name>.mp4` beside the grid, which is their contact sheet (`train.video`)."""
    if job.get("fps"):
        return render_clips(vae, recipe, job)
    rows = [(label, [decode(vae, recipe, z[None])[0] if z is not None else None for z in latents]) for label, latents in job["rows"]]
    buf = io.BytesIO()
    grid(job["title"], rows).save(buf, format="PNG")
    atomic_write_bytes(job["path"], buf.getvalue())
    return Path(job["path"])


_kept: dict[tuple[str, str], np.ndarray] = {}  # dataset clips decoded, by name and latent digest


def render_clips(vae, recipe: DecoderRecipe, job: dict) -> Path:
    """Decode a job of clips: each row's one latent (C, T, h, w) becomes `<name>.mp4` (`job["names"]`, in `path`'s
    folder) at `fps`, and a row of the contact sheet written at `path`; returns the sheet's path. The frames of the rows
    named in `job["kept"]` are kept for the next jobs."""
    from train.video import sheet_row, write_mp4

    path = Path(job["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for (label, (z,)), name in zip(job["rows"], job["names"]):
        # a dataset clip (`kept`) is the same latent at every validation: decoded once by this process (a clip's
        # decoding costs many images'); the sampled ones are new each time
        key = (name, hashlib.sha256(z.numpy().tobytes()).hexdigest())
        frames = _kept.get(key)
        if frames is None:
            frames = decode_clip(vae, recipe, z[None])
            if name in job.get("kept", ()):
                _kept[key] = frames
        write_mp4(path.parent / f"{name}.mp4", frames, job["fps"])
        rows.append((label, sheet_row(frames)))
    buf = io.BytesIO()
    grid(job["title"], rows).save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _worker(recipe: DecoderRecipe, jobs, results) -> None:
    torch.set_num_threads(1)  # the training process keeps the other cores
    vae = load_decoder(recipe, torch.device("cpu"))
    while (job := jobs.get()) is not None:
        try:
            results.put(("ok", str(render(vae, recipe, job))))
        except Exception as e:  # reported in the training process, which carries on
            results.put(("error", f"{job['path']}: {type(e).__name__}: {e}"))


class Decoder:
    """Turns rows of latents into grid PNGs: in a background CPU process, or in-process on `device`.

    `submit` returns at once in the background mode; `finished()` yields the grids written so far,
    `close()` waits for the rest.
    """

    def __init__(self, recipe: DecoderRecipe, device: torch.device | None = None):
        self.recipe, self.device = recipe, device
        self._done: list[tuple[str, str]] = []
        if device is None:
            ctx = mp.get_context("spawn")  # a clean interpreter: no copy of the training process's memory
            self._jobs, self._results = ctx.Queue(), ctx.Queue()
            self._process = ctx.Process(target=_worker, args=(recipe, self._jobs, self._results), daemon=True, name="decoder")
            self._process.start()
            self._pending = 0

    def submit(self, title: str, rows: list[tuple[str, list[torch.Tensor]]], path: Path, *, names: list[str] | None = None,
               fps: float | None = None, kept: tuple[str, ...] = ()) -> None:
        """Queue a grid of `rows` (label, latents; None: an empty cell) at `path`; with `fps`, rows of one clip each, written as
        `names[k]`.mp4 beside `path` (their contact sheet), those named in `kept` (the same at every validation)
        decoded once."""
        job = {"title": title, "rows": [(label, [None if z is None else z.detach().float().cpu() for z in zs]) for label, zs in rows],
               "path": str(path)}
        if fps:
            job.update(fps=fps, names=list(names), kept=tuple(kept))
        if self.device is None:
            self._jobs.put(job)
            self._pending += 1
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # cached blocks of the step go back before the decoder comes in
        vae = load_decoder(self.recipe, self.device)
        try:
            self._done.append(("ok", str(render(vae, self.recipe, job))))
        finally:
            del vae
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def finished(self, wait: bool = False) -> list[tuple[str, str]]:
        """(status, path or error) of the grids completed since the last call."""
        if self.device is None:
            import queue

            while self._pending:
                try:
                    item = self._results.get(timeout=1.0) if wait else self._results.get_nowait()
                except queue.Empty:
                    if not wait:
                        break
                    if not self._process.is_alive():
                        self._done.append(("error", f"the decoder process exited with code {self._process.exitcode}"))
                        self._pending = 0
                    continue
                self._done.append(item)
                self._pending -= 1
        done, self._done = self._done, []
        return done

    def close(self) -> list[tuple[str, str]]:
        done = self.finished(wait=True)
        if self.device is None:
            self._jobs.put(None)
            self._process.join(timeout=60)
        return done
