"""A cache of caption variants end to end: stage one stores each caption's variants as the sample's captions (their
embeddings are those of the expected strings), a re-run re-encodes nothing, `shards inspect` shows them, and
training draws every variant about equally often and exactly again on resume."""

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from precompute.captions import TagOptions, caption_variants
from precompute.config import PrecomputeConfig
from precompute.encode import Encoders
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache
from shards.cli import app as shards_app
from train.data import BatchStream, Epoch, TrainingSamples
from train.order import BatchPlan

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

CAPTIONS = ["1girl, solo, red hair, smile, outdoors, sky", "cat, sitting, window, sunlight, indoors",
            "dog, running, beach, waves, sunset, sand, 4k", "solo, smile"]  # the last: two tags, few variants
OPTIONS = 'caption_prefix = "sks, "\nshuffle_tags = true\nkeep_tokens = 1\ntag_dropout = 0.3\ncaption_variants = 4\n'
TAGS = TagOptions(4, shuffle=True, keep_tokens=1, dropout=0.3)
RUN = dict(workers=0, progress=False, storage_dtype="fp32", max_shard_mb=0)


@pytest.fixture(scope="module", params=[True, False], ids=["texts-once", "texts-inline"])
def built(request, tmp_path_factory):
    """Four images with tag-list captions, cached as source "tags" with prefix, shuffle, keep_tokens, dropout and
    four variants; each text stored once (the default) or with each sample."""
    root, run = tmp_path_factory.mktemp("variants"), {**RUN, "dedup_texts": request.param}
    data = make_folder(root / "data", count=len(CAPTIONS))
    for caption, txt in zip(CAPTIONS, sorted(data.glob("*.txt"))):
        txt.write_text(caption + "\n", encoding="utf-8")
    file = root / "data.toml"
    file.write_text(f'[[source]]\nname = "tags"\npath = "data"\n{OPTIONS}', encoding="utf-8")
    summary = precompute(str(file), "tiny-sana", root / "cache", **run)
    assert summary["new"] == len(CAPTIONS) and summary["failed"] == 0
    assert summary["sources"]["tags"]["captions"] == 14  # 4 + 4 + 4 + 2 (the run's summary says so per source)
    return SimpleNamespace(root=root, run=run)


def expected(root: Path, sample) -> list[str]:
    """The captions a cached sample should hold, from its image and caption files."""
    image = root / "data" / bytes(sample["source"].tolist()).decode()
    caption = image.with_suffix(".txt").read_text(encoding="utf-8").strip()
    return caption_variants([caption], TAGS, "sks, ", hashlib.sha256(image.read_bytes()).digest())


def test_the_cache_holds_the_embeddings_of_each_captions_variants(built):
    cache = Cache(built.root / "cache")
    encoders = Encoders(PrecomputeConfig("unused").preset(), torch.device("cpu"), vae=False)
    counts = []
    for i in range(len(cache)):
        s = cache[i]
        texts = expected(built.root, s)
        first = texts[0].removeprefix("sks, ").split(", ")[0]
        assert all(t.startswith(f"sks, {first}") for t in texts)  # the prefix, then the kept tag, in every variant
        lengths = s["text_lengths"].tolist()
        assert len(lengths) == len(texts)
        rows = torch.split(s["text"], lengths)
        for text, stored in zip(texts, rows):  # each caption's rows are the embedding of its string, in order
            fresh = encoders.encode_text([text]).fields[0]["text"]
            assert stored.shape == fresh.shape and torch.allclose(stored, fresh, atol=1e-5), text
        counts.append(len(texts))
    assert sorted(counts) == [2, 4, 4, 4]  # "solo, smile" keeps "solo": only itself and "sks, solo"


def files(cache: Path) -> dict[str, bytes]:
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file() and not p.name.startswith(".lock")}


