"""FLUX.2: its own VAE (AutoencoderKLFlux2: a KL posterior of 32 channels, f8) whose latents the pipelines patchify 2 x 2
into 128 channels and normalise by the VAE's batch-norm running statistics, and captions in a chat template through a
language model whose hidden states of three layers are stacked per token: FLUX.2-dev's Mistral Small 3.1 (layers 10,
20, 30) as Flux2Pipeline.encode_prompt computes them, klein's Qwen3 (layers 9, 18, 27) as Flux2KleinPipeline's. Every
token is kept, padding included: the transformer attends to all of them without a mask.

A FLUX.2 cache holds text-to-image samples beside edit samples. Each reference image is prepared as the pipelines'
`__call__` prepares an image it is given (its area cap, sides cut to multiples of 16, a centre crop) and stored as the
pipeline's image latents (`_encode_vae_image`: the posterior's mode, patchified and normalised like the target)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/, scheduler/). The klein
# models are the ones Flux2KleinPipeline loads: the step-distilled 4B and 9B and their undistilled bases (what BFL
# recommends fine-tuning); the two of a size share the VAE and the text encoder.
FLUX2_DEV = "black-forest-labs/FLUX.2-dev"
KLEIN = {"flux2-klein-4b": "black-forest-labs/FLUX.2-klein-4B", "flux2-klein-base-4b": "black-forest-labs/FLUX.2-klein-base-4B",
         "flux2-klein-9b": "black-forest-labs/FLUX.2-klein-9B", "flux2-klein-base-9b": "black-forest-labs/FLUX.2-klein-base-9B"}
# The pipelines' caption limit (`max_sequence_length`'s default), of the templated caption; the tiny encoders' limit.
MAX_TOKENS = 512
TINY_TOKENS = 64
# Reference images per sample: the pipelines set no limit of their own; BFL's documentation recommends at most 6 for
# FLUX.2 [dev] and allows 4 for [klein] ("Reference Images per Model", docs.bfl.ml).
DEV_REFERENCES = 6
KLEIN_REFERENCES = 4
TINY_WIDTH = 16  # the tiny language models' hidden size: three stacked layers make a caption token 48 wide
TINY_VOCAB = 1000
# Mistral's chat-template tokens (system prompt, instruction, image markers), the tiny tokenizer's special tokens.
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Mistral Small 3.1's chat template for the conversations Flux2Pipeline builds (a system turn, user turns of text or
# image blocks), without the published template's tool calls and default system prompt, which no caption uses.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = namespace(v='') %}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{%- set text.v = text.v + block['text'] %}"
    "{%- else %}{%- set text.v = text.v + '[IMG]' %}{%- endif %}{%- endfor %}{%- set text = text.v %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class ReferenceSize:
    """How the pipelines size an image they are given: refused below `min_side` pixels a side or beyond `max_aspect`
    (`Flux2ImageProcessor.check_image_input`), resized (Lanczos) to `area` pixels when larger, then its sides cut to
    multiples of `multiple` by a centre crop."""

    area: int
    multiple: int
    min_side: int
    max_aspect: int

    def fingerprint(self) -> dict:
        return {"max_area": self.area, "multiple_of": self.multiple, "min_side": self.min_side,
                "max_aspect_ratio": self.max_aspect, "resize": "lanczos to max_area when above it, then a centre crop",
                "prepared_as": "Flux2Pipeline.__call__ prepares its `image` inputs"}


# Flux2Pipeline.__call__ and Flux2KleinPipeline.__call__: 1024 x 1024 pixels at most, multiples of vae_scale_factor x 2
PIPELINE_REFERENCE = ReferenceSize(1024 * 1024, 16, 64, 8)
# The tiny presets' references: the same steps at a CPU-sized area cap (128 x 128) and one token's side as the minimum
TINY_REFERENCE = ReferenceSize(128 * 128, 16, 16, 8)


@functools.cache
def image_processor(multiple: int):
    """The pipelines' image processor (`Flux2ImageProcessor(vae_scale_factor=16)`), one per loader process."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    return Flux2ImageProcessor(vae_scale_factor=multiple)


def reference_size(preset: Preset) -> ReferenceSize:
    return TINY_REFERENCE if preset.vae.repo is None else PIPELINE_REFERENCE


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, 32, h, w) -> (B, 128, h/2, w/2), the pipelines' own 2 x 2 patching."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._patchify_latents(latents)


