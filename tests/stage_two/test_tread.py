"""--tread, TREAD token routing: a route's syntax and range, the forward at ratio 0 is the unrouted one bit for bit, the
routed tokens return to their places (blocks replaced by identity: routed = unrouted), rotary positions go with the kept
tokens, tokens the loss mask weights are never routed, only training forwards route, and a routed run trains (full and
LoRA) and resumes bit for bit; families whose blocks do not allow it refuse it."""

import math
import types

import pytest
import torch
from conftest import assert_same_checkpoints, losses, stage_one_cache

from train import tread
from train.config import TrainConfig
from train.families import get_family, get_preset
from train.families.base import LOSS_MASKS
from train.loop import train
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers models (left out of make test-fast)

ROUTED = ("tiny-flux", "tiny-flux1-kontext", "tiny-wan", "tiny-pixart", "tiny-sd3", "tiny-qwen-image", "tiny-qwen-image-edit")
CPU = torch.device("cpu")


def inputs(name: str, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Random noisy latents, timesteps and a batch of the preset's fields (a Wan clip of 5 frames; a Kontext
    reference of another size than the target)."""
    preset = get_preset(name)
    family, config = get_family(preset.family), preset.transformer_config()
    bucket = (64, 64, 5) if family.temporal_downsample else (64, 64)
    extra = {"reference_size": (48, 32)} if preset.references else {}
    fields = family.example_batch(config, preset, bucket, batch, 8, torch.float32, "cpu", **extra)
    g = torch.Generator().manual_seed(seed)

    def fill(v):
        if isinstance(v, list):
            return [fill(x) for x in v]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return torch.randn(v.shape, generator=g)
        return torch.ones_like(v) if isinstance(v, torch.Tensor) else v
    fields = {k: fill(v) for k, v in fields.items()}
    if family.name == "sd3":
        fields["t5_zeros"] = 0
    return fields["latents"], torch.full((batch,), 500.0), fields


def routed_model(name: str, routes: str, masked: bool = False, before_install=None, seed: int = 0):
    """The preset's transformer (seeded), in train mode, with `routes` installed; (module, routed forward, router)."""
    preset = get_preset(name)
    model = build_transformer(preset, None, seed)
    model.train()
    if before_install is not None:
        before_install(model)
    cfg = types.SimpleNamespace(tread=routes, seed=0, masked_loss=masked)
    router = tread.install(cfg, model, get_family(preset.family), say=lambda *a: None)
    router.at(7, 0, CPU)
    return model, router.forward(model_forward(model, preset.family, guidance=preset.train_guidance)), router


def unrouted(name: str, seed: int = 0, before=None):
    preset = get_preset(name)
    model = build_transformer(preset, None, seed)
    model.train()
    if before is not None:
        before(model)
    return model_forward(model, preset.family, guidance=preset.train_guidance)


# ---- the option ---------------------------------------------------------------------------------------------------

def test_routes_parse_resolve_and_refuse_what_they_cannot_be():
    assert tread.parse_routes("0.5:2:-2") == (tread.Route(0.5, 2, -2),)
    assert tread.parse_routes("0.25:0:1, 0.5:3:-1") == (tread.Route(0.25, 0, 1), tread.Route(0.5, 3, -1))
    assert tread.parse_routes("") == () and tread.parse_routes("off") == ()
    assert tread.resolve_routes(tread.parse_routes("0.5:2:-2"), 24) == [(0.5, 2, 22)]
    assert tread.resolve_routes(tread.parse_routes("0.5:3:-1,0.25:0:1"), 8) == [(0.25, 0, 1), (0.5, 3, 7)]
    for bad in ("0.5:2", "half:2:3", "0.5:2:3:4", "0.5:a:3"):
        with pytest.raises(ValueError, match=r"RATIO:START:END"):
            tread.parse_routes(bad)
    for bad in ("1:0:1", "-0.1:0:1"):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            tread.parse_routes(bad)
    with pytest.raises(ValueError, match=r"has 3 blocks"):
        tread.resolve_routes(tread.parse_routes("0.5:0:3"), 3)
    with pytest.raises(ValueError, match=r"comes before"):
        tread.resolve_routes(tread.parse_routes("0.5:2:1"), 3)
    with pytest.raises(ValueError, match=r"overlap"):
        tread.resolve_routes(tread.parse_routes("0.5:0:2,0.5:2:3"), 6)


