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


# ---- end to end: stage one's cache of an edit folder, training, resume, export through the stock pipelines ----------

EDITS = {"tiny-qwen-image-edit": 1, "tiny-qwen-image-edit-2509": 2}  # preset: references per sample of its folder


@pytest.fixture(scope="module")
def edit_caches(tmp_path_factory):
    """Stage one's fp32 caches of an edit folder of 6 targets for each tiny edit preset (x.ref.png beside each for
    Edit, x.ref0.png and x.ref1.png for 2509) with one validation prompt; {preset: (cache, folder)}."""
    from conftest import VALIDATION_PROMPTS

    from precompute.run import main as precompute
    from precompute.sample_data import make_edit_folder

    root = tmp_path_factory.mktemp("qwen-edit")
    out = {}
    for name, count in EDITS.items():
        data = make_edit_folder(root / f"data-{name}", count=6, references=count, seed=count)
        summary = precompute(str(data), name, root / name, workers=0, progress=False, references=True, storage_dtype="fp32",
                             validation_prompt=VALIDATION_PROMPTS[:1])
        assert summary["new"] == 6
        out[name] = (root / name, data)
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny edit presets' VAE and Qwen2.5-VL with its tokenizer and processor, saved in the diffusers layout."""
    from precompute.presets import get_preset as encoders
    from precompute.presets import save_tiny

    directory = tmp_path_factory.mktemp("parts")
    save_tiny(encoders("tiny-qwen-image-edit"), directory)
    return directory


def stock_edit(name: str, transformer, parts):
    """The stock edit pipeline of preset `name` around `transformer` with the published scheduler, its VAE and text
    encoder loaded with `from_pretrained` (the processor rebuilt around the saved tokenizer: transformers loads a
    Qwen2VLProcessor only with torchvision)."""
    import diffusers
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    from precompute.families.qwen_image import tiny_processor

    tokenizer = Qwen2Tokenizer.from_pretrained(parts / "tokenizer")
    return getattr(diffusers, get_family("qwen-image").pipeline_of(get_preset(name)))(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER),
        vae=diffusers.AutoencoderKLQwenImage.from_pretrained(parts / "vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(parts / "text_encoder"), tokenizer=tokenizer,
        processor=tiny_processor(tokenizer), transformer=transformer)


def edit(pipe, data, monkeypatch, output_type="np"):
    """An edit of the folder's first sample through the stock pipeline, at the tiny presets' reference areas (as stage
    one prepared the references the model trained on)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    from PIL import Image

    from precompute.families.qwen_image import TINY_CONDITION_AREA, TINY_VAE_AREA

    sized = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: sized(TINY_VAE_AREA, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", TINY_VAE_AREA)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", TINY_CONDITION_AREA)
    files = sorted(data.glob("00000.ref*.png"))
    images = [Image.open(f).convert("RGB") for f in files]
    caption = (data / "00000.txt").read_text().strip()
    return pipe(image=images if len(images) > 1 else images[0], prompt=caption, negative_prompt="", true_cfg_scale=4.0,
                height=64, width=64, num_inference_steps=2, output_type=output_type,
                generator=torch.Generator().manual_seed(0)).images


def run_config(name, cache, run, **kw):
    base = dict(model=name, cache=cache, run=run, steps=4, batch_size=2, workers=0, progress=False, log_every=1,
                checkpoint_every=2, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow  # validation, an export and an edit through the stock pipeline
@pytest.mark.parametrize("name", list(EDITS))
def test_a_tiny_edit_model_trains_resumes_exactly_and_its_export_edits_through_the_stock_pipeline(edit_caches, parts, tmp_path,
                                                                                                 monkeypatch, name):
    import numpy as np
    from conftest import assert_same_checkpoints, losses
    from diffusers import QwenImageTransformer2DModel

    from train.export import export
    from train.loop import train

    cache, data = edit_caches[name]
    straight = train(run_config(name, cache, tmp_path / "straight", validate=True))
    train(run_config(name, cache, tmp_path / "resumed", steps=2))
    resumed = train(run_config(name, cache, tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 4
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")
    assert (tmp_path / "straight" / "samples-step00000004.png").exists()

    export(tmp_path / "straight", tmp_path / "export")
    exported = QwenImageTransformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    base = build_transformer(get_preset(name), None, 0)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters()))  # it trained
    card = (tmp_path / "export" / "README.md").read_text()
    assert get_family("qwen-image").pipeline_of(get_preset(name)) in card and "pipe(image=" in card
    image = edit(stock_edit(name, exported, parts), data, monkeypatch)[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and float(image.std()) > 0


def test_a_full_fine_tune_resumes_bit_for_bit_from_the_weights_its_checkpoint_saved(edit_caches, tmp_path):
    """Weights and optimizer moments at steps 2 and 4 equal those of an uninterrupted run. The batches of samples whose
    references differ in shape run one sample per transformer call: CPU kernels round such one-row products
    differently on weights loaded in place from the checkpoint's file (not 64-byte aligned), unless the loaded
    weights get memory of their own."""
    from conftest import assert_same_checkpoints, losses

    from train.loop import train

    name = "tiny-qwen-image-edit-2509"
    cache, _ = edit_caches[name]
    train(run_config(name, cache, tmp_path / "straight"))
    train(run_config(name, cache, tmp_path / "resumed", steps=2))
    train(run_config(name, cache, tmp_path / "resumed"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")


@pytest.mark.parametrize("name", list(EDITS))
def test_a_tiny_edit_lora_resumes_exactly_and_loads_through_the_stock_pipeline(edit_caches, parts, tmp_path, monkeypatch, name):
    from conftest import assert_same_checkpoints, losses

    from train.export import export
    from train.loop import train

    cache, data = edit_caches[name]
    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
    straight = train(run_config(name, cache, tmp_path / "straight", **lora))
    train(run_config(name, cache, tmp_path / "resumed", **{**lora, "steps": 2}))
    resumed = train(run_config(name, cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"] and losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")

    written = export(tmp_path / "straight", tmp_path / "lora")
    pipe = stock_edit(name, build_transformer(get_preset(name), None, 0), parts)
    before = edit(pipe, data, monkeypatch, "latent")
    pipe.load_lora_weights(tmp_path / "lora", weight_name=written.name)
    after = edit(pipe, data, monkeypatch, "latent")
    assert torch.isfinite(after).all() and not torch.allclose(before, after)
    assert 'pipe.load_lora_weights("' in (tmp_path / "lora" / "README.md").read_text()
