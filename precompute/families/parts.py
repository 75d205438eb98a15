"""Pieces several families share: the KL VAE's posterior, T5 and CLIP text models and tokenizers (published and
tiny), and the masked encoding of captions (valid tokens only) that single-encoder pipelines return.

Tiny models are the real classes with small configs and seeded random weights, and tiny tokenizers are built
in-process from a small vocabulary, so every preset runs offline on a CPU in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from shards import LatentSpec

TINY_SEED = 0
# The tiny T5's width (d_model): the text width of the tiny presets that encode with T5.
TINY_T5_WIDTH = 32
# Words of the bundled sample captions, so the tiny tokenizers split them into whole words.
TINY_WORDS = (
    "a an the of on in with and at to is are small large big tiny red green blue yellow orange purple pink "
    "white black gray grey brown cyan magenta circle square triangle rectangle star ellipse stripe stripes "
    "shape shapes background picture photo image gradient dark light bright pale left right top bottom center "
    "corner two three several sky over under near above below"
).split()
CLIP_TOKENS = 77  # CLIP tokenizers pad every caption to this length


def seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`build()` with the tiny models' seed, in eval mode, leaving the caller's random state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return build().eval()


def bpe_state(bpe) -> tuple[dict, list[tuple[str, str]]]:
    """A trained `tokenizers` BPE's vocabulary and merges, as the slow tokenizer classes take them."""
    state = json.loads(bpe.to_str())["model"]
    return state["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]


# ---- KL autoencoders -----------------------------------------------------------------------------------------------

def tiny_kl_vae(latent_channels: int, scaling_factor: float, shift_factor: float | None = None):
    """An f8 AutoencoderKL; with a shift factor, as SD3's and Flux's are, without quant convs."""
    from diffusers import AutoencoderKL

    quant = {} if shift_factor is None else {"shift_factor": shift_factor, "use_quant_conv": False, "use_post_quant_conv": False}
    return seeded(lambda: AutoencoderKL(
        block_out_channels=(16, 32, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
        sample_size=256, scaling_factor=scaling_factor, **quant,
    ))


def load_kl_vae(repo: str, subfolder: str, revision: str | None):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(repo, subfolder=subfolder, revision=revision)


def kl_latent_spec(vae) -> LatentSpec:
    """The posterior's mean and std are cached, so training samples a fresh latent each step."""
    cfg = vae.config
    downsample = 2 ** (len(cfg.block_out_channels) - 1)
    return LatentSpec(int(cfg.latent_channels), downsample, float(cfg.scaling_factor),
                      float(getattr(cfg, "shift_factor", None) or 0.0), "mean_std")


def encode_kl(vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
    """(B, 3, H, W) in [-1, 1] -> `latent_mean` (shifted and scaled) and `latent_std` (scaled), (B, C, h, w)."""
    dist = vae.encode(x).latent_dist
    return {
        "latent_mean": ((dist.mean.float() - latent.shift_factor) * latent.scaling_factor),
        "latent_std": dist.std.float() * latent.scaling_factor,
    }


# ---- T5 and CLIP ---------------------------------------------------------------------------------------------------

def tiny_t5_tokenizer():
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(f"▁{w}", -1.0) for w in TINY_WORDS] + [(c, -5.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def tiny_t5(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=TINY_T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, dropout_rate=0.0)
    return seeded(lambda: T5EncoderModel(config))


def tiny_clip_tokenizer():
    """A byte-level BPE with CLIP's end-of-word suffix, trained here on the sample vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

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
    vocab, merges = bpe_state(bpe)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_TOKENS)


def tiny_clip(vocab_size: int, width: int, projection: bool):
    """A CLIP text model `width` wide: CLIPTextModelWithProjection, or with `projection` False CLIPTextModel."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, projection_dim=width,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu")
    return seeded(lambda: (CLIPTextModelWithProjection if projection else CLIPTextModel)(config))


def load_pretrained_text(model_class, repo: str, subfolder: str, tokenizer_subfolder: str, revision: str | None,
                         dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """A published text model (in `dtype`) and its tokenizer, from a Hub id or a local diffusers-layout directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(repo, subfolder=tokenizer_subfolder, revision=revision)
    return model_class.from_pretrained(repo, subfolder=subfolder, revision=revision, dtype=dtype), tokenizer


def text_width(module: torch.nn.Module) -> int:
    """A text model's output width: T5's d_model; Gemma's, CLIP's and most others' hidden_size."""
    config = module.config
    return int(getattr(config, "d_model", None) or config.hidden_size)


# ---- masked single-encoder captions --------------------------------------------------------------------------------

def encode_masked(pipeline, captions: list[str], device: torch.device, max_length: int, **kwargs) -> list[dict[str, torch.Tensor]]:
    """`encode_prompt` of a pipeline that returns (embeds, mask, ...) -> per caption `text` (L_i, D), its valid
    tokens only: the transformer masks padding in cross-attention, so dropping it is lossless."""
    embeds, mask, _, _ = pipeline.encode_prompt(
        captions, do_classifier_free_guidance=False, device=device, max_sequence_length=max_length, clean_caption=False, **kwargs,
    )
    embeds, mask = embeds.float().cpu(), mask.bool().cpu()
    return [{"text": e[m]} for e, m in zip(embeds, mask)]


def over_limit(tokenizer, captions: list[str], limit: int, prefix: list[str] | None = None) -> list[bool]:
    """Which captions have more than `limit` tokens; with a prefix of instruction lines, which exceed the budget
    the pipeline gives caption and prefix together (the prefix's tokens plus `limit` - 2)."""
    if prefix:
        head = "\n".join(prefix)
        budget = len(tokenizer.encode(head)) + limit - 2
        return [len(tokenizer.encode(head + c)) > budget for c in captions]
    return [len(tokenizer.encode(c)) > limit for c in captions]


def over_clip_or_t5_limit(clip, t5, captions: list[str], limit: int) -> list[bool]:
    """Which captions exceed CLIP's 77 tokens or T5's `limit` (`t5` None: T5 is left out)."""
    return [len(clip(c).input_ids) > CLIP_TOKENS or (t5 is not None and len(t5(c).input_ids) > limit) for c in captions]
