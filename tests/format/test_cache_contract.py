"""The contract between the stages (`shards.contract`): what stage two reads of a cache, typed, and caches
written before it existed still read and train."""

import shutil
from pathlib import Path

import pytest

from shards import Cache, CacheSpec, FormatError, TextSpec
from train.config import TrainConfig
from train.loop import train

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

LEGACY = Path(__file__).resolve().parents[1] / "data" / "cache-v2-3b95788"


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-sd3"])
def test_the_spec_writes_back_exactly_what_the_cache_holds(name):
    cache = Cache(LEGACY / name)
    spec = cache.spec
    vae, text = cache.fingerprint["vae"], cache.fingerprint["text_encoder"]
    assert {k: vae[k] for k in spec.latent.fingerprint()} == spec.latent.fingerprint()
    assert {k: text[k] for k in spec.text.fingerprint()} == spec.text.fingerprint()
    assert spec.record() == cache.manifest.extra["precompute"]
    assert set(spec.latent.fields) <= set(cache.schema)


def test_what_stage_two_reads_of_an_sd3_cache():
    spec = Cache(LEGACY / "tiny-sd3").spec
    assert (spec.family, spec.preset, spec.base_resolution) == ("sd3", "tiny-sd3", 256)
    assert spec.latent.posterior == "mean_std" and spec.latent.fields == ("latent_mean", "latent_std")
    assert spec.latent.shape(208, 304) == (16, 26, 38)
    assert (spec.text.layout, spec.text.tokens, spec.text.t5_zeros) == ("sd3_joint", 77 + 32, 0)
    assert spec.decoder.in_cache and spec.decoder.located(Path("/c")).source == "/c/vae"
    dropped = TextSpec.from_fingerprint({**spec.text.fingerprint(), "layout": {**spec.text.fingerprint()["layout"], "t5": "dropped"}})
    assert dropped.t5_zeros == 32 and not dropped.t5_stored


def test_a_cache_stage_one_did_not_write_is_refused_naming_the_fields():
    class Bare:
        fingerprint = {"vae": {"latent_channels": 4}}
        extra = {}

    with pytest.raises(FormatError, match=r"no text_encoder, vae.downsample"):
        CacheSpec.of(Bare(), "/somewhere")
    with pytest.raises(FormatError, match="unknown text layout 'interleaved'"):
        TextSpec.from_fingerprint({"max_length": 8, "layout": {"kind": "interleaved"}})


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-sd3"])
def test_a_cache_written_by_earlier_code_trains(tmp_path, name):
    cache = tmp_path / "cache"
    shutil.copytree(LEGACY / name, cache)  # the run registers itself as a reader in the cache
    result = train(TrainConfig(model=name, cache=cache, run=tmp_path / "run", steps=2, batch_size=2, progress=False,
                               validate=False, checkpoint_every=2))
    assert result["step"] == 2 and result["last_loss"] is not None
