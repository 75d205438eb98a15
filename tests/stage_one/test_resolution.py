"""Stage one at other resolutions than the preset's: `--resolution` (one or several) and a dataset file's per-source
`resolution`, each on a bucket table built as the published ones are; keys and fingerprints of caches at the base
resolution unchanged."""

import shutil
from pathlib import Path

import pytest

from precompute.config import PrecomputeConfig
from precompute.images import content_key
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import ASPECT_RATIO_TABLES, Cache, CacheSpec, load, resolution_table

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models


def run(data, cache, model="tiny-sana", **kw):
    return precompute(str(data), model, Path(cache), workers=0, progress=False, allow_upscale=True, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "folder", count=3)


def by_resolution(cache: Path) -> dict[int, dict[str, str]]:
    """resolution (pixels) -> key -> bucket of every sample."""
    c = Cache(cache)
    spec = c.spec
    out: dict[int, dict[str, str]] = {}
    for j, entry in zip(c.shards.rows, c.shards):
        keys = c.manifest.shards.samples_of(int(j))[0]
        out.setdefault(spec.resolution(entry.resolution), {}).update({k: entry.bucket for k in keys})
    return out


def test_resolution_option_builds_each_table_and_names_the_range(folder):
    config = PrecomputeConfig(str(folder), "tiny-sana", resolution=" 512, 768,512")
    assert config.resolution == "512,768" and config.resolutions() == (512, 768)
    assert config.policy(512).buckets == ASPECT_RATIO_TABLES[512]  # published, and its sides fit the tiny DC-AE's 8 px
    assert config.policy(768).buckets == resolution_table(768, 8)
    assert config.policy(512).resolution == 512 and config.policy().resolution == 0  # the base (256): keys as before
    assert config.policy().buckets == ASPECT_RATIO_TABLES[256]
    # Sana's 32 px tokens: 768 is built on multiples of 32, up to Sana's 4096
    sana = PrecomputeConfig(str(folder), "sana-600m", resolution="768,4096")
    assert all(b.height % 32 == 0 and b.width % 32 == 0 for r in (768, 4096) for b in sana.policy(r).buckets)
    assert sana.policy(1024).resolution == 0 and sana.policy(1024).buckets == ASPECT_RATIO_TABLES[1024]
    for bad, largest in (("500", 2048), ("192", 2048), ("4096", 2048), ("512,x", 2048)):
        with pytest.raises(ValueError, match=rf"--resolution {bad}: .* multiple of 64 from 256 to {largest}|--resolution {bad}: .*whole"):
            PrecomputeConfig(str(folder), "tiny-sana", resolution=bad)
    with pytest.raises(ValueError, match="--resolution 512: 512 is not a multiple of 64 from 256 to 384"):
        PrecomputeConfig(str(folder), "tiny-sd3", resolution="512")  # its learned positions end at 768 px a side


def test_a_dataset_file_sets_a_sources_resolutions(folder, tmp_path):
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\nname = "a"\npath = "{folder}"\nresolution = [512, 768]\n\n'
                    f'[[source]]\nname = "b"\npath = "{tmp_path / "other"}"\nresolution = 512\n\n'
                    f'[[source]]\nname = "c"\npath = "{tmp_path / "third"}"\n')
    config = PrecomputeConfig(str(toml), "tiny-sana", resolution="256,768")
    a, b, c = config.sources()
    assert (config.resolutions(a), config.resolutions(b), config.resolutions(c)) == ((512, 768), (512,), (256, 768))
    assert a.record()["resolution"] == [512, 768] and "resolution" not in c.record()
    toml.write_text(f'[[source]]\npath = "{folder}"\nresolution = 500\n')
    with pytest.raises(ValueError, match=r"data.toml:3: .*resolution = 500: must be a resolution.*multiple of 64 from 256"):
        PrecomputeConfig(str(toml), "tiny-sana")
    toml.write_text(f'[[source]]\npath = "{folder}"\nresolution = [512, 3072]\n')
    with pytest.raises(ValueError, match="source 'folder' sets resolution = 3072: .*from 256 to 2048"):
        PrecomputeConfig(str(toml), "tiny-sana")


def test_the_key_mixes_in_a_resolution_other_than_the_base():
    assert content_key(b"img", ["a cat"]) == content_key(b"img", ["a cat"], resolution=0)
    assert len({content_key(b"img", ["a cat"], resolution=r) for r in (0, 512, 768)}) == 3


@pytest.mark.slow
def test_two_resolutions_in_one_cache_keep_the_base_ones_keys_and_fingerprint(folder, tmp_path):
    run(folder, tmp_path / "multi")
    base = load(tmp_path / "multi")
    assert "resolutions" not in base.extra["precompute"]  # a cache of the base resolution records nothing new

    # a cache of the base resolution (tiny presets: 256) extended with 512: its samples are kept, keys and all
    summary = run(folder, tmp_path / "multi", resolution="256,512")
    assert (summary["unchanged"], summary["new"], summary["changed"]) == (3, 3, 0)
    multi = load(tmp_path / "multi")
    assert multi.fingerprint == base.fingerprint  # the fingerprint does not depend on the resolutions
    assert multi.resolutions() == {0: 3, 512: 3}
    samples = by_resolution(tmp_path / "multi")
    assert set(samples[256]) == {k for k, *_ in base.samples()}  # the base resolution's samples keep their keys
    assert not set(samples[256]) & set(samples[512])
    spec = CacheSpec.of(multi)
    assert spec.resolutions() == [256, 512]
    assert spec.tables == {256: ASPECT_RATIO_TABLES[256], 512: ASPECT_RATIO_TABLES[512]}
    for resolution, buckets in samples.items():
        assert set(buckets.values()) <= set(spec.tables[resolution])

    again = run(folder, tmp_path / "multi")  # a re-run without --resolution keeps the cache's resolutions
    assert (again["unchanged"], again["new"], again["removed"]) == (6, 0, 0)
    data = tmp_path / "copy" / "folder"  # the same source, by name
    shutil.copytree(folder, data)
    (data / "00001.txt").write_text("a new caption")  # the image is the same: each resolution's latent is its own
    edited = run(data, tmp_path / "multi")
    assert (edited["changed"], edited["unchanged"]) == (2, 4)
    cache = Cache(tmp_path / "multi")
    for i in range(len(cache)):
        s = cache[i]
        assert s["latent"].shape[1:] == (s.bucket.height // 8, s.bucket.width // 8)
    fewer = run(data, tmp_path / "multi", resolution="512")  # naming fewer removes the others, counted
    assert (fewer["unchanged"], fewer["removed"]) == (3, 3)
    assert load(tmp_path / "multi").resolutions() == {512: 3}
    assert CacheSpec.of(load(tmp_path / "multi")).resolutions() == [512]


@pytest.mark.slow
def test_768_cache_of_a_16px_model_is_bucketed_on_the_768_table(folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    for p in sorted(data.glob("00002.*")):
        p.unlink()
    run(data, tmp_path / "cache", "tiny-flux", resolution="768")
    cache = load(tmp_path / "cache")
    spec = CacheSpec.of(cache)
    assert spec.tables == {768: resolution_table(768, 16)} and spec.resolutions() == [768]
    assert resolution_table(768, 16)[0].name == "384x1536"
    assert cache.resolutions() == {768: 2}
    assert set(cache.buckets()) <= set(spec.tables[768])
