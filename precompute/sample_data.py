"""A small procedural image-caption dataset: coloured shapes on backgrounds, described by their captions.

`python -m precompute.sample_data DIR [--count N] [--tars]` writes it as a folder with sidecar captions
(or as webdataset tars). Deterministic for a given seed; used by `make demo` and the tests.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import typer
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
    "orange": (240, 140, 30), "purple": (140, 60, 180), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
# (height, width) of the generated images: portrait, square, landscape and a wide one
SIZES = ((320, 224), (256, 256), (224, 320), (176, 368))


def draw_sample(rng: random.Random) -> tuple[Image.Image, str]:
    h, w = rng.choice(SIZES)
    bg, fg = rng.sample(sorted(COLORS), 2)
    shape = rng.choice(SHAPES)
    size = rng.choice(("small", "large"))
    img = Image.new("RGB", (w, h), COLORS[bg])
    draw = ImageDraw.Draw(img)
    r = min(h, w) * (0.18 if size == "small" else 0.36)
    cx, cy = w / 2 + rng.uniform(-0.15, 0.15) * w, h / 2 + rng.uniform(-0.15, 0.15) * h
    draw_shape(draw, shape, cx, cy, r, COLORS[fg])
    return img, f"a {size} {fg} {shape} on a {bg} background"


def draw_shape(draw, shape: str, cx: float, cy: float, r: float, color) -> None:
    """A circle, square or triangle of half-size `r` centred at (cx, cy)."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)


def make_folder(root: Path, count: int = 64, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        img, caption = draw_sample(rng)
        img.save(root / f"{i:05d}.png")
        (root / f"{i:05d}.txt").write_text(caption + "\n", encoding="utf-8")
    return root


def make_tars(root: Path, count: int = 64, per_tar: int = 16, seed: int = 0) -> list[Path]:
    """img2dataset layout: KEY.jpg, KEY.txt and KEY.json with the caption (and a second one) per sample."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for t in range(0, count, per_tar):
        path = root / f"data-{t // per_tar:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(t, min(t + per_tar, count)):
                img, caption = draw_sample(rng)
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=95)
                meta = {"caption": caption, "prompt": f"{caption}, flat colours"}
                for ext, data in (("jpg", buf.getvalue()), ("txt", caption.encode()), ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def main(
    root: Path = typer.Argument(..., help="Directory to write the dataset into."),
    count: int = typer.Option(64, help="Number of images."),
    tars: bool = typer.Option(False, help="Write webdataset tars (16 samples each) instead of a folder."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    if tars:
        make_tars(root, count, seed=seed)
    else:
        make_folder(root, count, seed=seed)
    typer.echo(f"wrote {count} samples to {root}")


if __name__ == "__main__":
    typer.run(main)
