"""Stage one of an edit model whose text encoder sees the reference images: each caption is encoded with its
sample's references and its text is keyed by caption and references, in the cache that stores texts once and in the
one that stores them with each sample; an edited reference re-encodes its sample's text; a text shard of such texts
cannot be rebuilt from its captions, and a repair says so."""

import random
import shutil

import pytest
import torch
from PIL import Image

from precompute.encode import Encoders
from precompute.families import family
from precompute.presets import get_preset
from precompute.run import main as precompute
from precompute.sample_data import draw_sample
from shards import Cache, verify
from shards.references import references_digest
from shards.texts import TEXT_KEYS, keys_of, text_key

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

MODEL = "tiny-qwen-image-edit"
RUN = dict(workers=0, progress=False, batch_size=2, max_shard_mb=0, storage_dtype="fp32", references=True)
CAPTIONS = ["make it red", "make it red", "make it blue", "make it blue"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Four edits: two of one caption with other references, two of another caption with the same reference (the
    same bytes), every target its own drawing."""
    root = tmp_path_factory.mktemp("edits")
    rng = random.Random(7)
    for i, caption in enumerate(CAPTIONS):
        draw_sample(rng)[0].save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(caption)
        if i != 3:
            draw_sample(rng)[0].save(root / f"{i}.ref.png")
    shutil.copy(root / "2.ref.png", root / "3.ref.png")
    return root


def raw(cache) -> dict:
    c = Cache(cache)
    return {bytes(s["source"].tolist()).decode(): s for s in (c.read(i, resolve=False) for i in range(len(c)))}


def resolved(cache) -> dict:
    c = Cache(cache)
    return {bytes(c[i]["source"].tolist()).decode(): c[i] for i in range(len(c))}


def expected_text(enc, data, i: int) -> torch.Tensor:
    """Sample i's caption through the family's `encode_text` with its reference's `text_pixels`, as prepared."""
    preset = get_preset(MODEL)
    with Image.open(data / f"{i}.ref.png") as img, torch.inference_mode():
        ref = family(preset.family).prepare_reference(preset, img.convert("RGB"), 0, 1)
        return enc.encode_text([CAPTIONS[i]], references=[[ref["text_pixels"]]]).fields[0]["text"]


def test_a_caption_with_other_references_is_another_text_and_with_the_same_one_text(data, tmp_path):
    cache = tmp_path / "cache"
    precompute(str(data), MODEL, cache, **RUN)
    samples = raw(cache)
    digest = {i: references_digest([(data / f"{i}.ref.png").read_bytes()]) for i in range(4)}
    for i in range(4):
        assert keys_of(samples[f"{i}.png"][TEXT_KEYS]) == [text_key(CAPTIONS[i], digest[i])]
    assert digest[0] != digest[1] and digest[2] == digest[3]
    assert Cache(cache).manifest.text_stats()["texts"] == 3
    enc = Encoders(get_preset(MODEL), torch.device("cpu"))
    texts = resolved(cache)
    for i in (0, 1, 2):
        torch.testing.assert_close(texts[f"{i}.png"]["text"], expected_text(enc, data, i), rtol=1e-5, atol=1e-5)
    assert not torch.equal(texts["0.png"]["text"], texts["1.png"]["text"])  # the references change the text

    # texts stored with each sample: the same tensors
    per_sample = tmp_path / "per-sample"
    precompute(str(data), MODEL, per_sample, dedup_texts=False, **RUN)
    for name, s in resolved(per_sample).items():
        torch.testing.assert_close(s["text"], texts[name]["text"], rtol=0, atol=0)


def test_an_edited_reference_re_encodes_its_samples_text_alone(data, tmp_path, monkeypatch):
    work = tmp_path / "data"
    shutil.copytree(data, work)
    cache = tmp_path / "cache"
    precompute(str(work), MODEL, cache, **RUN)
    calls = []
    encode = Encoders.encode_text
    monkeypatch.setattr(Encoders, "encode_text", lambda self, captions, *a, **k: calls.append(list(captions)) or encode(self, captions, *a, **k))
    draw_sample(random.Random(8))[0].save(work / "3.ref.png")  # 3 no longer shares 2's reference
    summary = precompute(str(work), MODEL, cache, **RUN)
    assert (summary["changed"], summary["unchanged"]) == (1, 3)
    assert calls[0] == ["make it blue"]  # its text, with its new reference; then the run's prompts (the empty caption)
    assert all("make it" not in c for cs in calls[1:] for c in cs)
    assert keys_of(raw(cache)["3.png"][TEXT_KEYS]) == [text_key("make it blue", references_digest([(work / "3.ref.png").read_bytes()]))]
    assert Cache(cache).manifest.text_stats()["texts"] == 4


def test_a_repair_rebuilds_a_text_shard_of_texts_seen_with_references_from_their_samples_inputs(data, tmp_path, capsys):
    """Such a text cannot be rebuilt from its caption: the repair reads the inputs of the samples referring to it and
    encodes it again with their references; with those inputs gone, the text shard is named, not repaired."""
    work = tmp_path / "data"
    shutil.copytree(data, work)
    cache = tmp_path / "cache"
    precompute(str(work), MODEL, cache, **RUN)
    before = {name: s["text"].clone() for name, s in resolved(cache).items()}  # not views of the files damaged next
    paths = Cache(cache).texts.paths()
    for path in paths:  # every text shard damaged; the sample shards intact
        (cache / path).write_bytes((cache / path).read_bytes()[:100])
    assert not verify(cache).ok
    summary = precompute(str(work), MODEL, cache, repair=True, **RUN)
    assert summary["repaired_text_shards"] == len(paths) and "unrepairable_text_shards" not in summary and summary["repaired_shards"] == 0
    assert verify(cache).ok
    for name, s in resolved(cache).items():
        torch.testing.assert_close(s["text"], before[name], rtol=0, atol=0)

    # the only sample of a text lost its input: that text shard cannot be rebuilt and is named
    key = text_key(CAPTIONS[0], references_digest([(work / "0.ref.png").read_bytes()]))
    (path,) = [p for p in Cache(cache).texts.paths() if key in Cache(cache).manifest.texts.samples_of(
        Cache(cache).manifest.texts.row_of(p))[0]]
    (cache / path).write_bytes((cache / path).read_bytes()[:100])
    (work / "0.png").unlink()
    capsys.readouterr()
    summary = precompute(str(work), MODEL, cache, repair=True, **RUN)
    assert summary["unrepairable_text_shards"] == [path]
    assert "no sample referring to them was read again" in capsys.readouterr().err


def test_a_caption_sees_every_reference_of_its_sample_in_order(tmp_path):
    model = "tiny-qwen-image-edit-2509"
    data, rng = tmp_path / "data", random.Random(9)
    data.mkdir()
    draw_sample(rng)[0].save(data / "0.png")
    (data / "0.txt").write_text("put the two together")
    for j in range(2):
        draw_sample(rng)[0].save(data / f"0.ref{j}.png")
    cache = tmp_path / "cache"
    precompute(str(data), model, cache, **RUN)
    refs = [(data / f"0.ref{j}.png").read_bytes() for j in range(2)]
    (sample,) = raw(cache).values()
    assert keys_of(sample[TEXT_KEYS]) == [text_key("put the two together", references_digest(refs))]
    preset = get_preset(model)
    enc = Encoders(preset, torch.device("cpu"))
    with torch.inference_mode():
        pixels = []
        for j in range(2):
            with Image.open(data / f"0.ref{j}.png") as img:
                pixels.append(family(preset.family).prepare_reference(preset, img.convert("RGB"), j, 2)["text_pixels"])
        want = enc.encode_text(["put the two together"], references=[pixels]).fields[0]["text"]
    (got,) = resolved(cache).values()
    torch.testing.assert_close(got["text"], want, rtol=1e-5, atol=1e-5)
