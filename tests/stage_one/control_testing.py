"""What the tests of stage one's control images share: sample images with an edge map as control image, written as
sidecars, and the failures a run records."""

import io
import json
import random
from pathlib import Path

from PIL import Image, ImageFilter, ImageOps

from precompute.sample_data import draw_sample

RUN = dict(workers=0, progress=False, batch_size=1, max_shard_mb=0, storage_dtype="fp32")


def triples(count: int, seed: int = 0) -> list[tuple[Image.Image, Image.Image, str]]:
    """(image, control image, caption): the sample data's drawings, an edge map of each as its control image (other
    pixels than the image's, the same shape), and captions that say which sample they are."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        img, caption = draw_sample(rng)
        edges = img.convert("L").filter(ImageFilter.FIND_EDGES)
        out.append((img, ImageOps.autocontrast(edges).convert("RGB"), f"{caption}, sample {i}"))
    return out


def png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def sidecar_folder(root: Path, items) -> Path:
    """x.png + x.txt + x.control.png per sample."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (img, control, caption) in enumerate(items):
        img.save(root / f"{i:03d}.png")
        control.save(root / f"{i:03d}.control.png")
        (root / f"{i:03d}.txt").write_text(caption)
    return root


def failures(cache) -> dict[str, str]:
    lines = (Path(cache) / "failures.jsonl").read_text().splitlines()
    return {json.loads(line)["source"]: json.loads(line)["reason"] for line in lines}
