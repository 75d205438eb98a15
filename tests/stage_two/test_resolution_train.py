"""Training from a cache built at several resolutions: a stream per resolution, each resolution's share of an epoch
by --resolution-weight, and the planner reading the cache's resolution."""

import json

import numpy as np
import pytest

from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Bucket, Cache, resolution_table
from train.config import TrainConfig
from train.loop import train
from train.order import BatchPlan
from train.streams import Stream, resolution_draws

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Three images cached by the tiny Sana preset at 512 and at 768 (its base resolution is 256)."""
    root = tmp_path_factory.mktemp("multi")
    data = make_folder(root / "data", count=3)
    precompute(str(data), "tiny-sana", root / "cache", workers=0, progress=False, allow_upscale=True, resolution="512,768")
    return root / "cache"


def test_each_resolution_has_its_table_and_its_streams(cache):
    c = Cache(cache)
    assert c.spec.resolutions() == [512, 768]
    assert c.spec.tables[768] == resolution_table(768, 8)
    plan = BatchPlan.of(c, 1)
    assert {plan.resolutions[st] for st in plan.streams} == {512, 768}
    for st in plan.streams:  # each stream's bucket is of its own resolution's table
        assert st.bucket in c.spec.tables[plan.resolutions[st]]
    assert plan.draws_by_resolution() == {512: 3, 768: 3}  # unweighted: every sample once


def test_resolution_weight_shares_the_epoch(cache):
    c = Cache(cache)
    plan = BatchPlan.of(c, 1, resolution_weights={512: 1, 768: 3})
    assert plan.draws_by_resolution() == {512: 2, 768: 4}
    starts = c.shard_starts
    tags = c.shards.column("resolution")
    drawn = {512: 0, 768: 0}
    for batch in plan.global_batches(0):
        (i,) = batch.indices
        tag = int(tags[np.searchsorted(starts, i, side="right") - 1])
        drawn[c.spec.resolution(tag)] += 1
    assert drawn == {512: 2, 768: 4}
    with pytest.raises(ValueError, match="gives no weight to resolution 768.*512=1,768=1"):
        BatchPlan.of(c, 1, resolution_weights={512: 1})
    with pytest.raises(ValueError, match="--resolution-weight 1024=...: the cache holds no samples at 1024; it holds 512, 768"):
        BatchPlan.of(c, 1, resolution_weights={512: 1, 768: 1, 1024: 1})


def test_streams_of_one_bucket_at_two_resolutions_stay_apart():
    bucket = Bucket(512, 512)
    ranges = {Stream(bucket): [range(0, 10)], Stream(bucket, resolution=768): [range(10, 20)]}
    plan = BatchPlan(ranges, batch_size=5)
    batches = plan(0)
    assert len(batches) == 4 and all(max(b) < 10 or min(b) >= 10 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(20))
    draws = resolution_draws({st: 10 for st in ranges}, {st: st.resolution or 512 for st in ranges}, {512: 1.0, 768: 4.0})
    assert draws == {Stream(bucket): 4, Stream(bucket, resolution=768): 16}


def test_resolution_weight_option_is_checked():
    assert TrainConfig(resolution_weight="512=1, 1024=2.5").resolution_weights() == {512: 1.0, 1024: 2.5}
    assert TrainConfig().resolution_weights() is None
    for bad in ("512", "512=0", "512=1,512=2", "x=1", "512=nan"):
        with pytest.raises(ValueError, match=f"--resolution-weight {bad}: .*RESOLUTION=WEIGHT"):
            TrainConfig(resolution_weight=bad)


@pytest.mark.slow
def test_a_512_and_768_cache_trains_by_resolution_weight(cache, tmp_path, capsys):
    out = train(TrainConfig(model="tiny-sana", cache=[str(cache)], run=tmp_path / "run", steps=6, batch_size=1, progress=False,
                            log_every=1, checkpoint_every=1000, validate=False, lr=1e-3, resolution_weight="512=1,768=3"))
    assert out is not None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in rows)
    assert "resolutions: 512: 2 drawn per epoch, 768: 4 drawn per epoch" in capsys.readouterr().out


def test_plan_reads_the_caches_resolution_and_buckets(cache, capsys):
    from train.plan_command import plan_command

    plan_command("tiny-sana", cache=str(cache), as_json=True)
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["bucket"] == "768x768"  # the cache's largest resolution, not the preset's 256
    assert set(result["largest_batch_per_bucket"]) == {b.name for b in Cache(cache).manifest.buckets()}
    plan_command("tiny-sana", cache=str(cache), resolution=512, as_json=True)
    assert json.loads(capsys.readouterr().out)["config"]["bucket"] == "512x512"


@pytest.mark.slow
def test_a_768_cache_of_a_16px_model_trains(tmp_path):
    """Flux's 8x VAE and 2x2 patches: a 768 table built on 16 px steps, read from the cache, trains."""
    data = make_folder(tmp_path / "data", count=2)
    precompute(str(data), "tiny-flux", tmp_path / "cache", workers=0, progress=False, allow_upscale=True, resolution="768")
    c = Cache(tmp_path / "cache")
    assert c.spec.resolutions() == [768] and set(c.manifest.buckets()) <= set(resolution_table(768, 16))
    train(TrainConfig(model="tiny-flux", cache=[str(tmp_path / "cache")], run=tmp_path / "run", steps=2, batch_size=1,
                      progress=False, log_every=1, checkpoint_every=1000, validate=False))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
