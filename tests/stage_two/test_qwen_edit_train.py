"""Qwen-Image-Edit and Qwen-Image-Edit-2509 in stage two: the transformer gets the references' packed latents after the
target's with their patch grids in `img_shapes`, as QwenImageEditPipeline / QwenImageEditPlusPipeline give them, one
call per group of samples whose references share their shapes, and only the target's tokens are the prediction;
validation samples as the stock edit pipeline samples, the references passed every step; exports load in the edit
pipelines."""

import pytest
import torch
from conftest import record_calls

from train.config import TrainConfig
from train.families import get_family, get_preset
from train.families.qwen_image import SCHEDULER
from train.model import build_run_objective
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

WIDTH = 32  # the tiny Qwen2.5-VL's hidden size


def pack(x: torch.Tensor) -> torch.Tensor:
    from diffusers import QwenImagePipeline

    b, c, h, w = x.shape
    return QwenImagePipeline._pack_latents(x, b, c, h, w)


def edit_batch(g: torch.Generator, reference_shapes: list[list[tuple[int, int]]], tokens=(9, 6)) -> dict:
    """Two captions of different lengths (padded, with a mask, as stage two collates them) and each sample's references."""
    embeds = torch.randn(2, max(tokens), WIDTH, generator=g)
    mask = torch.tensor([[j < n for j in range(max(tokens))] for n in tokens])
    embeds[~mask] = 0
    refs = [[torch.randn(16, h, w, generator=g) for h, w in shapes] for shapes in reference_shapes]
    return {"text": embeds, "text_mask": mask, "references": refs}