def test_the_option_has_help_and_families_without_routing_refuse_it_saying_why():
    from train.config import ObjectiveOptions

    text = {f.name: f.metadata["help"] for f in __import__("dataclasses").fields(ObjectiveOptions)}["tread"]
    assert "RATIO:START:END" in text and "masked-loss" in text and "Flux" in text
    assert TrainConfig(model="tiny-flux", tread="0.5:0:-1").tread == "0.5:0:-1"
    with pytest.raises(ValueError, match=r"Sana.*Mix-FFN.*convol"):
        TrainConfig(model="tiny-sana", tread="0.5:0:1")
    for name in ("tiny-flux2", "tiny-z-image"):
        title = get_family(get_preset(name).family).title
        with pytest.raises(ValueError, match=rf"--tread: .*{title}"):
            TrainConfig(model=name, tread="0.5:0:1")
    with pytest.raises(ValueError, match=r"ControlNet"):
        TrainConfig(model="tiny-sd3", tread="0.5:0:1", controlnet=True)
    with pytest.raises(ValueError, match=r"RATIO:START:END"):
        TrainConfig(model="tiny-flux", tread="0.5")
    with pytest.raises(ValueError, match=r"has 3 blocks"):  # the range, against the transformer when it is built
        routed_model("tiny-flux", "0.5:1:5")


# ---- the forward --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ROUTED)
def test_ratio_zero_is_the_unrouted_forward_bit_for_bit_and_a_ratio_changes_it(name):
    xt, t, batch = inputs(name)
    reference = unrouted(name)(xt, t, batch)
    _, forward, _ = routed_model(name, "0:0:-1")
    assert torch.equal(forward(xt, t, batch), reference)
    _, forward, _ = routed_model(name, "0.5:0:-1")
    out = forward(xt, t, batch)
    assert out.shape == reference.shape and torch.isfinite(out).all() and not torch.allclose(out, reference)


def identity_blocks(name: str, start: int, end: int):
    """Blocks `start`..`end` of the transformer made identities (what they return, their image tokens untouched)."""
    family = get_family(get_preset(name).family)

    def apply(model):
        spec = family.tread_route(model)
        for block in spec.blocks[start : end + 1]:
            def same(*args, _block=block, **kwargs):
                import inspect

                bound = inspect.signature(type(_block).forward).bind(_block, *args, **kwargs).arguments
                if spec.output is None:
                    return bound["hidden_states"]
                return bound["encoder_hidden_states"], bound["hidden_states"]
            block.forward = same
    return apply


@pytest.mark.parametrize("name", ROUTED)
def test_every_routed_token_returns_to_its_place_as_it_was(name):
    """With the routed blocks replaced by identities, the kept tokens pass them unchanged too: the routed forward is the
    unrouted one exactly, so gathering and putting back are a permutation and its inverse."""
    xt, t, batch = inputs(name)
    depth = len(get_family(get_preset(name).family).tread_route(build_transformer(get_preset(name), None, 0)).blocks)
    end = depth - 1 if depth < 3 else depth - 2
    reference = unrouted(name, before=identity_blocks(name, 0, end))(xt, t, batch)
    _, forward, _ = routed_model(name, f"0.75:0:{end}", before_install=identity_blocks(name, 0, end))
    assert torch.equal(forward(xt, t, batch), reference)


def recording(name: str, seen: list):
    """Each block's arguments by name, as the block itself gets them (inside the routing), appended to `seen`."""
    import inspect

    family = get_family(get_preset(name).family)

    def apply(model):
        for block in family.tread_route(model).blocks:
            def record(*args, _block=block, _forward=block.forward, **kwargs):
                seen.append(inspect.signature(type(_block).forward).bind(_block, *args, **kwargs).arguments)
                return _forward(*args, **kwargs)
            block.forward = record
    return apply


