"""Stage two's generic path carries clips: latents (B, C, T, h, w) drawn from the cached posterior, batches of one clip
bucket, the family's conditioning fields in the batch, the objective over every element with a timestep per clip, the
held-out loss, and the planner's video tokens; all without a family's transformer (a stand-in family reads the cache)."""

import pytest
import torch
from video_testing import BUCKETS, CHANNELS, LATENT, MAX_TOKENS, clip_cache, register

from shards import Bucket, Cache
from train.data import BatchStream, Epoch, TrainingSamples, check_masks
from train.families.base import ModelPreset
from train.objectives import FlowMatching
from train.order import BatchPlan


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return clip_cache(tmp_path_factory.mktemp("clips") / "cache", condition=True)


def batches(cache: Cache, batch_size: int = 2, **kwargs) -> list[dict]:
    """Every batch of epoch 0, in order, as the training loop takes them."""
    samples = TrainingSamples(cache, seed=0, caption_dropout=0.0, **kwargs)
    plan = BatchPlan.of([cache], batch_size, seed=0)
    stream = BatchStream(Epoch(0, plan, samples), workers=1, prefetch=2)
    try:
        return [next(stream) for _ in range(plan.batches_per_epoch())]
    finally:
        stream.close()


def test_a_clip_batch_holds_latents_with_a_frame_axis_of_one_bucket(monkeypatch, clips):
    register(monkeypatch)
    cache = Cache(clips)
    seen = {}
    for b in batches(cache):
        bucket = Bucket(*b["bucket"])
        assert b["latents"].shape == (2, *LATENT.shape(*bucket)), bucket  # (B, C, T, h, w), T = (F - 1) // 4 + 1
        assert b["text"].shape == (2, MAX_TOKENS, 32)  # zero-filled to 512 by the layout
        assert "condition" not in b  # not asked for
        assert all(cache.bucket_of(int(k.removeprefix("clip"))) == bucket for k in b["keys"])  # one bucket a batch
        seen[bucket] = seen.get(bucket, 0) + 2
    assert seen == dict(BUCKETS)
    assert LATENT.shape(64, 64, 17) == (CHANNELS, 5, 8, 8) and LATENT.shape(64, 64, 1) == (CHANNELS, 1, 8, 8)


def test_a_clip_is_drawn_from_its_cached_posterior_afresh_every_epoch(monkeypatch, clips):
    register(monkeypatch)
    cache = Cache(clips)
    samples = TrainingSamples(cache, seed=0, caption_dropout=0.0)
    s = cache[0]
    mean, std = s["latent_mean"].float(), s["latent_std"].float()
    first, again, later = samples[(0, 0)]["latent"], samples[(0, 0)]["latent"], samples[(1, 0)]["latent"]
    assert first.shape == mean.shape == (CHANNELS, 5, 8, 8)
    assert torch.equal(first, again) and not torch.equal(first, later)  # a pure function of (seed, epoch, index)
    eps = (first - mean) / std  # mean + std * eps, eps standard normal over every element of every frame
    assert abs(float(eps.mean())) < 0.1 and abs(float(eps.std()) - 1) < 0.1
    assert not torch.allclose(eps[:, 0], eps[:, 1])  # each frame its own noise


def test_conditioning_fields_are_stacked_in_the_compute_dtype(monkeypatch, clips):
    register(monkeypatch)
    cache = Cache(clips)
    for b in batches(cache, conditioning=("condition",), conditioning_dtype=torch.float16):
        assert b["condition"].dtype == torch.float16
        assert b["condition"].shape == (2, 4 + CHANNELS, *b["latents"].shape[2:])
        for j, key in enumerate(b["keys"]):
            cached = cache[int(key.removeprefix("clip"))]["condition"]
            assert torch.equal(b["condition"][j], cached.to(torch.float16))


