"""Sana: the deep-compression autoencoder (AutoencoderDC, f32, a deterministic latent) and Gemma-2, encoded as
SanaPipeline encodes, with its instruction prompt and token selection."""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/).
SANA_600M = "Efficient-Large-Model/Sana_600M_1024px_diffusers"
SANA_1600M = "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers"


def complex_human_instruction() -> list[str]:
    """Sana's instruction prompt, as the diffusers SanaPipeline applies it by default."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def tiny_tokenizer():
    """A small GemmaTokenizer: a BPE trained here, deterministically, on the sample vocabulary and Sana's
    instruction prompt, so captions and the instruction take few tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{i:02X}>" for i in range(256)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
    corpus = [" ".join(parts.TINY_WORDS)] * 4 + complex_human_instruction()
    alphabet = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()")
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=900, special_tokens=specials, initial_alphabet=alphabet, show_progress=False))
    vocab, merges = parts.bpe_state(bpe)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)


def tiny_text_encoder(vocab_size: int):
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                          pad_token_id=0, bos_token_id=2, eos_token_id=1, attn_logit_softcapping=None)
    return parts.seeded(lambda: Gemma2Model(config))


def tiny_vae():
    """An f8 AutoencoderDC with 8 latent channels."""
    from diffusers import AutoencoderDC

    blocks = ("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock")
    return parts.seeded(lambda: AutoencoderDC(
        in_channels=3, latent_channels=8, attention_head_dim=8, encoder_block_types=blocks, decoder_block_types=blocks,
        encoder_block_out_channels=(16, 32, 32, 32), decoder_block_out_channels=(16, 32, 32, 32),
        encoder_layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,), (5,)), decoder_qkv_multiscales=((), (), (5,), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=0.41407,
    ))


class Sana(Family):
    name = "sana"

    def presets(self) -> dict[str, Preset]:
        text = self.text_encoders()
        # The DC-AE is fp16-safe and runs in bf16 on CUDA; each model's Gemma comes from its own repository. Its 32x
        # downsampling and the transformer's 1x1 patches make buckets multiples of 32 px, up to Sana's 4096 tables
        # (the tiny DC-AE downsamples 8x).
        out = {name: Preset(name, self.name, 1024, VaeSpec("dc", repo, fp16_safe=True, cuda_dtype="bf16"),
                            replace(text["gemma2-2b"], repo=repo), repo, granularity=32, max_resolution=4096)
               for name, repo in (("sana-600m", SANA_600M), ("sana-1600m", SANA_1600M))}
        out["tiny-sana"] = Preset("tiny-sana", self.name, 256, VaeSpec("dc", None, fp16_safe=True, cuda_dtype="bf16"),
                                  text["tiny-gemma2"], None, granularity=8)
        return out

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        return {
            "gemma2-2b": TextEncoderSpec("gemma2-2b", self.name, "gemma2", SANA_1600M, complex_human_instruction=True, fp16_safe=True),
            "tiny-gemma2": TextEncoderSpec("tiny-gemma2", self.name, "gemma2", None, max_length=64, complex_human_instruction=True,
                                           fp16_safe=True),
        }

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        from diffusers import AutoencoderDC

        return AutoencoderDC.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision) if repo else tiny_vae()

    def latent_spec(self, vae) -> LatentSpec:
        cfg = vae.config
        return LatentSpec(int(cfg.latent_channels), 2 ** (len(cfg.encoder_block_out_channels) - 1), float(cfg.scaling_factor),
                          float(getattr(cfg, "shift_factor", None) or 0.0), "deterministic")

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        return {"latent": (vae.encode(x).latent.float() - latent.shift_factor) * latent.scaling_factor}

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import SanaPipeline
        from transformers import Gemma2Model

        if repo:
            model, tokenizer = parts.load_pretrained_text(Gemma2Model, repo, spec.subfolder, spec.tokenizer_subfolder,
                                                          spec.revision, dtype)
        else:
            tokenizer = tiny_tokenizer()
            model = tiny_text_encoder(len(tokenizer))
        pipeline = SanaPipeline(tokenizer=tokenizer, text_encoder=model, vae=None, transformer=None, scheduler=None)
        instruction = complex_human_instruction() if spec.complex_human_instruction else None
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline, instruction)

    def text_spec(self, side: TextSide) -> TextSpec:
        # padded to the batch's longest caption, with a mask
        return TextSpec("masked", parts.text_width(side.pipeline.text_encoder), side.spec.max_length)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        # The pipeline selects the caption's tokens after the instruction's; without it, as it encodes the negative prompt
        return parts.encode_masked(side.pipeline, captions, device, side.spec.max_length,
                                   complex_human_instruction=side.instruction if instruction else None)

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return parts.over_limit(side.pipeline.tokenizer, captions, side.spec.max_length, side.instruction)


FAMILY = Sana()