def pipeline_layout(x: torch.Tensor) -> torch.Tensor:
    """Pixels in the memory layout the pipelines' image processor hands the VAE (a NumPy (B, H, W, 3) array transposed:
    channels last, strides (H W 3, 1, W 3, 3)), so its convolutions compute the same bits as the pipeline's."""
    b, c, h, w = x.shape
    # a fresh (B, H, W, 3) buffer: `contiguous()` keeps a size-1 batch's stride, which the convolutions look at
    return torch.empty((b, h, w, c), dtype=x.dtype, device=x.device).copy_(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def batch_norm_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 128, 1, 1) mean and std of the VAE's batch norm, built as the pipelines build them."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def tiny_vae():
    """AutoencoderKLFlux2 at CPU size: f8 (four blocks), the published 32 latent channels and 2 x 2 patches, and seeded
    batch-norm statistics (a new BatchNorm's are 0 and 1, which would hide a normalisation left out)."""
    from diffusers import AutoencoderKLFlux2

    def build():
        vae = AutoencoderKLFlux2(block_out_channels=(16, 32, 32, 32), layers_per_block=1, latent_channels=32,
                                 norm_num_groups=8, sample_size=256)
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(0.5 * torch.randn(n))
        vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(n))
        return vae

    return parts.seeded(build)


def tiny_mistral_tokenizer():
    """A byte-level BPE with Mistral's chat-template tokens and a chat template of Mistral Small 3.1's form, trained on
    the sample captions' words and Flux2Pipeline's system message (so the template and captions take few tokens)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # every byte symbol in the initial alphabet: ids and merge ties the same in every process (see qwen_tokenizer)
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=list(MISTRAL_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(parts.TINY_WORDS)] * 4 + [SYSTEM_MESSAGE] * 8, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=131072)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def tiny_mistral(tokenizer, layers: int):
    """Mistral3ForConditionalGeneration, the pipeline's class, `TINY_WIDTH` wide with `layers` language layers (the
    pipeline stacks layers 10, 20 and 30) and a one-layer Pixtral vision tower, which text encoding never runs."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=TINY_WIDTH, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
                         pad_token_id=ids("<pad>")),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
        image_token_index=ids("[IMG]"), spatial_merge_size=2, multimodal_projector_bias=False)
    return parts.seeded(lambda: Mistral3ForConditionalGeneration(config))


def tiny_qwen3(vocab_size: int, layers: int):
    """Qwen3ForCausalLM, Flux2KleinPipeline's class, `TINY_WIDTH` wide with `layers` layers (it stacks 9, 18 and 27)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=TINY_WIDTH, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return parts.seeded(lambda: Qwen3ForCausalLM(config))


def stacked_layers(pipeline) -> tuple[int, ...]:
    """The hidden layers the pipeline's `encode_prompt` stacks by default (`text_encoder_out_layers`)."""
    return tuple(inspect.signature(pipeline.encode_prompt).parameters["text_encoder_out_layers"].default)


