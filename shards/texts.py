"""Texts stored once: the text embeddings of a caption in one text row, which every sample with that caption refers to.

In a cache that stores texts once (`Manifest.text_schema` is set), a caption's text fields (`text`, `clip`,
`pooled`...) are not stored with each sample: they are one row of a *text shard* (`texts/rRRRRR-SEQ.safetensors`,
laid out like a shard, metadata `kind: texts`), keyed by the caption's text key, the sha256 of its UTF-8 (the
fingerprint covers the encoder that made the row). A sample holds `text_keys`, one 32-byte key per caption, and its
shard's manifest entry lists the keys its samples refer to (`ShardEntry.texts`), so what is still referred to is
known from the manifest alone. A read resolves a sample's keys into the fields the per-sample layout stores
(`resolve`): the same tensors, whichever layout the cache has. See FORMAT.md.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from shards.buckets import Bucket
from shards.schema import Field, FormatError, Schema

TEXT_KEYS = "text_keys"  # a sample's field: ragged uint8 (captions, 32), each caption's text key
TEXT_LENGTHS = "text_lengths"  # the per-sample layout's token count of each caption, rebuilt by `resolve`
TEXT_DIR = "texts"  # the folder of the text shards
TEXT_BUCKET = Bucket(0, 0)  # what the manifest lists as a text shard's bucket (its rows hold no image)
TEXTS_KIND = "texts"  # a text shard's `kind` metadata: never read as a shard of samples
# Records (`Manifest.extra`) that spare a run the scan for text rows no sample refers to. A writer that commits texts
# no sample of its own refers to yet (texts committed ahead of their samples, or for samples then refused) sets
# `ahead_marker(rank)` in that same commit, and takes it back when it finishes with every such text referred to; a
# writer killed meanwhile leaves it set. `TEXTS_CHECKED`: set by a scan, so every text committed ahead since is marked
# (a cache whose writers predate the markers has never been scanned: it is, once).
TEXTS_CHECKED = "texts_checked"
TEXTS_AHEAD = "texts_ahead_r"


def ahead_marker(rank: int) -> str:
    """The record a writer of `rank` sets while texts it committed may be referred to by no sample."""
    return f"{TEXTS_AHEAD}{rank:05d}"


def unsettled(extra: dict) -> tuple[bool, list[str]]:
    """Whether a cache's texts were ever checked for rows no sample refers to (`TEXTS_CHECKED`), and the markers of
    texts committed ahead of their samples its records hold (`ahead_marker`): the scan is needed unless checked and
    no marker is set."""
    return bool(extra.get(TEXTS_CHECKED)), sorted(k for k, v in extra.items() if k.startswith(TEXTS_AHEAD) and v)


def text_key(caption: str, context: bytes = b"") -> str:
    """A caption's text key: the sha256 of its UTF-8 (the same as `prompt_key`). A text that depends on more than its
    caption (an edit model's text encoder sees the sample's reference images: `shards.references.references_digest`)
    adds that `context`, so equal captions with other references are other texts."""
    data = caption.encode("utf-8", "surrogateescape")
    return hashlib.sha256(data + b"\0context\0" + context if context else data).hexdigest()


def key_rows(keys: list[str]) -> torch.Tensor:
    """Text keys as a sample's `text_keys` field: (n, 32) uint8."""
    return torch.frombuffer(bytearray(b"".join(bytes.fromhex(k) for k in keys)) or bytearray(32), dtype=torch.uint8)[: 32 * len(keys)].reshape(-1, 32)


def keys_of(rows: torch.Tensor) -> list[str]:
    """A sample's `text_keys` field as hex keys."""
    data = rows.contiguous().numpy().tobytes()
    return [data[i : i + 32].hex() for i in range(0, len(data), 32)]


def check_text_schema(schema: Schema, text_schema: Schema) -> None:
    """The fields of a cache that stores texts once: samples refer to their texts by `text_keys`, and every text field
    is ragged (one row per caption, of any number of tokens).

    Raises:
        ValueError: what is wrong, naming the field.
    """
    field = schema.get(TEXT_KEYS)
    if field is None or field.dtype != torch.uint8 or not field.ragged:
        raise ValueError(f"a cache that stores texts once needs a ragged uint8 field {TEXT_KEYS!r} in its sample schema")
    if not text_schema:
        raise ValueError("a cache that stores texts once needs at least one text field")
    for name, spec in text_schema.items():
        if not spec.ragged:
            raise ValueError(f"text field {name!r} must be ragged: a text row holds one caption of any length")
        if name in schema:
            raise ValueError(f"text field {name!r} is also a sample field; a text field is stored in text rows only")


