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
    assert summary["sources"] == {"b": {"samples": 3, "new": 0, "changed": 0, "unchanged": 3, "removed": 1,
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
