"""A small tokenizer of Qwen's class (`Qwen2Tokenizer`), built in-process: no download, the same in every process.

Qwen2 / Qwen2.5 / Qwen3 text encoders share this tokenizer class: a byte-level BPE behind Qwen's pre-tokenizer
split, with chat-template special tokens. The tiny presets train one here on the texts their pipeline feeds it (its
prompt template, the sample captions' words), so those texts take few tokens and the pipeline's fixed token offsets
(Qwen-Image drops its template's first 34) hold as they do for the published tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# The published Qwen2.5 tokenizer's special tokens the text-only pipelines use, then the vision markers the
# Qwen2.5-VL config names (they must exist for its token ids to lie in the vocabulary).
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>")


def tiny_qwen_tokenizer(corpus: Sequence[str], special_tokens: Sequence[str] = QWEN_SPECIAL_TOKENS, vocab_size: int = 1200,
                        chat_template: str | None = None):
    """A `Qwen2Tokenizer` whose BPE is trained on `corpus`, deterministically.

    Args:
        corpus: the texts to learn merges from; words they repeat become single tokens.
        special_tokens: added as special tokens after the BPE's vocabulary, in this order; the first is the
            end-of-text, padding and unknown token, as in Qwen's published tokenizers.
        vocab_size: the BPE's vocabulary size before the special tokens (256 byte symbols included).
        chat_template: a Jinja chat template for `apply_chat_template`, if the pipeline uses one.

    Returns:
        the tokenizer; every byte sequence tokenizes (the 256 byte symbols are in the vocabulary).
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # Every byte symbol is in the initial alphabet, so symbol ids are assigned in sorted order and ties between merges
    # break the same way in every process: the vocabulary a cache's fingerprint records does not change between runs.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([text for text in corpus for text in _without(text, special_tokens)], trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    first = special_tokens[0]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=merges, unk_token=first, eos_token=first, pad_token=first,
                               extra_special_tokens=list(special_tokens[1:]), model_max_length=131072)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _without(text: str, special_tokens: Sequence[str]) -> list[str]:
    """`text` split around the special tokens it holds: they are added whole, never learned as merges."""
    parts = [text]
    for token in special_tokens:
        parts = [piece for part in parts for piece in part.split(token)]
    return [part for part in parts if part]
