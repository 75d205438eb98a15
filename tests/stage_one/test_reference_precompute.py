"""Stage one of an edit preset end to end: a folder of images with their reference images beside them (`x.ref.png`)
becomes a cache whose samples hold each reference's latent as the family prepares and encodes it; an edited reference
re-encodes exactly its sample, a re-run with nothing changed encodes nothing, and an edited caption reuses the
cached latents, references included. An edit-only model refuses a run without reference images before loading."""

import json
import random

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import precompute.run as stage_one
from precompute.encode import Encoders
from precompute.families import family
from precompute.presets import get_preset
from precompute.run import main as precompute
from precompute.sample_data import draw_sample
from shards import LATENT_KEY, Cache
from shards.cli import app as shards_app
from shards.references import REFERENCE_LATENT, REFERENCE_SHAPE, unpack

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

MODEL = "tiny-flux1-kontext"
RUN = dict(workers=0, progress=False, batch_size=2, max_shard_mb=0, storage_dtype="fp32", references=True)


def edit_folder(root, count: int, seed: int = 0):
    """x.png (the edit's target), x.ref.png (its input: another drawing, of another size) and x.txt per sample."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        target, caption = draw_sample(rng)
        reference, _ = draw_sample(rng)
        target.save(root / f"{i}.png")
        reference.save(root / f"{i}.ref.png")
        (root / f"{i}.txt").write_text(f"make it {caption}")
    return root


def by_source(cache) -> dict:
    c = Cache(cache)
    return {bytes(c[i]["source"].tolist()).decode(): c[i] for i in range(len(c))}


class Calls:
    """How many images and references went through the VAE."""

    def __init__(self, monkeypatch):
        self.images, self.references = [], []
        images, references = Encoders.encode_images, Encoders.encode_references
        monkeypatch.setattr(Encoders, "encode_images", lambda s, px: self.images.append(len(px)) or images(s, px))
        monkeypatch.setattr(Encoders, "encode_references", lambda s, px: self.references.append(len(px)) or references(s, px))


@pytest.fixture(scope="module")
def enc():
    return Encoders(get_preset(MODEL), torch.device("cpu"))


def expected_reference(enc, path) -> torch.Tensor:
    """What the cache must hold for reference image `path`: the family's `prepare_reference`, then its
    `encode_references` with the cache's VAE."""
    preset = get_preset(MODEL)
    with Image.open(path) as img, torch.inference_mode():
        pixels = family(preset.family).prepare_reference(preset, img.convert("RGB"), 0, 1)["pixels"]
        return family(preset.family).encode_references(enc.vae, pixels[None], enc.latent)[0]


def test_the_cache_holds_each_prepared_reference_encoded_and_edits_re_encode_one_sample(enc, tmp_path, monkeypatch):
    data, cache = edit_folder(tmp_path / "data", 3), tmp_path / "cache"
    summary = precompute(str(data), MODEL, cache, **RUN)
    assert summary["new"] == 3 and summary["references"]["samples_with_references"] == 3
    assert summary["references"]["references_per_sample"] == 1.0
    before = by_source(cache)
    for name, s in before.items():
        (ref,) = unpack(s)
        assert ref.shape[0] == s["latent_mean"].shape[0]
        torch.testing.assert_close(ref, expected_reference(enc, data / name.replace(".png", ".ref.png")), rtol=0, atol=0)

    calls = Calls(monkeypatch)
    summary = precompute(str(data), MODEL, cache, **RUN)  # nothing changed: nothing read, nothing encoded
    assert (summary["new"], summary["changed"], summary["unchanged"]) == (0, 0, 3)
    assert calls.images == calls.references == []

    # one reference edited: exactly its sample is encoded again, its image and its reference
    draw_sample(random.Random(99))[0].save(data / "1.ref.png")
    summary = precompute(str(data), MODEL, cache, **RUN)
    assert (summary["new"], summary["changed"], summary["unchanged"], summary["removed"]) == (0, 1, 2, 0)
    assert calls.images == [1] and calls.references == [1]
    after = by_source(cache)
    assert after["1.png"].key != before["1.png"].key
    torch.testing.assert_close(unpack(after["1.png"])[0], expected_reference(enc, data / "1.ref.png"), rtol=0, atol=0)
    for name in ("0.png", "2.png"):
        assert after[name].key == before[name].key

    # a caption edited: the sample's latents, its reference's among them, are copied, not encoded
    (data / "2.txt").write_text("make it a green triangle")
    summary = precompute(str(data), MODEL, cache, **RUN)
    assert (summary["changed"], summary["latents_reused"]) == (1, 1)
    assert calls.images == [1] and calls.references == [1]
    again = by_source(cache)
    for name in (REFERENCE_LATENT, REFERENCE_SHAPE, "latent_mean", LATENT_KEY):
        assert torch.equal(again["2.png"][name], after["2.png"][name])


