"""Presets: which VAE and text encoder a model family's cache is built with.

Stage two has presets of the same names for the transformer it trains. Real presets load
published weights with `from_pretrained` (a Hub id or a local directory in the diffusers layout);
`tiny-*` presets build the same classes from small configs with seeded random weights, so the
whole path runs offline on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch

from shards.options import Dtype

# Published repositories (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/).
PIXART_SIGMA_ENCODERS = "PixArt-alpha/pixart_sigma_sdxlvae_T5_diffusers"
SANA_600M = "Efficient-Large-Model/Sana_600M_1024px_diffusers"
SANA_1600M = "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers"
SD3_MEDIUM = "stabilityai/stable-diffusion-3-medium-diffusers"
SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
SD35_LARGE = "stabilityai/stable-diffusion-3.5-large"
FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL = "black-forest-labs/FLUX.1-schnell"


@dataclass(frozen=True)
class VaeSpec:
    """The image encoder.

    Args:
        kind: "kl" for AutoencoderKL (a Gaussian posterior: mean and std are cached so training
            can sample), "sd3" for SD3's 16-channel AutoencoderKL (the same, with a shift factor), "flux"
            for Flux.1's (SD3's architecture with its own shift and scaling), "dc" for AutoencoderDC
            (deterministic latent).
        repo: Hub id or local directory; None builds the tiny model of this kind.
        fp16_safe: False for VAEs that overflow to NaN in fp16 (the SDXL VAE).
        cuda_dtype: compute dtype on CUDA by default: fp32, bf16 or fp16 (on CPU it is fp32).
    """

    kind: Literal["kl", "dc", "sd3", "flux"]
    repo: str | None
    subfolder: str = "vae"
    revision: str | None = None
    fp16_safe: bool = False
    cuda_dtype: Dtype = "fp32"

    @property
    def gaussian(self) -> bool:
        """An AutoencoderKL: its posterior's mean and std are cached."""
        return self.kind != "dc"


@dataclass(frozen=True)
class TextEncoderSpec:
    """The caption encoder, used through its family pipeline's own `encode_prompt`.

    Args:
        name: the name `--text-encoder` selects it by.
        kind: "t5" (T5EncoderModel, encoded like PixArt-Sigma), "gemma2" (Gemma2Model, encoded
            like Sana, with its token selection), "sd3" (CLIP-L + CLIP-G + T5, encoded like
            StableDiffusion3Pipeline; subfolders text_encoder{,_2,_3} and tokenizer{,_2,_3}) or "flux"
            (CLIP-L's pooled output + T5, encoded like FluxPipeline; text_encoder{,_2}, tokenizer{,_2}).
        repo: Hub id or local directory; None builds the tiny model of this kind.
        max_length: token limit of a caption (for "sd3" and "flux": of the T5 part; CLIP's is 77).
        drop_t5: "sd3" only: leave T5 out, as StableDiffusion3Pipeline does with `text_encoder_3=None`
            (its tokens are zeros at inference, so they are not stored).
        complex_human_instruction: prepend Sana's instruction prompt, as the released Sana models
            were trained.
        fp16_safe: False for encoders that overflow in fp16 (T5).
        cuda_dtype: compute dtype on CUDA by default.
    """

    name: str
    kind: Literal["t5", "gemma2", "sd3", "flux"]
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
class Preset:
    """A model family's encoders, bucket table and the transformer stage two trains."""

    name: str
    family: Literal["pixart", "sana", "sd3", "flux"]
    base_resolution: int
    vae: VaeSpec
    text: TextEncoderSpec
    transformer: str | None  # informational here; stage two loads it


