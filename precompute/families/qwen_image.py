"""Qwen-Image: its video VAE (AutoencoderKLQwenImage: a KL posterior, 16 channels, f8, images as one frame, normalised
per channel) and Qwen2.5-VL-7B's last hidden states, encoded as QwenImagePipeline encodes: its prompt template around
the caption, the template's first tokens dropped, the valid tokens kept (its transformer masks the padding).

Qwen-Image-Edit and Qwen-Image-Edit-2509 (QwenImageEditPipeline, QwenImageEditPlusPipeline) edit reference images: each
reference is resized as the pipeline resizes an input image (about a megapixel for the VAE, its own aspect ratio;
2509 hands the text encoder a smaller copy), its latent is the VAE posterior's mode normalised as the pipeline's
`_encode_vae_image` normalises it, and a caption is encoded by the pipeline's `encode_prompt` with the sample's
references: Qwen2.5-VL sees them through its vision tower (their vision tokens stay in the cached text)."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from functools import cache
from importlib import import_module

import numpy as np
import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from precompute.families.qwen_tokenizer import tiny_qwen_tokenizer
from shards import LatentSpec, TextSpec

# Published repository (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/, scheduler/).
QWEN_IMAGE = "Qwen/Qwen-Image"
# QwenImagePipeline's own limit on caption tokens when it generates (`max_sequence_length`'s default in __call__).
MAX_TOKENS = 512
# The published VAE's per-channel statistics (its config's latents_mean / latents_std), which the tiny VAE keeps.
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382,
               1.1253, 2.8251, 1.9160)

QWEN_IMAGE_EDIT = "Qwen/Qwen-Image-Edit"
QWEN_IMAGE_EDIT_2509 = "Qwen/Qwen-Image-Edit-2509"
# 2509 takes a list of images and sets no limit; Qwen's model card documents one to three as what it was trained for.
EDIT_2509_REFERENCES = 3
# The tiny edit presets' areas, scaled down from the pipelines' (VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE) to CPU size.
TINY_VAE_AREA = 64 * 64
TINY_CONDITION_AREA = 32 * 32
# What an edit text holds beside its caption: Qwen2.5-VL's vision tokens of each reference (14-pixel patches merged
# 2 x 2; the processor rounds sides to 28 pixels). The pipelines cut nothing, so a text's tokens are its caption's (up to
# MAX_TOKENS, QwenImagePipeline's own limit, as a planning figure) plus these: about 37 x 37 for Edit's 1024 x 1024 image,
# 14 x 14 and the "Picture n: " words for each of 2509's 384 x 384 ones.
EDIT_TOKENS = MAX_TOKENS + 37 * 37
EDIT_2509_TOKENS = MAX_TOKENS + EDIT_2509_REFERENCES * (14 * 14 + 7)
TINY_EDIT_TOKENS = 64
# Where the edit repositories keep the Qwen2VLProcessor whose tokenizer and image processor encode_prompt uses.
PROCESSOR = "processor"
EDIT_KINDS = ("qwen2.5-vl-edit", "qwen2.5-vl-edit-2509")  # the edit pipelines' text encoders (`TextEncoderSpec.kind`)
VISION_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"  # Edit's template holds its one image here


@dataclass(frozen=True)
class Edit:
    """How an edit pipeline prepares the images it is given (one text encoder of this family per pipeline).

    Args:
        pipeline: the diffusers pipeline class, QwenImageEditPipeline or QwenImageEditPlusPipeline.
        vae_area: the pixel area `calculate_dimensions` sizes the image the VAE encodes at (its aspect ratio kept,
            sides multiples of 32).
        text_area: the area of the copy the text encoder sees (2509's condition image); None: Edit hands it the VAE's
            resized image itself.
        references: the most images an edit takes.
    """

    pipeline: str
    vae_area: int
    text_area: int | None
    references: int


@cache
def edits() -> dict[str, Edit]:
    """The edit pipelines' sizes by text encoder name (each edit preset encodes with its own: `check_text_options`).
    Edit's __call__ sizes its image at the literal 1024 * 1024, which 2509 names VAE_IMAGE_SIZE."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE

    return {
        "qwen2.5-vl-7b-edit": Edit("QwenImageEditPipeline", VAE_IMAGE_SIZE, None, 1),
        "qwen2.5-vl-7b-edit-2509": Edit("QwenImageEditPlusPipeline", VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE, EDIT_2509_REFERENCES),
        "tiny-qwen2.5-vl-edit": Edit("QwenImageEditPipeline", TINY_VAE_AREA, None, 1),
        "tiny-qwen2.5-vl-edit-2509": Edit("QwenImageEditPlusPipeline", TINY_VAE_AREA, TINY_CONDITION_AREA, EDIT_2509_REFERENCES),
    }


PIPELINE_MODULES = {"QwenImageEditPipeline": "pipeline_qwenimage_edit", "QwenImageEditPlusPipeline": "pipeline_qwenimage_edit_plus"}


def pipeline_template() -> tuple[str, int]:
    """QwenImagePipeline's prompt template ("...{}...") and how many of its leading tokens the pipeline drops."""
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx


@cache
def edit_pipeline(name: str):
    """An edit pipeline class's instance without components: its prompt template and image processor (cached: the
    loader's workers prepare every reference with it)."""
    import diffusers

    return getattr(diffusers, name)(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None)


def edit_dimensions(pipeline: str, area: int, image) -> tuple[int, int]:
    """(width, height) the pipeline's own `calculate_dimensions` gives an image at `area`."""
    module = import_module(f"diffusers.pipelines.qwenimage.{PIPELINE_MODULES[pipeline]}")
    width, height = module.calculate_dimensions(area, image.width / image.height)[:2]
    if not width or not height:
        raise ValueError(f"a reference image of {image.width}x{image.height} pixels: {pipeline} sizes it to {width}x{height} "
                         f"at {area} pixels; crop it to a less extreme aspect ratio")
    return width, height


def check_edit_template(tokenizer, pipeline) -> None:
    """The edit pipelines drop a fixed number of leading tokens, meant to be their system prompt and the user turn's
    opening (the images' and the caption's tokens stay): refuse a tokenizer that splits that prefix otherwise."""
    template, drop = pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx
    turn = "<|im_start|>user\n"
    n = len(tokenizer(template.split(turn)[0] + turn).input_ids)
    if n != drop:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) splits {type(pipeline).__name__}'s prompt template "
                         f"prefix into {n} tokens, but the pipeline drops {drop}: it is not Qwen-Image-Edit's tokenizer; give "
                         f"the published one (processor/ of {QWEN_IMAGE_EDIT})")