class Flux2(Family):
    name = "flux2"
    padding = "all tokens kept"
    own_text_encoder = ("the FLUX.2 model's own: Mistral Small 3.1 for dev (mistral-small-3.1-24b), Qwen3 for klein "
                        "(qwen3-4b-flux2, qwen3-8b-flux2), three layers stacked per token")

    def presets(self) -> dict[str, Preset]:
        # the VAE has no fp16 guarantee (as Flux.1's): fp32 by default; the language models run in bf16
        text = self.text_encoders()
        out = {"flux2-dev": Preset("flux2-dev", self.name, 1024, VaeSpec("flux2", FLUX2_DEV), text["mistral-small-3.1-24b"],
                                   FLUX2_DEV, references=DEV_REFERENCES)}
        for name, repo in KLEIN.items():
            encoder = text["qwen3-4b-flux2" if name.endswith("4b") else "qwen3-8b-flux2"]
            out[name] = Preset(name, self.name, 1024, VaeSpec("flux2", repo), replace(encoder, repo=repo), repo,
                               references=KLEIN_REFERENCES)
        out["tiny-flux2"] = Preset("tiny-flux2", self.name, 256, VaeSpec("flux2", None), text["tiny-mistral3"], None,
                                   references=DEV_REFERENCES)
        out["tiny-flux2-klein"] = Preset("tiny-flux2-klein", self.name, 256, VaeSpec("flux2", None), text["tiny-qwen3-flux2"],
                                         None, references=KLEIN_REFERENCES)
        return out

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        return {
            "mistral-small-3.1-24b": TextEncoderSpec("mistral-small-3.1-24b", self.name, "mistral3", FLUX2_DEV, max_length=MAX_TOKENS),
            "qwen3-4b-flux2": TextEncoderSpec("qwen3-4b-flux2", self.name, "qwen3", KLEIN["flux2-klein-4b"], max_length=MAX_TOKENS),
            "qwen3-8b-flux2": TextEncoderSpec("qwen3-8b-flux2", self.name, "qwen3", KLEIN["flux2-klein-9b"], max_length=MAX_TOKENS),
            "tiny-mistral3": TextEncoderSpec("tiny-mistral3", self.name, "mistral3", None, max_length=TINY_TOKENS),
            "tiny-qwen3-flux2": TextEncoderSpec("tiny-qwen3-flux2", self.name, "qwen3", None, max_length=TINY_TOKENS),
        }

    # -- the image side ----------------------------------------------------------------------------------------------

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        if not repo:
            return tiny_vae()
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision)

    def latent_spec(self, vae) -> LatentSpec:
        """The posterior's mean and std of the patchified latent (128 channels at 1/16 of the pixels), normalised per
        channel by the batch norm's running mean and sqrt(running var + eps), as the pipelines normalise and denormalise
        their latents."""
        cfg = vae.config
        ph, pw = cfg.patch_size
        mean, std = batch_norm_stats(vae, torch.zeros((), dtype=torch.float32))
        return LatentSpec(int(cfg.latent_channels) * ph * pw, 2 ** (len(cfg.block_out_channels) - 1) * ph, 1.0, 0.0,
                          "mean_std", tuple(mean.flatten().tolist()), tuple(std.flatten().tolist()))

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        """The mean is the pipelines' `_encode_vae_image` of the image (mode, patchify, (z - mean) / std); the std is
        patched alike and divided by the same std, so mean + std * noise is a normalised draw of the posterior."""
        dist = vae.encode(pipeline_layout(x)).latent_dist
        z, std = patchify(dist.mode()), patchify(dist.std)
        bn_mean, bn_std = batch_norm_stats(vae, z)
        return {"latent_mean": ((z - bn_mean) / bn_std).float(), "latent_std": (std / bn_std).float()}

    def decoder_patch(self, vae) -> int:
        """Latent pixels a side each stored position folds into its channels (2): decoding unfolds them after undoing
        the normalisation, as the pipelines unpatchify before `vae.decode` (the decoder recipe's `patch`, where the
        recipe records one)."""
        return int(vae.config.patch_size[0])

    def vae_fingerprint(self, vae) -> dict:
        return {"patch_size": list(vae.config.patch_size), "batch_norm_eps": float(vae.config.batch_norm_eps),
                "normalised_as": "Flux2Pipeline._encode_vae_image: (patchify(z) - bn.running_mean) / "
                                 "sqrt(bn.running_var + batch_norm_eps)"}

    # -- reference images ---------------------------------------------------------------------------------------------

    def prepare_reference(self, preset: Preset, image, index: int, count: int) -> dict[str, torch.Tensor]:
        """Flux2Pipeline.__call__'s preparation of an input image: refused when too small or too narrow, resized to the
        area cap when above it, its sides cut to multiples of 16 by a centre crop, to [-1, 1]. Every reference is
        prepared alike (their order only sets their positions in training)."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        size = reference_size(preset)
        try:
            Flux2ImageProcessor.check_image_input(image, size.max_aspect, size.min_side, size.area)
        except ValueError as e:
            raise ValueError(f"{preset.name} takes no such reference image: {e}") from None
        if image.width * image.height > size.area:
            image = Flux2ImageProcessor._resize_to_target_area(image, size.area)
        width, height = image.width // size.multiple * size.multiple, image.height // size.multiple * size.multiple
        pixels = image_processor(size.multiple).preprocess(image, height=height, width=width, resize_mode="crop")  # (1, 3, h, w)
        return {"pixels": pixels[0].float()}

    def encode_references(self, vae, x: torch.Tensor, latent: LatentSpec) -> torch.Tensor:
        """The pipeline's own `_encode_vae_image` (mode, patchify, batch-norm normalisation): (B, 128, h/16, w/16). One
        image per VAE call in the image processor's layout, as `prepare_image_latents` encodes each input image (a
        batch's convolutions round differently)."""
        from diffusers import Flux2Pipeline

        shell = Flux2Pipeline(scheduler=None, vae=vae, text_encoder=None, tokenizer=None, transformer=None)
        return torch.cat([shell._encode_vae_image(pipeline_layout(image[None]), None) for image in x]).float()

    def reference_fingerprint(self, preset: Preset) -> dict:
        return {**reference_size(preset).fingerprint(),
                "latent": "Flux2Pipeline._encode_vae_image (the posterior's mode, patchified, batch-norm normalised)"}

    # -- the text side ---------------------------------------------------------------------------------------------------

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        """Mistral 3 through Flux2Pipeline (its tokenizer's chat template: the text-only path of the published
        processor, which needs torchvision only for images), or Qwen3 through Flux2KleinPipeline."""
        from diffusers import Flux2KleinPipeline, Flux2Pipeline
        from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

        mistral = spec.kind == "mistral3"
        if repo:
            model_class = Mistral3ForConditionalGeneration if mistral else Qwen3ForCausalLM
            model, tokenizer = parts.load_pretrained_text(model_class, repo, spec.subfolder, spec.tokenizer_subfolder,
                                                          spec.revision, dtype)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"the tokenizer in {repo}/{spec.tokenizer_subfolder} has no chat template, which the FLUX.2 "
                                 f"pipelines format every caption with; give the published one ({FLUX2_DEV if mistral else KLEIN['flux2-klein-4b']})")
        elif mistral:
            tokenizer = tiny_mistral_tokenizer()
            model = tiny_mistral(tokenizer, 30)
        else:
            from precompute.families.z_image import tiny_tokenizer as tiny_qwen3_tokenizer

            tokenizer = tiny_qwen3_tokenizer()  # Qwen3's chat template, its `enable_thinking` switch included
            model = tiny_qwen3(len(tokenizer), 27)
        pipeline_class = Flux2Pipeline if mistral else Flux2KleinPipeline
        pipeline = pipeline_class(scheduler=None, vae=None, text_encoder=model, tokenizer=tokenizer, transformer=None)
        # the system message wraps every caption of dev, the negative prompt's too: its digest goes into the fingerprint
        instruction = [pipeline.system_message] if mistral else None
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline, instruction=instruction)

    def text_spec(self, side: TextSide) -> TextSpec:
        # every caption holds all `max_length` tokens (padding included), each the stacked layers' states side by side;
        # collated batches of them have nothing to pad, and the transformer takes them without a mask
        config = side.pipeline.text_encoder.config
        width = getattr(config, "text_config", config).hidden_size
        return TextSpec("masked", len(stacked_layers(side.pipeline)) * int(width), side.spec.max_length)

    def text_fingerprint(self, side: TextSide) -> dict:
        return {"stacked_layers": list(stacked_layers(side.pipeline)), "tokens": "all max_length tokens, padding included"}

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]  # (max_length, layers x D)

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True, references=None) -> list[dict[str, torch.Tensor]]:
        embeds, _ = side.pipeline.encode_prompt(list(captions), device=device, max_sequence_length=side.spec.max_length)
        return [{"text": e.float().cpu()} for e in embeds]  # (max_length, layers x D) each

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return [len(ids) > side.spec.max_length for ids in templated_ids(side, captions)]

    def caption_elements(self, text: TextSpec) -> int:
        return text.max_tokens * text.width  # every token, padding included


def templated_ids(side: TextSide, captions: list[str]) -> list[list[int]]:
    """The token ids the pipeline's `encode_prompt` would cut to `max_length`: each caption in its chat template."""
    tokenizer = side.tokenizers[side.spec.tokenizer_subfolder]
    if side.spec.kind == "mistral3":
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        texts = tokenizer.apply_chat_template(format_input(list(captions), side.pipeline.system_message), tokenize=False,
                                              add_generation_prompt=False)
        return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False) for c in captions]
    return [tokenizer(t).input_ids for t in texts]


FAMILY = Flux2()
