"""The frozen encoders: VAE for images, the family pipeline's `encode_prompt` for captions."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from precompute.presets import (
    Preset,
    sana_complex_human_instruction,
    text_parts,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_vae,
    weights_digest,
)
from shards import DecoderRecipe, Field, LatentSpec, Schema, TextSpec
from shards.options import torch_dtype


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype(requested: str | None, cuda_default: str, device: torch.device) -> torch.dtype:
    """An encoder's compute dtype: the one requested, else fp32 on CPU and the preset's choice on CUDA
    (`PrecomputeConfig` refuses fp16 for encoders that overflow in it)."""
    return torch_dtype(requested or (cuda_default if device.type == "cuda" else "fp32"))


CLIP_TOKENS = 77  # SD3's and Flux's CLIP tokenizers pad every caption to this length
# The fingerprint's `padding`. PixArt and Sana mask padding in cross-attention, so trimming it is lossless ("trimmed").
# SD3 attends to every token without a mask: only CLIP's zero padding to the joint width is trimmed. Flux attends to
# every T5 token without a mask: all are kept.
PADDING = {"sd3": "clip width trimmed; all tokens kept", "flux": "all tokens kept"}


@dataclass
class TextBatch:
    """Per caption, the cached text fields (float32, on the CPU) and whether it was truncated.

    Masked families: `text` (L_i, D), valid tokens only. SD3: `clip` (77, D_clip) CLIP-L and CLIP-G
    side by side without the zero padding to the joint width, `pooled` (1, D_pooled), and `text`
    (T5 tokens, D) unless T5 is dropped. Flux: `text` (T5 tokens, D), padding included, and `pooled`
    (1, D_pooled), CLIP-L's pooled output.
    """

    fields: list[dict[str, torch.Tensor]]
    truncated: list[bool]


class Encoders:
    """The preset's VAE and text encoder, frozen, in eval mode, on one device.

    Args:
        preset: the family's preset.
        device: where to run.
        vae_dtype / text_dtype: compute dtypes, fp32, bf16 or fp16 (None: the preset's defaults for the device).
        pretrained: a local directory in the diffusers layout that replaces the preset's repos
            (for both encoders), e.g. a downloaded snapshot or a saved tiny preset.
        vae: False builds the text side only (`python -m precompute prompts`): nothing that needs the VAE
            (`encode_images`, `latent_spec`, `schema`, `fingerprint`, `decoder_recipe`) is available.
    """

    def __init__(self, preset: Preset, device: torch.device, *, vae_dtype: str | None = None, text_dtype: str | None = None,
                 pretrained: str | None = None, vae: bool = True):
        self.preset, self.device = preset, device
        self.vae: torch.nn.Module | None = None
        if vae:
            self._load_vae(vae_dtype, pretrained)
        self._load_text(text_dtype, pretrained)

    def _load_vae(self, dtype: str | None, pretrained: str | None) -> None:
        preset = self.preset
        self.vae_dtype = compute_dtype(dtype, preset.vae.cuda_dtype, self.device)
        self.vae_repo = pretrained or preset.vae.repo
        self.vae_source = self.vae_repo or f"tiny-{preset.vae.kind} (seeded)"
        if preset.vae.gaussian:
            from diffusers import AutoencoderKL as VaeClass
        else:
            from diffusers import AutoencoderDC as VaeClass
        if self.vae_repo:
            self.vae = VaeClass.from_pretrained(self.vae_repo, subfolder=preset.vae.subfolder, revision=preset.vae.revision)
        else:
            self.vae = tiny_vae(preset.vae.kind)
        self.vae = self.vae.to(self.device).eval().requires_grad_(False)
        if self.vae_dtype != torch.float32:
            self.vae.to(self.vae_dtype)
        cfg = self.vae.config
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(getattr(cfg, "shift_factor", None) or 0.0)
        self.latent_channels = int(cfg.latent_channels)
        blocks = cfg.block_out_channels if preset.vae.gaussian else cfg.encoder_block_out_channels
        self.downsample = 2 ** (len(blocks) - 1)

    def _load_text(self, dtype: str | None, pretrained: str | None) -> None:
        preset, device = self.preset, self.device
        self.text_dtype = compute_dtype(dtype, preset.text.cuda_dtype, device)
        text_repo = pretrained or preset.text.repo
        self.text_source = text_repo or f"{preset.text.name} (seeded)"
        # Captions go through the family pipeline's own encode_prompt, so cached embeddings are
        # exactly what inference computes (Sana's instruction prefix and token selection included).
        self.text_modules: dict[str, torch.nn.Module] = {}  # by subfolder, in pipeline order
        self.tokenizers: dict[str, object] = {}
        for kind, subfolder, tokenizer_subfolder in text_parts(preset.text):
            if text_repo:
                from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection, Gemma2Model, T5EncoderModel

                classes = {"t5": T5EncoderModel, "gemma2": Gemma2Model, "clip-l-pooled": CLIPTextModel}
                TextClass = classes.get(kind, CLIPTextModelWithProjection)
                tokenizer = AutoTokenizer.from_pretrained(text_repo, subfolder=tokenizer_subfolder, revision=preset.text.revision)
                model = TextClass.from_pretrained(text_repo, subfolder=subfolder, revision=preset.text.revision, dtype=self.text_dtype)
            else:
                tokenizer = tiny_tokenizer("clip" if kind.startswith("clip") else kind)
                model = tiny_text_encoder(kind, len(tokenizer))
            self.tokenizers[tokenizer_subfolder] = tokenizer
            self.text_modules[subfolder] = model.to(device, self.text_dtype).eval().requires_grad_(False)
        self.tokenizer = list(self.tokenizers.values())[-1]  # the caption limit's tokenizer (T5 for SD3 and Flux)
        self.text_encoder = list(self.text_modules.values())[-1]
        modules, tokenizers = self.text_modules, self.tokenizers
        if preset.text.kind == "sd3":
            from diffusers import StableDiffusion3Pipeline

            self.pipeline = StableDiffusion3Pipeline(
                transformer=None, scheduler=None, vae=None,
                text_encoder=modules["text_encoder"], tokenizer=tokenizers["tokenizer"],
                text_encoder_2=modules["text_encoder_2"], tokenizer_2=tokenizers["tokenizer_2"],
                text_encoder_3=modules.get("text_encoder_3"), tokenizer_3=tokenizers.get("tokenizer_3"),
            )
            self.clip_dim = sum(modules[k].config.hidden_size for k in ("text_encoder", "text_encoder_2"))
            self.pooled_dim = sum(modules[k].config.projection_dim for k in ("text_encoder", "text_encoder_2"))
        elif preset.text.kind == "flux":
            from diffusers import FluxPipeline

            self.pipeline = FluxPipeline(
                transformer=None, scheduler=None, vae=None,
                text_encoder=modules["text_encoder"], tokenizer=tokenizers["tokenizer"],
                text_encoder_2=modules["text_encoder_2"], tokenizer_2=tokenizers["tokenizer_2"],
            )
            self.pooled_dim = modules["text_encoder"].config.hidden_size  # CLIPTextModel's pooled output
        else:
            from diffusers import PixArtSigmaPipeline, SanaPipeline

            Pipeline = PixArtSigmaPipeline if preset.text.kind == "t5" else SanaPipeline
            self.pipeline = Pipeline(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=None, transformer=None, scheduler=None)
        self.instruction = sana_complex_human_instruction() if preset.text.complex_human_instruction else None
        config = self.text_encoder.config
        self.text_dim = int(getattr(config, "d_model", None) or config.hidden_size)  # T5's d_model; Gemma's and CLIP's hidden_size

    # -- what the cache records ---------------------------------------------------------------

    def latent_spec(self) -> LatentSpec:
        # KL: the posterior's mean and std, so training samples a fresh latent each step
        return LatentSpec(self.latent_channels, self.downsample, self.scaling_factor, self.shift_factor,
                          "mean_std" if self.preset.vae.gaussian else "deterministic")

    def text_spec(self) -> TextSpec:
        """The cached text; for SD3 and Flux, how stage two builds the transformer's text input from it."""
        text = self.preset.text
        width = None if text.drop_t5 else self.text_dim
        if text.kind == "flux":
            # encoder_hidden_states = every T5 token, padding included (Flux has no text mask); pooled = CLIP-L's
            return TextSpec("flux", width, text.max_length, t5_tokens=text.max_length, pooled_width=self.pooled_dim,
                            t5_width=width)
        if text.kind != "sd3":
            return TextSpec("masked", width, text.max_length)  # padded to the batch's longest caption, with a mask
        # encoder_hidden_states = cat(pad(clip, to the joint width), T5 tokens, dim=tokens); a dropped T5 is as many
        # zero tokens, as StableDiffusion3Pipeline with text_encoder_3=None uses
        return TextSpec("sd3_joint", width, text.max_length, clip_tokens=CLIP_TOKENS, t5_tokens=text.max_length,
                        t5_stored=not text.drop_t5, clip_width=self.clip_dim, pooled_width=self.pooled_dim, t5_width=width)

    def schema(self, storage_dtype: torch.dtype, control: bool = False) -> Schema:
        """Fields of every sample. `text` holds all of a sample's captions back to back and
        `text_lengths` their token counts, so one image can carry several captions. With `control`, the control
        image's latent fields (ControlNet caches), stacked like the image's."""
        return {
            **{name: Field(storage_dtype) for name in self.latent_spec().fields},
            # the flipped image's latent: one row for samples of a `flip = true` source, none for the others
            **{name: Field(storage_dtype, ragged=True) for name in self.latent_spec().flipped_fields},
            **{name: Field(storage_dtype) for name in (self.latent_spec().control_fields if control else ())},
            **self.prompt_schema(storage_dtype),
            "text_lengths": Field(torch.int32, ragged=True),
            "original_size": Field(torch.int32),
            "crop": Field(torch.int32),
            "source": Field(torch.uint8, ragged=True),
        }

    def prompt_schema(self, storage_dtype: torch.dtype) -> Schema:
        """The text fields of one caption (see `TextBatch`)."""
        names = ["text"]
        if self.preset.text.kind == "sd3":
            names = ["clip", "pooled"] + ([] if self.preset.text.drop_t5 else ["text"])
        elif self.preset.text.kind == "flux":
            names = ["text", "pooled"]
        return {name: Field(storage_dtype, ragged=True) for name in names}

    def fingerprint(self) -> dict:
        """The `vae` and `text_encoder` parts of the cache's fingerprint: the encoders' identity beside the specs."""
        return {
            "vae": {
                "class": type(self.vae).__name__,
                "source": self.vae_source,
                "revision": self.preset.vae.revision,
                "weights": weights_digest(self.vae),
                "compute_dtype": str(self.vae_dtype).removeprefix("torch."),
                **self.latent_spec().fingerprint(),
            },
            "text_encoder": self.text_fingerprint(),
        }

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
            "padding": PADDING.get(self.preset.text.kind, "trimmed"),
        }

    def _text_modules_fingerprint(self) -> dict:
        def one(module, tokenizer) -> dict:
            vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
            return {"class": type(module).__name__, "weights": weights_digest(module), "tokenizer": type(tokenizer).__name__,
                    "tokenizer_vocab_sha256": hashlib.sha256(vocab).hexdigest()}

        pairs = list(zip(self.text_modules.items(), self.tokenizers.values()))
        if len(pairs) == 1:
            return one(self.text_encoder, self.tokenizer)
        return {"modules": {name: one(module, tokenizer) for (name, module), tokenizer in pairs}}

    def decoder_recipe(self) -> tuple[DecoderRecipe, dict[str, bytes]]:
        """How stage two rebuilds this VAE to decode samples, plus the files to store in the cache when the
        weights exist nowhere else (tiny presets). Stage two loads it with `from_pretrained` and keeps only
        the decoder."""
        vae_class = type(self.vae).__name__
        if self.vae_repo:
            local = Path(self.vae_repo)
            source = str(local.resolve()) if local.is_dir() else self.vae_repo
            return DecoderRecipe(vae_class, source, self.scaling_factor, self.shift_factor, self.preset.vae.subfolder,
                                 self.preset.vae.revision), {}
        from safetensors.torch import save

        weights = save({k: v.detach().float().contiguous().cpu() for k, v in self.vae.state_dict().items()})
        files = {"vae/config.json": self.vae.to_json_string().encode(), "vae/diffusion_pytorch_model.safetensors": weights}
        return DecoderRecipe(vae_class, "vae", self.scaling_factor, self.shift_factor, in_cache=True), files

    # -- encoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) uint8 -> scaled latents: `latent_mean`/`latent_std` (KL) or `latent` (DC), (B, C, h, w)."""
        x = pixels.to(self.device, non_blocking=True).to(self.vae_dtype) / 127.5 - 1.0
        if self.preset.vae.gaussian:
            dist = self.vae.encode(x).latent_dist
            return {
                "latent_mean": ((dist.mean.float() - self.shift_factor) * self.scaling_factor),
                "latent_std": dist.std.float() * self.scaling_factor,
            }
        return {"latent": (self.vae.encode(x).latent.float() - self.shift_factor) * self.scaling_factor}

    @torch.inference_mode()
    def encode_text(self, captions: list[str], instruction: bool = True) -> TextBatch:
        """Captions -> their cached text fields (see `TextBatch`), and whether each was truncated.

        `instruction=False` encodes without Sana's instruction prefix, as its pipeline encodes the
        negative (empty) prompt for classifier-free guidance.
        """
        if self.preset.text.kind == "sd3":
            return TextBatch(self._encode_sd3(captions), self.truncated(captions))
        if self.preset.text.kind == "flux":
            return TextBatch(self._encode_flux(captions), self.truncated(captions))
        kwargs = {"complex_human_instruction": self.instruction if instruction else None} if self.preset.text.kind == "gemma2" else {}
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            captions, do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.preset.text.max_length, clean_caption=False, **kwargs,
        )
        embeds, mask = embeds.float().cpu(), mask.bool().cpu()
        return TextBatch([{"text": e[m]} for e, m in zip(embeds, mask)], self.truncated(captions))  # padding dropped

    def _encode_sd3(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        if self.preset.text.drop_t5:
            # encode_prompt needs the transformer's joint width for the zero T5 tokens; the CLIP half is
            # the pipeline's own per-encoder call, concatenated as encode_prompt does.
            (l, pooled_l), (g, pooled_g) = (
                self.pipeline._get_clip_prompt_embeds(captions, device=self.device, clip_model_index=i) for i in (0, 1)
            )
            clip, pooled, t5 = torch.cat([l, g], dim=-1), torch.cat([pooled_l, pooled_g], dim=-1), None
        else:
            joint, _, pooled, _ = self.pipeline.encode_prompt(
                captions, None, None, device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.preset.text.max_length,
            )
            clip, t5 = joint[:, :CLIP_TOKENS, : self.clip_dim], joint[:, CLIP_TOKENS:]
        out = []
        for i in range(len(captions)):
            fields = {"clip": clip[i].float().cpu(), "pooled": pooled[i : i + 1].float().cpu()}
            if t5 is not None:
                fields["text"] = t5[i].float().cpu()
            out.append(fields)
        return out

    def _encode_flux(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        # (B, T5 tokens, D) every token, padding included; (B, D_pooled); the text ids are zeros, rebuilt in training
        t5, pooled, _ = self.pipeline.encode_prompt(captions, None, device=self.device,
                                                    max_sequence_length=self.preset.text.max_length)
        return [{"text": t5[i].float().cpu(), "pooled": pooled[i : i + 1].float().cpu()} for i in range(len(captions))]

    def truncated(self, captions: list[str]) -> list[bool]:
        """Which captions exceed the token limit (the pipeline truncates them)."""
        limit = self.preset.text.max_length
        if self.preset.text.kind in ("sd3", "flux"):
            clip = self.tokenizers["tokenizer"]
            t5 = self.tokenizers.get("tokenizer_3" if self.preset.text.kind == "sd3" else "tokenizer_2")
            return [len(clip(c).input_ids) > CLIP_TOKENS or (t5 is not None and len(t5(c).input_ids) > limit) for c in captions]
        if self.instruction:
            prefix = "\n".join(self.instruction)
            budget = len(self.tokenizer.encode(prefix)) + limit - 2
            return [len(self.tokenizer.encode(prefix + c)) > budget for c in captions]
        return [len(self.tokenizer.encode(c)) > limit for c in captions]
