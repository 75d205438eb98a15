"""The frozen encoders: VAE for images, the family pipeline's `encode_prompt` for captions."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from precompute.presets import (
    Preset,
    sana_complex_human_instruction,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_vae,
    weights_digest,
)
from shards import Field, Schema

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(requested: str | None, default_cuda: str, device: torch.device, fp16_safe: bool, what: str, force: bool) -> torch.dtype:
    """The compute dtype of an encoder: float32 on CPU, the preset's choice on CUDA, never an unsafe fp16."""
    name = requested or (default_cuda if device.type == "cuda" else "float32")
    if name not in DTYPES:
        raise ValueError(f"{what} dtype {name!r}: choose one of {sorted(DTYPES)}")
    if name == "float16" and not fp16_safe and not force:
        raise ValueError(
            f"the {what} overflows to NaN/Inf in float16; use bfloat16 or float32 "
            f"(or pass --force-fp16 with an fp16-safe checkpoint such as the fp16-fix SDXL VAE)"
        )
    return DTYPES[name]


@dataclass
class TextBatch:
    embeds: list[torch.Tensor]  # per caption (L_i, D), valid tokens only
    truncated: list[bool]


class Encoders:
    """The preset's VAE and text encoder, frozen, in eval mode, on one device.

    Args:
        preset: the family's preset.
        device: where to run.
        vae_dtype / text_dtype: compute dtypes (None: the preset's defaults for the device).
        pretrained: a local directory in the diffusers layout that replaces the preset's repos
            (for both encoders), e.g. a downloaded snapshot or a saved tiny preset.
        force_fp16: allow fp16 for encoders known to overflow in it.
    """

    def __init__(self, preset: Preset, device: torch.device, *, vae_dtype: str | None = None, text_dtype: str | None = None,
                 pretrained: str | None = None, force_fp16: bool = False):
        self.preset, self.device = preset, device
        self.vae_dtype = resolve_dtype(vae_dtype, preset.vae.cuda_dtype, device, preset.vae.fp16_safe, "VAE", force_fp16)
        self.text_dtype = resolve_dtype(text_dtype, preset.text.cuda_dtype, device, preset.text.fp16_safe, "text encoder", force_fp16)
        vae_repo = pretrained or preset.vae.repo
        text_repo = pretrained or preset.text.repo
        self.vae_repo = vae_repo
        self.vae_source = vae_repo or f"tiny-{preset.vae.kind} (seeded)"
        self.text_source = text_repo or f"{preset.text.name} (seeded)"

        if preset.vae.kind == "kl":
            from diffusers import AutoencoderKL as VaeClass
        else:
            from diffusers import AutoencoderDC as VaeClass
        if vae_repo:
            self.vae = VaeClass.from_pretrained(vae_repo, subfolder=preset.vae.subfolder, revision=preset.vae.revision)
        else:
            self.vae = tiny_vae(preset.vae.kind)
        self.vae = self.vae.to(device).eval().requires_grad_(False)
        if self.vae_dtype != torch.float32:
            self.vae.to(self.vae_dtype)

        if text_repo:
            from transformers import AutoTokenizer, Gemma2Model, T5EncoderModel

            TextClass = T5EncoderModel if preset.text.kind == "t5" else Gemma2Model
            self.tokenizer = AutoTokenizer.from_pretrained(text_repo, subfolder=preset.text.tokenizer_subfolder, revision=preset.text.revision)
            text_encoder = TextClass.from_pretrained(text_repo, subfolder=preset.text.subfolder, revision=preset.text.revision, dtype=self.text_dtype)
        else:
            self.tokenizer = tiny_tokenizer(preset.text.kind)
            text_encoder = tiny_text_encoder(preset.text.kind, len(self.tokenizer))
        self.text_encoder = text_encoder.to(device, self.text_dtype).eval().requires_grad_(False)

        # Captions go through the family pipeline's own encode_prompt, so cached embeddings are
        # exactly what inference computes (Sana's instruction prefix and token selection included).
        if preset.text.kind == "t5":
            from diffusers import PixArtSigmaPipeline as Pipeline
        else:
            from diffusers import SanaPipeline as Pipeline
        self.pipeline = Pipeline(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=None, transformer=None, scheduler=None)
        self.instruction = sana_complex_human_instruction() if preset.text.complex_human_instruction else None
        cfg = self.vae.config
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(getattr(cfg, "shift_factor", None) or 0.0)
        self.latent_channels = int(cfg.latent_channels)
        blocks = cfg.block_out_channels if preset.vae.kind == "kl" else cfg.encoder_block_out_channels
        self.downsample = 2 ** (len(blocks) - 1)
        self.text_dim = int(self.text_encoder.config.hidden_size if preset.text.kind == "gemma2" else self.text_encoder.config.d_model)

    # -- what the cache records ---------------------------------------------------------------

    def schema(self, storage_dtype: torch.dtype) -> Schema:
        """Fields of every sample. `text` holds all of a sample's captions back to back and
        `text_lengths` their token counts, so one image can carry several captions."""
        latent = (
            {"latent_mean": Field(storage_dtype), "latent_std": Field(storage_dtype)}
            if self.preset.vae.kind == "kl"
            else {"latent": Field(storage_dtype)}
        )
        return {
            **latent,
            "text": Field(storage_dtype, ragged=True),
            "text_lengths": Field(torch.int32, ragged=True),
            "original_size": Field(torch.int32),
            "crop": Field(torch.int32),
            "source": Field(torch.uint8, ragged=True),
        }

    def prompt_schema(self, storage_dtype: torch.dtype) -> Schema:
        return {"text": Field(storage_dtype, ragged=True)}

    def fingerprint(self) -> dict:
        tokenizer_vocab = json.dumps(sorted(self.tokenizer.get_vocab().items())).encode()
        return {
            "vae": {
                "class": type(self.vae).__name__,
                "source": self.vae_source,
                "revision": self.preset.vae.revision,
                "weights": weights_digest(self.vae),
                "compute_dtype": str(self.vae_dtype).removeprefix("torch."),
                "scaling_factor": self.scaling_factor,
                "shift_factor": self.shift_factor,
                "latent_channels": self.latent_channels,
                "downsample": self.downsample,
                # KL: the posterior's mean and std, so training samples a fresh latent each step.
                "posterior": "mean_std" if self.preset.vae.kind == "kl" else "deterministic",
                "stored": "(z - shift_factor) * scaling_factor",
            },
            "text_encoder": {
                "name": self.preset.text.name,
                "class": type(self.text_encoder).__name__,
                "source": self.text_source,
                "revision": self.preset.text.revision,
                "weights": weights_digest(self.text_encoder),
                "compute_dtype": str(self.text_dtype).removeprefix("torch."),
                "hidden_size": self.text_dim,
                "tokenizer": type(self.tokenizer).__name__,
                "tokenizer_vocab_sha256": hashlib.sha256(tokenizer_vocab).hexdigest(),
                "max_length": self.preset.text.max_length,
                "encode_prompt": f"{type(self.pipeline).__name__}.encode_prompt",
                "complex_human_instruction_sha256": (
                    hashlib.sha256("\n".join(self.instruction).encode()).hexdigest() if self.instruction else None
                ),
                "clean_caption": False,
                # Both families mask padding in cross-attention, so trimming it is lossless.
                "padding": "trimmed",
            },
        }

    def decoder_recipe(self) -> tuple[dict, dict[str, bytes]]:
        """How stage two rebuilds this VAE to decode samples: its class, where its weights are, and the
        latent scaling; plus the files to store in the cache when the weights exist nowhere else (tiny
        presets). Stage two loads it with `from_pretrained` and keeps only the decoder."""
        recipe = {"class": type(self.vae).__name__, "scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor}
        if self.vae_repo:
            local = Path(self.vae_repo)
            source = str(local.resolve()) if local.is_dir() else self.vae_repo
            return {**recipe, "source": source, "subfolder": self.preset.vae.subfolder, "revision": self.preset.vae.revision}, {}
        from safetensors.torch import save

        weights = save({k: v.detach().float().contiguous().cpu() for k, v in self.vae.state_dict().items()})
        files = {"vae/config.json": self.vae.to_json_string().encode(), "vae/diffusion_pytorch_model.safetensors": weights}
        return {**recipe, "source": "vae", "subfolder": None, "revision": None, "in_cache": True}, files

    # -- encoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) uint8 -> scaled latents: `latent_mean`/`latent_std` (KL) or `latent` (DC), (B, C, h, w)."""
        x = pixels.to(self.device, non_blocking=True).to(self.vae_dtype) / 127.5 - 1.0
        if self.preset.vae.kind == "kl":
            dist = self.vae.encode(x).latent_dist
            return {
                "latent_mean": ((dist.mean.float() - self.shift_factor) * self.scaling_factor),
                "latent_std": dist.std.float() * self.scaling_factor,
            }
        return {"latent": (self.vae.encode(x).latent.float() - self.shift_factor) * self.scaling_factor}

    @torch.inference_mode()
    def encode_text(self, captions: list[str], instruction: bool = True) -> TextBatch:
        """Captions -> embeddings of their valid tokens (float32, on the CPU), and whether each was truncated.

        `instruction=False` encodes without Sana's instruction prefix, as its pipeline encodes the
        negative (empty) prompt for classifier-free guidance.
        """
        kwargs = {"complex_human_instruction": self.instruction if instruction else None} if self.preset.text.kind == "gemma2" else {}
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            captions, do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.preset.text.max_length, clean_caption=False, **kwargs,
        )
        embeds, mask = embeds.float().cpu(), mask.bool().cpu()
        out = [e[m] for e, m in zip(embeds, mask)]  # (L_i, D): padding dropped, order kept
        return TextBatch(out, self.truncated(captions))

    def truncated(self, captions: list[str]) -> list[bool]:
        """Which captions exceed the token limit (the pipeline truncates them)."""
        limit = self.preset.text.max_length
        if self.instruction:
            prefix = "\n".join(self.instruction)
            budget = len(self.tokenizer.encode(prefix)) + limit - 2
            return [len(self.tokenizer.encode(prefix + c)) > budget for c in captions]
        return [len(self.tokenizer.encode(c)) > limit for c in captions]
