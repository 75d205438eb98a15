"""Caption variants: a tag-list caption shuffled and thinned into several versions, encoded once each.

kohya's `shuffle_caption` reshuffles a caption's tags every step; here the text embeddings are cached, so a source's
`caption_variants = N` precomputes up to N versions of each caption and training draws one of a sample's captions
uniformly each time it is drawn. Variant 0 is the caption's tags in their written order, none dropped (what a prompt
at inference looks like); the others shuffle the tags (`shuffle_tags`) and drop each with `tag_dropout`, except the
first `keep_tokens` tags, which stay in place and are never dropped (kohya's `keep_tokens`). With
`keep_tokens_separator` (kohya's, often "|||"), the text before it is kept in place instead, and the text after a
second one stays at the end. Identical versions are stored once, so a caption of few tags may have fewer than N.

Every variant is a pure function of the caption, the options and the image's bytes (the seed): a re-run produces the
same captions, hence the same sample keys, and an incremental run re-encodes nothing. The draws use only
`random.Random.random()`, whose sequence for a seed Python keeps across versions.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

# How many candidates one variant may take before a caption is said to have no more distinct variants (a few tags
# have few permutations); the bound keeps a caption of one tag from looping.
ATTEMPTS_PER_VARIANT = 16


@dataclass(frozen=True)
class TagOptions:
    """How a source's captions become variants (its dataset-file keys of the same names; see `precompute.sources`).

    Args:
        variants: versions per caption, variant 0 included (>= 2: the options apply).
        shuffle: shuffle the tags that are not kept.
        keep_tokens: the first this many tags stay in place and are never dropped.
        separator: what separates tags; variants join them as the caption does (`joiner`).
        keep_separator: when a caption holds it, the text before it is kept in place (instead of `keep_tokens`) and
            the text after a second one stays at the end; it is not part of any variant.
        dropout: the probability of dropping each tag that is not kept, per variant.
    """

    variants: int
    shuffle: bool = False
    keep_tokens: int = 0
    separator: str = ","
    keep_separator: str | None = None
    dropout: float = 0.0

    def joiner(self, caption: str) -> str:
        """What variants of `caption` put between tags: its first separator with the whitespace around it, as the
        caption writes it (", " in "a, b,c"; " | " in "a | b")."""
        found = re.search(rf"\s*{re.escape(self.separator)}\s*", caption)
        return found.group(0) if found else self.separator

    def parts(self, caption: str) -> tuple[list[str], list[str], list[str]]:
        """A caption's tags as (kept in front, free to move and drop, kept at the end), empty tags left out."""
        def tags(text: str) -> list[str]:
            return [t.strip() for t in text.split(self.separator) if t.strip()]

        if self.keep_separator and self.keep_separator in caption:
            front, rest = caption.split(self.keep_separator, 1)
            middle, _, end = rest.partition(self.keep_separator)
            return tags(front), tags(middle), tags(end)
        every = tags(caption)
        return every[: self.keep_tokens], every[self.keep_tokens :], []

    def variants_of(self, caption: str, seed: bytes) -> list[str]:
        """Up to `variants` distinct versions of `caption`, the first its tags in written order.

        Args:
            caption: one caption as read (stripped, without the source's caption prefix).
            seed: bytes of the input's content (its image's digest): inputs of one caption get different variants.
        """
        front, middle, end = self.parts(caption)
        written = (*front, *middle, *end)
        if not written:  # separators alone: nothing to vary
            return [caption]
        rng = random.Random(int.from_bytes(hashlib.blake2b(seed + b"\0" + caption.encode("utf-8"), digest_size=16).digest(), "big"))
        seen, out = {written}, [written]
        for _ in range(ATTEMPTS_PER_VARIANT * self.variants):
            if len(out) == self.variants:
                break
            free = list(middle)
            if self.shuffle:  # Fisher-Yates on random() alone: the same order on every Python
                for i in range(len(free) - 1, 0, -1):
                    j = int(rng.random() * (i + 1))
                    free[i], free[j] = free[j], free[i]
            if self.dropout:
                free = [t for t in free if rng.random() >= self.dropout]
            tags = (*front, *free, *end)
            if tags and tags not in seen:  # a variant of no tag at all would be caption dropout, which training does
                seen.add(tags)
                out.append(tags)
        joiner = self.joiner(caption)
        return [joiner.join(tags) for tags in out]


def caption_variants(captions: list[str], options: TagOptions | None, prefix: str, seed: bytes) -> list[str]:
    """A sample's captions as stored: each caption's variants (or the caption, without options) after the source's
    prefix, which stays first and whole; a text twice (two captions' variants can meet) is kept once, in first place."""
    if options is None:
        return [prefix + c for c in captions]
    out = [prefix + v for c in captions for v in options.variants_of(c, seed)]
    return list(dict.fromkeys(out))
