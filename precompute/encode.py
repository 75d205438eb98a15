"""The frozen encoders: the family's VAE for images and clips, its pipeline's `encode_prompt` for captions, and for an
image-to-video preset what its pipeline computes from a clip's first frame.

What differs between families (which classes load, how pixels become latent fields, which text fields a caption
has) is asked of the family (`precompute.families`); devices, dtypes, the fingerprint, the schema and the decoder
recipe are the same for all and built here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from precompute.families import family
from precompute.families.base import FirstFrameSide, Preset
from precompute.presets import weights_digest, weights_sources
from shards import LATENT_KEY, MASK, DecoderRecipe, Field, LatentSpec, Schema, TextSpec, diff_fingerprints
from shards.fingerprint import normalize
from shards.options import torch_dtype
from shards.quiet import no_truncation_warnings
from shards.references import reference_schema


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype(requested: str | None, cuda_default: str, device: torch.device) -> torch.dtype:
    """An encoder's compute dtype: the one requested, else fp32 on CPU and the preset's choice on CUDA
    (`PrecomputeConfig` refuses fp16 for encoders that overflow in it)."""
    return torch_dtype(requested or (cuda_default if device.type == "cuda" else "fp32"))


@dataclass
class TextBatch:
    """Per caption, the cached text fields (float32, on the CPU; the family's `prompt_fields`) and whether it was
    truncated."""

    fields: list[dict[str, torch.Tensor]]
    truncated: list[bool]


class Encoders:
    """The preset's VAE and text encoder (and an image-to-video preset's image encoder), frozen, in eval mode, on one
    device.

    Args:
        preset: the family's preset.
        device: where to run.
        vae_dtype / text_dtype / image_dtype: compute dtypes, fp32, bf16 or fp16 (None: the preset's defaults for the
            device); `image_dtype` is the first frame's image encoder's.
        pretrained: a local directory in the diffusers layout that replaces the preset's repos
            (for every encoder), e.g. a downloaded snapshot or a saved tiny preset.
        vae: False builds the text side only (`python -m precompute prompts`): nothing that needs the VAE
            (`encode_images`, `encode_videos`, `latent_spec`, `schema`, `fingerprint`, `decoder_recipe`) is available.
        sources: `weights_sources(preset, pretrained, vae)` when the caller has it (asked of the Hub once).
    """

    def __init__(self, preset: Preset, device: torch.device, *, vae_dtype: str | None = None, text_dtype: str | None = None,
                 pretrained: str | None = None, vae: bool = True, sources: dict[str, str] | None = None,
                 image_dtype: str | None = None):
        self.preset, self.device = preset, device
        # a Hub repository the Hub cannot serve loads from its cached snapshot (or fails here, saying what to do); the
        # fingerprint and the decoder recipe name the repository all the same
        self.sources = weights_sources(preset, pretrained, vae) if sources is None else sources
        self.family, self.text_family = family(preset.family), family(preset.text.family)
        self.vae: torch.nn.Module | None = None
        # what an image-to-video preset caches from a clip's first frame (none for other presets)
        self.first_frame_fields = self.family.first_frame_fields(preset)
        self.first_frame: FirstFrameSide | None = None
        if vae:
            self._load_vae(vae_dtype, pretrained)
            if self.first_frame_fields:
                self._load_first_frame(image_dtype, pretrained)
        self._load_text(text_dtype, pretrained)

    def _load_vae(self, dtype: str | None, pretrained: str | None) -> None:
        spec = self.preset.vae
        self.vae_dtype = compute_dtype(dtype, spec.cuda_dtype, self.device)
        self.vae_repo = pretrained or spec.repo
        self.vae_source = self.vae_repo or f"tiny-{spec.kind} (seeded)"
        load_from = self.sources.get(self.vae_repo, self.vae_repo) if self.vae_repo else None
        self.vae = self.family.load_vae(spec, load_from).to(self.device).eval().requires_grad_(False)
        if self.vae_dtype != torch.float32:
            self.vae.to(self.vae_dtype)
        self.latent = self.family.latent_spec(self.vae)
        self.downsample = self.latent.downsample

    def _load_first_frame(self, dtype: str | None, pretrained: str | None) -> None:
        spec = self.preset.image_encoder
        self.image_dtype = compute_dtype(dtype, spec.cuda_dtype if spec else "fp32", self.device)
        repo = pretrained or (spec.repo if spec else None)
        self.image_source = None if spec is None else repo or f"tiny-{spec.kind} (seeded)"
        load_from = self.sources.get(repo, repo) if repo else None
        self.first_frame = self.family.load_first_frame(self.preset, self.vae, load_from, self.image_dtype)
        for module in self.first_frame.modules.values():
            module.to(self.device, self.image_dtype).eval().requires_grad_(False)

    def _load_text(self, dtype: str | None, pretrained: str | None) -> None:
        spec = self.preset.text
        self.text_dtype = compute_dtype(dtype, spec.cuda_dtype, self.device)
        text_repo = pretrained or spec.repo
        self.text_source = text_repo or f"{spec.name} (seeded)"
        # Captions go through the family pipeline's own encode_prompt, so cached embeddings are
        # exactly what inference computes (instruction prefixes and token selection included).
        self.text = self.text_family.load_text(spec, self.sources.get(text_repo, text_repo) if text_repo else None, self.text_dtype)
        for module in self.text.modules.values():
            module.to(self.device, self.text_dtype).eval().requires_grad_(False)
        self.pipeline, self.instruction = self.text.pipeline, self.text.instruction
        # a warning per caption over the token limit would bury the log: the run counts them (captions_truncated)
        no_truncation_warnings(*{c.__module__ for c in type(self.pipeline).__mro__})

    # -- what the cache records ---------------------------------------------------------------

    def latent_spec(self) -> LatentSpec:
        return self.latent

    def text_spec(self) -> TextSpec:
        """The cached text, and how stage two builds the transformer's text input from it."""
        return self.text_family.text_spec(self.text)

    def schema(self, storage_dtype: torch.dtype, control: bool = False) -> Schema:
        """Fields of every sample. The text fields hold all of a sample's captions back to back and
        `text_lengths` their token counts, so one image can carry several captions. With `control`, the control
        image's latent fields (ControlNet caches), stacked like the image's. An image-to-video preset's first-frame
        fields (`first_frame_fields`) are stacked like the latents. `mask` (a row for a sample with a loss mask) and
        `latent_key` are `shards.MASK` and `shards.LATENT_KEY`."""
        return {
            **{name: Field(storage_dtype) for name in self.latent.fields},
            # the flipped image's latent: one row for samples of a `flip = true` source, none for the others
            **{name: Field(storage_dtype, ragged=True) for name in self.latent.flipped_fields},
            **{name: Field(storage_dtype) for name in (self.latent.control_fields if control else ())},
            **{name: Field(storage_dtype) for name in self.first_frame_fields},
            **self.prompt_schema(storage_dtype),
            "text_lengths": Field(torch.int32, ragged=True),
            "original_size": Field(torch.int32),
            "crop": Field(torch.int32),
            "source": Field(torch.uint8, ragged=True),
            MASK: Field(torch.uint8, ragged=True),
            LATENT_KEY: Field(torch.uint8),
            # an edit preset's references (`shards.references`): every sample has both fields, empty without any
            **(reference_schema(storage_dtype) if self.preset.references else {}),
        }

    def prompt_schema(self, storage_dtype: torch.dtype) -> Schema:
        """The text fields of one caption (see `TextBatch`)."""
        return {name: Field(storage_dtype, ragged=True) for name in self.text_family.prompt_fields(self.preset.text)}

    def fingerprint(self) -> dict:
        """The `vae` and `text_encoder` parts of the cache's fingerprint: the encoders' identity beside the specs."""
        return {
            "vae": {
                "class": type(self.vae).__name__,
                "source": self.vae_source,
                "revision": self.preset.vae.revision,
                "weights": weights_digest(self.vae),
                "compute_dtype": str(self.vae_dtype).removeprefix("torch."),
                **self.latent.fingerprint(),
                **self.family.vae_fingerprint(self.vae),
            },
            "text_encoder": self.text_fingerprint(),
            **({"first_frame": self.first_frame_fingerprint()} if self.first_frame else {}),
            **({"references": self.references_fingerprint()} if self.preset.references else {}),
        }

    def references_fingerprint(self) -> dict:
        """The fingerprint's `references` part, for an edit preset only: how many a sample may have, how the family
        prepares each (its size and resampling: `reference_fingerprint`) and what is stored of its latent."""
        return {"max": self.preset.references, "latent": "the posterior's mean, normalised as the pipeline's reference latents",
                "encoder": "the cache's VAE", "text_sees_references": self.text_family.text_takes_references,
                **self.family.reference_fingerprint(self.preset)}

    def first_frame_fingerprint(self) -> dict:
        """The fingerprint's `first_frame` part, for an image-to-video preset only: the fields and the image encoder
        that computes `image_embeds` (its processor's settings included)."""
        side = self.first_frame
        out = {"fields": list(self.first_frame_fields), "pipeline": type(side.pipeline).__name__, "vae": "the cache's VAE"}
        if side.spec is not None:
            (module,) = side.modules.values()
            settings = json.dumps(side.processor.to_dict(), sort_keys=True, default=str).encode()
            out["image_encoder"] = {"class": type(module).__name__, "source": self.image_source,
                                    "revision": side.spec.revision, "weights": weights_digest(module),
                                    "compute_dtype": str(self.image_dtype).removeprefix("torch."),
                                    "processor": type(side.processor).__name__,
                                    "processor_sha256": hashlib.sha256(settings).hexdigest()}
        return out

    def text_fingerprint(self) -> dict:
        """The fingerprint's `text_encoder` part: what determines every cached caption and prompt embedding."""
        return {
            "name": self.preset.text.name,
            "source": self.text_source,
            "revision": self.preset.text.revision,
            **self._text_modules_fingerprint(),
            "compute_dtype": str(self.text_dtype).removeprefix("torch."),
            **self.text_spec().fingerprint(),
            "encode_prompt": f"{type(self.pipeline).__name__}.encode_prompt",
            "complex_human_instruction_sha256": (
                hashlib.sha256("\n".join(self.instruction).encode()).hexdigest() if self.instruction else None
            ),
            "clean_caption": False,
            "padding": self.text_family.padding,
            **self.text_family.text_fingerprint(self.text),
        }

    def _text_modules_fingerprint(self) -> dict:
        pairs = list(zip(self.text.modules.items(), self.text.tokenizers.values()))
        if len(pairs) == 1:
            (_, module), tokenizer = pairs[0]
            return module_fingerprint(module, tokenizer)
        return {"modules": {name: module_fingerprint(module, tokenizer) for (name, module), tokenizer in pairs}}

    def decoder_recipe(self) -> tuple[DecoderRecipe, dict[str, bytes]]:
        """How stage two rebuilds this VAE to decode samples, plus the files to store in the cache when the
        weights exist nowhere else (tiny presets). Stage two loads it with `from_pretrained` and keeps only
        the decoder."""
        latent = self.latent
        # how the latents were normalised, undone before decoding
        stored = dict(latents_mean=latent.latents_mean, latents_std=latent.latents_std, frame_axis=self.family.frame_axis,
                      patch=self.family.decoder_patch(self.vae))
        vae_class, scaling, shift = type(self.vae).__name__, latent.scaling_factor, latent.shift_factor
        if self.vae_repo:
            local = Path(self.vae_repo)
            source = str(local.resolve()) if local.is_dir() else self.vae_repo
            return DecoderRecipe(vae_class, source, scaling, shift, self.preset.vae.subfolder, self.preset.vae.revision,
                                 **stored), {}
        from safetensors.torch import save

        weights = save({k: v.detach().float().contiguous().cpu() for k, v in self.vae.state_dict().items()})
        files = {"vae/config.json": self.vae.to_json_string().encode(), "vae/diffusion_pytorch_model.safetensors": weights}
        return DecoderRecipe(vae_class, "vae", scaling, shift, in_cache=True, **stored), files

    # -- encoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) uint8 -> the latent fields (`latent_spec().fields`), each (B, C, h, w), normalised as the
        family stores them."""
        x = pixels.to(self.device, non_blocking=True).to(self.vae_dtype) / 127.5 - 1.0
        return self.family.encode_images(self.vae, x, self.latent)

    @torch.inference_mode()
    def encode_videos(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) uint8 clips of one bucket (F = 1: images in a video cache) -> the latent fields, each
        (B, C, T, h, w), normalised as the family stores them, and an image-to-video preset's first-frame fields,
        all float32 on the encoding device. Pixels go to [-1, 1] in float32 by the expression of the pipelines'
        image and video processors (p / 255, then 2x - 1: the same bits), then to the VAE's dtype."""
        x = (2.0 * (pixels.to(self.device, non_blocking=True).float() / 255.0) - 1.0).to(self.vae_dtype)
        fields = self.family.encode_videos(self.vae, x, self.latent)
        if self.first_frame is not None:
            fields.update(self.family.encode_first_frames(self.first_frame, x, pixels[:, :, 0], self.latent))
        return fields

    @torch.inference_mode()
    def encode_references(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, h, w) prepared references of one size, float32 in [-1, 1] (`Family.prepare_reference`) -> their
        latents (B, C, h', w') float32 on the encoding device, as the family's pipeline computes them."""
        x = pixels.to(self.device, non_blocking=True).to(self.vae_dtype)
        return self.family.encode_references(self.vae, x, self.latent)

    @torch.inference_mode()
    def encode_text(self, captions: list[str], instruction: bool = True,
                    references: list[list[torch.Tensor]] | None = None) -> TextBatch:
        """Captions -> their cached text fields (see `TextBatch`), and whether each was truncated.

        `instruction=False` encodes without the family's instruction prompt, as its pipeline encodes the
        negative (empty) prompt for classifier-free guidance. `references`: for a family whose text encoder sees an
        edit sample's reference images (`Family.text_takes_references`), per caption its sample's references'
        `text_pixels` (None: captions alone).
        """
        if references is None:
            fields = self.text_family.encode_text(self.text, captions, self.device, instruction)
        else:
            fields = self.text_family.encode_text(self.text, captions, self.device, instruction, references=references)
        return TextBatch(fields, self.truncated(captions))

    def truncated(self, captions: list[str]) -> list[bool]:
        """Which captions exceed the token limit (the pipeline truncates them)."""
        return self.text_family.truncated(self.text, captions)

    def caption_elements(self) -> int:
        """About how many values one caption stores (for the disk check)."""
        return self.text_family.caption_elements(self.text_spec())