def test_a_rerun_reencodes_nothing_and_an_edit_of_the_options_reencodes_the_source(built, tmp_path):
    before = files(built.root / "cache")
    for image in (built.root / "data").glob("*.png"):  # touched: read again, keyed again, found unchanged
        os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    again = precompute(str(built.root / "data.toml"), "tiny-sana", built.root / "cache", **built.run)
    assert (again["unchanged"], again["new"], again["changed"], again["encoded"]) == (len(CAPTIONS), 0, 0, 0)
    assert {k: v for k, v in files(built.root / "cache").items() if "_log" not in k} == \
        {k: v for k, v in before.items() if "_log" not in k}  # the same shards: only the inputs' stamps were recorded
    edited = tmp_path / "data.toml"
    edited.write_text((built.root / "data.toml").read_text().replace("tag_dropout = 0.3", "tag_dropout = 0.5")
                      .replace('path = "data"', f'path = "{built.root / "data"}"'), encoding="utf-8")
    other = tmp_path / "cache"
    changed = precompute(str(edited), "tiny-sana", other, **built.run)
    assert changed["new"] == len(CAPTIONS)
    keys = {k for k, _ in Cache(built.root / "cache").keys()}
    assert len(keys - {k for k, _ in Cache(other).keys()}) >= 3  # other variants, other keys


def test_inspect_shows_the_variants_and_the_captions_per_sample(built):
    out = CliRunner().invoke(shards_app, ["inspect", str(built.root / "cache"), "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    source = info["sources"]["tags"]
    if built.run["dedup_texts"]:  # every variant a text of its own: 14 texts, each stored once
        assert (info["texts"]["texts"], info["texts"]["references"]) == (14, 14)
    assert {k: source[k] for k in ("caption_variants", "shuffle_tags", "keep_tokens", "tag_dropout", "tag_separator")} == \
        {"caption_variants": 4, "shuffle_tags": True, "keep_tokens": 1, "tag_dropout": 0.3, "tag_separator": ","}
    assert source["captions"] == 14 and source["captions_per_sample"] == 3.5
    text = CliRunner().invoke(shards_app, ["inspect", str(built.root / "cache")], env={"COLUMNS": "250"}).output
    assert "3.50 captions per sample (14 in all); caption_variants 4 (shuffle_tags, keep_tokens 1, tag_dropout 0.3, " \
           "tag_separator ',')" in text, text


def test_training_draws_every_variant_about_equally_often(built):
    cache = Cache(built.root / "cache")
    samples = TrainingSamples(cache, seed=5, caption_dropout=0.0)
    epochs = 400
    for i in range(len(cache)):
        fields = cache[i].fields
        n = samples.layout.captions(fields)
        options = [samples.layout.caption(fields, j)["text"] for j in range(n)]
        drawn = Counter()
        for epoch in range(epochs):
            text = samples[(epoch, i)]["cond"]["text"]
            drawn[next(j for j, t in enumerate(options) if t.shape == text.shape and torch.equal(t, text))] += 1
        assert set(drawn) == set(range(n))
        assert all(abs(c - epochs / n) < 0.25 * epochs / n + 15 for c in drawn.values()), drawn  # about 5 sd


def take(cache_root: Path, n: int, workers: int, start=(0, 0)) -> list[dict]:
    """The first `n` batches of a stream from (epoch, cursor) `start`, epochs handed over as the training loop does."""
    cache = Cache(cache_root)

    def epoch(number, first=0):
        return Epoch(number, BatchPlan.of(cache, 2, seed=3), TrainingSamples(cache, 3, 0.0), first)

    out = []
    with BatchStream(epoch(*start), workers=workers, prefetch=2, readahead=2) as stream:
        while len(out) < n:
            if stream.needs_epoch():
                stream.add_epoch(epoch(stream._epochs[-1].number + 1))
            out.append(next(stream))
    return out


def test_a_resumed_run_draws_the_same_variants(built):
    full = take(built.root / "cache", 12, workers=0)
    at = next(k for k, b in enumerate(full) if b["epoch"] == 2)
    resumed = take(built.root / "cache", 12 - at, workers=2, start=(2, 0))
    for a, b in zip(full[at:], resumed):
        assert (a["epoch"], a["cursor"], a["keys"]) == (b["epoch"], b["cursor"], b["keys"])
        assert torch.equal(a["text"], b["text"]) and torch.equal(a["text_mask"], b["text_mask"])
    picks = {tuple(b["text_mask"].sum(1).tolist()) for b in full}
    assert len(picks) > 1  # the draws differ from batch to batch: not the same caption each time