@pytest.mark.parametrize("name", ROUTED)
def test_the_routed_blocks_see_the_kept_share_with_their_positions(name):
    """Inside a route the blocks take K = N - round(N x ratio) image tokens (Kontext: its reference's too, all of them);
    a rotary table comes with the kept tokens' rows, the rows a sequence of just those tokens would have."""
    preset = get_preset(name)
    family = get_family(preset.family)
    xt, t, batch = inputs(name)
    seen = []
    model, forward, router = routed_model(name, "0.5:0:0", before_install=recording(name, seen))
    kept = []
    draw = router.draw
    router.draw = lambda *a: kept.append(draw(*a)) or kept[-1]
    forward(xt, t, batch)
    first, second = seen[0], seen[1]  # inside the route, after it
    hidden, after = first["hidden_states"], second["hidden_states"]
    n = family.tread_tokens(model.config, xt) or after.shape[1]
    references, k = after.shape[1] - n, n - round(n * 0.5)
    assert hidden.shape[1] == k + references and kept[0].shape[1] == hidden.shape[1]
    assert torch.equal(kept[0][:, k:], torch.arange(n, after.shape[1]).expand(kept[0].shape[0], -1))  # references all kept
    if preset.family == "flux":
        cos, sin = first["image_rotary_emb"]
        full_cos, full_sin = second["image_rotary_emb"]
        text = first["encoder_hidden_states"].shape[1]
        rows = torch.cat([torch.arange(text), text + kept[0][0]])
        assert cos.shape[0] == text + k + references
        assert torch.equal(cos, full_cos[rows]) and torch.equal(sin, full_sin[rows])
        from diffusers import FluxPipeline  # the rows are those of the kept tokens' own position ids

        ids = FluxPipeline._prepare_latent_image_ids(1, xt.shape[-2] // 2, xt.shape[-1] // 2, CPU, torch.float32)
        if references:
            rh, rw = batch["references"][0][0].shape[-2:]
            ref = FluxPipeline._prepare_latent_image_ids(1, rh // 2, rw // 2, CPU, torch.float32)
            ref[..., 0] = 1
            ids = torch.cat([ids, ref])
        own = model.pos_embed(torch.cat([torch.zeros(text, 3), ids[kept[0][0]]]))
        assert torch.allclose(cos, own[0]) and torch.allclose(sin, own[1])
    if preset.family == "qwen-image":
        image, text = first["image_rotary_emb"]
        full_image, full_text = second["image_rotary_emb"]
        assert image.shape[0] == k + references and torch.equal(text, full_text)
        assert torch.equal(image, full_image[kept[0][0]])
    if preset.family == "wan":
        cos, sin = first["rotary_emb"]
        full_cos, full_sin = second["rotary_emb"]
        assert cos.shape[:2] == (xt.shape[0], k)
        for j in range(xt.shape[0]):
            assert torch.equal(cos[j], full_cos[0, kept[0][j]]) and torch.equal(sin[j], full_sin[0, kept[0][j]])


def test_only_training_forwards_route():
    """Gradients off (the held-out loss, validation, output preservation's target) or the transformer in eval mode:
    every token, the unrouted prediction bit for bit; a forward outside the run's (the planner's) routes nothing."""
    name = "tiny-flux"
    xt, t, batch = inputs(name)
    reference = unrouted(name)(xt, t, batch)
    model, forward, router = routed_model(name, "0.5:0:-1")
    with torch.no_grad():
        assert torch.equal(forward(xt, t, batch), reference)
    model.eval()
    assert torch.equal(forward(xt, t, batch), reference)
    model.train()
    assert not torch.allclose(forward(xt, t, batch), reference)
    plain = model_forward(model, "flux", guidance=1.0)  # not through the router's forward
    assert torch.equal(plain(xt, t, batch), reference)


def test_the_selection_is_drawn_from_the_step_micro_batch_and_rank():
    name = "tiny-wan"
    xt, t, batch = inputs(name)
    _, forward, router = routed_model(name, "0.5:0:-1")
    a = forward(xt, t, batch)
    router.at(7, 0, CPU)
    assert torch.equal(forward(xt, t, batch), a)  # the same step and micro-batch: the same tokens
    router.at(8, 0, CPU)
    assert not torch.equal(forward(xt, t, batch), a)
    router.at(7, 1, CPU)
    assert not torch.equal(forward(xt, t, batch), a)
    router.rank = 1
    router.at(7, 0, CPU)
    assert not torch.equal(forward(xt, t, batch), a)


def test_recomputed_blocks_route_the_same_tokens():
    """Gradient checkpointing (diffusers' own, converted per block, or every-K) recomputes the blocks without drawing
    again: the gradients are those of the routed forward without checkpointing."""
    name = "tiny-flux"
    xt, t, batch = inputs(name)

    def grads(checkpoint):
        model, forward, _ = routed_model(name, "0.5:0:-1", before_install=checkpoint)
        forward(xt, t, batch).pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain = grads(None)
    for every in ("all", "every-2"):
        def checkpoint(model, every=every):
            from train.model import checkpoint_blocks

            checkpoint_blocks(model, 1 if every == "all" else 2)
        recomputed = grads(checkpoint)
        assert all(torch.allclose(plain[n], recomputed[n], atol=1e-6) for n in plain), every


# ---- masked loss --------------------------------------------------------------------------------------------------

def test_tokens_the_loss_weights_are_never_routed():
    n, ratio = 16, 0.5
    keep = torch.zeros(3, n, dtype=torch.bool)
    keep[0, :3] = True  # fewer than the kept share: still half routed
    keep[1, 5:15] = True  # more than the kept share: only the others routed
    for seed in range(20):
        kept = tread.select(torch.rand(3, n, generator=torch.Generator().manual_seed(seed)), keep, ratio)
        assert kept.shape == (3, 10)  # the most any row must keep
        for row in range(3):
            assert set(keep[row].nonzero().flatten().tolist()) <= set(kept[row].tolist())
            assert kept[row].tolist() == sorted(set(kept[row].tolist()))  # distinct, in order
    kept = tread.select(torch.rand(3, n, generator=torch.Generator().manual_seed(0)), None, ratio)
    assert kept.shape == (3, 8)

    # a latent mask to tokens: a token is weighted where any cell of its patch is
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.uint8)
    mask[0, 0, 0, 1] = 3
    mask[0, 0, 3, 3] = 255
    assert tread.token_mask(mask, 2).tolist() == [[True, False, False, True]]


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-pixart"])
def test_a_masked_run_keeps_the_weighted_tokens_of_each_sample(name):
    """Per sample (PixArt) or for the call (Flux: one rotary table, so the union of its samples' weighted tokens)."""
    xt, t, batch = inputs(name)
    h, w = xt.shape[-2:]
    mask = torch.zeros(2, 1, h, w, dtype=torch.uint8)
    mask[0, :, : h // 2] = 255  # the top half of the first sample
    mask[1, :, :, -2:] = 128  # the right edge of the second
    batch["mask"] = mask
    _, forward, router = routed_model(name, "0.5:0:-1", masked=True)
    kept = []
    draw = router.draw
    router.draw = lambda *a: kept.append(draw(*a)) or kept[-1]
    forward(xt, t, batch)
    patch = get_family(get_preset(name).family).latent_patch(get_preset(name).transformer_config())
    weighted = tread.token_mask(mask, patch)
    rows = weighted.any(0, keepdim=True) if name == "tiny-flux" else weighted
    assert kept[0].shape[0] == rows.shape[0]
    for row, positions in zip(rows, kept[0]):
        assert set(row.nonzero().flatten().tolist()) <= set(positions.tolist())
    n = weighted.shape[1]
    assert kept[0].shape[1] == max(n - round(n * 0.5), int(rows.sum(1).max()))
    # the loader's batch also carries its masks in host memory: the count is taken there, the selection the same
    router.at(7, 0, CPU)
    forward(xt, t, {**batch, LOSS_MASKS: list(mask)})
    assert torch.equal(kept[1], kept[0])
    with pytest.raises(KeyError):  # --masked-loss needs the batch's mask
        forward(xt, t, {k: v for k, v in batch.items() if k != "mask"})


# ---- runs ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_cache(tmp_path_factory):
    return stage_one_cache(tmp_path_factory.mktemp("flux"), "tiny-flux")


def run_cfg(cache, run, **kw):
    base = dict(model="tiny-flux", cache=[str(cache)], run=run, steps=4, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=2, lr=1e-3, precision="fp32", validate=False, tread="0.5:0:-1")
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_routed_run_trains_and_resumes_bit_for_bit(flux_cache, tmp_path, kind):
    extra = dict(lora_rank=4, lora_alpha=8, lr=1e-2) if kind == "lora" else {}
    straight = train(run_cfg(flux_cache, tmp_path / "straight", **extra))
    train(run_cfg(flux_cache, tmp_path / "resumed", steps=2, **extra))
    resumed = train(run_cfg(flux_cache, tmp_path / "resumed", **extra))
    assert straight["step"] == resumed["step"] == 4 and math.isfinite(straight["last_loss"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")
    train(run_cfg(flux_cache, tmp_path / "plain", tread=None, **extra))
    assert losses(tmp_path / "plain")[0] != losses(tmp_path / "straight")[0]  # routing changed the training forward


def test_a_masked_loss_run_never_routes_the_weighted_tokens(tmp_path, monkeypatch):
    """Stage one's masks (the left half of every image weighted 0) through the trainer: every routed call keeps each
    token the batch's loss mask weights, and routes some of the others."""
    from PIL import Image

    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    data = make_folder(tmp_path / "data", count=8)
    for image in sorted(data.glob("*.png")):
        with Image.open(image) as img:
            mask = Image.new("L", img.size, 255)
        mask.paste(0, (0, 0, img.width // 2, img.height))
        mask.save(image.with_name(image.stem + ".mask.png"))
    precompute(str(data), "tiny-pixart", tmp_path / "cache", workers=0, progress=False, masks=True)
    seen = []
    draw = tread.Router.draw

    def spy(self, hidden, ratio, shared):
        kept = draw(self, hidden, ratio, shared)
        assert self.call["host"] is not None  # the loader's batch carries its loss masks in host memory
        seen.append((self.call["keep"], kept, hidden.shape[1]))
        return kept
    monkeypatch.setattr(tread.Router, "draw", spy)
    train(TrainConfig(model="tiny-pixart", cache=[str(tmp_path / "cache")], run=tmp_path / "run", steps=2, batch_size=2,
                      workers=0, progress=False, validate=False, masked_loss=True, tread="0.5:0:-1", precision="fp32"))
    assert len(seen) == 2
    for keep, kept, n in seen:
        assert keep.any() and not keep.all()
        for row in range(keep.shape[0]):
            assert set(keep[row].nonzero().flatten().tolist()) <= set(kept[row].tolist())
        assert kept.shape[1] < n


@pytest.mark.parametrize("name", ["tiny-pixart", "tiny-flux"])
def test_a_masked_loss_routed_step_reads_the_device_once(name):
    """Counted as CUDA's sync debug mode would (`bench.sync_counter`): with --masked-loss, the count of tokens a routed
    call keeps comes from the batch's loss masks in host memory, so an optimizer step of two micro-batches still waits
    for the device once, the gradient norm's read. A batch without the host copy reads the count from the device once
    per routed call (what the host copy saves)."""
    from bench.syncs import THE_READ, step_batch, syncs_per_step

    net, trainer, batch = step_batch(name, tread="0.5:0:-1", masked_loss=True)
    h, w = batch["latents"].shape[-2:]
    mask = torch.zeros(2, 1, h, w, dtype=torch.uint8)
    mask[0, :, : h * 3 // 4] = 255  # more than the kept half: the count is the data's, not the ratio's
    mask[1, :, :, :2] = 77
    masks = [m.clone() for m in mask]  # the collate's host copies, apart from the tensor copied to the device
    per_step, _ = syncs_per_step(net, trainer, {**batch, "mask": mask, LOSS_MASKS: masks})
    for syncs in per_step[1:]:
        assert len(syncs) == 1 and THE_READ in syncs[0], syncs
    per_step, _ = syncs_per_step(net, trainer, {**batch, "mask": mask})
    for syncs in per_step[1:]:
        assert len(syncs) == 3 and sum(THE_READ in s for s in syncs) == 1, syncs
        assert sum("train/tread.py" in s for s in syncs) == 2, syncs


def test_two_experts_are_routed_each():
    """A two-expert model (--expert both): each expert's blocks route, whichever takes a sample."""
    from train.experts import Experts

    preset = get_preset("tiny-wan")

    def experts():
        model = Experts(build_transformer(preset, None, 0), build_transformer(preset, None, 1), 500.0,
                        ("transformer", "transformer_2"))
        model.train()
        return model

    xt, _, batch = inputs("tiny-wan")
    t = torch.tensor([900.0, 100.0])  # one sample for each expert
    plain = experts()
    reference = model_forward(plain, "wan")(xt, t, batch)
    for routes, same in (("0:0:-1", True), ("0.5:0:-1", False)):
        model = experts()
        router = tread.install(types.SimpleNamespace(tread=routes, seed=0, masked_loss=False), model, get_family("wan"),
                               say=lambda *a: None)
        router.at(0, 0, CPU)
        out = router.forward(model_forward(model, "wan"))(xt, t, batch)
        assert torch.equal(out, reference) == same
        if not same:  # both experts' predictions changed
            assert not torch.allclose(out[0], reference[0]) and not torch.allclose(out[1], reference[1])


def test_a_routed_wan_run_on_clips_resumes_bit_for_bit(tmp_path):
    """The video case: tiny-wan's LoRA trained from a cache of clips with --tread, resumed, equals the uninterrupted run."""
    from video_testing import clip_cache

    cache = clip_cache(tmp_path / "cache", family="wan", preset="tiny-wan")

    def cfg(run, **kw):
        return TrainConfig(**{**dict(model="tiny-wan", cache=[str(cache)], run=run, steps=4, batch_size=2, workers=0,
                                     progress=False, log_every=1, checkpoint_every=2, lr=1e-2, precision="fp32",
                                     validate=False, lora_rank=4, lora_alpha=8, tread="0.5:0:-1"), **kw})
    train(cfg(tmp_path / "straight"))
    train(cfg(tmp_path / "resumed", steps=2))
    train(cfg(tmp_path / "resumed"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")
    train(cfg(tmp_path / "plain", tread=None))
    assert losses(tmp_path / "plain")[0] != losses(tmp_path / "straight")[0]
