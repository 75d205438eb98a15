"""Stage one with loss masks: every kind of input finds its image's mask (sidecar, metadata column, tar member,
dataset column, mask folder, alpha channel), which is resized and cropped as the image and cached at latent
resolution in its own field; bad or missing masks are named failures; a new mask or new captions re-encode no latent."""

import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from control_testing import png
from PIL import Image, ImageDraw

from precompute.config import PrecomputeConfig
from precompute.encode import Encoders
from precompute.folders import list_folder
from precompute.images import content_key
from precompute.run import main as precompute
from precompute.sample_data import draw_sample
from shards import LATENT_KEY, MASK, Cache
from train.data import TrainingSamples

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RUN = dict(workers=0, progress=False, max_shard_mb=0)
DOWNSAMPLE = 8  # tiny-sana's VAE


def pictures(count: int, seed: int) -> list[tuple[Image.Image, Image.Image, str]]:
    """(image, its mask, caption): the sample drawings with an ellipse of their own as mask (grey inside a white
    ring, black outside), so a wrong resize, crop or average shows."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        img, caption = draw_sample(rng)
        mask = Image.new("L", img.size, 0)
        w, h = img.size
        ImageDraw.Draw(mask).ellipse((w * 0.1, h * 0.2, w * 0.8, h * 0.9), fill=255)
        ImageDraw.Draw(mask).ellipse((w * 0.3, h * 0.4, w * 0.6, h * 0.7), fill=100)
        out.append((img, mask, f"{caption}, sample {seed}-{i}"))
    return out


def expected_mask(mask: Image.Image, s) -> torch.Tensor:
    """The mask as the image was resized (to cover its bucket) and cropped (the sample's crop), averaged over each
    latent cell's pixels: (1, h, w) uint8."""
    h, w = (int(v) for v in s["original_size"])
    top, left, bh, bw = (int(v) for v in s["crop"])
    scale = max(bh / h, bw / w)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    cropped = np.asarray(mask.resize((rw, rh), Image.BICUBIC).crop((left, top, left + bw, top + bh)), dtype=np.float64)
    cells = cropped.reshape(bh // DOWNSAMPLE, DOWNSAMPLE, bw // DOWNSAMPLE, DOWNSAMPLE).mean(axis=(1, 3))
    return torch.from_numpy(np.round(cells).astype(np.uint8))[None]


def by_source(cache) -> dict[str, object]:
    c = Cache(cache)
    return {bytes(c[i]["source"].tolist()).decode(): c[i] for i in range(len(c))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One run over a dataset file with a source of every kind of input, and the masks each sample must hold."""
    root = tmp_path_factory.mktemp("masks")
    expect: dict[tuple[str, str], Image.Image | None] = {}  # (source, input) -> its mask

    side = root / "side"  # x.png + x.mask.png + x.txt
    side.mkdir()
    for i, (img, mask, caption) in enumerate(pictures(5, 1)):
        img.save(side / f"{i}.png")
        (side / f"{i}.txt").write_text(caption)
        if i == 0:
            continue  # no mask: missing_mask
        if i == 1:
            mask.resize((mask.width // 2, mask.height // 2)).save(side / f"{i}.mask.png")  # mask_size
        elif i == 2:
            (side / f"{i}.mask.png").write_bytes(b"not a png")  # corrupt_mask
        else:
            mask.save(side / f"{i}.mask.jpg" if i == 4 else side / f"{i}.mask.png", quality=100)
            expect["side", f"{i}.png"] = Image.open(side / (f"{i}.mask.jpg" if i == 4 else f"{i}.mask.png")).convert("L")

    meta = root / "meta"  # metadata.jsonl with mask_file_name; a row without one falls back to the sidecar
    (meta / "m").mkdir(parents=True)
    rows = []
    for i, (img, mask, caption) in enumerate(pictures(2, 2)):
        img.save(meta / f"{i}.png")
        if i == 0:
            mask.save(meta / "m" / "first.png")
            rows.append({"file_name": f"{i}.png", "text": caption, "mask_file_name": "m/first.png"})
        else:
            mask.save(meta / f"{i}.mask.png")
            rows.append({"file_name": f"{i}.png", "text": caption})
        expect["meta", f"{i}.png"] = mask
    (meta / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    folder, masks = root / "folder", root / "folder-masks"  # mask = "DIR": the masks under the images' relative names
    (folder / "a").mkdir(parents=True)
    (masks / "a").mkdir(parents=True)
    for i, (img, mask, caption) in enumerate(pictures(2, 3)):
        img.save(folder / "a" / f"{i}.jpg", quality=95)
        (folder / "a" / f"{i}.txt").write_text(caption)
        mask.save(masks / "a" / f"{i}.png")
        expect["folder", f"a/{i}.jpg"] = mask

    tars = root / "tars"  # KEY.jpg + KEY.txt + KEY.mask.png
    tars.mkdir()
    with tarfile.open(tars / "data-0000.tar", "w") as tar:
        for i, (img, mask, caption) in enumerate(pictures(2, 4)):
            for name, data in ((f"{i:04d}.jpg", png(img, "JPEG")), (f"{i:04d}.txt", caption.encode()),
                               (f"{i:04d}.mask.png", png(mask))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            expect["tars", f"data-0000.tar/{i:04d}"] = mask

    import pyarrow as pa
    import pyarrow.parquet as pq

    hf = root / "hf"  # a parquet file with image, text and mask columns
    hf.mkdir()
    items = pictures(2, 5)
    pq.write_table(pa.table({"image": [png(img) for img, _, _ in items], "text": [c for _, _, c in items],
                             "mask": [png(m) for _, m, _ in items]}), hf / "train.parquet")
    for i, (_, mask, _) in enumerate(items):
        expect["hf", f"train.parquet:{i}"] = mask

    alpha = root / "alpha"  # RGBA images: the alpha channel is the mask; an RGB one has none
    alpha.mkdir()
    for i, (img, mask, caption) in enumerate(pictures(3, 6)):
        if i < 2:
            rgba = img.convert("RGBA")
            rgba.putalpha(mask)
            rgba.save(alpha / f"{i}.png")
            expect["alpha", f"{i}.png"] = mask
        else:
            img.save(alpha / f"{i}.png")
        (alpha / f"{i}.txt").write_text(caption)

    plain = root / "plain"  # a source without masks: its samples have none
    plain.mkdir()
    for i, (img, mask, caption) in enumerate(pictures(2, 7)):
        img.save(plain / f"{i}.png")
        mask.save(plain / f"{i}.mask.png")  # never an image, and not asked for
        (plain / f"{i}.txt").write_text(caption)
        expect["plain", f"{i}.png"] = None

    (root / "data.toml").write_text("""
[[source]]
path = "side"
masks = true

[[source]]
path = "meta"
masks = true

[[source]]
path = "folder"
mask = "folder-masks"

[[source]]
path = "tars/data-0000.tar"
name = "tars"
masks = true

[[source]]
path = "hf/train.parquet"
name = "hf"
masks = true

[[source]]
path = "alpha"
alpha_mask = true

[[source]]
path = "plain"
flip = true
""")
    summary = precompute(str(root / "data.toml"), "tiny-sana", root / "cache", max_failure_fraction=0.5, **RUN)
    return root, expect, summary


def test_every_kind_of_input_caches_its_mask_resized_and_cropped_as_its_image(built):
    root, expect, _ = built
    c = Cache(root / "cache")
    assert c.schema[MASK].dtype == torch.uint8 and c.schema[MASK].ragged
    names = dict(zip(c.manifest.shards.paths(), c.manifest.shards.datasets()))
    seen = {}
    for i in range(len(c)):
        s = c[i]
        j, _ = c.locate(i)
        seen[names[c.manifest.shards.paths()[j]], bytes(s["source"].tolist()).decode()] = s
    assert set(seen) == set(expect)
    for where, mask in expect.items():
        s = seen[where]
        _, h, w = s["latent"].shape
        if mask is None:
            assert s[MASK].shape == (0, h, w), where
            continue
        assert s[MASK].shape == (1, h, w), where
        assert torch.equal(s[MASK], expected_mask(mask, s)), where
        assert int(s[MASK].min()) == 0 and int(s[MASK].max()) == 255, where  # black outside, white ring: both present
    # the masks are weights, not latents: no VAE saw them
    assert all(s["latent_key"].shape == (16,) for s in seen.values())


def test_bad_and_missing_masks_are_named_failures(built):
    root, _, summary = built
    reasons = [json.loads(line) for line in (root / "cache" / "failures.jsonl").read_text().splitlines()]
    by = {(r["dataset"], r["source"]): (r["reason"], r["detail"]) for r in reasons}
    assert set(by) == {("side", "0.png"), ("side", "1.png"), ("side", "2.png"), ("alpha", "2.png")}
    assert by["side", "0.png"] == ("missing_mask", "no 0.mask.<image extension> beside the image")
    reason, detail = by["side", "1.png"]
    assert reason == "mask_size" and "a mask must have its image's size" in detail
    assert by["side", "2.png"][0] == "corrupt_mask"
    assert by["alpha", "2.png"][0] == "missing_mask" and "no alpha channel" in by["alpha", "2.png"][1]
    assert summary["failed_by_reason"] == {"corrupt_mask": 1, "mask_size": 1, "missing_mask": 2}


def test_mask_files_are_never_training_images(tmp_path):
    img, mask, caption = pictures(1, 8)[0]
    img.save(tmp_path / "x.png")
    mask.save(tmp_path / "x.mask.png")
    mask.save(tmp_path / "y.MASK.jpg")  # a mask without its image is no image either
    (tmp_path / "x.txt").write_text(caption)
    assert [e.source for e in list_folder(tmp_path).entries] == ["x.png"]
    assert [(e.source, Path(e.mask).name) for e in list_folder(tmp_path, mask=True).entries] == [("x.png", "x.mask.png")]


def test_a_flipped_view_takes_its_mask_mirrored(built):
    root, expect, _ = built
    samples = TrainingSamples(root / "cache", seed=0, caption_dropout=0.0, masked=True)
    c = samples.cache
    views = set()
    for i in range(len(c)):
        s = c[i]
        for epoch in range(6):
            item = samples[(epoch, i)]
            if len(s[MASK]):
                plain = s[MASK]
            else:  # a source without masks: every element counts
                plain = torch.full(item["mask"].shape, 255, dtype=torch.uint8)
            flipped = len(s["flip_latent"]) and torch.equal(item["latent"], s["flip_latent"][0].float())
            views.add(bool(flipped))
            assert torch.equal(item["mask"], plain.flip(-1) if flipped else plain)
    assert views == {True, False}


def asymmetric(data: Path) -> None:
    """Masks that differ from their mirror image: each keeps the left third of its image."""
    for image in sorted(data.glob("*.png")):
        if not image.name.endswith(".mask.png"):
            with Image.open(image) as img:
                mask = Image.new("L", img.size, 0)
            mask.paste(255, (0, 0, mask.width // 3, mask.height))
            mask.save(image.with_name(image.stem + ".mask.png"))


def test_a_new_mask_or_new_captions_reuse_the_cached_latents(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    for i, (img, mask, caption) in enumerate(pictures(4, 9)):
        img.save(data / f"{i}.png")
        mask.save(data / f"{i}.mask.png")
        (data / f"{i}.txt").write_text(caption)
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, masks=True, **RUN)
    before = by_source(cache)
    calls = []
    encode = Encoders.encode_images
    monkeypatch.setattr(Encoders, "encode_images", lambda self, px: calls.append(len(px)) or encode(self, px))

    asymmetric(data)  # every mask changes
    (data / "0.txt").write_text("another caption")  # and one caption
    summary = precompute(str(data), "tiny-sana", cache, masks=True, **RUN)
    assert (summary["changed"], summary["latents_reused"], summary["removed"]) == (4, 4, 0)
    assert calls == []  # no image went through the VAE
    after = by_source(cache)
    for name, s in after.items():
        assert s.key != before[name].key
        assert torch.equal(s["latent"], before[name]["latent"]) and torch.equal(s[LATENT_KEY], before[name][LATENT_KEY])
        assert not torch.equal(s[MASK], before[name][MASK])
    assert len(Cache(cache)) == 4

    # an image that changes is encoded again, even with its mask unchanged
    img, _, _ = pictures(1, 10)[0]
    with Image.open(data / "1.png") as old:
        img.resize(old.size).save(data / "1.png")
    summary = precompute(str(data), "tiny-sana", cache, masks=True, **RUN)
    assert (summary["changed"], summary["latents_reused"]) == (1, 0) and calls == [1]

    # turning masks off (--no-masks: a run that does not say keeps them) re-reads every input (new keys: no mask in
    # them) and re-encodes no latent
    summary = precompute(str(data), "tiny-sana", cache, masks=False, **RUN)
    assert (summary["changed"], summary["latents_reused"]) == (4, 4) and calls == [1]
    assert all(len(s[MASK]) == 0 for s in by_source(cache).values())


def test_keys_without_masks_are_the_keys_of_before():
    """content_key of a sample without a mask hashes exactly what it hashed before masks existed."""
    import hashlib

    assert content_key(b"img", ["a", "b"]) == hashlib.sha256(b"img\x00a\x00b").hexdigest()
    assert content_key(b"img", ["a"], mask=b"m") != content_key(b"img", ["a"])
    assert content_key(b"img", ["a"], alpha_mask=True) not in (content_key(b"img", ["a"]), content_key(b"img", ["a"], mask=b"m"))


def test_mask_options_are_checked(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "data.toml").write_text('[[source]]\npath = "d"\nalpha_mask = true\nmask = "m"\n')
    with pytest.raises(ValueError, match="alpha channel.*mask"):
        PrecomputeConfig(str(tmp_path / "data.toml"))
    (tmp_path / "bad.toml").write_text('[[source]]\npath = "d"\nmasks = "yes"\n')
    with pytest.raises(ValueError, match="bad.toml:3: .*masks = 'yes': must be true or false"):
        PrecomputeConfig(str(tmp_path / "bad.toml"))
    sources = PrecomputeConfig(str(tmp_path / "d"), masks=True).sources()
    assert sources[0].mask_mode == "file" and sources[0].salt() != 0
    assert PrecomputeConfig(str(tmp_path / "d"), alpha_mask=True).sources()[0].mask_mode == "alpha"
    assert PrecomputeConfig(str(tmp_path / "d")).sources()[0].salt() == 0  # no masks: stamps as before


def test_a_cache_written_before_masks_keeps_its_keys_and_refuses_masked_sources(tmp_path):
    """tests/data's cache of an earlier version (no mask, no latent key): a run without masks finds every sample
    unchanged, and one asking for masks is refused before anything is encoded."""
    import shutil

    from precompute.sample_data import make_folder

    legacy = Path(__file__).resolve().parents[1] / "data" / "cache-v2-3b95788" / "tiny-sana"
    shutil.copytree(legacy, tmp_path / "cache")
    data = make_folder(tmp_path / "DATA", count=6)  # the legacy cache's dataset (its README)
    write_white_masks(data)
    summary = precompute(str(data), "tiny-sana", tmp_path / "cache", validation_prompt=["a red circle"], **RUN)
    assert (summary["unchanged"], summary["new"], summary["changed"]) == (6, 0, 0)
    assert MASK not in Cache(tmp_path / "cache").schema
    with pytest.raises(ValueError, match="built before masks could be stored: write it into a new cache"):
        precompute(str(data), "tiny-sana", tmp_path / "cache", masks=True, **RUN)


def write_white_masks(data: Path) -> None:
    for image in sorted(data.glob("*.png")):
        with Image.open(image) as img:
            Image.new("L", img.size, 255).save(image.with_name(image.stem + ".mask.png"))


def test_inspect_says_where_each_source_takes_its_masks(built):
    from typer.testing import CliRunner

    from shards.cli import app

    root, _, _ = built
    out = CliRunner().invoke(app, ["inspect", str(root / "cache")], env={"COLUMNS": "250"}).output
    lines = out.splitlines()

    def masks_of(source: str) -> str:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(source + " "))
        following = lines[at + 1] if at + 1 < len(lines) else ""
        return following.strip() if following.strip().startswith("loss masks") else ""

    assert masks_of("alpha") == "loss masks from the images' alpha channel"
    assert masks_of("folder") == f"loss masks from {root / 'folder-masks'}"
    assert masks_of("side") == "loss masks from mask files"
    assert masks_of("plain") == ""
