"""Stage one's limits and sources as a user sets them: --max-pixels is the one pixel limit, and two sources of a
dataset file never read the same inputs."""

import io
import struct
import zlib

import pytest
from PIL import Image
from typer.testing import CliRunner

import precompute.images as images
from precompute.__main__ import EXIT_INPUT, app
from precompute.config import PrecomputeConfig
from precompute.images import Record, decode_image, prepare
from precompute.sample_data import make_folder
from precompute.sources import read_dataset_file

DEFAULT_MAX_PIXELS = PrecomputeConfig("unused").max_pixels


def png(width: int, height: int) -> bytes:
    """A black 1-bit PNG of any size in a few kilobytes: rows of zeros compress to almost nothing."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte, then the packed bits
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


@pytest.fixture
def pillow_limit(monkeypatch):
    """Pillow's guard as it is now, put back after the test (decoding raises it for the process)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


# ---- --max-pixels ------------------------------------------------------------------------------------------

def test_a_photo_over_pillows_limit_opens_under_the_default_max_pixels(pillow_limit, monkeypatch):
    """A 105-megapixel photo (a 102 MP medium-format camera's size) is below --max-pixels' default and above
    Pillow's own 89 MP warning: our limit decides, so it is read. The conversion to RGB (420 MB) is left out."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)  # Pillow's default, whatever ran before
    monkeypatch.setattr(images, "to_rgb", lambda img: img.size)
    data = png(10_240, 10_240)
    assert len(data) < 64 << 10
    size, reason, detail = decode_image(data, DEFAULT_MAX_PIXELS)
    assert (size, reason) == ((10_240, 10_240), None), detail
    # below the image's size, --max-pixels refuses it from its header, naming the limit
    img, reason, detail = decode_image(data, 100_000_000)
    assert img is None and reason == "too_many_pixels"
    assert "10240x10240" in detail and "100000000" in detail


@pytest.mark.parametrize("pixels", [3_600, 1_600])  # over twice Pillow's limit (its error), and between (its warning)
def test_max_pixels_above_pillows_limit_is_the_limit_that_decides(pillow_limit, monkeypatch, pixels):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)  # Pillow's guard, scaled down with the images
    side = int(pixels ** 0.5)
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buf, "PNG")
    policy = PrecomputeConfig("unused", max_pixels=10_000, allow_upscale=True).policy()
    out = prepare(Record("big.png", buf.getvalue(), ["a red square"]), policy)
    assert out["status"] == "ok", out
    assert out["original_size"] == (side, side) and out["pixels"].shape == (3, 256, 256)

    buf = io.BytesIO()
    Image.new("RGB", (120, 120)).save(buf, "PNG")  # 14,400 pixels: over --max-pixels
    out = prepare(Record("bigger.png", buf.getvalue(), ["a black square"]), policy)
    assert (out["status"], out["reason"]) == ("failed", "too_many_pixels")
    assert "120x120" in out["detail"]


def test_a_lower_max_pixels_still_refuses_after_a_higher_one_raised_pillows_guard(pillow_limit, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    buf = io.BytesIO()
    Image.new("L", (60, 60)).save(buf, "PNG")
    assert decode_image(buf.getvalue(), 100_000)[1] is None  # raises Pillow's guard to 100,000 for the process
    img, reason, _ = decode_image(buf.getvalue(), 2_000)
    assert img is None and reason == "too_many_pixels"


# ---- two sources over the same inputs ------------------------------------------------------------------------

def write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("second, how", [
    ('path = "photos"\nrepeats = 3\n', "reads the same path as"),
    ('path = "photos/"\nflip = true\n', "reads the same path as"),
    ('path = "photos/../photos"\ncaption_column = "other"\n', "reads the same path as"),
    ('path = "photos/dogs"\nrepeats = 5\n', "lies inside"),
    ('path = "alias"\n', "reads the same path as"),  # a symlink to the same folder
])
def test_two_sources_over_the_same_folder_are_refused_naming_both(tmp_path, second, how):
    make_folder(tmp_path / "photos" / "dogs", count=1)
    (tmp_path / "alias").symlink_to(tmp_path / "photos")
    file = write(tmp_path / "data.toml", f'[[source]]\nname = "all"\npath = "photos"\n\n'
                                         f'[[source]]\nname = "more"\n{second}')
    with pytest.raises(ValueError) as e:
        read_dataset_file(file)
    message = str(e.value)
    assert f"{file}:7" in message and how in message
    assert "'more'" in message and "'all'" in message and str(tmp_path / "photos") in message

    # the folder that holds the other one, listed second
    file = write(tmp_path / "data.toml", '[[source]]\npath = "photos/dogs"\n\n[[source]]\npath = "photos"\n')
    with pytest.raises(ValueError, match="'photos' .* holds source 'dogs'"):
        read_dataset_file(file)


def test_sources_that_read_different_inputs_are_kept(tmp_path):
    file = write(tmp_path / "data.toml", '[[source]]\npath = "photos"\n\n[[source]]\npath = "photos-2"\n\n'
                                         '[[source]]\nname = "tars-a"\npath = "shards/{0..4}.tar"\n\n'
                                         '[[source]]\nname = "tars-b"\npath = "shards/{5..9}.tar"\n\n'
                                         '[[source]]\nname = "train"\npath = "hub"\n\n'
                                         '[[source]]\nname = "val"\npath = "hub"\nsplit = "validation"\n\n'
                                         '[[source]]\nname = "s3"\npath = "s3://bucket/photos/{0..9}.tar"\n\n'
                                         '[[source]]\nname = "gs"\npath = "gs://bucket/photos/{0..9}.tar"\n')
    names = [s.name for s in read_dataset_file(file)]
    assert names == ["photos", "photos-2", "tars-a", "tars-b", "train", "val", "s3", "gs"]
    file = write(tmp_path / "data.toml", '[[source]]\nname = "a"\npath = "s3://bucket/photos"\n\n'
                                         '[[source]]\nname = "b"\npath = "s3://bucket/photos/{0..9}.tar"\n')
    with pytest.raises(ValueError, match="'b' .* lies inside source 'a'"):
        read_dataset_file(file)


def test_two_sources_over_one_folder_exit_2_before_anything_is_read(tmp_path):
    make_folder(tmp_path / "photos", count=1)
    file = write(tmp_path / "data.toml", '[[source]]\nname = "a"\npath = "photos"\n\n[[source]]\nname = "b"\n'
                                         'path = "photos"\nrepeats = 4\n')
    out = CliRunner().invoke(app, [str(file), "--cache", str(tmp_path / "cache"), "--no-progress"])
    assert out.exit_code == EXIT_INPUT, out.output
    assert "reads the same path as source 'a'" in out.output
    assert not (tmp_path / "cache").exists()
