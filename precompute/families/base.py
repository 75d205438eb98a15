"""What stage one asks of a model family: the interface every `precompute/families/<family>.py` implements.

A family module knows its VAE and text encoder(s): the presets that name them, how they load (`from_pretrained` of
the right classes, or a tiny seeded copy), how an image becomes the latent fields the cache stores (with the
family's normalisation) and how captions become text fields through the family's stock diffusers pipeline and its
own `encode_prompt`, so that cached values are exactly what inference computes. Generic code (`precompute.encode`)
chooses devices and dtypes, assembles the fingerprint, the schema and the decoder recipe, and asks the family for
the rest; it never names a family.

Adding a family: a module in this folder with a `FAMILY` object of a `Family` subclass, and its line in
`precompute/families/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from shards import Bucket, LatentSpec, TextSpec, bucket_table, resolution_table
from shards.buckets import resolution_problem
from shards.options import Dtype

# Where T5 can be left out: the error every other family's encoder gives for --drop-t5.
DROP_T5_REFUSED = "--drop-t5 applies to SD3 presets (CLIP-L + CLIP-G + T5)"


@dataclass(frozen=True)
class VaeSpec:
    """The image encoder.

    Args:
        kind: the family's name for this VAE (a tiny one is recorded as `tiny-<kind> (seeded)` in the fingerprint).
        repo: Hub id or local directory (diffusers layout); None builds the tiny model of this kind.
        fp16_safe: False for VAEs that overflow to NaN in fp16.
        cuda_dtype: compute dtype on CUDA by default: fp32, bf16 or fp16 (on CPU it is fp32).
    """

    kind: str
    repo: str | None
    subfolder: str = "vae"
    revision: str | None = None
    fp16_safe: bool = False
    cuda_dtype: Dtype = "fp32"


@dataclass(frozen=True)
class TextEncoderSpec:
    """The caption encoder(s), used through their family pipeline's own `encode_prompt`.

    Args:
        name: the name `--text-encoder` selects it by (recorded in the fingerprint).
        family: the family whose module loads and runs it (`Family.name`).
        kind: the family's name for this encoder.
        repo: Hub id or local directory; None builds the tiny model(s).
        subfolder / tokenizer_subfolder: where a single-model encoder's weights and tokenizer are.
        max_length: token limit of a caption (where CLIP encoders run beside a T5: of the T5 part).
        complex_human_instruction: prepend the family's instruction prompt, as its released models were trained.
        drop_t5: leave T5 out where the family's pipeline can (its tokens are zeros at inference, not stored).
        fp16_safe: False for encoders that overflow in fp16 (T5).
        cuda_dtype: compute dtype on CUDA by default.
    """

    name: str
    family: str
    kind: str
    repo: str | None
    subfolder: str = "text_encoder"
    tokenizer_subfolder: str = "tokenizer"
    revision: str | None = None
    max_length: int = 300
    complex_human_instruction: bool = False
    drop_t5: bool = False
    fp16_safe: bool = False
    cuda_dtype: Dtype = "bf16"


@dataclass(frozen=True)
class ImageEncoderSpec:
    """The image encoder an image-to-video preset embeds a clip's first frame with (a CLIP vision model and its image
    processor, used through the family's pipeline), loaded from the preset's repository like the VAE.

    Args:
        kind: the family's name for this encoder.
        repo: Hub id or local directory (diffusers layout); None builds the tiny model.
        cuda_dtype: compute dtype on CUDA by default.
    """

    kind: str
    repo: str | None
    subfolder: str = "image_encoder"
    processor_subfolder: str = "image_processor"
    revision: str | None = None
    cuda_dtype: Dtype = "bf16"


@dataclass(frozen=True)
class Preset:
    """A model family's encoders, bucket table and the transformer stage two trains.

    Args:
        family: the `Family.name` of the VAE (the cache records it; stage two picks its transformer family by it).
        base_resolution: the resolution whose published table the cache is bucketed on by default.
        transformer: informational here; stage two loads it.
        granularity: pixels per side of one image token, the VAE's downsampling times the transformer's patch
            (32 for DC-AE, 16 for an 8x VAE with 2x2 patches): the sides of a bucket table built for another
            resolution are multiples of it.
        max_resolution: the largest `--resolution` the model takes.
        image_to_video: the transformer is conditioned on a clip's first frame: the cache holds the family's
            first-frame fields (`Family.first_frame_fields`) beside the latents.
        image_encoder: the first frame's image encoder, where the transformer also takes its embedding.
        frame_rate: frames per second of this preset's clips, where it differs from its family's.
        references: an edit preset's most reference images per sample (its pipeline's limit); 0 for a preset that
            takes none. Its caches hold the references' latents (`shards.references`), prepared and encoded by the
            family (`prepare_reference`, `encode_references`).
        requires_references: an edit-only model (Kontext, Qwen-Image-Edit): a run with no source of reference images
            is refused; without it (FLUX.2) a cache holds text-to-image samples (no references) beside edit samples.
    """

    name: str
    family: str
    base_resolution: int
    vae: VaeSpec
    text: TextEncoderSpec
    transformer: str | None
    granularity: int = 16
    max_resolution: int = 2048
    image_to_video: bool = False
    image_encoder: ImageEncoderSpec | None = None
    frame_rate: float | None = None
    references: int = 0
    requires_references: bool = False


@dataclass
class TextSide:
    """A text encoder, loaded: its models and tokenizers by subfolder in pipeline order, and the family's stock
    pipeline built with only those (no transformer, VAE or scheduler).

    `instruction`: the lines the pipeline wraps every caption in (an instruction prompt, a template), or None; the
    fingerprint records their digest."""

    spec: TextEncoderSpec
    modules: dict[str, torch.nn.Module]
    tokenizers: dict[str, object]
    pipeline: object
    instruction: list[str] | None = None


@dataclass
class FirstFrameSide:
    """What an image-to-video preset computes from a clip's first frame, loaded: the family's image-to-video pipeline
    built with the VAE (and the image encoder and its processor, where the preset has one), nothing else.

    `modules`: the image encoder by subfolder (empty without one); `processor`: its image processor or None."""

    spec: ImageEncoderSpec | None
    modules: dict[str, torch.nn.Module]
    processor: object
    pipeline: object


class Family(ABC):
    """A model family as stage one sees it. One instance per family (`FAMILY` in its module), without state:
    what a load produces (a VAE module, a `TextSide`) is handed back to the methods that use it.

    Attributes:
        name: what presets and the cache's record call the family (`Preset.family`, `CacheSpec.family`).
        padding: the fingerprint's `text_encoder.padding`: what of a caption's padding the cache keeps.
        own_text_encoder: None when the family's transformer takes any single-sequence text encoder of the masked
            layout (padding trimmed, a mask); else what it needs, for the error refusing another family's encoder,
            e.g. "CLIP-L + T5 (clip-l-t5)".
        frame_axis: the VAE takes and returns video, (B, C, T, H, W), and the decoder recipe records it; an image
            family's cache holds one frame without that axis (`encode_images` drops it), a `video` family's keeps it.
        video: the cache holds clips: every sample's latent fields keep the frame axis, (C, T, h, w), an image being
            a one-frame clip (`encode_videos`).
        frame_rate: frames per second clips are resampled to (a preset may set its own, `frame_rate_of`).
        temporal_downsample: pixel frames per latent frame after the first: F = 4k + 1 frames encode to k + 1.
        frame_buckets: the clip lengths (pixel frames) a video source is cut to by default.
        text_takes_references: the text encoder sees an edit sample's reference images (Qwen-Image-Edit's VL model):
            `encode_text` gets them, and the text's key covers their bytes.
    """

    name: str
    padding: str = "trimmed"
    own_text_encoder: str | None = None
    frame_axis: bool = False
    video: bool = False
    frame_rate: float | None = None
    temporal_downsample: int = 0
    frame_buckets: tuple[int, ...] = ()
    text_takes_references: bool = False

    # -- names ---------------------------------------------------------------------------------------------------

    @abstractmethod
    def presets(self) -> dict[str, Preset]:
        """The family's presets by name, real ones (published weights) and `tiny-*` ones (seeded, CPU-sized)."""

    @abstractmethod
    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        """The text encoders `--text-encoder` may name, by name (`TextEncoderSpec.family` is this family)."""

    # -- the image side: the family of `Preset.family` ------------------------------------------------------------

    @abstractmethod
    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        """The VAE, in fp32 on the CPU: `from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision)` of
        the family's VAE class, or with `repo` None the same class built from a small config with seeded weights."""

    @abstractmethod
    def latent_spec(self, vae: torch.nn.Module) -> LatentSpec:
        """What the cache stores of an image, read from the loaded VAE's config: channels, downsampling, the
        normalisation applied and whether a posterior's mean and std or a deterministic latent is kept."""

    @abstractmethod
    def encode_images(self, vae: torch.nn.Module, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) pixels in [-1, 1], in the VAE's dtype and on its device -> the latent fields of `latent`
        (`latent.fields`), each (B, C, H / downsample, W / downsample) float32, normalised as `latent` records."""

    def encode_videos(self, vae: torch.nn.Module, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) pixel frames in [-1, 1], in the VAE's dtype and on its device -> the latent fields, each
        (B, C, T, h, w) float32 with T = (F - 1) // temporal_downsample + 1, normalised as `latent` records. Only
        a `video` family encodes clips."""
        raise ValueError(f"{self.name} models take images, not video clips: choose a video model's preset")

    def vae_fingerprint(self, vae: torch.nn.Module) -> dict:
        """Entries of the fingerprint's `vae` part beside the latent spec that change what the VAE computes (e.g. how
        large frames are tiled); empty by default, so the fingerprints of caches without them do not change."""
        return {}

    def decoder_patch(self, vae: torch.nn.Module) -> int:
        """How many latent pixels a side of the VAE's latent one stored latent pixel folds into its channels (the
        decoder recipe's `patch`): 1 by default, the VAE's latent stored as it is."""
        return 1

    def save_tiny_vae(self, spec: VaeSpec, directory: str) -> None:
        """Write the tiny VAE in the diffusers layout (`directory/spec.subfolder`), to load back with `load_vae`."""
        self.load_vae(spec, None).save_pretrained(f"{directory}/{spec.subfolder}")

    # -- the text side: the family of `TextEncoderSpec.family` ------------------------------------------------------

    def text_subfolders(self, spec: TextEncoderSpec) -> list[tuple[str, str]]:
        """(model subfolder, tokenizer subfolder) of each of the encoder's models, in pipeline order: by default the
        spec's one model and tokenizer."""
        return [(spec.subfolder, spec.tokenizer_subfolder)]

    @abstractmethod
    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        """The tokenizer(s) and model(s), loaded with `from_pretrained` from `repo` (models in `dtype`) or, with
        `repo` None, the tiny ones (seeded, fp32), and the family's stock pipeline built with only them. The caller
        moves the models to their device and dtype and freezes them."""

    def save_tiny_text(self, spec: TextEncoderSpec, directory: str) -> None:
        """Write the tiny text encoder's models and tokenizers in the diffusers layout, every model the family's
        pipeline can use (a droppable T5 included), to load back with `load_text`."""
        side = self.load_text(replace(spec, drop_t5=False), None, torch.float32)
        for subfolder, module in side.modules.items():
            module.save_pretrained(f"{directory}/{subfolder}")
        for subfolder, tokenizer in side.tokenizers.items():
            tokenizer.save_pretrained(f"{directory}/{subfolder}")

    @abstractmethod
    def text_spec(self, side: TextSide) -> TextSpec:
        """The cached text's layout (`shards.TextSpec`): widths, token counts, and how stage two builds the
        transformer's text input from it."""

    @abstractmethod
    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        """The names of one caption's cached fields, in the cache's schema order (each ragged: rows per caption)."""

    @abstractmethod
    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True, references: list[list[torch.Tensor]] | None = None) -> list[dict[str, torch.Tensor]]:
        """Captions -> per caption its `prompt_fields`, float32 on the CPU, computed by the pipeline's own
        `encode_prompt` (under inference mode; the caller provides it). `instruction=False` leaves out the
        family's instruction prompt, as its pipeline encodes the negative prompt. `references`: for a family whose
        text encoder sees them (`text_takes_references`), per caption its sample's references' `text_pixels`."""

    @abstractmethod
    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        """Which captions exceed a token limit the pipeline truncates them to (counted, reported to the user)."""

    def text_fingerprint(self, side: TextSide) -> dict:
        """Entries of the fingerprint's `text_encoder` part beside the generic ones that change what the pipeline
        computes (e.g. how it cleans a caption); empty by default."""
        return {}

    # -- the first frame: image-to-video presets ---------------------------------------------------------------------

    def first_frame_fields(self, preset: Preset) -> tuple[str, ...]:
        """The fields an image-to-video preset caches from a clip's first frame, each fixed-shape per bucket; none
        for other presets."""
        return ()

    def load_first_frame(self, preset: Preset, vae: torch.nn.Module, repo: str | None, dtype: torch.dtype) -> FirstFrameSide:
        """The pipeline that computes `first_frame_fields`, with the VAE already loaded and the image encoder loaded
        from `repo` (models in `dtype`), or the tiny one with `repo` None. The caller moves the image encoder to its
        device and dtype and freezes it."""
        raise ValueError(f"{preset.name} is not an image-to-video preset")

    def encode_first_frames(self, side: FirstFrameSide, x: torch.Tensor, first: torch.Tensor,
                            latent: LatentSpec) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) clips in [-1, 1] (VAE dtype and device) and their first frames as the images they are,
        (B, 3, H, W) uint8 -> per field of `first_frame_fields` a float32 (B, ...) tensor computed from each clip's
        first frame as the family's image-to-video pipeline computes it from an image it is given."""
        raise ValueError("this family has no image-to-video presets")

    def save_tiny_first_frame(self, preset: Preset, directory: str) -> None:
        """Write the tiny image encoder and its processor in the diffusers layout, to load back with
        `load_first_frame` (nothing where the preset has none)."""
        return None

    # -- reference images: edit presets --------------------------------------------------------------------------------

    def prepare_reference(self, preset: Preset, image, index: int, count: int) -> dict[str, torch.Tensor]:
        """One reference image of a sample (a PIL RGB image, orientation applied; reference `index` of `count`) as the
        preset's edit pipeline prepares an image it is given: `pixels`, float32 (3, h, w) in [-1, 1], what its VAE
        encodes (the pipeline's own size and resampling for that image, not the target's bucket), and, where the
        text encoder sees the references (`text_takes_references`), `text_pixels`, uint8 (3, h', w'), the image the
        pipeline hands its text encoder. Runs in the loader's workers; pure image work."""
        raise ValueError(f"{preset.name} is not an edit preset: it takes no reference images")

    def encode_references(self, vae: torch.nn.Module, x: torch.Tensor, latent: LatentSpec) -> torch.Tensor:
        """(B, 3, h, w) prepared references of one size in [-1, 1] (VAE dtype and device) -> (B, C, h', w') float32, the
        reference latents the pipeline concatenates to the target's, normalised as it normalises them. By default the
        posterior's mean (the pipelines take the mode, `sample_mode="argmax"`) of `encode_images`."""
        fields = self.encode_images(vae, x, latent)
        return fields["latent_mean"] if "latent_mean" in fields else fields["latent"]

    def reference_fingerprint(self, preset: Preset) -> dict:
        """How `prepare_reference` sizes and resamples a reference (the fingerprint's `references` part, with the
        generic entries): whatever changes the prepared pixels."""
        return {}

    # -- buckets -------------------------------------------------------------------------------------------------------

    def frame_rate_of(self, preset: Preset) -> float | None:
        """Frames per second a preset's clips are resampled to (None: the family takes images)."""
        return preset.frame_rate or self.frame_rate

    def resolution_problem(self, preset: Preset, resolution: object) -> str | None:
        """Why `resolution` is not one a bucket table can be built for with this preset (None: it is). By default
        the published tables' areas: multiples of 64 up to the preset's largest."""
        return resolution_problem(resolution, preset.max_resolution)

    def bucket_table(self, preset: Preset, resolution: int) -> tuple[Bucket, ...]:
        """The (height, width) buckets of a resolution: by default the published table of the preset's base one, as
        it always was, and for others the 1024 table's aspect ratios scaled to that area (`resolution_table`)."""
        if resolution == preset.base_resolution:
            return bucket_table(resolution)
        return resolution_table(resolution, preset.granularity)

    # -- checks and estimates ------------------------------------------------------------------------------------

    def check_text_options(self, preset: Preset) -> None:
        """Raise ValueError naming the option when `preset.text` (this family's encoder, with the run's options
        applied) asks for something the encoder cannot do. By default T5 cannot be dropped."""
        if preset.text.drop_t5:
            raise ValueError(f"{DROP_T5_REFUSED}; {preset.name} encodes captions with {preset.text.name} alone")

    def caption_elements(self, text: TextSpec) -> int:
        """About how many values one caption stores, for the disk check before a run. By default a masked layout's
        caption keeps its valid tokens only: half the token limit, as an estimate."""
        return text.max_tokens // 2 * text.width