def by_hand(transformer, x: torch.Tensor, t: torch.Tensor, batch: dict, i: int) -> torch.Tensor:
    """Sample i's call as the edit pipelines build it: the target's packed latent, then each reference's, `img_shapes`
    the target's and each reference's (1, h/2, w/2); the caption's tokens and mask; sigma; the target's tokens kept."""
    from diffusers import QwenImagePipeline

    h, w = x.shape[2:]
    latents = pack(x[i : i + 1])
    image_latents = torch.cat([pack(r[None]) for r in batch["references"][i]], dim=1)
    shapes = [[(1, h // 2, w // 2), *[(1, r.shape[1] // 2, r.shape[2] // 2) for r in batch["references"][i]]]]
    with torch.no_grad():
        out = transformer(hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t[i : i + 1] / 1000,
                          encoder_hidden_states_mask=batch["text_mask"][i : i + 1], encoder_hidden_states=batch["text"][i : i + 1],
                          img_shapes=shapes, return_dict=False)[0]
    return QwenImagePipeline._unpack_latents(out[:, : latents.size(1)], h, w, 1)[:, :, 0]


@pytest.mark.parametrize("name, shapes", [
    ("tiny-qwen-image-edit", [[(8, 12)], [(10, 6)]]),
    ("tiny-qwen-image-edit-2509", [[(8, 12), (8, 8)], [(8, 12), (12, 4)]]),
], ids=["edit", "2509"])
def test_forward_runs_each_group_as_the_edit_pipeline_calls_the_transformer(name, shapes):
    """A batch of two whose references differ in shape: one transformer call per sample, each equal to the call the
    pipeline builds; the prediction has the target's shape."""
    preset = get_preset(name)
    transformer = build_transformer(preset, None, 0).eval()
    calls = record_calls(transformer)
    g = torch.Generator().manual_seed(1)
    batch = edit_batch(g, shapes)
    x, t = torch.randn(2, 16, 6, 10, generator=g), torch.tensor([700.0, 150.0])
    with torch.no_grad():
        ours = model_forward(transformer, preset.family)(x, t, batch)
    assert ours.shape == x.shape and len(calls) == 2
    assert [c["img_shapes"] for c in calls] == [[[(1, 3, 5), *[(1, h // 2, w // 2) for h, w in s]]] for s in shapes]
    for i in range(2):
        assert torch.equal(ours[i : i + 1], by_hand(transformer, x, t, batch, i)), i


def test_samples_whose_references_share_their_shapes_run_in_one_call():
    preset = get_preset("tiny-qwen-image-edit-2509")
    transformer = build_transformer(preset, None, 0).eval()
    calls = record_calls(transformer)
    g = torch.Generator().manual_seed(2)
    batch = edit_batch(g, [[(8, 12), (4, 4)]] * 2)
    x, t = torch.randn(2, 16, 6, 10, generator=g), torch.tensor([400.0, 900.0])
    with torch.no_grad():
        ours = model_forward(transformer, preset.family)(x, t, batch)
    assert len(calls) == 1 and calls[0]["hidden_states"].shape == (2, 15 + 24 + 4, 64)
    assert calls[0]["img_shapes"] == [[(1, 3, 5), (1, 4, 6), (1, 2, 2)]] * 2
    for i in range(2):
        torch.testing.assert_close(ours[i : i + 1], by_hand(transformer, x, t, batch, i), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("guidance", [4.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_validation_edits_as_the_stock_edit_pipeline_edits(guidance, monkeypatch):
    """The family's sampler from the same noise, embeddings and reference against `QwenImageEditPipeline.__call__`
    given the reference image: the reference's latents (as stage one caches them) are passed at every step, the
    prediction is the target's, true CFG norm-rescaled as the pipeline combines it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
    from PIL import Image

    from precompute.families.qwen_image import FAMILY as ENCODING
    from precompute.families.qwen_image import TINY_VAE_AREA, tiny_vae
    from precompute.presets import get_preset as encoding_preset

    # the pipeline sizes its image at a megapixel, the tiny preset at 64 x 64: the pipeline at the tiny preset's area
    sized = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: sized(TINY_VAE_AREA, ratio))
    preset = get_preset("tiny-qwen-image-edit")
    transformer = build_transformer(preset, None, 0).eval()
    family = get_family(preset.family)
    objective = build_run_objective(TrainConfig(model=preset.name), preset, preset.transformer_config())
    vae = tiny_vae()
    g = torch.Generator().manual_seed(3)
    image = Image.fromarray((torch.rand(16, 16, 3, generator=g) * 255).byte().numpy()).resize((100, 60), Image.BILINEAR)
    prepared = ENCODING.prepare_reference(encoding_preset(preset.name), image, 0, 1)
    with torch.no_grad():
        reference = ENCODING.encode_references(vae, prepared["pixels"][None], ENCODING.latent_spec(vae))[0]
    assert reference.shape == (16, 8, 12)
    cond, null = torch.randn(1, 11, WIDTH, generator=g), torch.randn(1, 5, WIDTH, generator=g)
    height, width, steps, c = 64, 96, 2, 16
    noise = torch.randn(1, c, height // 8, width // 8, generator=g)

    text = {"text": torch.cat([torch.nn.functional.pad(null, (0, 0, 0, 6)), cond]),
            "text_mask": torch.tensor([[True] * 5 + [False] * 6, [True] * 11]), "references": [[reference]] * 2}
    scheduler = family.sampling_scheduler(objective, height * width)
    family.set_timesteps(scheduler, objective, steps, height * width, torch.device("cpu"))
    forward = model_forward(transformer, preset.family)
    with torch.no_grad():
        ours = family.denoise(forward, scheduler, noise.clone(), text, guidance=guidance, channels=c,
                              autocast=torch.autocast("cpu", enabled=False))
        pipe = QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER), vae=vae, text_encoder=None,
                                     tokenizer=None, processor=None, transformer=transformer)
        out = pipe(image=image, prompt_embeds=cond, negative_prompt_embeds=null, true_cfg_scale=guidance, height=height,
                   width=width, num_inference_steps=steps, latents=pack(noise), output_type="latent").images
    stock = QwenImageEditPipeline._unpack_latents(out, height, width, 8)[:, :, 0]
    assert ours.shape == stock.shape and torch.allclose(ours, stock, atol=1e-5)
    assert not torch.allclose(ours, noise, atol=1e-2)  # it sampled


def test_the_edit_presets_export_to_their_pipelines_and_their_cards_edit_an_image():
    from train.card import Base, usage

    family = get_family("qwen-image")
    assert family.pipeline_of(get_preset("qwen-image-edit")) == "QwenImageEditPipeline"
    assert family.pipeline_of(get_preset("qwen-image-edit-2509")) == "QwenImageEditPlusPipeline"
    assert family.pipeline_of(get_preset("qwen-image")) == "QwenImagePipeline"
    code = usage("qwen-image", "lora", Base("hub", "Qwen/Qwen-Image-Edit"), "owner/export", preset=get_preset("qwen-image-edit"))
    assert "QwenImageEditPipeline.from_pretrained" in code and "from diffusers.utils import load_image" in code
    assert 'image = pipe(image=load_image("input.png"), prompt="an edit instruction", negative_prompt="", true_cfg_scale=4.0)' in code
    code = usage("qwen-image", "full", Base("hub", "Qwen/Qwen-Image-Edit-2509"), "owner/export", preset=get_preset("qwen-image-edit-2509"))
    assert "QwenImageEditPlusPipeline.from_pretrained" in code and 'image=[load_image("input1.png"), load_image("input2.png")]' in code


def test_the_published_edit_models_are_qwen_images_architecture():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    family = get_family("qwen-image")
    for name, repo, refs in (("qwen-image-edit", "Qwen/Qwen-Image-Edit", 1), ("qwen-image-edit-2509", "Qwen/Qwen-Image-Edit-2509", 3)):
        preset = get_preset(name)
        config = preset.transformer_config()
        assert (preset.repo, preset.references, preset.reference_pixels) == (repo, refs, 1024 * 1024)
        assert config == get_preset("qwen-image").transformer_config()
        assert (preset.validation_steps, preset.guidance_scale) == (50, 4.0)  # the edit pipelines' defaults
        # the planner's reference: the pipeline's size for an image of the bucket's aspect ratio
        for bucket in ((1024, 1024), (928, 1664), (1472, 1140)):
            width, height, _ = calculate_dimensions(1024 * 1024, bucket[1] / bucket[0])
            assert family.reference_size(config, preset, bucket) == (height, width)