def tiny_edit_tokenizer():
    """The tiny tokenizer of the edit presets: trained on both edit pipelines' templates and the sample words, so their
    system prompt splits into exactly the tokens the pipelines drop (checked)."""
    edit, plus = (edit_pipeline(name) for name in PIPELINE_MODULES)
    words = " ".join(parts.TINY_WORDS)
    corpus = ([edit.prompt_template_encode.format(words)] * 8 + [plus.prompt_template_encode.format("Picture 1: " + words)] * 8
              + [words] * 4)
    tokenizer = tiny_qwen_tokenizer(corpus)
    for pipeline in (edit, plus):
        check_edit_template(tokenizer, pipeline)
    return tokenizer


@cache
def images_only_processor():
    """Qwen2VLProcessor without its video processor: transformers builds a Qwen2VLProcessor only with torchvision (its
    video processor's base class needs it), and encode_prompt never hands it a video."""
    from transformers import Qwen2VLProcessor

    class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImagesOnlyQwen2VLProcessor


def tiny_processor(tokenizer):
    """The tiny edit presets' processor: Qwen2.5-VL's image processing (PIL backend, the published patch and merge sizes)
    around the tiny tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return images_only_processor()(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)


def load_processor(repo: str, subfolder: str, revision: str | None):
    """A published edit pipeline's processor, as the pipeline's `from_pretrained` loads it. Without torchvision
    transformers cannot build a Qwen2VLProcessor (nor the stock pipeline load): the same tokenizer and image
    processor settings are loaded with the image processor's PIL backend, which resizes slightly otherwise than the
    torchvision one the stock pipeline uses where it runs; a warning says so and the fingerprint names the backend."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(repo, subfolder=subfolder, revision=revision)
    image_processor = AutoImageProcessor.from_pretrained(repo, subfolder=subfolder, revision=revision)
    warnings.warn(f"{repo}: torchvision is not installed, so {type(image_processor).__name__} (the PIL backend) prepares the "
                  f"images Qwen2.5-VL sees; the stock edit pipeline loads its processor only with torchvision and then "
                  f"resizes with torchvision's kernels, so cached texts may differ from its in the last bits. Install "
                  f"torchvision to cache exactly what it computes.", stacklevel=2)
    tokenizer = AutoTokenizer.from_pretrained(repo, subfolder=subfolder, revision=revision)
    return images_only_processor()(image_processor=image_processor, tokenizer=tokenizer)


