"""Stage one for Qwen-Image-Edit and Qwen-Image-Edit-2509: a reference image is prepared exactly as the stock edit
pipelines' __call__ prepares an input image (the VAE's image, and the image their text encoder sees), its latent is the
pipelines' `image_latents`, and a caption is encoded by the pipeline's own `encode_prompt` with the sample's reference
images, through the tiny Qwen2.5-VL's vision tower. Bit for bit, in fp32."""

import numpy as np
import pytest
import torch
from PIL import Image

from precompute.families.qwen_image import (
    FAMILY,
    check_edit_template,
    edit_pipeline,
    tiny_edit_tokenizer,
    tiny_processor,
)
from precompute.families.qwen_tokenizer import tiny_qwen_tokenizer
from precompute.presets import get_preset

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

CPU = torch.device("cpu")
EDIT, PLUS = "QwenImageEditPipeline", "QwenImageEditPlusPipeline"


class Stop(Exception):
    """Raised by a spy once the pipeline has prepared what the test compares."""


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB picture (noise would make every resampler look alike)."""
    g = np.random.default_rng(seed)
    small = g.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny edit presets' VAE and Qwen2.5-VL saved in the diffusers layout (with the tokenizer and processor)."""
    directory = tmp_path_factory.mktemp("parts")
    preset = get_preset("tiny-qwen-image-edit")
    FAMILY.save_tiny_vae(preset.vae, str(directory))
    FAMILY.save_tiny_text(preset.text, str(directory))
    return directory