TEXT_ENCODERS: dict[str, Callable[[], TextEncoderSpec]] = {
    "t5-xxl": lambda: TextEncoderSpec("t5-xxl", "t5", PIXART_SIGMA_ENCODERS),
    "gemma2-2b": lambda: TextEncoderSpec("gemma2-2b", "gemma2", SANA_1600M, complex_human_instruction=True, fp16_safe=True),
    "tiny-t5": lambda: TextEncoderSpec("tiny-t5", "t5", None, max_length=64),
    "tiny-gemma2": lambda: TextEncoderSpec("tiny-gemma2", "gemma2", None, max_length=64, complex_human_instruction=True, fp16_safe=True),
    # StableDiffusion3Pipeline's default T5 length is 256 tokens (SD3.5 was also trained with 256).
    "clip-l-g-t5": lambda: TextEncoderSpec("clip-l-g-t5", "sd3", SD35_LARGE, max_length=256),
    "tiny-clip-l-g-t5": lambda: TextEncoderSpec("tiny-clip-l-g-t5", "sd3", None, max_length=32),
    # FluxPipeline's default T5 length is 512 tokens; FLUX.1-schnell was trained with 256 (the flux presets set it).
    "clip-l-t5": lambda: TextEncoderSpec("clip-l-t5", "flux", FLUX_DEV, max_length=512),
    "tiny-clip-l-t5": lambda: TextEncoderSpec("tiny-clip-l-t5", "flux", None, max_length=32),
}


def _pixart(name: str, base: int, transformer: str) -> Preset:
    return Preset(name, "pixart", base, VaeSpec("kl", PIXART_SIGMA_ENCODERS), TEXT_ENCODERS["t5-xxl"](), transformer)


def _sana(name: str, repo: str) -> Preset:
    vae = VaeSpec("dc", repo, fp16_safe=True, cuda_dtype="bf16")
    return Preset(name, "sana", 1024, vae, replace(TEXT_ENCODERS["gemma2-2b"](), repo=repo), repo)


def _sd3(name: str, repo: str) -> Preset:
    # The SD3 VAE has no fp16 guarantee (its config asks for upcasting): fp32 by default.
    return Preset(name, "sd3", 1024, VaeSpec("sd3", repo), replace(TEXT_ENCODERS["clip-l-g-t5"](), repo=repo), repo)


def _flux(name: str, repo: str, max_length: int) -> Preset:
    # The Flux VAE is SD3's architecture and has no fp16 guarantee either (force_upcast): fp32 by default.
    text = replace(TEXT_ENCODERS["clip-l-t5"](), repo=repo, max_length=max_length)
    return Preset(name, "flux", 1024, VaeSpec("flux", repo), text, repo)