def test_inspect_reports_references_per_sample_and_their_bytes(tmp_path):
    data, cache = edit_folder(tmp_path / "data", 2, seed=3), tmp_path / "cache"
    precompute(str(data), MODEL, cache, **RUN)
    result = CliRunner().invoke(shards_app, ["inspect", str(cache), "--json"])
    assert result.exit_code == 0, result.output
    refs = json.loads(result.output)["references"]
    samples = by_source(cache).values()
    stored = sum(s[REFERENCE_LATENT].numel() * 4 + s[REFERENCE_SHAPE].numel() * 4 for s in samples)
    assert (refs["samples_with_references"], refs["references"], refs["references_per_sample"]) == (2, 2, 1.0)
    offsets = sum(2 * 8 * (int(n) + 1) for n in Cache(cache).manifest.shards.column("samples"))  # two fields' (N + 1) int64
    assert refs["bytes_per_sample"] == (stored + offsets) / 2
    text = CliRunner().invoke(shards_app, ["inspect", str(cache)]).output
    assert "references: 2 samples with reference images, 1.00 references per sample" in text


def test_an_edit_only_model_without_reference_images_is_refused_before_loading(tmp_path, monkeypatch):
    data = edit_folder(tmp_path / "data", 1)
    loaded = []
    monkeypatch.setattr(stage_one, "weights_sources", lambda *a, **k: loaded.append(a) or {})
    with pytest.raises(ValueError, match="edit model.*--references"):
        precompute(str(data), MODEL, tmp_path / "cache", **{**RUN, "references": False})
    assert not loaded and not (tmp_path / "cache").exists()


def test_text_to_image_and_multi_reference_edits_share_a_cache(tmp_path):
    """A model that takes references without needing them: a source of edits with two references each (of two sizes)
    beside a source of plain images. Every sample has the reference fields, empty for the plain ones; the summary and
    inspect count them per source."""
    model = "tiny-flux2"
    edits, plain = edit_folder(tmp_path / "edits", 2, seed=5), tmp_path / "plain"
    rng = random.Random(6)
    for i in range(2):  # a square reference, then a tall one
        with Image.open(edits / f"{i}.ref.png") as first:
            first.resize((256, 256)).save(edits / f"{i}.ref0.png")
        (edits / f"{i}.ref.png").unlink()
        draw_sample(rng)[0].resize((128, 256)).save(edits / f"{i}.ref1.png")
    plain.mkdir()
    for i in range(2):
        img, caption = draw_sample(rng)
        img.save(plain / f"{i}.png")
        (plain / f"{i}.txt").write_text(caption)
    (tmp_path / "data.toml").write_text(f'[[source]]\npath = "{edits}"\nreferences = true\n[[source]]\npath = "{plain}"\n')
    cache = tmp_path / "cache"
    summary = precompute(str(tmp_path / "data.toml"), model, cache, **{**RUN, "references": False})
    refs = summary["references"]
    assert (refs["samples_with_references"], refs["samples_without_references"], refs["references_per_sample"]) == (2, 2, 2.0)
    assert refs["sources"] == {"edits": {"samples_with_references": 2, "references": 4},
                               "plain": {"samples_with_references": 0, "references": 0}}
    preset, enc = get_preset(model), Encoders(get_preset(model), torch.device("cpu"))
    c = Cache(cache)
    for i in range(len(c)):
        s, dataset = c[i], c.manifest.shards.datasets()[c.locate(i)[0]]
        name = bytes(s["source"].tolist()).decode()
        got = unpack(s)
        if dataset == "plain":
            assert s[REFERENCE_LATENT].shape == (0, 128) and s[REFERENCE_SHAPE].shape == (0, 2)
            continue
        assert len(got) == 2 and got[0].shape != got[1].shape  # each reference at its own size
        for j, latent in enumerate(got):
            with Image.open(edits / name.replace(".png", f".ref{j}.png")) as img, torch.inference_mode():
                pixels = family(preset.family).prepare_reference(preset, img.convert("RGB"), j, 2)["pixels"]
                want = family(preset.family).encode_references(enc.vae, pixels[None], enc.latent)[0]
            torch.testing.assert_close(latent, want, rtol=0, atol=0)
    text = CliRunner().invoke(shards_app, ["inspect", str(cache)]).output
    assert "2 samples with reference images (and 2 without, text-to-image), 2.00 references per sample" in text
    assert "reference images: 4 for 2 samples (2.00 per sample)" in text
