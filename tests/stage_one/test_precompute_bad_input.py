"""Bad input is converted correctly or skipped with a named reason; the run never crashes."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from precompute.config import PrecomputeConfig
from precompute.images import Record, prepare
from precompute.run import main as precompute
from shards import Bucket, Cache

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

CAPTION = "a small red circle on a blue background"


def png(img: Image.Image, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def exif_rotated() -> bytes:
    img = Image.new("RGB", (320, 224), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return png(img, "JPEG", exif=exif)


def corpus() -> dict[str, tuple[bytes | None, bytes | None]]:
    """name -> (image bytes, caption bytes); None means the file is absent."""
    good = png(Image.new("RGB", (256, 256), (10, 200, 10)))
    jpeg = png(Image.new("RGB", (300, 300), (10, 20, 200)), "JPEG")
    gray16 = Image.fromarray(np.full((256, 256), 65535, dtype=np.uint16))
    palette = Image.new("RGB", (256, 256), (250, 0, 0)).convert("P", palette=Image.ADAPTIVE)
    cap = CAPTION.encode()
    return {
        "good1.png": (good, cap),
        "good2.jpg": (jpeg, cap),
        "cmyk.jpg": (png(Image.new("CMYK", (256, 256), (0, 255, 255, 0)), "JPEG"), cap),
        "gray16.png": (png(gray16), cap),
        "palette.png": (png(palette), cap),
        "rgba.png": (png(Image.new("RGBA", (256, 256), (0, 0, 0, 0))), cap),
        "gray.png": (png(Image.new("L", (256, 256), 128)), cap),
        "exif.jpg": (exif_rotated(), cap),
        "longcap.png": (good, " ".join(["red circle"] * 400).encode()),
        "truncated.jpg": (jpeg[: len(jpeg) // 2], cap),
        "garbage.png": (bytes(range(256)) * 8, cap),
        "text.jpg": (b"this is not an image", cap),
        "zero.png": (b"", cap),
        "bomb.png": (png(Image.new("L", (3000, 3000), 0)), cap),
        "tiny.png": (png(Image.new("RGB", (20, 20))), cap),
        "extreme.png": (png(Image.new("RGB", (1000, 40))), cap),
        "nocaption.png": (good, None),
        "emptycaption.png": (good, b"   \n"),
        "latin1.png": (good, "caf\xe9 cr\xe8me".encode("latin-1")),
    }


EXPECTED_FAILURES = {
    "truncated.jpg": "corrupt_image",
    "garbage.png": "not_an_image",
    "text.jpg": "not_an_image",
    "zero.png": "empty_file",
    "bomb.png": "too_many_pixels",
    "tiny.png": "too_small",
    "extreme.png": "extreme_aspect",
    "nocaption.png": "missing_caption",
    "emptycaption.png": "empty_caption",
}


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    for name, (image, caption) in corpus().items():
        (root / name).write_bytes(image)
        if caption is not None:
            (root / name).with_suffix(".txt").write_bytes(caption)
    return root


def test_bad_input_corpus(bad_folder, tmp_path):
    summary = precompute(str(bad_folder), "tiny-sana", tmp_path, workers=2, progress=False, max_pixels=4_000_000)
    failures = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert {f["source"]: f["reason"] for f in failures} == EXPECTED_FAILURES
    assert summary["failed"] == len(EXPECTED_FAILURES)
    assert summary["failed_by_reason"]["not_an_image"] == 2
    assert summary["captions_truncated"] == 1
    assert summary["caption_fallbacks"] == {"cp1252": 1}  # latin1.png's caption: read, reported, cached
    cache = Cache(tmp_path)
    sources = {bytes(cache[i]["source"].tolist()).decode(): cache[i] for i in range(len(cache))}
    assert set(sources) == set(corpus()) - set(EXPECTED_FAILURES)
    assert sources["exif.jpg"]["original_size"].tolist() == [320, 224]  # rotated upright: portrait
    assert sources["longcap.png"]["text"].shape[0] == 64  # truncated to the token limit


def test_failure_threshold_sets_the_exit_code(bad_folder, tmp_path):
    from typer.testing import CliRunner

    from precompute.__main__ import app

    args = [str(bad_folder), "--model", "tiny-sana", "--cache", str(tmp_path), "--workers", "0", "--no-progress",
            "--max-pixels", "4000000"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 1 and "over --max-failure-fraction" in out.output
    out = CliRunner().invoke(app, args + ["--max-failure-fraction", "0.9"])
    assert out.exit_code == 0, out.output


def policy(**kw):
    return PrecomputeConfig("unused", **kw).policy()  # tiny-sana's 256 table


def test_conversions_are_correct():
    items = corpus()
    rgba = prepare(Record("rgba.png", items["rgba.png"][0], [CAPTION]), policy())
    assert rgba["pixels"].min() == 255  # transparent composited on white
    gray16 = prepare(Record("g", items["gray16.png"][0], [CAPTION]), policy())
    assert gray16["pixels"].min() == 255  # 16-bit white stays white, not clipped garbage
    cmyk = prepare(Record("c", items["cmyk.jpg"][0], [CAPTION]), policy())
    r, g, b = (cmyk["pixels"][c].float().mean() for c in range(3))
    assert r > 200 and g < 60 and b < 60  # CMYK (0, 255, 255, 0) is red
    pal = prepare(Record("p", items["palette.png"][0], [CAPTION]), policy())
    assert pal["pixels"][0].float().mean() > 240 and pal["pixels"].shape == (3, 256, 256)


def test_upscale_and_aspect_options():
    tiny = png(Image.new("RGB", (20, 20)))
    assert prepare(Record("t", tiny, [CAPTION]), policy())["reason"] == "too_small"
    ok = prepare(Record("t", tiny, [CAPTION]), policy(allow_upscale=True))
    assert ok["status"] == "ok" and ok["bucket"] == Bucket(256, 256)
    wide = png(Image.new("RGB", (1000, 40)))
    clamped = prepare(Record("w", wide, [CAPTION]), policy(extreme_aspect="clamp", allow_upscale=True))
    assert clamped["status"] == "ok" and clamped["bucket"] == Bucket(128, 512)  # the widest bucket


def test_a_sample_encoded_to_non_finite_values_is_a_named_failure(tmp_path, monkeypatch):
    """A VAE that overflows on one image (NaN latents) fails that sample by name and source; the others are cached."""
    from precompute.encode import Encoders

    for i, colour in enumerate([(200, 10, 10), (10, 200, 10)]):
        Image.new("RGB", (256, 256), colour).save(tmp_path / f"img{i}.png")
        (tmp_path / f"img{i}.txt").write_text(CAPTION)
    encode_images = Encoders.encode_images

    def overflowing(self, pixels):
        fields = encode_images(self, pixels)
        red = pixels[:, 0].float().mean(dim=(1, 2)) > 100  # img0 is the red one
        return {name: torch.where(red[:, None, None, None], torch.nan, t) for name, t in fields.items()}

    monkeypatch.setattr(Encoders, "encode_images", overflowing)
    summary = precompute(str(tmp_path), "tiny-sana", str(tmp_path / "cache"), workers=0, batch_size=2, max_failure_fraction=1.0)
    failures = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert [(f["reason"], f["source"].endswith("img0.png"), f["dataset"]) for f in failures] == [("non_finite", True, tmp_path.name)]
    assert summary["failed"] == 1 and len(Cache(tmp_path / "cache")) == 1
