"""A small procedural image-caption dataset: coloured shapes on backgrounds, described by their captions.

`python -m precompute.sample_data DIR [--count N] [--tars]` writes it as a folder with sidecar captions
(or as webdataset tars); `--references N` writes an edit dataset instead (`make_edit_folder`: each target image with N
reference images beside it and an instruction as its caption). Deterministic for a given seed; used by `make demo` and
the tests.
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


def draw_edit(rng: random.Random, references: int = 1) -> tuple[Image.Image, list[Image.Image], str]:
    """(target, its references, the instruction): reference 0 is a scene of one shape, the target the same scene with
    the shape in another colour; each further reference shows another shape, which the target adds beside the first.
    References are drawn at other sizes than the target (the same scene scaled), as edit datasets' inputs are."""
    h, w = rng.choice(SIZES)
    bg, old, new, *others = rng.sample(sorted(COLORS), 3 + max(references - 1, 0))
    shape = rng.choice(SHAPES)
    cx, cy = 0.5 + rng.uniform(-0.12, 0.12), 0.38 + rng.uniform(-0.08, 0.08)  # where it is, as a share of each side
    extras = [(rng.choice(SHAPES), color) for color in others]
    spots = [((k + 1) / (len(extras) + 1), 0.85) for k in range(len(extras))]  # where the target adds them

    def scene(size: tuple[int, int], color, added: list) -> Image.Image:
        sh, sw = size
        img = Image.new("RGB", (sw, sh), COLORS[bg])
        draw = ImageDraw.Draw(img)
        draw_shape(draw, shape, cx * sw, cy * sh, min(sh, sw) * 0.25, COLORS[color])
        for (extra, extra_color), (ex, ey) in zip(added, spots):
            draw_shape(draw, extra, ex * sw, ey * sh, min(sh, sw) * 0.1, COLORS[extra_color])
        return img

    def other_size() -> tuple[int, int]:
        return rng.choice([s for s in SIZES if s != (h, w)])

    refs = [scene(other_size(), old, [])]
    for extra, color in extras:  # the shape to add, alone on grey
        rh, rw = other_size()
        img = Image.new("RGB", (rw, rh), (128, 128, 128))
        draw_shape(ImageDraw.Draw(img), extra, rw / 2, rh / 2, min(rh, rw) * 0.3, COLORS[color])
        refs.append(img)
    target = scene((h, w), new, extras)
    added = " and ".join(f"the {color} {extra} of image {k + 2}" for k, (extra, color) in enumerate(extras))
    added = f" and add {added} below it" if extras else ""
    return target, refs, f"make the {old} {shape} {new}{added}"


def make_edit_folder(root: Path, count: int = 16, references: int = 1, seed: int = 0) -> Path:
    """An edit dataset in a folder: per sample the target `NNNNN.png`, its instruction `NNNNN.txt` ("make the red circle
    blue") and its reference images beside it, `NNNNN.ref.png` for one, `NNNNN.ref0.png`, `NNNNN.ref1.png`, ... for
    several (`draw_edit`)."""
    if references < 1:
        raise ValueError(f"references={references}: an edit sample has at least one reference image")
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        target, refs, caption = draw_edit(rng, references)
        target.save(root / f"{i:05d}.png")
        for k, ref in enumerate(refs):
            ref.save(root / f"{i:05d}.ref{'' if references == 1 else k}.png")
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
    references: int = typer.Option(0, min=0, help="Write an edit dataset instead (for an edit model's --references): "
                                                  "each target image with this many reference images beside it "
                                                  "(x.ref.png, or x.ref0.png, x.ref1.png, ...) and an instruction as "
                                                  "its caption."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    if references and tars:
        raise typer.BadParameter("--references writes a folder; leave out --tars")
    if references:
        make_edit_folder(root, count, references, seed=seed)
    elif tars:
        make_tars(root, count, seed=seed)
    else:
        make_folder(root, count, seed=seed)
    typer.echo(f"wrote {count} samples to {root}")


if __name__ == "__main__":
    typer.run(main)