def test_a_cache_without_a_conditioning_field_the_model_takes_is_refused(monkeypatch, tmp_path):
    register(monkeypatch)
    cache = Cache(clip_cache(tmp_path / "plain", buckets=((Bucket(64, 64, 17), 2),)))
    with pytest.raises(ValueError, match="holds no condition field"):
        TrainingSamples(cache, seed=0, caption_dropout=0.0, conditioning=("condition",))


def test_masked_loss_on_clips_is_refused_naming_the_option(clips):
    with pytest.raises(ValueError, match="--masked-loss: .* holds clips"):
        check_masks(Cache(clips))


def test_the_objective_noises_every_frame_at_one_timestep_per_clip_and_averages_every_element(monkeypatch, clips):
    register(monkeypatch)
    cache = Cache(clips)
    batch = batches(cache, conditioning=("condition",))[0]
    seen = {}

    def model_fn(xt, t, b):  # a stand-in transformer: what the family's forward would get
        seen.update(xt=xt, t=t, condition=b["condition"])
        return torch.zeros_like(xt)

    flow = FlowMatching(shift=3.0)
    g = torch.Generator().manual_seed(5)
    loss, s = flow(model_fn, batch, g)
    x0 = batch["latents"]
    g = torch.Generator().manual_seed(5)  # the same draws again: sigmas, then noise of the latents' shape
    sigmas = flow.sigmas(2, 64 * 64, g)
    noise = torch.randn(x0.shape, generator=g)
    assert torch.equal(s, sigmas) and torch.equal(seen["t"], sigmas * 1000)
    expected_xt = (1 - sigmas.view(2, 1, 1, 1, 1)) * x0 + sigmas.view(2, 1, 1, 1, 1) * noise
    assert torch.allclose(seen["xt"], expected_xt)
    assert torch.equal(seen["condition"], batch["condition"])  # the conditioning fields reach the model's call
    # a zero prediction's loss: the mean over channels, frames and pixels of (noise - x0)^2, per clip
    assert torch.allclose(loss, ((noise - x0) ** 2).mean(dim=(1, 2, 3, 4)))


def test_the_planner_counts_a_clips_tokens_frame_by_frame(monkeypatch):
    family = register(monkeypatch)
    config = {"out_channels": 16, "patch_size": (1, 2, 2), "text_dim": 32}
    preset = ModelPreset("stand-in", family.name, None, config, "flow", "flow", base_resolution=480)
    # 81 frames -> 21 latent frames; 480 x 832 pixels -> 60 x 104 latent pixels -> 30 x 52 patches of 2 x 2
    assert family.image_tokens(config, preset, Bucket(480, 832, 81)) == 21 * 30 * 52 == 32_760
    assert family.image_tokens(config, preset, Bucket(480, 832, 1)) == 1 * 30 * 52
    assert family.image_tokens(config, preset, (480, 832)) == 30 * 52  # an image: no frame axis
    batch = family.example_batch(config, preset, Bucket(480, 832, 81), 2, 512, torch.float32)
    assert batch["latents"].shape == (2, 16, 21, 60, 104) and batch["latents"].device.type == "meta"
    assert batch["text"].shape == (2, 512, 32)
    with pytest.raises(ValueError, match="encodes clips of k x 4 \\+ 1 frames; choose 77 or 81"):
        family.image_tokens(config, preset, Bucket(480, 832, 80))


def test_the_plan_command_reads_clip_buckets(monkeypatch, clips):
    from train.plan_command import traced_bucket

    register(monkeypatch)
    assert traced_bucket("tiny-sana", None, "81x480x832", None, None) == Bucket(480, 832, 81)
    assert traced_bucket("tiny-sana", 480, None, 81, None) == Bucket(480, 480, 81)
    assert traced_bucket("tiny-sana", None, "480x832", None, None) == Bucket(480, 832)
    assert traced_bucket("tiny-sana", None, None, None, Cache(clips)) == Bucket(64, 64, 17)  # its largest clip bucket
    with pytest.raises(ValueError, match="disagree"):
        traced_bucket("tiny-sana", None, "81x480x832", 49, None)