def module_fingerprint(module: torch.nn.Module, tokenizer) -> dict:
    """A text model's and its tokenizer's identity: classes, a weights digest and the vocabulary's digest."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {"class": type(module).__name__, "weights": weights_digest(module), "tokenizer": type(tokenizer).__name__,
            "tokenizer_vocab_sha256": hashlib.sha256(vocab).hexdigest()}


def check_text_encoder(cached: dict, built: dict, root: Path) -> None:
    """Refuse a text encoder whose fingerprint part differs from the cache's, naming the differing fields: its
    embeddings would not be those of the cache's captions. Where the weights were loaded from (`source`) is not
    compared: a copy of the same weights (a local snapshot of the Hub repository, a moved directory) has the same
    weights digest, tokenizer and settings, and encodes the same."""
    differences = [d for d in diff_fingerprints(normalize(cached), normalize(built), "text_encoder")
                   if d[0] != "text_encoder.source"]
    if differences:
        lines = [f"  {path}: cache={a!r} this run={b!r}" for path, a, b in differences]
        raise ValueError(f"the text encoder built here is not the one the cache at {root} was built with "
                         f"({cached.get('source')}); differing fields:\n" + "\n".join(lines)
                         + "\nPass --pretrained and --text-dtype as the cache was built (or leave them out: the defaults "
                         "are the cache's).")