def resolve(fields: dict[str, torch.Tensor], texts: list[dict[str, torch.Tensor]], text_schema: Schema) -> dict[str, torch.Tensor]:
    """A sample's fields as the per-sample layout stores them: its own fields but `text_keys`, each text field its
    captions' rows back to back, and `text_lengths` the token count of each caption's `text` (0 without one).

    Args:
        fields: the sample's stored fields.
        texts: the text rows its `text_keys` name, in order.
    """
    out = {name: t for name, t in fields.items() if name != TEXT_KEYS}
    for name in text_schema:
        rows = [t[name] for t in texts]
        out[name] = rows[0] if len(rows) == 1 else torch.cat(rows)  # one caption: the row itself, no copy
    out[TEXT_LENGTHS] = torch.tensor([len(t["text"]) if "text" in t else 0 for t in texts], dtype=torch.int32)
    return out


def resolved_schema(schema: Schema, text_schema: Schema) -> Schema:
    """The fields `resolve` returns: the per-sample layout's schema."""
    out = {name: field for name, field in schema.items() if name != TEXT_KEYS}
    return {**out, **text_schema, TEXT_LENGTHS: Field(torch.int32, ragged=True)}


def key_prefixes(keys: list[str]) -> np.ndarray:
    """The first 8 bytes of each hex key as a big-endian uint64: what `TextIndex` sorts and searches."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    try:
        return np.frombuffer(bytes.fromhex("".join(k[:16] for k in keys)), dtype=">u8").astype(np.uint64)
    except ValueError:
        raise FormatError("a text key of the manifest is not hex; the log was edited or damaged") from None


def hex_prefixes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`key_prefixes` of ragged ASCII keys (bytes `data`, `(n + 1,)` `offsets`), without a Python string per key when
    they are all of one length (stage one's are 64 hex digits)."""
    n, start = len(offsets) - 1, int(offsets[0]) if len(offsets) else 0
    lengths = np.diff(offsets)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if np.any(lengths < 16):
        raise FormatError("a text key of the manifest is shorter than 16 hex digits; the log was edited or damaged")
    if np.all(lengths == lengths[0]):  # a view of the keys' first 16 digits: no copy but the digits'
        digits = data[start : start + n * int(lengths[0])].reshape(n, int(lengths[0]))[:, :16].tobytes()
    else:
        digits = b"".join(bytes(data[a : a + 16]) for a in offsets[:-1].tolist())
    try:
        return np.frombuffer(bytes.fromhex(digits.decode("ascii")), dtype=">u8").astype(np.uint64)
    except (ValueError, UnicodeDecodeError):
        raise FormatError("a text key of the manifest is not hex; the log was edited or damaged") from None


def table_prefixes(table) -> tuple[np.ndarray, np.ndarray]:
    """`key_prefixes` of every live text of a text table (`ShardTable`), in table order, and each live shard's count.
    Rows a snapshot holds are read from its columns as arrays (first use checks them against `texts_sha256`)."""
    parts, counts = [], []
    for j in (int(j) for j in table.rows):
        if j in table._samples_of or table._snapshot_samples is None:
            parts.append(key_prefixes(table.samples_of(j)[0]))
        else:
            bounds, keys = table._snapshot_samples.columns()[:2]
            offsets = keys.offsets[int(bounds[j]) : int(bounds[j + 1]) + 1]
            parts.append(hex_prefixes(np.frombuffer(keys.data, dtype=np.uint8), offsets))
        counts.append(len(parts[-1]))
    prefixes = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
    return prefixes, np.array(counts, dtype=np.int64)


class TextIndex:
    """Where each text row is: text key -> (text shard, row), for the live text shards of one generation.

    Built once per reader from the manifest's text table: two arrays sorted by the keys' first 8 bytes, 16 bytes per
    text (100M texts: 1.6 GB; a text stored by several ranks at once is found at its first copy in table order). A
    lookup is a binary search, then the full key is compared with the text shard's own (`locate`'s caller), so
    keys sharing their first 8 bytes are told apart.

    Args:
        prefixes: the `key_prefixes` of every live text, in table order (`table_prefixes`).
        counts: each live text shard's number of texts.
    """

    def __init__(self, prefixes: np.ndarray, counts: np.ndarray):
        order = np.argsort(prefixes, kind="stable")  # equal prefixes keep table order: the first copy first
        shard = np.repeat(np.arange(len(counts), dtype=np.int32), counts)[order]
        row = (order - np.repeat(np.cumsum(counts) - counts, counts)[order]).astype(np.int32)
        self.prefixes, self.shard, self.row = prefixes[order], shard, row

    def __len__(self) -> int:
        return len(self.prefixes)

    def candidates(self, key: str) -> list[tuple[int, int]]:
        """(text shard, row) of every text whose key begins like `key`, the first copy first."""
        prefix = np.uint64(int(key[:16], 16))
        a, b = np.searchsorted(self.prefixes, prefix, "left"), np.searchsorted(self.prefixes, prefix, "right")
        return [(int(self.shard[i]), int(self.row[i])) for i in range(a, b)]
