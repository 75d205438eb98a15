"""Several sources in one cache: the dataset file, scoped incremental runs, removing and naming sources."""

import json

import pytest
from typer.testing import CliRunner

from precompute.config import PrecomputeConfig
from precompute.removal import RemovalRefused
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from precompute.sources import default_name, read_dataset_file
from shards import Cache, ShardWriter, load
from shards.cli import app as shards_app

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RUN = dict(workers=0, progress=False, batch_size=4, max_shard_mb=0)


def write_toml(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


# ---- the dataset file ----------------------------------------------------------------------------------

def test_a_dataset_file_lists_sources_with_their_options(tmp_path):
    file = write_toml(tmp_path / "data.toml", """
# two folders
[[source]]
name = "dogs"
path = "/data/dogs"
repeats = 3
caption_prefix = "sks dog, "
default_caption = "a photo of sks dog"

[[source]]
path = "regularisation"   # relative to this file
""")
    dogs, reg = read_dataset_file(file)
    assert (dogs.name, dogs.path, dogs.repeats, dogs.caption_prefix, dogs.default_caption) == \
        ("dogs", "/data/dogs", 3, "sks dog, ", "a photo of sks dog")
    assert (reg.name, reg.path, reg.repeats) == ("regularisation", str(tmp_path / "regularisation"), None)
    assert dogs.record() == {"path": "/data/dogs", "repeats": 3, "caption_prefix": "sks dog, ",
                             "default_caption": "a photo of sks dog"}
    assert reg.record() == {"path": str(tmp_path / "regularisation"), "repeats": 1}
    assert dogs.salt() != 0 and reg.salt() == 0


@pytest.mark.parametrize("body, line, message", [
    ('[[source]]\npath = "a"\n\n[[source]]\npath = "b"\ncaptoin_prefix = "x"\n', 6, "did you mean 'caption_prefix'"),
    ('[[source]]\npath = "a"\nrepeats = 0\n', 3, "whole number"),
    ('[[source]]\npath = "a"\nrepeats = 2.5\n', 3, "whole number"),
    ('[[source]]\npath = "a"\nweight = -1\n', 3, "above 0"),
    ('[[source]]\npath = "a"\nrepeats = 2\nweight = 0.5\n', 4, "not both"),
    ('[[source]]\npath = "a"\n[[source]]\nname = "a"\npath = "b"\n', 4, "second source named 'a'"),
    ('[[source]]\npath = "a"\nweight = 1\n[[source]]\npath = "b"\n', 3, "some sources have a weight"),
    ('[[source]]\nname = "x"\n', 1, "has no path"),
    ('[[sources]]\npath = "a"\n', 1, "unknown table or key 'sources'"),
    ('[[source]]\npath = "a\n', 2, "not valid TOML"),
])
def test_a_dataset_file_with_a_mistake_is_refused_naming_the_line(tmp_path, body, line, message):
    file = write_toml(tmp_path / "data.toml", body)
    with pytest.raises(ValueError, match=message) as e:
        read_dataset_file(file)
    assert f"{file}:{line}" in str(e.value) or f"line {line}" in str(e.value)


def test_a_source_is_named_after_its_path():
    assert default_name("/data/photos/") == "photos"
    assert default_name("s3://bucket/laion/{00000..00999}.tar") == "laion"
    assert default_name("/data/hub/data/train-*.parquet") == "data"


# ---- scoped runs -----------------------------------------------------------------------------------------

@pytest.fixture
def two_folders(tmp_path):
    a = make_folder(tmp_path / "a", count=6, seed=1)
    b = make_folder(tmp_path / "b", count=4, seed=2)
    file = write_toml(tmp_path / "data.toml", f'[[source]]\nname = "photos"\npath = "{a}"\nrepeats = 3\n\n'
                                               f'[[source]]\npath = "{b}"\n')
    return a, b, file


def inspect_sources(cache) -> dict:
    out = CliRunner().invoke(shards_app, ["inspect", str(cache), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)["sources"]


def test_two_sources_in_one_cache_and_runs_that_touch_only_their_own(tmp_path, two_folders):
    a, b, file = two_folders
    cache = tmp_path / "cache"
    summary = precompute(str(file), "tiny-sana", cache, **RUN)
    assert summary["sources"]["photos"]["new"] == 6 and summary["sources"]["b"]["new"] == 4
    sources = inspect_sources(cache)
    assert {n: (s["samples"], s.get("repeats")) for n, s in sources.items()} == {"photos": (6, 3), "b": (4, 1)}
    assert sources["photos"]["path"] == str(a)

    # DATA=b alone: b is unchanged, photos is another source and is kept whole
    (b / "00000.png").unlink()
    summary = precompute(str(b), "tiny-sana", cache, **RUN)
    assert summary["sources"] == {"b": {"samples": 3, "captions": 3, "new": 0, "changed": 0, "unchanged": 3, "removed": 1,
                                        "duplicate": 0, "failed": 0}}
    assert summary["other_sources"] == {"photos": 6}
    assert {n: s["samples"] for n, s in inspect_sources(cache).items()} == {"photos": 6, "b": 3}
    assert inspect_sources(cache)["photos"]["repeats"] == 3  # its record is kept too

    # a shard holds one source's samples; shards ls names it
    lines = CliRunner().invoke(shards_app, ["ls", str(cache)]).output.splitlines()
    assert sorted({line.split("\t")[-1] for line in lines}) == ["b", "photos"]
    cache_ = Cache(cache)
    for j, name in enumerate(cache_.shards.datasets()):
        inputs = cache_.manifest.shards.samples_of(int(cache_.shards.rows[j]))[1]
        assert all((a if name == "photos" else b).joinpath(s).exists() for s in inputs)


def test_removing_a_source(tmp_path, two_folders):
    a, b, file = two_folders
    cache = tmp_path / "cache"
    precompute(str(file), "tiny-sana", cache, **RUN)
    with pytest.raises(ValueError, match="DATA lists that source too"):
        PrecomputeConfig(str(file), remove_source=["b"])
    with pytest.raises(ValueError, match="no such source; it has 'b', 'photos'"):
        precompute(str(a), "tiny-sana", cache, remove_source=["c"], **RUN)
    only_photos = write_toml(tmp_path / "photos.toml", f'[[source]]\nname = "photos"\npath = "{a}"\nrepeats = 3\n')
    summary = precompute(str(only_photos), "tiny-sana", cache, remove_source=["b"], **RUN)
    assert summary["sources"]["photos"]["unchanged"] == 6 and summary["other_sources"] == {}
    assert set(inspect_sources(cache)) == {"photos"} and len(Cache(cache)) == 6


def test_a_source_that_lost_most_inputs_is_refused_without_touching_the_others(tmp_path, two_folders):
    a, b, file = two_folders
    cache = tmp_path / "cache"
    precompute(str(file), "tiny-sana", cache, **RUN)
    for p in sorted(a.glob("*.png"))[:4]:
        p.unlink()
    with pytest.raises(RemovalRefused, match="4 of the 6 cached samples of source 'photos'"):
        precompute(str(file), "tiny-sana", cache, **RUN)
    assert {n: s["samples"] for n, s in inspect_sources(cache).items()} == {"photos": 6, "b": 4}


def test_samples_cached_before_sources_had_names_are_adopted_by_the_same_data(tmp_path):
    data = make_folder(tmp_path / "images", count=5)
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, **RUN)
    manifest = load(cache)
    with ShardWriter(cache, manifest.fingerprint, manifest.schema) as w:  # as a cache written before names existed
        w.rename_dataset("images", "")
    assert set(load(cache).datasets()) == {""}
    summary = precompute(str(data), "tiny-sana", cache, **RUN)
    assert summary["sources"]["images"]["unchanged"] == 5 and summary["sources"]["images"]["new"] == 0
    assert set(load(cache).datasets()) == {"images"}


# ---- training draws each source by its share -------------------------------------------------------------

def two_source_plan(records: dict, sizes=(400, 400), **kw):
    """A plan over two sources of `sizes` samples, each in two buckets of 10-sample shards."""
    from shards import Bucket
    from train.order import BatchPlan
    from train.streams import Stream, source_draws

    ranges, samples, start = {}, {}, 0
    for name, n in zip(("a", "b"), sizes):
        for bucket in (Bucket(64, 64), Bucket(48, 80)):
            half = n // 2
            ranges[Stream(bucket, name)] = [range(s, min(s + 10, start + half)) for s in range(start, start + half, 10)]
            samples[Stream(bucket, name)] = half
            start += half
    return BatchPlan(ranges, draws=source_draws(samples, records), **kw), start


def source_of(index: int, sizes=(400, 400)) -> str:
    return "a" if index < sizes[0] else "b"


@pytest.mark.parametrize("records, share", [({"a": {"repeats": 3}, "b": {"repeats": 1}}, 3.0),
                                            ({"a": {"weight": 0.25}, "b": {"weight": 0.75}}, 1 / 3)])
def test_sources_are_drawn_by_their_repeats_or_weights(records, share):
    from collections import Counter

    plan, n = two_source_plan(records, batch_size=4, seed=3, remainder="drop")
    drawn = Counter()
    for epoch in range(3):
        for planned in plan.global_batches(epoch):
            assert {source_of(i) for i in planned.indices} == {planned.source}  # a batch holds one source
            drawn.update(source_of(i) for i in planned.indices)
    assert drawn["a"] / drawn["b"] == pytest.approx(share, rel=0.02)
    if "repeats" in records["a"]:  # every sample of a three times an epoch, each pass shuffled anew
        epoch = [i for p in plan.global_batches(0) for i in p.indices]
        assert Counter(Counter(i for i in epoch if i < 400).values()) == Counter({3: 400})
    # the same seed, the same batches; a resume lands on the tail; N ranks see what one process sees
    again, _ = two_source_plan(records, batch_size=4, seed=3, remainder="drop")
    assert again(1) == plan(1)
    assert plan(1, start=7) == plan(1)[7:]
    ranks = [two_source_plan(records, batch_size=2, seed=3, rank=r, world_size=2, remainder="drop")[0] for r in range(2)]
    assert [a + b for a, b in zip(ranks[0](2), ranks[1](2))] == plan(2)


def test_a_one_source_plan_keeps_the_batches_of_a_cache_without_sources():
    from shards import Bucket
    from train.order import BatchPlan
    from train.streams import Stream

    ranges = {Bucket(64, 64): [range(0, 10), range(10, 17)], Bucket(48, 80): [range(17, 30)]}
    named = {Stream(b, "photos"): spans for b, spans in ranges.items()}
    assert BatchPlan(named, 3, seed=4)(0) == BatchPlan(ranges, 3, seed=4)(0)


# ---- caption options --------------------------------------------------------------------------------------

def test_caption_prefix_and_default_caption_and_editing_them(tmp_path):
    from precompute.images import content_key

    data = make_folder(tmp_path / "dogs", count=4)
    (data / "00003.txt").unlink()  # an image without a caption
    file = write_toml(tmp_path / "data.toml", f'[[source]]\npath = "{data}"\ncaption_prefix = "sks dog, "\n'
                                              f'default_caption = "a photo of sks dog"\n')
    cache = tmp_path / "cache"
    summary = precompute(str(file), "tiny-sana", cache, **RUN)
    assert summary["sources"]["dogs"]["new"] == 4 and summary["failed"] == 0
    expected = {content_key((data / f"{i:05d}.png").read_bytes(),
                            ["sks dog, " + (data / f"{i:05d}.txt").read_text().strip()]) for i in range(3)}
    expected.add(content_key((data / "00003.png").read_bytes(), ["sks dog, a photo of sks dog"]))
    assert {k for k, _ in Cache(cache).keys()} == expected
    assert precompute(str(file), "tiny-sana", cache, **RUN)["sources"]["dogs"]["unchanged"] == 4  # not read again

    # another prefix: every input is read and encoded again, replacing its old sample
    write_toml(file, f'[[source]]\npath = "{data}"\ncaption_prefix = "zwx dog, "\ndefault_caption = "a photo of zwx dog"\n')
    summary = precompute(str(file), "tiny-sana", cache, **RUN)
    assert (summary["sources"]["dogs"]["changed"], summary["sources"]["dogs"]["removed"]) == (4, 0)
    assert len(Cache(cache)) == 4 and not ({k for k, _ in Cache(cache).keys()} & expected)
    # without the options: the plain captions, and the image without one is skipped again
    write_toml(file, f'[[source]]\npath = "{data}"\n')
    summary = precompute(str(file), "tiny-sana", cache, allow_removal=True, **RUN)
    assert summary["sources"]["dogs"]["changed"] == 3 and summary["failed_by_reason"] == {"missing_caption": 1}


# ---- flipped latents ------------------------------------------------------------------------------------------

def test_a_flip_source_caches_the_latent_of_the_flipped_image_and_training_draws_both(tmp_path):
    import torch
    from PIL import Image, ImageOps

    from train.data import TrainingSamples

    plain, mirrored = tmp_path / "plain", tmp_path / "mirrored"
    made = make_folder(tmp_path / "drawn", count=6, seed=4)
    for d in (plain, mirrored):
        d.mkdir()
    for i, image in enumerate(sorted(made.glob("*.png"))):  # at a bucket's size: no crop to mirror
        img = Image.open(image).convert("RGB").resize((256, 256))
        img.save(plain / f"{i}.png")
        ImageOps.mirror(img).save(mirrored / f"{i}.png")
        for d in (plain, mirrored):
            (d / f"{i}.txt").write_text(image.with_suffix(".txt").read_text())
    file = write_toml(tmp_path / "data.toml", f'[[source]]\npath = "{plain}"\nflip = true\n\n[[source]]\npath = "{mirrored}"\n')
    cache = tmp_path / "cache"
    precompute(str(file), "tiny-sana", cache, workers=0, progress=False, batch_size=1, storage_dtype="fp32")
    c = Cache(cache)
    names = c.shards.datasets()
    by_input = {}
    for j, name in enumerate(names):
        row = int(c.shards.rows[j])
        start = int(c.shard_starts[j])
        for r, source in enumerate(c.manifest.shards.samples_of(row)[1]):
            by_input[(name, source)] = c[start + r]
    for i in range(6):
        flipped, reference = by_input[("plain", f"{i}.png")], by_input[("mirrored", f"{i}.png")]
        assert flipped["flip_latent"].shape[0] == 1 and reference["flip_latent"].shape[0] == 0
        torch.testing.assert_close(flipped["flip_latent"][0], reference["latent"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(flipped["latent"], reference["latent"])
    # training draws the flipped view about one time in two, for the flip source only
    samples = TrainingSamples(c, seed=0, caption_dropout=0.0)
    index = {key: i for key, i in c.keys()}
    key = by_input[("plain", "0.png")].key
    views = [samples[(epoch, index[key])]["latent"] for epoch in range(40)]
    is_flipped = [torch.equal(v, by_input[("plain", "0.png")]["flip_latent"][0]) for v in views]
    assert all(f or torch.equal(v, by_input[("plain", "0.png")]["latent"]) for f, v in zip(is_flipped, views))
    assert 10 <= sum(is_flipped) <= 30
    other = index[by_input[("mirrored", "0.png")].key]
    assert all(torch.equal(samples[(e, other)]["latent"], by_input[("mirrored", "0.png")]["latent"]) for e in range(10))


# ---- several caches in one run --------------------------------------------------------------------------------

def test_several_caches_train_by_their_weights_and_resume_exactly(tmp_path):
    from train.config import TrainConfig
    from train.loop import train

    small, large = tmp_path / "c256", tmp_path / "c256-more"
    precompute(str(make_folder(tmp_path / "x", count=6, seed=1)), "tiny-sana", small, **RUN)
    precompute(str(make_folder(tmp_path / "y", count=6, seed=2)), "tiny-sana", large, **RUN)

    def cfg(run, steps, **kw):
        return TrainConfig(model="tiny-sana", cache=[str(small), str(large)], cache_weight=[3, 1], run=run, steps=steps,
                           batch_size=2, progress=False, log_every=1, checkpoint_every=1000, validate=False, lr=1e-3, **kw)

    train(cfg(tmp_path / "straight", 8))
    train(cfg(tmp_path / "resumed", 4))
    train(cfg(tmp_path / "resumed", 8))
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("straight", "resumed")]
    assert [r["loss"] for r in rows[0]] == pytest.approx([r["loss"] for r in rows[1]], rel=1e-6, abs=1e-7)
    drawn = rows[0][-1]["samples_by_source"]
    assert drawn == rows[1][-1]["samples_by_source"] and set(drawn) == {"c256/x", "c256-more/y"}
    state = json.loads(sorted((tmp_path / "resumed" / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert [c["cache_root"] for c in state["caches"]] == [str(small.resolve()), str(large.resolve())]

    from train.order import BatchPlan
    plan = BatchPlan.of([Cache(small), Cache(large)], 2, weights=[3, 1])
    assert plan.draws_by_source() == {"c256/x": 9, "c256-more/y": 3}  # 12 samples, shared 3:1
    with pytest.raises(ValueError, match="trained from 2 cache"):
        train(TrainConfig(model="tiny-sana", cache=[str(small)], run=tmp_path / "resumed", steps=9, batch_size=2,
                          progress=False, validate=False))
    with pytest.raises(ValueError, match="--cache-weight"):
        train(cfg(tmp_path / "resumed", 9).__class__(**{**cfg(tmp_path / "resumed", 9).__dict__, "cache_weight": [1, 1]}))


def test_caches_of_other_encoders_do_not_train_one_run(tmp_path):
    from train.config import TrainConfig
    from train.loop import train

    a, b = tmp_path / "a", tmp_path / "b"
    data = make_folder(tmp_path / "x", count=2)
    precompute(str(data), "tiny-sana", a, **RUN)
    precompute(str(data), "tiny-sana", b, storage_dtype="fp32", **RUN)
    with pytest.raises(ValueError, match="storage dtype"):
        train(TrainConfig(model="tiny-sana", cache=[str(a), str(b)], run=tmp_path / "run", steps=1, batch_size=1,
                          progress=False, validate=False))
    with pytest.raises(ValueError, match="2 weights for 1 caches"):
        TrainConfig(model="tiny-sana", cache=[str(a)], cache_weight=[1, 2])
