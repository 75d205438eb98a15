"""Z-Image: the Flux VAE (a KL posterior, 16 channels, f8, Flux's shift and scaling) and Qwen3-4B, encoded as
ZImagePipeline encodes: each caption in Qwen3's chat template, the second-to-last hidden layer's valid tokens."""

from __future__ import annotations

from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from precompute.families.flux import FAMILY as FLUX
from precompute.families.qwen_tokenizer import tiny_qwen_tokenizer
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/); the two share the VAE and
# the text encoder.
Z_IMAGE = "Tongyi-MAI/Z-Image"
Z_IMAGE_TURBO = "Tongyi-MAI/Z-Image-Turbo"
TINY_WIDTH = 32  # tiny-qwen3's hidden size: tiny-z-image's caption width (cap_feat_dim)
# Qwen3's chat template for the conversations ZImagePipeline builds (system, user and assistant turns and the
# generation prompt), with its `enable_thinking` switch: False opens the reply with an empty thinking block, True (as
# the pipeline asks) leaves it to the model. The published tokenizer's template adds tool calls and reasoning
# history, which no caption uses.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def chat_prompt(tokenizer, caption: str) -> str:
    """A caption as ZImagePipeline hands it to the tokenizer: one user turn and the assistant's prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=True)


def tiny_tokenizer():
    """A `Qwen2Tokenizer` with Qwen3's chat template, its BPE trained on the sample words and the template's text."""
    template = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return tiny_qwen_tokenizer([" ".join(parts.TINY_WORDS)] * 4 + [template] * 2, chat_template=QWEN3_CHAT_TEMPLATE)


def tiny_text_encoder(vocab_size: int) -> torch.nn.Module:
    """A Qwen3Model of three layers, so the second-to-last hidden state the pipeline takes is an inner layer's."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=TINY_WIDTH, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return parts.seeded(lambda: Qwen3Model(config))


class ZImage(Family):
    name = "z-image"
    own_text_encoder = "Qwen3-4B (qwen3-4b)"

    def presets(self) -> dict[str, Preset]:
        # The Flux VAE has no fp16 guarantee (force_upcast): fp32 by default. Both models share encoders.
        qwen = self.text_encoders()
        return {
            "z-image": Preset("z-image", self.name, 1024, VaeSpec("flux", Z_IMAGE), qwen["qwen3-4b"], Z_IMAGE),
            "z-image-turbo": Preset("z-image-turbo", self.name, 1024, VaeSpec("flux", Z_IMAGE_TURBO),
                                    replace(qwen["qwen3-4b"], repo=Z_IMAGE_TURBO), Z_IMAGE_TURBO),
            "tiny-z-image": Preset("tiny-z-image", self.name, 256, VaeSpec("flux", None), qwen["tiny-qwen3"], None),
        }

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        # ZImagePipeline's default token limit is 512 (of the templated caption); Qwen3 is kept out of fp16 (bf16)
        return {"qwen3-4b": TextEncoderSpec("qwen3-4b", self.name, "qwen3", Z_IMAGE, max_length=512),
                "tiny-qwen3": TextEncoderSpec("tiny-qwen3", self.name, "qwen3", None, max_length=64)}

    # -- the image side: Flux.1's VAE, as the Flux family loads and encodes with it ---------------------------------

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        return FLUX.load_vae(spec, repo)

    def latent_spec(self, vae) -> LatentSpec:
        return FLUX.latent_spec(vae)

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        # (z - shift) * scaling: the inverse of what ZImagePipeline decodes with
        return FLUX.encode_images(vae, x, latent)

    # -- the text side: Qwen3 through ZImagePipeline.encode_prompt ---------------------------------------------------

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import ZImagePipeline
        from transformers import Qwen3Model

        if repo:
            model, tokenizer = parts.load_pretrained_text(Qwen3Model, repo, spec.subfolder, spec.tokenizer_subfolder,
                                                          spec.revision, dtype)
        else:
            tokenizer = tiny_tokenizer()
            model = tiny_text_encoder(len(tokenizer))
        pipeline = ZImagePipeline(scheduler=None, vae=None, text_encoder=model, tokenizer=tokenizer, transformer=None)
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline)

    def text_spec(self, side: TextSide) -> TextSpec:
        # each caption's valid tokens, padded per batch with a mask; the transformer takes them unpadded, as a list
        return TextSpec("masked", parts.text_width(side.modules[side.spec.subfolder]), side.spec.max_length)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        # encode_prompt returns per caption the hidden states of its valid tokens (L_i, D): nothing else to trim. It
        # writes the templated captions into the list it is given: a copy.
        embeds, _ = side.pipeline.encode_prompt(list(captions), device=device, do_classifier_free_guidance=False,
                                                max_sequence_length=side.spec.max_length)
        return [{"text": e.float().cpu()} for e in embeds]

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        tokenizer = side.tokenizers[side.spec.tokenizer_subfolder]
        return [len(tokenizer(chat_prompt(tokenizer, c)).input_ids) > side.spec.max_length for c in captions]


FAMILY = ZImage()