def stock(name: str, parts, transformer=None):
    """The stock edit pipeline with the tiny components loaded back with `from_pretrained` (the processor rebuilt
    around the saved tokenizer: transformers loads a Qwen2VLProcessor only with torchvision, which is not installed)."""
    import diffusers
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(parts / "tokenizer")
    return getattr(diffusers, name)(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=diffusers.AutoencoderKLQwenImage.from_pretrained(parts / "vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(parts / "text_encoder").eval(), tokenizer=tokenizer,
        processor=tiny_processor(tokenizer), transformer=transformer)


def tiny_transformer():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16,
                                       num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def what_call_prepares(pipe, images, prompt="make it blue"):
    """Run the pipeline's __call__ until it hands its prepared images on: {"text_image": the `image` its encode_prompt
    gets, "vae_images": what prepare_latents gets}. The encoders do not run (the sizes are a megapixel's)."""
    seen = {}

    def spy_encode(*args, **kwargs):
        seen.setdefault("text_image", kwargs["image"])
        return torch.zeros(1, 4, 32), None

    def spy_prepare(image, *args, **kwargs):
        seen["vae_images"] = image
        raise Stop

    pipe.encode_prompt, pipe.prepare_latents = spy_encode, spy_prepare
    with pytest.raises(Stop), torch.no_grad():
        pipe(image=images, prompt=prompt, num_inference_steps=1, true_cfg_scale=1.0)
    return seen


def test_the_tiny_edit_tokenizer_splits_the_system_prompt_into_the_tokens_the_pipelines_drop():
    tokenizer = tiny_edit_tokenizer()
    for name in (EDIT, PLUS):
        pipe = edit_pipeline(name)
        assert pipe.prompt_template_encode_start_idx == 64
        check_edit_template(tokenizer, pipe)
        ids = tokenizer(pipe.prompt_template_encode.format("a red circle")).input_ids
        # after the dropped system prompt and turn opening: the image's place (Edit) or the caption (2509)
        assert tokenizer.decode(ids[64:]).startswith("<|vision_start|>" if name == EDIT else "a red circle")
    with pytest.raises(ValueError, match="splits QwenImageEditPipeline's prompt template prefix into [0-9]+ tokens, but the "
                                         "pipeline drops 64"):
        check_edit_template(tiny_qwen_tokenizer(["a red circle"]), edit_pipeline(EDIT))  # never saw the template


@pytest.mark.parametrize("size", [(300, 200), (97, 413)])
def test_a_real_edit_presets_reference_is_what_qwenimageeditpipeline_prepares(parts, size):
    """qwen-image-edit: the pipeline's own sizes for the image (about a megapixel, its aspect ratio), resized once by its
    image processor; the VAE gets that image and encode_prompt the very same one."""
    pipe = stock(EDIT, parts, tiny_transformer())
    image = picture(*size, seed=1)
    seen = what_call_prepares(pipe, image)
    ours = FAMILY.prepare_reference(get_preset("qwen-image-edit"), image, 0, 1)
    theirs = seen["vae_images"][:, :, 0]  # (1, 3, h, w), the frame axis the pipeline adds
    assert ours["pixels"].shape == theirs.shape[1:] and ours["pixels"].dtype == torch.float32
    assert abs(ours["pixels"].shape[1] * ours["pixels"].shape[2] / 1024**2 - 1) < 0.1
    assert torch.equal(ours["pixels"], theirs[0])
    assert np.array_equal(ours["text_pixels"].permute(1, 2, 0).numpy(), np.asarray(seen["text_image"]))


def test_a_real_2509_presets_references_are_what_qwenimageeditpluspipeline_prepares(parts):
    """qwen-image-edit-2509: each image at VAE_IMAGE_SIZE for the VAE (preprocessed from the original) and at
    CONDITION_IMAGE_SIZE for the text encoder, each at its own aspect ratio."""
    pipe = stock(PLUS, parts, tiny_transformer())
    images = [picture(300, 200, seed=2), picture(150, 410, seed=3)]
    seen = what_call_prepares(pipe, images)
    preset = get_preset("qwen-image-edit-2509")
    assert preset.references == 3 and preset.requires_references
    for j, image in enumerate(images):
        ours = FAMILY.prepare_reference(preset, image, j, 2)
        assert torch.equal(ours["pixels"], seen["vae_images"][j][0, :, 0])
        assert np.array_equal(ours["text_pixels"].permute(1, 2, 0).numpy(), np.asarray(seen["text_image"][j]))
        assert abs(ours["text_pixels"].shape[1] * ours["text_pixels"].shape[2] / 384**2 - 1) < 0.15


@pytest.mark.parametrize("name", ["tiny-qwen-image-edit", "tiny-qwen-image-edit-2509"])
def test_reference_latents_are_the_pipelines_image_latents(parts, name):
    """The pipelines' `prepare_latents` from the prepared references: its packed `image_latents` are our latents
    packed, one reference after the other (the posterior's mode, (z - mean) / std)."""
    plus = name.endswith("2509")
    preset = get_preset(name)
    pipe = stock(PLUS if plus else EDIT, parts)
    images = [picture(100, 60, seed=4), picture(64, 64, seed=5)][: 2 if plus else 1]
    prepared = [FAMILY.prepare_reference(preset, image, j, len(images)) for j, image in enumerate(images)]
    with torch.no_grad():
        ours = [FAMILY.encode_references(pipe.vae, p["pixels"][None], FAMILY.latent_spec(pipe.vae)) for p in prepared]
        given = [p["pixels"][None, :, None] for p in prepared]  # (1, 3, 1, h, w) as __call__ hands them over
        _, theirs = pipe.prepare_latents(given if plus else given[0], 1, 16, 64, 64, torch.float32, CPU, None)
    packed = torch.cat([pipe._pack_latents(z[:, :, None], 1, 16, z.shape[2], z.shape[3]) for z in ours], dim=1)
    assert [tuple(z.shape) for z in ours] == [(1, 16, 8, 12), (1, 16, 8, 8)][: len(images)]
    assert torch.equal(packed, theirs)


def test_an_edit_caption_is_what_qwenimageeditpipeline_encodes_with_its_image(parts):
    """Each caption with its sample's reference, as `encode_prompt(prompt, image)` of the stock pipeline; a caption
    without one (a validation prompt, the empty caption) as 2509's encode_prompt encodes a prompt without images, in
    one batch."""
    preset = get_preset("tiny-qwen-image-edit")
    side = FAMILY.load_text(preset.text, None, torch.float32)
    pipe, plus = stock(EDIT, parts), stock(PLUS, parts)
    a, b = (FAMILY.prepare_reference(preset, picture(*size, seed=s), 0, 1) for size, s in (((100, 60), 6), ((64, 64), 7)))
    captions = ["make the circle blue", "", "add a small star", "a red circle"]
    with torch.inference_mode():
        ours = FAMILY.encode_text(side, captions, CPU, references=[[a["text_pixels"]], [a["text_pixels"]], [b["text_pixels"]], []])
    with torch.no_grad():
        for j, ref in ((0, a), (1, a), (2, b)):
            embeds, mask = pipe.encode_prompt(captions[j], image=Image.fromarray(ref["text_pixels"].permute(1, 2, 0).numpy()), device=CPU)
            assert mask is None and torch.equal(ours[j]["text"], embeds[0]), captions[j]
        embeds, _ = plus.encode_prompt([captions[3]], image=None, device=CPU)
        assert torch.equal(ours[3]["text"], embeds[0])
    # the vision tower ran: the image's tokens are in the text, and another image gives another text
    assert ours[0]["text"].shape[0] > ours[3]["text"].shape[0] + 3
    with torch.inference_mode():
        other = FAMILY.encode_text(side, [captions[0]], CPU, references=[[b["text_pixels"]]])
    assert not torch.equal(other[0]["text"], ours[0]["text"])
    assert FAMILY.truncated(side, captions) == [False] * 4  # the edit pipelines cut nothing


def test_a_2509_caption_is_what_qwenimageeditpluspipeline_encodes_with_its_images(parts):
    """Two references of different sizes: the caption with "Picture 1: ... Picture 2: ..." and both condition images."""
    preset = get_preset("tiny-qwen-image-edit-2509")
    side = FAMILY.load_text(preset.text, None, torch.float32)
    refs = [FAMILY.prepare_reference(preset, picture(*size, seed=s), j, 2) for j, (size, s) in enumerate((((100, 60), 8), ((50, 90), 9)))]
    pixels = [r["text_pixels"] for r in refs]
    with torch.inference_mode():
        ours = FAMILY.encode_text(side, ["put the star on the square", "put the star on the square"], CPU,
                                  references=[pixels, pixels[:1]])
    pipe = stock(PLUS, parts)
    with torch.no_grad():
        two, _ = pipe.encode_prompt("put the star on the square", image=[Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels], device=CPU)
        one, _ = pipe.encode_prompt("put the star on the square", image=[Image.fromarray(pixels[0].permute(1, 2, 0).numpy())], device=CPU)
    assert torch.equal(ours[0]["text"], two[0]) and torch.equal(ours[1]["text"], one[0])
    assert ours[0]["text"].shape[0] > ours[1]["text"].shape[0]
    with pytest.raises(ValueError, match="at most 1 reference"):
        FAMILY.encode_text(FAMILY.load_text(get_preset("tiny-qwen-image-edit").text, None, torch.float32), ["x"], CPU,
                           references=[pixels])


def test_the_edit_presets_and_their_records():
    """The presets name the published repositories and their pipelines' limits; the fingerprint records how references
    are sized and what processes the text encoder's images; an edit preset keeps its own text encoder."""
    from dataclasses import replace

    from precompute.presets import get_text_encoder

    edit, plus = get_preset("qwen-image-edit"), get_preset("qwen-image-edit-2509")
    assert (edit.vae.repo, edit.text.repo, edit.transformer, edit.references) == ("Qwen/Qwen-Image-Edit",) * 3 + (1,)
    assert (plus.vae.repo, plus.text.repo, plus.transformer, plus.references) == ("Qwen/Qwen-Image-Edit-2509",) * 3 + (3,)
    assert edit.text.tokenizer_subfolder == "processor" and edit.requires_references and plus.requires_references
    assert FAMILY.reference_fingerprint(edit) == {"pipeline": EDIT, "vae_area": 1024 * 1024, "text_area": 1024 * 1024, "resample": "lanczos",
                                                  "sizes": "calculate_dimensions: the image's aspect ratio, sides multiples of 32"}
    assert FAMILY.reference_fingerprint(plus)["text_area"] == 384 * 384
    assert FAMILY.reference_fingerprint(get_preset("tiny-qwen-image-edit-2509"))["vae_area"] == 64 * 64
    side = FAMILY.load_text(get_preset("tiny-qwen-image-edit").text, None, torch.float32)
    assert FAMILY.text_fingerprint(side)["image_processor"] == "Qwen2VLImageProcessorPil"
    assert FAMILY.text_fingerprint(FAMILY.load_text(get_preset("tiny-qwen-image").text, None, torch.float32)) == {}
    with pytest.raises(ValueError, match="qwen-image-edit encodes captions with its pipeline's own text encoder"):
        FAMILY.check_text_options(replace(edit, text=get_text_encoder("qwen2.5-vl-7b")))
    with pytest.raises(ValueError, match="qwen-image encodes captions"):
        FAMILY.check_text_options(replace(get_preset("qwen-image"), text=get_text_encoder("qwen2.5-vl-7b-edit")))
    with pytest.raises(ValueError, match="not an edit preset"):
        FAMILY.prepare_reference(get_preset("tiny-qwen-image"), picture(64, 64, 0), 0, 1)

    from shards import TextSpec

    # the disk estimate counts an edit text's vision tokens whole (Edit's 1,369 at a megapixel) and a short caption
    assert FAMILY.caption_elements(TextSpec("masked", 3584, edit.text.max_length)) == (37 * 37 + 64) * 3584
    assert FAMILY.caption_elements(TextSpec("masked", 3584, 512)) == 256 * 3584


# -- a whole stage-one run ------------------------------------------------------------------------------------------

RUN = dict(workers=0, progress=False, batch_size=2, max_shard_mb=0, storage_dtype="fp32", references=True)


def by_source(cache) -> dict:
    from shards import Cache

    c = Cache(cache)
    return {bytes(c[i]["source"].tolist()).decode(): c[i] for i in range(len(c))}


def reference_files(data, name: str, count: int) -> list:
    stem = name.removesuffix(".png")
    return [data / f"{stem}.ref.png"] if count == 1 else [data / f"{stem}.ref{k}.png" for k in range(count)]


def expected(pipe, preset, data, name: str, caption: str, count: int):
    """What the cache must hold for sample `name`: (its text, its reference latents), from its reference files through
    the family's `prepare_reference` and the stock pipeline's `encode_prompt` and `prepare_latents`."""
    images = [Image.open(path).convert("RGB") for path in reference_files(data, name, count)]
    prepared = [FAMILY.prepare_reference(preset, image, j, count) for j, image in enumerate(images)]
    texts = [Image.fromarray(p["text_pixels"].permute(1, 2, 0).numpy()) for p in prepared]
    plus = type(pipe).__name__ == PLUS
    with torch.no_grad():
        text, _ = pipe.encode_prompt(caption, image=texts if plus else texts[0], device=CPU)
        given = [p["pixels"][None, :, None] for p in prepared]
        _, packed = pipe.prepare_latents(given if plus else given[0], 1, 16, 64, 64, torch.float32, CPU, None)
    latents, start = [], 0
    for p in prepared:
        h, w = p["pixels"].shape[1] // 8, p["pixels"].shape[2] // 8
        latents.append(pipe._unpack_latents(packed[:, start : start + h * w // 4], h * 8, w * 8, 8)[0, :, 0])
        start += h * w // 4
    return text[0], latents


@pytest.mark.parametrize("name, count", [("tiny-qwen-image-edit", 1), ("tiny-qwen-image-edit-2509", 2)], ids=["edit", "2509"])
def test_a_tiny_edit_cache_holds_what_the_stock_pipeline_computes_and_an_edited_reference_re_encodes_its_sample(
        parts, tmp_path, monkeypatch, name, count):
    """Stage one on an edit folder (x.ref.png; x.ref0.png and x.ref1.png for 2509): every sample's text is the stock
    pipeline's `encode_prompt` of its caption with its reference images and its reference latents the pipeline's
    `image_latents`, bit for bit; the validation prompt is encoded without images. Editing one reference image
    re-encodes exactly that sample, its text included (the text's key covers the references)."""
    from precompute.encode import Encoders
    from precompute.run import main as precompute
    from precompute.sample_data import make_edit_folder
    from shards import prompt_key
    from shards.references import unpack

    preset = get_preset(name)
    pipe = stock(PLUS if count > 1 else EDIT, parts)
    data, cache = make_edit_folder(tmp_path / "data", 3, references=count, seed=1), tmp_path / "cache"
    summary = precompute(str(data), name, cache, validation_prompt=["make it red"], **RUN)
    assert summary["new"] == 3 and summary["references"]["references_per_sample"] == count
    before = by_source(cache)
    for source, s in before.items():
        caption = (data / source.replace(".png", ".txt")).read_text().strip()
        text, latents = expected(pipe, preset, data, source, caption, count)
        assert torch.equal(s["text"], text), source
        assert [torch.equal(a, b) for a, b in zip(unpack(s), latents)] == [True] * count, source
    from shards import Cache

    prompts = Cache(cache).prompts()
    with torch.no_grad():
        alone, _ = stock(PLUS, parts).encode_prompt("make it red", image=None, device=CPU)
    assert torch.equal(prompts[prompt_key("make it red")].fields["text"], alone[0])

    # one reference image edited: its sample alone is encoded again, its references and its caption with them
    calls = {"references": [], "captions": []}
    references, texts = Encoders.encode_references, Encoders.encode_text
    monkeypatch.setattr(Encoders, "encode_references", lambda s, px: calls["references"].append(len(px)) or references(s, px))
    monkeypatch.setattr(Encoders, "encode_text", lambda s, captions, *a, **k: calls["captions"].append(list(captions))
                        or texts(s, captions, *a, **k))
    edited = reference_files(data, "00001.png", count)[-1]
    image = Image.open(edited).convert("RGB")
    image.paste((250, 20, 20), (0, 0, image.width // 3, image.height // 3))  # a red corner
    image.save(edited)
    summary = precompute(str(data), name, cache, validation_prompt=["make it red"], **RUN)
    caption = (data / "00001.txt").read_text().strip()
    assert (summary["new"], summary["changed"], summary["unchanged"]) == (0, 1, 2)
    samples = [c for c in calls["captions"] if c not in ([""], ["make it red"])]  # each run encodes its prompts again
    assert sum(calls["references"]) == count and samples == [[caption]], calls["captions"]
    after = by_source(cache)
    text, latents = expected(pipe, preset, data, "00001.png", caption, count)
    assert torch.equal(after["00001.png"]["text"], text) and not torch.equal(text, before["00001.png"]["text"])
    assert torch.equal(unpack(after["00001.png"])[-1], latents[-1])
    for source in ("00000.png", "00002.png"):
        assert after[source].key == before[source].key and torch.equal(after[source]["text"], before[source]["text"])


def test_a_real_edit_preset_loads_the_published_layout_with_from_pretrained(parts):
    """qwen-image-edit pointed at a directory in its layout (the tiny components saved there: vae/, text_encoder/,
    processor/) loads them with `from_pretrained` and encodes what the tiny preset encodes; without torchvision the
    processor's PIL backend is used, and a warning says so."""
    from precompute.encode import Encoders

    preset = get_preset("qwen-image-edit")
    with pytest.warns(UserWarning, match="torchvision is not installed"):
        real = Encoders(preset, CPU, pretrained=str(parts))
    tiny = Encoders(get_preset("tiny-qwen-image-edit"), CPU)
    assert type(real.pipeline).__name__ == EDIT and type(real.pipeline.processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert real.fingerprint()["text_encoder"]["image_processor_sha256"] == tiny.fingerprint()["text_encoder"]["image_processor_sha256"]
    pixels = FAMILY.prepare_reference(get_preset("tiny-qwen-image-edit"), picture(100, 60, seed=10), 0, 1)["text_pixels"]
    captions, references = ["make it green", ""], [[pixels], []]
    for a, b in zip(real.encode_text(captions, references=references).fields, tiny.encode_text(captions, references=references).fields):
        assert torch.equal(a["text"], b["text"])
