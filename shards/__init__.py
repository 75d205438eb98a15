"""The on-disk cache format shared by `precompute` (which writes it) and `train` (which reads it).

A cache is a directory of memory-mapped safetensors shards, one aspect-ratio bucket per shard, and a
manifest kept as a commit log with snapshots, which fingerprints everything that determines the cached
values and lists the shards of every generation. A cache may store each distinct caption's text once, in text
shards its samples refer to by key (`shards.texts`), which a read resolves.
See FORMAT.md beside this file.
"""

from shards.buckets import ASPECT_RATIO_TABLES, Bucket, aspect_error, bucket_table, nearest_bucket, resolution_table
from shards.contract import CONTROL_PREFIX, FLIP_PREFIX, LATENT_KEY, MASK, CacheSpec, DecoderRecipe, LatentSpec, TextSpec
from shards.fingerprint import canonical_json, diff_fingerprints, fingerprint_hash
from shards.gc import gc, register_reader
from shards.generations import load
from shards.layout import MANIFEST
from shards.lock import CacheLock
from shards.log import exists
from shards.manifest import Manifest
from shards.prompts import Prompt, prompt_key
from shards.reader import Cache, Sample, ShardReader
from shards.remote import RemoteCache, open_cache
from shards.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CacheBusy,
    CorruptSample,
    DamagedCache,
    Field,
    FingerprintMismatch,
    FormatError,
    Schema,
)
from shards.table import ShardEntry
from shards.verify import Report, verify
from shards.writer import ShardWriter

__all__ = [
    "ASPECT_RATIO_TABLES",
    "Bucket",
    "Cache",
    "CacheBusy",
    "FLIP_PREFIX",
    "CONTROL_PREFIX",
    "LATENT_KEY",
    "MASK",
    "CacheSpec",
    "DecoderRecipe",
    "LatentSpec",
    "TextSpec",
    "CacheLock",
    "CorruptSample",
    "DamagedCache",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Field",
    "FingerprintMismatch",
    "FormatError",
    "MANIFEST",
    "Prompt",
    "Manifest",
    "RemoteCache",
    "Report",
    "Sample",
    "Schema",
    "ShardEntry",
    "ShardReader",
    "ShardWriter",
    "aspect_error",
    "bucket_table",
    "canonical_json",
    "diff_fingerprints",
    "fingerprint_hash",
    "exists",
    "gc",
    "load",
    "register_reader",
    "resolution_table",
    "nearest_bucket",
    "open_cache",
    "prompt_key",
    "verify",
]