def check_template(tokenizer) -> None:
    """The pipeline drops a fixed number of leading tokens, meant to be its template's prefix: refuse a tokenizer that
    splits the prefix otherwise, since captions would lose their first tokens or keep part of the template."""
    template, drop = pipeline_template()
    prefix = template.split("{}")[0]
    n = len(tokenizer(prefix).input_ids)
    if n != drop:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) splits QwenImagePipeline's prompt template prefix into "
                         f"{n} tokens, but the pipeline drops {drop}: it is not Qwen-Image's tokenizer; give the "
                         f"published one (tokenizer/ of {QWEN_IMAGE})")


def tiny_tokenizer():
    """Qwen's tokenizer class, trained on the pipeline's template and the sample captions' words, so the template's
    prefix splits into exactly the tokens the pipeline drops (checked), as with the published tokenizer."""
    template, _ = pipeline_template()
    corpus = [template.format(" ".join(parts.TINY_WORDS))] * 8 + [" ".join(parts.TINY_WORDS)] * 4
    tokenizer = tiny_qwen_tokenizer(corpus)
    check_template(tokenizer)
    return tokenizer


def tiny_text_encoder(tokenizer):
    """Qwen2_5_VLForConditionalGeneration, the pipeline's class, 32 wide with 2 layers (and a one-block vision tower,
    which text encoding never runs); M-RoPE's sections sum to half the head width, as in the published model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None, eos_token_id=ids("<|im_end|>"),
                pad_token_id=ids("<|endoftext|>"),
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    return parts.seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))


def tiny_vae():
    """AutoencoderKLQwenImage at CPU size: f8 (three spatial downsamplings), 16 channels, the published statistics."""
    from diffusers import AutoencoderKLQwenImage

    return parts.seeded(lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
        latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD),
    ))


def channel_stats(latent: LatentSpec, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, C, 1, 1, 1) mean and inverse std, built as the Qwen-Image pipelines build them."""
    shape = (1, latent.channels, 1, 1, 1)
    mean = torch.tensor(latent.latents_mean).view(shape).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(latent.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inverse_std


def edit_of(spec: TextEncoderSpec) -> Edit | None:
    """The edit pipeline a text encoder belongs to; None for QwenImagePipeline's."""
    return edits().get(spec.name) if is_edit(spec) else None


def is_edit(spec: TextEncoderSpec) -> bool:
    """Whether a text encoder is an edit pipeline's (without importing diffusers: a run's options are checked first)."""
    return spec.kind in EDIT_KINDS


def to_pil(pixels: torch.Tensor):
    """A uint8 (3, h, w) image, as the PIL image it was made from."""
    from PIL import Image

    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


class QwenImage(Family):
    name = "qwen-image"
    own_text_encoder = "Qwen2.5-VL-7B through Qwen-Image's prompt template (qwen2.5-vl-7b)"
    frame_axis = True  # the VAE takes images as one-frame videos (B, C, 1, H, W): the decoder recipe records it
    text_takes_references = True  # the edit pipelines' Qwen2.5-VL sees the reference images

    def presets(self) -> dict[str, Preset]:
        text = self.text_encoders()
        # The VAE and Qwen2.5-VL run in bf16 in the published pipeline; fp16 is not known to be safe for either.
        vae = VaeSpec("qwen-image", QWEN_IMAGE, cuda_dtype="bf16")
        tiny_vae = VaeSpec("qwen-image", None, cuda_dtype="bf16")
        edit = dict(requires_references=True)  # an edit model edits: every sample has its reference images
        return {
            "qwen-image": Preset("qwen-image", self.name, 1024, vae, text["qwen2.5-vl-7b"], QWEN_IMAGE),
            "qwen-image-edit": Preset("qwen-image-edit", self.name, 1024, VaeSpec("qwen-image", QWEN_IMAGE_EDIT, cuda_dtype="bf16"),
                                      text["qwen2.5-vl-7b-edit"], QWEN_IMAGE_EDIT, references=1, **edit),
            "qwen-image-edit-2509": Preset("qwen-image-edit-2509", self.name, 1024,
                                           VaeSpec("qwen-image", QWEN_IMAGE_EDIT_2509, cuda_dtype="bf16"),
                                           text["qwen2.5-vl-7b-edit-2509"], QWEN_IMAGE_EDIT_2509,
                                           references=EDIT_2509_REFERENCES, **edit),
            "tiny-qwen-image": Preset("tiny-qwen-image", self.name, 256, tiny_vae, text["tiny-qwen2.5-vl"], None),
            "tiny-qwen-image-edit": Preset("tiny-qwen-image-edit", self.name, 256, tiny_vae, text["tiny-qwen2.5-vl-edit"], None,
                                           references=1, **edit),
            "tiny-qwen-image-edit-2509": Preset("tiny-qwen-image-edit-2509", self.name, 256, tiny_vae,
                                                text["tiny-qwen2.5-vl-edit-2509"], None, references=EDIT_2509_REFERENCES, **edit),
        }

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        # An edit encoder's tokenizer is its processor's (encode_prompt tokenizes with the processor); `max_length` is
        # the tokens of a caption and its references' vision tokens the planner assumes: the edit pipelines cut nothing.
        edit = dict(family=self.name, tokenizer_subfolder=PROCESSOR)
        return {"qwen2.5-vl-7b": TextEncoderSpec("qwen2.5-vl-7b", self.name, "qwen2.5-vl", QWEN_IMAGE, max_length=MAX_TOKENS),
                "qwen2.5-vl-7b-edit": TextEncoderSpec("qwen2.5-vl-7b-edit", kind="qwen2.5-vl-edit", repo=QWEN_IMAGE_EDIT,
                                                      max_length=EDIT_TOKENS, **edit),
                "qwen2.5-vl-7b-edit-2509": TextEncoderSpec("qwen2.5-vl-7b-edit-2509", kind="qwen2.5-vl-edit-2509",
                                                           repo=QWEN_IMAGE_EDIT_2509, max_length=EDIT_2509_TOKENS, **edit),
                "tiny-qwen2.5-vl": TextEncoderSpec("tiny-qwen2.5-vl", self.name, "qwen2.5-vl", None, max_length=64),
                "tiny-qwen2.5-vl-edit": TextEncoderSpec("tiny-qwen2.5-vl-edit", kind="qwen2.5-vl-edit", repo=None,
                                                        max_length=TINY_EDIT_TOKENS, **edit),
                "tiny-qwen2.5-vl-edit-2509": TextEncoderSpec("tiny-qwen2.5-vl-edit-2509", kind="qwen2.5-vl-edit-2509", repo=None,
                                                             max_length=TINY_EDIT_TOKENS, **edit)}

    # -- the image side --

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        if not repo:
            return tiny_vae()
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision)

    def latent_spec(self, vae) -> LatentSpec:
        """The posterior's mean and std, normalised per channel as the pipelines do: (z - mean) * (1 / std)."""
        cfg = vae.config
        return LatentSpec(int(cfg.z_dim), 2 ** len(cfg.temperal_downsample), 1.0, 0.0, "mean_std",
                          tuple(float(v) for v in cfg.latents_mean), tuple(float(v) for v in cfg.latents_std))

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        dist = vae.encode(x[:, :, None]).latent_dist  # one frame: (B, 3, 1, H, W) -> (B, C, 1, h, w)
        z, std = dist.mean.float(), dist.std.float()
        mean, inverse_std = channel_stats(latent, z)
        return {"latent_mean": ((z - mean) * inverse_std)[:, :, 0], "latent_std": (std * inverse_std)[:, :, 0]}

    # -- reference images: the edit presets --

    def prepare_reference(self, preset: Preset, image, index: int, count: int) -> dict[str, torch.Tensor]:
        """As the edit pipeline's __call__ prepares an input image: sized by its `calculate_dimensions` at the VAE's
        area (the image's aspect ratio, sides multiples of 32) and resized by its image processor (Lanczos). Edit resizes
        once and hands that image to the VAE and to the text encoder; 2509 preprocesses the original for the VAE and
        hands the text encoder a copy resized to its condition area."""
        edit = self.edit(preset)
        processor = edit_pipeline(edit.pipeline).image_processor
        width, height = edit_dimensions(edit.pipeline, edit.vae_area, image)
        if edit.text_area is None:
            text = processor.resize(image, height, width)
            pixels = processor.preprocess(text, height, width)
        else:
            text_width, text_height = edit_dimensions(edit.pipeline, edit.text_area, image)
            text = processor.resize(image, text_height, text_width)
            pixels = processor.preprocess(image, height, width)
        text_pixels = torch.from_numpy(np.asarray(text, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
        return {"pixels": pixels[0].float(), "text_pixels": text_pixels}

    def encode_references(self, vae: torch.nn.Module, x: torch.Tensor, latent: LatentSpec) -> torch.Tensor:
        """The pipelines' `_encode_vae_image`: the one-frame posterior's mode, (z - latents_mean) / latents_std. One
        image per VAE call, as the pipelines encode each input image (a batch's convolutions round differently); the
        text encoder's pass over the same references costs far more."""
        z = torch.cat([vae.encode(image[None, :, None]).latent_dist.mode() for image in x])  # (B, C, 1, h, w)
        shape = (1, latent.channels, 1, 1, 1)
        mean = torch.tensor(latent.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(latent.latents_std).view(shape).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0].float()

    def reference_fingerprint(self, preset: Preset) -> dict:
        edit = self.edit(preset)
        resample = edit_pipeline(edit.pipeline).image_processor.config.resample
        return {"pipeline": edit.pipeline, "vae_area": edit.vae_area, "text_area": edit.text_area or edit.vae_area,
                "sizes": "calculate_dimensions: the image's aspect ratio, sides multiples of 32", "resample": resample}

    def edit(self, preset: Preset) -> Edit:
        edit = edit_of(preset.text)
        if not preset.references or edit is None:
            raise ValueError(f"{preset.name} is not an edit preset: it takes no reference images")
        return edit

    # -- the text side --

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import QwenImagePipeline
        from transformers import Qwen2_5_VLForConditionalGeneration

        if edit_of(spec) is not None:
            return self.load_edit_text(spec, repo, dtype)
        if repo:
            model, tokenizer = parts.load_pretrained_text(Qwen2_5_VLForConditionalGeneration, repo, spec.subfolder,
                                                          spec.tokenizer_subfolder, spec.revision, dtype)
            check_template(tokenizer)
        else:
            tokenizer = tiny_tokenizer()
            model = tiny_text_encoder(tokenizer)
        pipeline = QwenImagePipeline(scheduler=None, vae=None, text_encoder=model, tokenizer=tokenizer, transformer=None)
        # the template wraps every caption, the negative prompt's too: its digest goes into the fingerprint
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline,
                        instruction=[pipeline.prompt_template_encode, str(pipeline.prompt_template_encode_start_idx)])

    def load_edit_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        """Qwen2.5-VL with its vision tower and the edit pipeline's processor (its tokenizer and image processor)."""
        import diffusers
        from transformers import Qwen2_5_VLForConditionalGeneration

        if repo:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision,
                                                                       dtype=dtype)
            processor = load_processor(repo, spec.tokenizer_subfolder, spec.revision)
        else:
            tokenizer = tiny_edit_tokenizer()
            model, processor = tiny_text_encoder(tokenizer), tiny_processor(tokenizer)
        pipeline = getattr(diffusers, edit_of(spec).pipeline)(scheduler=None, vae=None, text_encoder=model, tokenizer=processor.tokenizer,
                                                              processor=processor, transformer=None)
        check_edit_template(processor.tokenizer, pipeline)
        # the tokenizer first: the fingerprint records its vocabulary (the processor's settings: `text_fingerprint`)
        tokenizers = {"tokenizer": processor.tokenizer, spec.tokenizer_subfolder: processor}
        return TextSide(spec, {spec.subfolder: model}, tokenizers, pipeline,
                        instruction=[pipeline.prompt_template_encode, str(pipeline.prompt_template_encode_start_idx)])

    def text_fingerprint(self, side: TextSide) -> dict:
        """An edit encoder's processor: how it sizes and normalises the images the vision tower sees."""
        if edit_of(side.spec) is None:
            return {}
        processor = side.pipeline.processor
        settings = json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str).encode()
        return {"processor": type(processor).__name__, "image_processor": type(processor.image_processor).__name__,
                "image_processor_sha256": hashlib.sha256(settings).hexdigest()}

    def text_spec(self, side: TextSide) -> TextSpec:
        # padded to the batch's longest caption, with a mask, as the pipeline pads a batch of prompts
        return TextSpec("masked", int(side.pipeline.text_encoder.config.text_config.hidden_size), side.spec.max_length)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True, references: list[list[torch.Tensor]] | None = None) -> list[dict[str, torch.Tensor]]:
        """The pipeline's `encode_prompt` (template applied, its prefix dropped, cut to `max_length`), valid tokens
        only: it returns no mask when no caption of the batch is padded. An edit encoder encodes a caption with its
        references (`encode_edit`)."""
        if edit_of(side.spec) is not None:
            return self.encode_edit(side, captions, device, references)
        if references is not None and any(references):
            raise ValueError(f"{side.spec.name} encodes captions alone; reference images go with an edit preset's encoder")
        embeds, mask = side.pipeline.encode_prompt(captions, device=device, max_sequence_length=side.spec.max_length)
        return valid_tokens(embeds, mask)

    def encode_edit(self, side: TextSide, captions: list[str], device: torch.device,
                    references: list[list[torch.Tensor]] | None) -> list[dict[str, torch.Tensor]]:
        """Each caption with its references (`text_pixels`, as `prepare_reference` made them) through the edit
        pipeline's `encode_prompt`, one caption at a time as the pipeline encodes an edit's prompt (a batch's padding
        would move the last bits; 2509's encode_prompt cannot pair captions with their own images at all). Captions
        without references (validation prompts, the empty caption) are encoded in one batch as 2509's encode_prompt
        encodes a prompt without images: Edit's template has a place for exactly one image and its pipeline cannot
        encode a prompt without it, and 2509's template is Edit's without that place."""
        references = references if references is not None else [[] for _ in captions]
        if len(references) != len(captions):
            raise ValueError(f"{len(captions)} captions, references for {len(references)}")
        edit = edit_of(side.spec)
        out: list[dict[str, torch.Tensor] | None] = [None] * len(captions)
        alone = [i for i, refs in enumerate(references) if not refs]
        if alone:
            pipeline = side.pipeline
            text_only = edit_pipeline("QwenImageEditPlusPipeline")
            assert pipeline.prompt_template_encode.replace(VISION_SPAN, "") == text_only.prompt_template_encode
            text_only = type(text_only)(scheduler=None, vae=None, text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer,
                                        processor=pipeline.processor, transformer=None)
            embeds, mask = text_only.encode_prompt([captions[i] for i in alone], image=None, device=device)
            for i, fields in zip(alone, valid_tokens(embeds, mask)):
                out[i] = fields
        for i, refs in enumerate(references):
            if not refs:
                continue
            if len(refs) > edit.references:
                raise ValueError(f"{edit.pipeline} takes at most {edit.references} reference image(s); a caption has {len(refs)}")
            images = [to_pil(r) for r in refs]
            # Edit's __call__ hands encode_prompt its one resized image, 2509's the list of its condition images
            image = images[0] if edit.pipeline == "QwenImageEditPipeline" else images
            embeds, _ = side.pipeline.encode_prompt(captions[i], image=image, device=device)
            out[i] = {"text": embeds[0].float().cpu()}
        return out

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        if is_edit(side.spec):
            return [False] * len(captions)  # the edit pipelines' encode_prompt cuts no caption
        pipeline = side.pipeline
        template, drop = pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx
        return [len(pipeline.tokenizer(template.format(c)).input_ids) - drop > side.spec.max_length for c in captions]

    def check_text_options(self, preset: Preset) -> None:
        """An edit preset encodes with its own pipeline's encoder (its template sees the references), and a
        text-to-image preset with QwenImagePipeline's."""
        super().check_text_options(preset)
        own = self.presets()[preset.name].text if preset.name in self.presets() else preset.text
        if (is_edit(own) or is_edit(preset.text)) and preset.text.name != own.name:
            raise ValueError(f"--text-encoder {preset.text.name}: {preset.name} encodes captions with its pipeline's own "
                             f"text encoder and prompt template, {own.name}")

    def caption_elements(self, text: TextSpec) -> int:
        """An edit text keeps every vision token of its references (its limit beyond the caption's MAX_TOKENS) and a
        caption of about 64 tokens; a text-to-image caption half its limit, as by default."""
        vision = text.max_tokens - MAX_TOKENS
        return (vision + 64) * text.width if vision > 0 else super().caption_elements(text)


def valid_tokens(embeds: torch.Tensor, mask: torch.Tensor | None) -> list[dict[str, torch.Tensor]]:
    """A batch's (B, L, D) embeddings and mask (None: nothing padded) -> per caption its valid tokens, float32 on the CPU."""
    embeds = embeds.float().cpu()
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool().cpu()
    return [{"text": e[m]} for e, m in zip(embeds, mask)]


FAMILY = QwenImage()