PRESETS: dict[str, Callable[[], Preset]] = {
    "pixart-sigma-512": lambda: _pixart("pixart-sigma-512", 512, "PixArt-alpha/PixArt-Sigma-XL-2-512-MS"),
    "pixart-sigma-1024": lambda: _pixart("pixart-sigma-1024", 1024, "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"),
    "sana-600m": lambda: _sana("sana-600m", SANA_600M),
    "sana-1600m": lambda: _sana("sana-1600m", SANA_1600M),
    "sd3-medium": lambda: _sd3("sd3-medium", SD3_MEDIUM),
    "sd35-medium": lambda: _sd3("sd35-medium", SD35_MEDIUM),
    "sd35-large": lambda: _sd3("sd35-large", SD35_LARGE),
    "flux-dev": lambda: _flux("flux-dev", FLUX_DEV, 512),
    "flux-schnell": lambda: _flux("flux-schnell", FLUX_SCHNELL, 256),
    "tiny-pixart": lambda: Preset("tiny-pixart", "pixart", 256, VaeSpec("kl", None), TEXT_ENCODERS["tiny-t5"](), None),
    "tiny-sana": lambda: Preset(
        "tiny-sana", "sana", 256, VaeSpec("dc", None, fp16_safe=True, cuda_dtype="bf16"), TEXT_ENCODERS["tiny-gemma2"](), None
    ),
    "tiny-sd3": lambda: Preset("tiny-sd3", "sd3", 256, VaeSpec("sd3", None), TEXT_ENCODERS["tiny-clip-l-g-t5"](), None),
    "tiny-flux": lambda: Preset("tiny-flux", "flux", 256, VaeSpec("flux", None), TEXT_ENCODERS["tiny-clip-l-t5"](), None),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def get_text_encoder(name: str) -> TextEncoderSpec:
    try:
        return TEXT_ENCODERS[name]()
    except KeyError:
        raise ValueError(f"unknown text encoder {name!r}; choose one of {', '.join(TEXT_ENCODERS)}") from None


def sana_complex_human_instruction() -> list[str]:
    """Sana's instruction prompt, as the diffusers SanaPipeline applies it by default."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


# ---- tiny models: the real classes, small configs, seeded random weights -------------------------

TINY_SEED = 0
# tiny-flux's text widths, which stage two's tiny Flux transformer takes as joint_attention_dim (the tiny T5's d_model)
# and pooled_projection_dim (the tiny CLIP-L's hidden size, its pooled output's width).
TINY_T5_WIDTH = 32
TINY_FLUX_POOLED_WIDTH = 24
# Words of the bundled sample captions, so the tiny tokenizers split them into whole words.
TINY_WORDS = (
    "a an the of on in with and at to is are small large big tiny red green blue yellow orange purple pink "
    "white black gray grey brown cyan magenta circle square triangle rectangle star ellipse stripe stripes "
    "shape shapes background picture photo image gradient dark light bright pale left right top bottom center "
    "corner two three several sky over under near above below"
).split()


def tiny_tokenizer(kind: str):
    """A small tokenizer of the real class, built in-process (no download): "t5", "gemma2" or "clip"."""
    if kind == "clip":
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
        from transformers import CLIPTokenizer

        # A byte-level BPE with CLIP's end-of-word suffix, trained here on the sample vocabulary.
        specials = ["<|startoftext|>", "<|endoftext|>"]
        bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token=specials[1]))
        bpe.normalizer = normalizers.Lowercase()
        bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
        corpus = [" ".join(TINY_WORDS)] * 4 + [" ".join(".,;:!?'\"-()0123456789")]
        # The trainer numbers a word's last character with its suffix ("e</w>") in hash order, which differs from
        # process to process, and breaks ties between merges by those numbers: listed up front, in sorted order,
        # they get the same numbers in every process, and so does the vocabulary a cache's fingerprint records.
        ends = sorted({word[-1] + "</w>" for line in corpus for word in line.split()})
        bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials + ends, end_of_word_suffix="</w>",
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        state = json.loads(bpe.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
        return CLIPTokenizer(vocab=state["vocab"], merges=merges, model_max_length=77)
    if kind == "t5":
        from transformers import T5Tokenizer

        chars = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()"
        vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
        vocab += [(f"▁{w}", -1.0) for w in TINY_WORDS] + [(c, -5.0) for c in chars]
        return T5Tokenizer(vocab=vocab, extra_ids=0)
    if kind == "gemma2":
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
        from transformers import GemmaTokenizer

        # A small BPE trained here, deterministically, on the sample vocabulary and Sana's
        # instruction prompt, so captions and the instruction take few tokens.
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{i:02X}>" for i in range(256)]
        bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.normalizer = normalizers.Replace(" ", "▁")
        bpe.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
        corpus = [" ".join(TINY_WORDS)] * 4 + sana_complex_human_instruction()
        alphabet = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()")
        bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=900, special_tokens=specials, initial_alphabet=alphabet, show_progress=False))
        state = json.loads(bpe.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
        return GemmaTokenizer(vocab=state["vocab"], merges=merges, add_bos_token=True)
    raise ValueError(kind)


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return build().eval()


def tiny_text_encoder(kind: str, vocab_size: int) -> torch.nn.Module:
    if kind == "t5":
        from transformers import T5Config, T5EncoderModel

        config = T5Config(vocab_size=vocab_size, d_model=TINY_T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          feed_forward_proj="gated-gelu", is_encoder_decoder=False, dropout_rate=0.0)
        return _seeded(lambda: T5EncoderModel(config))
    if kind == "gemma2":
        from transformers import Gemma2Config, Gemma2Model

        config = Gemma2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1, attn_logit_softcapping=None)
        return _seeded(lambda: Gemma2Model(config))
    if kind in ("clip-l", "clip-g", "clip-l-pooled"):
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        # CLIP-L is the narrower of SD3's two (768 and 1280). Flux's CLIP-L is a CLIPTextModel whose pooled output
        # (hidden_size wide) is the transformer's pooled projection input: TINY_FLUX_POOLED_WIDTH.
        width = {"clip-l": 8, "clip-g": 16, "clip-l-pooled": TINY_FLUX_POOLED_WIDTH}[kind]
        config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, projection_dim=width,
                                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu")
        return _seeded(lambda: (CLIPTextModel if kind == "clip-l-pooled" else CLIPTextModelWithProjection)(config))
    raise ValueError(kind)


def tiny_vae(kind: str) -> torch.nn.Module:
    """f8 autoencoders: KL with 4 latent channels (SDXL-like), SD3's and Flux's KL with 16 and a shift, DC with 8."""
    if kind == "kl":
        from diffusers import AutoencoderKL

        return _seeded(lambda: AutoencoderKL(
            block_out_channels=(16, 32, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=4, norm_num_groups=8,
            sample_size=256, scaling_factor=0.13025,
        ))
    if kind in ("sd3", "flux"):
        from diffusers import AutoencoderKL

        # SD3's and Flux's VAEs: 16 channels, no quant convs, each family's published shift and scaling factors.
        scaling, shift = {"sd3": (1.5305, 0.0609), "flux": (0.3611, 0.1159)}[kind]
        return _seeded(lambda: AutoencoderKL(
            block_out_channels=(16, 32, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=16, norm_num_groups=8,
            sample_size=256, scaling_factor=scaling, shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False,
        ))
    if kind == "dc":
        from diffusers import AutoencoderDC

        blocks = ("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock")
        return _seeded(lambda: AutoencoderDC(
            in_channels=3, latent_channels=8, attention_head_dim=8, encoder_block_types=blocks, decoder_block_types=blocks,
            encoder_block_out_channels=(16, 32, 32, 32), decoder_block_out_channels=(16, 32, 32, 32),
            encoder_layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            encoder_qkv_multiscales=((), (), (5,), (5,)), decoder_qkv_multiscales=((), (), (5,), (5,)),
            upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
            decoder_act_fns="silu", scaling_factor=0.41407,
        ))
    raise ValueError(kind)


def sd3_text_parts(drop_t5: bool = False) -> list[tuple[str, str, str]]:
    """(tiny kind, model subfolder, tokenizer subfolder) of SD3's text encoders, in pipeline order."""
    parts = [("clip-l", "text_encoder", "tokenizer"), ("clip-g", "text_encoder_2", "tokenizer_2"), ("t5", "text_encoder_3", "tokenizer_3")]
    return parts[:2] if drop_t5 else parts


def text_parts(text: TextEncoderSpec) -> list[tuple[str, str, str]]:
    """(tiny kind, model subfolder, tokenizer subfolder) of a text encoder's models, in pipeline order: SD3's three,
    Flux's CLIP-L (its pooled output) and T5, or the one model of the other families."""
    if text.kind == "sd3":
        return sd3_text_parts(text.drop_t5)
    if text.kind == "flux":
        return [("clip-l-pooled", "text_encoder", "tokenizer"), ("t5", "text_encoder_2", "tokenizer_2")]
    return [(text.kind, text.subfolder, text.tokenizer_subfolder)]


def save_tiny(preset: Preset, directory) -> None:
    """Write a tiny preset's components in the diffusers layout, to load back with `from_pretrained`."""
    tiny_vae(preset.vae.kind).save_pretrained(f"{directory}/{preset.vae.subfolder}")
    for kind, model_dir, tokenizer_dir in text_parts(replace(preset.text, drop_t5=False)):
        tokenizer = tiny_tokenizer("clip" if kind.startswith("clip") else kind)
        tiny_text_encoder(kind, len(tokenizer)).save_pretrained(f"{directory}/{model_dir}")
        tokenizer.save_pretrained(f"{directory}/{tokenizer_dir}")


def weights_digest(module: torch.nn.Module, samples: int = 4096) -> str:
    """A cheap digest of a module's weights: names, shapes, dtypes and evenly spaced values.

    Hashing every byte of T5-XXL would cost tens of seconds per run; any two distinct checkpoints
    differ at sampled positions, which is what the fingerprint needs.
    """
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        picked = flat[::step][:samples].to("cpu", torch.float64)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()
