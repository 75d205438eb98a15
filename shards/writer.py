"""ShardWriter: buffers samples per bucket, publishes each shard atomically, then commits it to the log.

The checks a sample passes and the encoding of a shard file are in `shards.encode`; writing a shard file and
copying rows out of one and removing a killed writer's leftovers in `shards.shard_files`; the locks a writer holds in `shards.lock`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from shards.atomic import atomic_write_bytes, fsync_dir
from shards.buckets import Bucket
from shards.encode import Item, check_sample, check_stamp, encode_shard
from shards.generations import compact, compaction_due, load, replay
from shards.layout import confined
from shards.lock import CacheLock, writers_lock
from shards.log import exists, missing_manifest, write_commit, write_pointer
from shards.manifest import Manifest
from shards.prompts import PROMPTS_FILE, Prompt, encode_prompts, stored_prompts
from shards.reader import ShardReader
from shards.schema import BASE_VERSION, CacheBusy, Schema, schema_to_json, validate_schema
from shards.shard_files import intact_rows, remove_leftovers, write_shard_file
from shards.table import ShardEntry, members, sorted_unique
from shards.texts import (
    TEXT_BUCKET,
    TEXT_DIR,
    TEXT_KEYS,
    TEXTS_CHECKED,
    TEXTS_KIND,
    ahead_marker,
    check_text_schema,
    keys_of,
    text_key,
    unsettled,
)

# Bytes of the texts met (`_text_sizes`) kept past a commit, besides those still buffered: the texts of about one
# shard's samples; others are read again from their text shard when a later sample refers to them.
TEXT_SIZES_KEPT = 1 << 17


class ShardWriter:
    """Writes samples into a cache directory, one bucket (and dataset, and resolution) per shard, each shard one commit.

    Samples are buffered per bucket, dataset and resolution; a shard is published when its buffer reaches `max_shard_bytes` or
    `max_shard_samples` (and at `finish`): written under a temp name, fsynced, renamed, then committed as a
    new generation of the log. A crash at any instant leaves every committed shard intact and listed;
    buffered samples are absent. Shard files are never modified or deleted: removing samples commits
    new shards without them and retires the old ones, which `python -m shards gc` deletes once no reader
    needs them.

    Shard names carry the writer's rank, so the processes of a multi-process run never collide; they
    commit into the same log.

    Args:
        root: the cache directory (created if missing). An existing cache is appended to.
        fingerprint: everything that determines the cached values; appending to a cache with another
            fingerprint raises `FingerprintMismatch` naming the differing fields.
        schema: the fields of every sample.
        rank: this process's global rank.
        max_shard_bytes: publish a bucket's shard once its samples reach this many bytes.
        max_shard_samples: ... or this many samples.
        max_buffer_bytes: bound on buffered bytes over all buckets; past it the largest buffer is
            published early (as a smaller shard).
        check_finite: refuse samples whose floating fields hold NaN or Inf.
        text_schema: store each text once (`shards.texts`): the fields of one caption's text row. Samples then hold
            `text_keys` (ragged uint8 (n, 32)) and their texts are written with `write_text`. The layout is chosen when a
            cache starts: for an existing cache, None means its own, and another one is refused.
        manifest: this cache's manifest as the caller loaded it (a `Manifest.copy()`: the writer takes it over),
            brought up to the newest generation here instead of loading the cache again: its sample index is shared,
            not read a second time.

    Raises:
        CacheBusy: another writer of this rank holds the cache, or `python -m shards gc` is collecting it.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: dict,
        schema: Schema,
        *,
        rank: int = 0,
        max_shard_bytes: int = 128 << 20,
        max_shard_samples: int = 100_000,
        max_buffer_bytes: int = 1 << 30,
        check_finite: bool = True,
        text_schema: Schema | None = None,
        manifest: Manifest | None = None,
    ):
        validate_schema(schema)
        if text_schema is not None:
            validate_schema(text_schema)
            check_text_schema(schema, text_schema)
        self.root = Path(root)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self.max_buffer_bytes = max_buffer_bytes
        self.check_finite = check_finite
        self.root.mkdir(parents=True, exist_ok=True)
        self._buffers: dict[tuple[Bucket, str, int], list[Item]] = {}  # by (bucket, dataset, resolution)
        self._buffer_bytes: dict[tuple[Bucket, str, int], int] = {}
        self._pending: dict = {}  # files and run records for the next commit
        self._texts_buffer: list[Item] = []  # texts written, not committed yet: the next commit adds them
        self._texts_buffer_bytes = 0
        self._texts_uncounted: set[str] = set()  # buffered texts no buffered sample refers to yet
        self._text_sizes: dict[str, int] = {}  # text key -> the bytes of its fields: buffered texts, and recent ones
        self._ahead: set[str] = set()  # texts this writer committed that none of its committed samples refers to yet
        self._marked = False  # whether this writer set its `ahead_marker` (taken back at `finish` once none is ahead)
        self._settled = -1  # the generation this writer last found no unreferenced text at (`drop_unreferenced_texts`)
        self._closed = False
        # One writer per rank and cache: a second one would delete this one's files as leftovers; and no gc
        # meanwhile, which would take a shard renamed but not yet committed for a leftover.
        self._lock = CacheLock(self.root, f".lock-r{rank:05d}", f"rank {rank} of the cache")
        try:
            self._writers_lock = writers_lock(self.root)
        except BaseException:
            self._lock.release()
            raise
        try:
            if manifest is not None:
                self.manifest = manifest
                replay(self.root, self.manifest)
                self.manifest.check_compatible(fingerprint, schema, self.root, text_schema or self.manifest.text_schema)
            elif exists(self.root):
                self.manifest = load(self.root)
                self.manifest.check_compatible(fingerprint, schema, self.root, text_schema or self.manifest.text_schema)
            else:
                never, why = missing_manifest(self.root)
                if not never:  # starting afresh would delete committed shards as leftovers
                    raise FileNotFoundError(why)
                if TEXT_KEYS in schema and text_schema is None:
                    raise ValueError(f"the schema has {TEXT_KEYS!r}: a cache that stores each text once starts with its "
                                     f"text_schema (the fields of a text row)")
                self.manifest = Manifest(fingerprint, schema, text_schema=text_schema)
            # a damaged sample index is named now, never copied into the next snapshot (read from the file, once per process)
            self.manifest.shards.check_sample_index()
            if self.manifest.texts is not None:
                self.manifest.texts.check_sample_index()
            # what is listed: the manifest's keys (searched in place, `ShardTable.find_key`) and the keys buffered here
            self._listed: set[str] = set()  # keys buffered, not committed yet
            self._texts: set[str] = set()  # text keys buffered or in a commit being made
            # `has_text` is asked from another thread than the one writing: the manifest's tables change under this lock
            self._lookups = threading.RLock()
            # a marker an earlier writer of this rank left (killed with texts ahead of their samples) stays for the scan
            self._inherited = bool(self.manifest.extra.get(ahead_marker(rank)))
            remove_leftovers(self.root, self.rank, self.manifest.next_seq)
        except BaseException:
            self.close()
            raise

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def text_schema(self) -> Schema | None:
        """The fields of a text row when the cache stores each text once; None when texts are stored with each sample."""
        return self.manifest.text_schema

    def listed(self, key: str) -> bool:
        """Whether `key` is in the cache or this writer's buffers (as far as this writer has caught up with others)."""
        if key in self._listed:
            return True
        with self._lookups:
            return self.manifest.shards.find_key(key) is not None

    def has_text(self, key: str) -> bool:
        """Whether the text of text key `key` is in the cache or this writer's buffer: samples may refer to it without
        writing it again (as far as this writer has caught up with others)."""
        if key in self._texts:
            return True
        with self._lookups:
            return self.manifest.texts is not None and self.manifest.texts.find_key(key) is not None

    def has_texts(self, keys: list[str]) -> np.ndarray:
        """`has_text` of each key, looked up in bulk: (n,) bool."""
        out = np.fromiter((k in self._texts for k in keys), dtype=bool, count=len(keys))
        asked = [k for k, buffered in zip(keys, out) if not buffered]
        if asked and self.manifest.texts is not None:
            with self._lookups:
                out[~out] = self.manifest.texts.has_keys(asked)
        return out

    def write_text(self, caption: str, fields: Mapping[str, torch.Tensor], context: bytes = b"") -> str:
        """Store one caption's text fields once; samples refer to it by the returned text key (`shards.texts.text_key`).
        A text already stored is not stored again. It is committed with the next commit (at the latest with the
        samples that refer to it; its bytes count towards the shard of the first sample buffered that refers to it),
        or alone once the buffered texts pass `max_buffer_bytes`.

        Raises:
            ValueError: the cache stores texts with each sample, or the fields do not fit the text schema.

        `context`: what else the text depends on, part of its key (`shards.texts.text_key`).
        """
        if self.text_schema is None:
            raise ValueError(f"the cache at {self.root} stores texts with each sample; write_text needs a cache started "
                             f"with a text_schema")
        key = text_key(caption, context)
        if self.has_text(key):
            return key
        known = self.manifest.shapes.get(TEXT_BUCKET, {})
        shapes, checked = check_sample(f"text {caption[:60]!r}", TEXT_BUCKET, fields, self.text_schema, known, self.check_finite)
        self.manifest.shapes.setdefault(TEXT_BUCKET, shapes)
        self._texts.add(key)
        self._texts_buffer.append((key, checked, caption, 0))
        self._texts_uncounted.add(key)
        size = self._text_sizes[key] = sum(t.numel() * t.element_size() for t in checked.values())
        self._texts_buffer_bytes += size
        if self._texts_buffer_bytes > self.max_buffer_bytes or len(self._texts_buffer) >= self.max_shard_samples:
            self.commit()  # texts alone (memory is bounded): the samples referring to them come with later commits
        return key

    def write(self, key: str, bucket: Bucket | tuple[int, int], sample: Mapping[str, torch.Tensor], *,
              source: str = "", stamp: int = 0, dataset: str = "", resolution: int = 0) -> None:
        """Add one sample; it becomes durable when its shard is committed.

        Args:
            key: the sample's unique key (ASCII, e.g. a content hash).
            bucket: the sample's bucket `(height, width)`.
            sample: one tensor per schema field, in the field's dtype. Fixed fields have the same shape for
                every sample of a bucket; ragged ones `(L, *trailing)`.
            source: where the sample came from (a path, a tar key), recorded in the sample index.
            stamp: a 63-bit digest of the input's state when it was read (size, mtime), so a later run can
                tell an unchanged input without reading it; 0 when unknown.
            dataset: the named dataset the sample belongs to (a `[[source]]` of stage one's dataset file);
                shards hold samples of one dataset, so training can weigh datasets from the shard table.
            resolution: for a cache of several resolutions, the one whose bucket table the sample was cached at
                (0: the cache's base resolution); shards hold samples of one resolution.

        Raises:
            ValueError: the key is already in the cache, or the sample does not fit the schema or holds
                NaN/Inf; nothing is written.
        """
        if self._closed:
            raise RuntimeError("write() after finish()")
        bucket = Bucket(*bucket)
        if not key or not key.isascii():
            raise ValueError(f"sample key {key!r} must be a non-empty ASCII string")
        if self.listed(key):
            raise ValueError(f"sample {key} is already in the cache at {self.root}; a key is written once")
        check_stamp(key, stamp)
        known = self.manifest.shapes.get(bucket, {})
        shapes, fields = check_sample(key, bucket, sample, self.schema, known, self.check_finite)
        if self.text_schema is not None:
            missing = [k for k in keys_of(fields[TEXT_KEYS]) if not self.has_text(k)]
            if missing:
                raise ValueError(f"sample {key} refers to text {missing[0]}, which is neither in the cache nor written "
                                 f"(write_text) by this writer")
        self.manifest.shapes.setdefault(bucket, shapes)
        self._listed.add(key)
        slot = (bucket, str(dataset), int(resolution))
        self._buffers.setdefault(slot, []).append((key, fields, source, int(stamp)))
        size = sum(t.numel() * t.element_size() for t in fields.values())
        if self.text_schema is not None:  # the buffered texts it is the first to refer to count towards its shard
            fresh = {k for k in keys_of(fields[TEXT_KEYS]) if k in self._texts_uncounted}
            size += sum(self._text_sizes[k] for k in fresh)
            self._texts_uncounted -= fresh
        self._buffer_bytes[slot] = self._buffer_bytes.get(slot, 0) + size
        if self._buffer_bytes[slot] >= self.max_shard_bytes or len(self._buffers[slot]) >= self.max_shard_samples:
            self._flush_slot(slot)
        elif sum(self._buffer_bytes.values()) > self.max_buffer_bytes:
            self._flush_slot(max(self._buffer_bytes, key=self._buffer_bytes.get))

    def flush(self, bucket: Bucket | None = None) -> None:
        """Publish and commit the buffered samples of one bucket (or of all) now."""
        wanted = Bucket(*bucket) if bucket is not None else None
        for slot in [s for s in self._buffers if wanted is None or s[0] == wanted]:
            self._flush_slot(slot)

    def _flush_slot(self, slot: tuple[Bucket, str, int]) -> None:
        bucket, dataset, resolution = slot
        items = self._buffers.pop(slot, [])
        self._buffer_bytes.pop(slot, None)
        if items:
            entry = self._write_shard(bucket, items, dataset, resolution)
            self.commit(add=[entry.to_json()], shapes={bucket.name: self.manifest.shapes[bucket]})

    def _write_shard(self, bucket: Bucket, items: list[Item], dataset: str = "", resolution: int = 0,
                     texts: bool = False) -> ShardEntry:
        """Write one shard file (a text shard with `texts`) durably under a fresh name; it is part of the cache once
        committed."""
        schema, folder = (self.text_schema, TEXT_DIR) if texts else (self.schema, bucket.name)
        data, field_bytes = encode_shard(bucket, items, schema, self.manifest.shapes[bucket], self.manifest.fingerprint_sha256,
                                         self.rank, TEXTS_KIND if texts else None)
        sequence = f"r{self.rank:05d}/{folder}"
        seq = self.manifest.next_seq.get(sequence, 0)
        self.manifest.next_seq[sequence] = seq + 1
        path = write_shard_file(self.root, bucket, self.rank, seq, data, folder)  # streamed from the samples' tensors
        entry = ShardEntry(path.relative_to(self.root).as_posix(), bucket, len(items), len(data), data.sha256,
                           field_bytes, keys=[k for k, *_ in items], sources=[s for _, _, s, _ in items], stamps=[t for *_, t in items],
                           dataset=dataset, resolution=resolution)
        if self.text_schema is not None and not texts:  # what its samples refer to, for removals and `inspect`
            refs = [k for _, fields, _, _ in items for k in keys_of(fields[TEXT_KEYS])]
            entry.texts, entry.text_refs = sorted(set(refs)), len(refs)
            entry.text_ref_bytes = self._text_bytes(refs)
        return entry

    def _text_bytes(self, keys: list[str]) -> int:
        """The bytes of the fields of the texts `keys` (each as often as listed): of texts met lately, known; of others,
        read from their text shards (each opened once)."""
        sizes, table = self._text_sizes, self.manifest.texts
        by_shard: dict[int, list[tuple[str, int]]] = {}
        for key in dict.fromkeys(k for k in keys if k not in sizes):
            found = table.find_key(key)
            if found is None:
                raise ValueError(f"text {key} is neither in the cache at {self.root} nor written by this writer")
            by_shard.setdefault(found[0], []).append((key, found[1]))
        for j, wanted in by_shard.items():
            reader = ShardReader(self.root / table.entry_at_row(j).path, TEXTS_KIND)
            for key, row in wanted:
                sizes[key] = sum(t.numel() * t.element_size() for t in reader.fields(row).values())
        return sum(sizes[k] for k in keys)

    def _flush_texts(self) -> dict | None:
        """Write the buffered texts as one text shard: its entry for the next commit's `add_texts`, or None."""
        if not self._texts_buffer:
            return None
        entry = self._write_shard(TEXT_BUCKET, self._texts_buffer, texts=True)
        self._texts_buffer, self._texts_buffer_bytes = [], 0
        self._texts_uncounted.clear()
        return entry.to_json()

    def commit(self, **actions) -> int:
        """Append one commit of `actions` (add, remove, replace, restamp, rename_dataset, shapes), with the files and run
        records set since the last commit; returns its generation.

        Generation numbers are claimed with create-if-absent: when another writer took the number, this one
        reads that commit and tries the next. Each attempt first applies what other writers committed and
        checks the actions still apply (nothing they remove or replace was removed meanwhile), so the log
        never holds a commit that cannot be replayed.

        Raises:
            CacheBusy: another writer removed what this commit changes; nothing was committed.
        """
        actions = {k: v for k, v in actions.items() if v}
        flushed = []
        if (texts := self._flush_texts()) is not None:  # in the commit of the samples that may refer to them
            actions["add_texts"] = [*actions.get("add_texts", []), texts]
            actions["shapes"] = {**actions.get("shapes", {}), TEXT_BUCKET.name: self.manifest.shapes[TEXT_BUCKET]}
            flushed = texts["keys"]
        ahead, marker = self._still_ahead(flushed, actions), ahead_marker(self.rank)
        for name in ("files", "extra"):
            if self._pending.get(name):
                actions[name] = {**self._pending[name], **actions.get(name, {})}
        while True:
            self._catch_up()
            if why := self.manifest.conflict(actions):
                raise CacheBusy(f"another writer changed the cache at {self.root} meanwhile ({why}); nothing was "
                                f"committed: retry")
            generation = self.manifest.generation + 1
            commit = {"generation": generation, "rank": self.rank, **actions}
            if ahead and not self.manifest.extra.get(marker):  # in the commit of those texts: a kill after it leaves
                commit["extra"] = {**commit.get("extra", {}), marker: True}  # the mark (set again if a scan took it)
            if generation == 0:
                commit["init"] = {"fingerprint": self.manifest.fingerprint, "fingerprint_sha256": self.manifest.fingerprint_sha256,
                                  "fields": schema_to_json(self.schema)}
            if generation == 0 and self.text_schema is not None:
                commit["init"]["texts"] = {"fields": schema_to_json(self.text_schema)}
            if self.manifest.version != BASE_VERSION:
                commit["format_version"] = self.manifest.version
            if write_commit(self.root, commit, self.rank):
                break
        self._pending.clear()
        self._ahead, self._marked = ahead, self._marked or marker in commit.get("extra", {})
        with self._lookups:
            self.manifest.apply(commit)
            self._forget_committed(commit)
        if generation == 0:
            write_pointer(self.root, self.manifest)
        elif compaction_due(self.root, generation):
            compact(self.root, self.manifest, self.rank)
        return generation

    def _catch_up(self) -> None:
        """Apply the commits other writers made since this one last looked (the first one checks that they
        started the same cache). Their keys and texts are then the manifest's (texts another writer dropped are
        written again when referred to)."""
        with self._lookups:
            replay(self.root, self.manifest, check_end=False)  # the log was checked whole at the start

    def _forget_committed(self, commit: dict) -> None:
        """Keys of a commit this writer made are the manifest's now: only those still buffered stay in its sets."""
        for obj in commit.get("add", []) + [new for _, new in commit.get("replace", [])]:
            self._listed.difference_update(obj.get("keys") or [])
        for obj in commit.get("add_texts", []):
            self._texts.difference_update(obj.get("keys") or [])
        if len(self._text_sizes) > TEXT_SIZES_KEPT:  # bounded: the buffered texts' and no more
            self._text_sizes = {k: v for k, v in self._text_sizes.items() if k in self._texts}

    def _still_ahead(self, flushed: list[str], actions: dict) -> set[str]:
        """The texts this writer committed that none of its samples refers to, once `actions` (with the text keys
        `flushed` from its buffer) are committed."""
        if not flushed and not self._ahead:
            return self._ahead
        ahead = self._ahead | set(flushed)
        for obj in actions.get("add", []) + [new for _, new in actions.get("replace", [])]:
            ahead.difference_update(obj.get("texts") or [])
        return ahead

    def add_prompts(self, prompts: dict[str, Prompt], schema: Schema) -> None:
        """Store prompt embeddings (the empty caption, validation prompts) beside the shards.

        Prompts already stored are kept; the file is rewritten atomically under a new name (a reader of an
        earlier generation keeps its own) and listed at the next commit (at the latest `finish`).

        Args:
            prompts: by key (`shards.prompts.prompt_key(text)`).
            schema: the fields of a prompt (the text fields of the samples).
        """
        entry = self._pending.get("files", {}).get("prompts") or self.manifest.files.get("prompts")
        merged, problem = stored_prompts(self.root, entry)
        if problem:  # rewritten from what is given: the damaged file's embeddings are not carried over
            warnings.warn(f"the stored prompts are not kept: {problem}", stacklevel=2)
        merged.update(prompts)
        data = encode_prompts(merged, schema, self.manifest.fingerprint_sha256)
        digest = hashlib.sha256(data).hexdigest()
        if entry and entry["sha256"] == digest:
            return
        stem, suffix = PROMPTS_FILE.rsplit(".", 1)
        self.add_file("prompts", f"{stem}-{digest[:16]}.{suffix}", data, count=len(merged))

    def add_file(self, role: str, path: str, data: bytes, **info) -> None:
        """Store an auxiliary file (prompt embeddings, the decoder of a VAE that exists nowhere else).

        Written atomically now; listed in the manifest under `role`, with its size and sha256, at the next
        commit, so `verify` checks it like a shard.
        """
        target = self.root / confined(path, "add_file")
        if not target.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"auxiliary file {path!r} must lie inside the cache {self.root}")
        if not target.parent.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(target.parent.parent)
        atomic_write_bytes(target, data)
        self._pending.setdefault("files", {})[role] = {
            "path": target.relative_to(self.root).as_posix(), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **info,
        }

    def set_extra(self, name: str, value) -> None:
        """Record free-form JSON under `extra[name]` at the next commit."""
        self._pending.setdefault("extra", {})[name] = json.loads(json.dumps(value))

    def remove(self, keys: set[str]) -> int:
        """Drop samples from the cache (e.g. their source images were removed or changed).

        Each shard holding any of them is retired and its other samples are copied into a new shard (not
        re-encoded); the retirements and the new shards are one commit. The retired files stay on disk for
        readers of earlier generations until `python -m shards gc`.

        Returns:
            The number of samples removed.
        """
        self.flush()
        self._catch_up()  # shards other writers committed hold keys too
        keys = set(keys)
        table = self.manifest.shards
        # the shards holding them, found by key (a cache holds a key once), in table order
        rows = sorted({found[0] for found in map(table.find_key, keys) if found is not None})
        retired, added, removed = [], [], 0
        for j, entry in ((j, table.entry_at_row(j)) for j in rows):
            shard_keys, sources, stamps = table.samples_of(j)
            drop = {i for i, k in enumerate(shard_keys) if k in keys}
            if not drop:
                continue
            removed += len(drop)
            retired.append(entry.path)
            items = [(shard_keys[i], fields, sources[i], stamps[i])
                     for i, fields in intact_rows(self.root, entry.path, [i for i in range(len(shard_keys)) if i not in drop])]
            if items:
                added.append(self._write_shard(entry.bucket, items, entry.dataset, entry.resolution).to_json())
        if retired:
            self.commit(remove=retired, add=added, **self._drop_texts(retired, added))
        return removed

    def drop_unreferenced_texts(self) -> int:
        """Drop the text rows no sample refers to (left by a writer killed between committing texts and the samples
        referring to them, or stored for samples that were then refused), in one commit; returns how many. The scan
        (over the hashes of every text key and reference, O(texts)) runs only when some may be: a writer marks texts it
        commits ahead of its samples (`shards.texts.ahead_marker`) and takes the mark back when all are referred to, so
        a run whose writers all finished with their texts referred to (and no marker left by a killed one) skips it.
        A removal drops the texts it leaves unreferenced itself."""
        if self.text_schema is None:
            return 0
        self.flush()
        self._catch_up()
        checked, marks = unsettled(self.manifest.extra)
        if checked and not marks and not self._ahead or self._settled == self.manifest.generation:
            return 0  # every text committed since the last scan was committed with (or before) a sample referring to it
        actions = self._drop_texts([], [])
        dropped = sum(len(self.manifest.texts.samples_of(self.manifest.texts.row_of(p))[0]) for p in actions["remove_texts"])
        kept = sum(len(obj["keys"]) for obj in actions["add_texts"])
        settled = {k: None for k in marks} | ({} if checked else {TEXTS_CHECKED: True})
        self._ahead, self._marked, self._inherited = set(), False, False
        if actions["remove_texts"]:
            self.commit(**actions, extra=settled)
        else:  # recorded with the next commit (at the latest `finish`)
            for name, value in settled.items():
                self.set_extra(name, value)
        self._settled = self.manifest.generation
        return dropped - kept

    def _drop_texts(self, retired: list[str], added: list[dict]) -> dict:
        """The text rows no sample refers to once the shards `retired` leave and `added` join: the actions that drop
        them (`remove_texts`), copying the other rows of a text shard that keeps some into a new one (`add_texts`)."""
        if self.text_schema is None:
            return {}
        table, shards = self.manifest.texts, self.manifest.shards
        skip = {shards.row_of(p) for p in retired}
        added_keys = [k for obj in added for k in obj.get("texts") or []]
        # on hashes first: a text row whose key's hash no sample's reference has is unreferenced; the text shards holding
        # one are checked key by key against the references with those shards' hashes (decoded alone)
        referred_hashes = sorted_unique(np.concatenate([shards.referenced_hashes(skip), shards.text_hashes(added_keys)]))
        index = table.index()
        hashes = index.hashes("keys")
        unreferenced = ~members(hashes, referred_hashes)
        counts = table.column("samples")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        touched = np.zeros(len(counts), dtype=bool)
        if len(hashes):
            touched[counts > 0] = np.logical_or.reduceat(unreferenced, starts[counts > 0])
        affected = [int(table.rows[i]) for i in np.flatnonzero(touched)]
        spans = [hashes[starts[i] : starts[i] + counts[i]] for i in np.flatnonzero(touched)]
        maybe = sorted_unique(np.concatenate(spans)) if spans else np.zeros(0, np.uint64)
        referred = shards.referenced_texts(skip, maybe) | set(added_keys) if affected else set()
        dropped, kept = [], []
        for j in affected:
            keys = table.samples_of(int(j))[0]
            keep = [i for i, k in enumerate(keys) if k in referred]
            if len(keep) == len(keys):
                continue
            entry = table.entry_at_row(int(j))
            dropped.append(entry.path)
            captions = table.samples_of(int(j))[1]
            items = [(keys[i], fields, captions[i], 0) for i, fields in intact_rows(self.root, entry.path, keep, TEXTS_KIND)]
            if items:
                kept.append(self._write_shard(TEXT_BUCKET, items, texts=True).to_json())
        return {"remove_texts": dropped, "add_texts": kept}

    def remove_dataset(self, name: str) -> int:
        """Drop every sample of dataset `name`: its shards are retired whole (nothing is copied) in one commit.
        Returns the number of samples removed."""
        self.flush()
        self._catch_up()
        table = self.manifest.shards
        rows = [int(j) for j, dataset in zip(table.rows, table.datasets()) if dataset == name]
        if not rows:
            return 0
        keys = {k for j in rows for k in table.samples_of(j)[0]}
        retired = [table.entry_at_row(j).path for j in rows]
        self.commit(remove=retired, **self._drop_texts(retired, []))
        return len(keys)

    def rename_dataset(self, old: str, new: str) -> int:
        """Every shard of dataset `old` now belongs to `new` (one commit, no file touched); returns their samples."""
        self.flush()
        self._catch_up()
        samples = self.manifest.datasets().get(old, {}).get("samples", 0)
        if samples and old != new:
            self.commit(rename_dataset=[[old, new]])
        return samples

    def replace(self, path: str, samples: list[tuple[str, dict[str, torch.Tensor]]]) -> str:
        """Commit a repaired copy of shard (or text shard) `path`: the same keys in the same order, freshly encoded.
        Readers of any generation are redirected to the copy; returns its path."""
        self._catch_up()
        texts = self.manifest.texts is not None and path in self.manifest.texts
        table = self.manifest.texts if texts else self.manifest.shards
        j = table.row_of(path)
        keys, sources, stamps = table.samples_of(j)
        if [k for k, _ in samples] != list(keys):
            raise ValueError(f"a repair of {path} must hold its keys in order ({len(keys)} samples)")
        entry = table.entry_at_row(j)
        checked = []
        for key, fields in samples:  # a repaired text row is checked as a new one is
            shapes, fields = check_sample(key, entry.bucket, fields, self.text_schema if texts else self.schema,
                                          self.manifest.shapes.get(entry.bucket, {}), self.check_finite)
            self.manifest.shapes.setdefault(entry.bucket, shapes)
            checked.append(fields)
        new = self._write_shard(entry.bucket, [(k, f, s, t) for (k, _), f, s, t in zip(samples, checked, sources, stamps)], entry.dataset,
                                entry.resolution, texts)
        self.commit(replace=[[path, new.to_json()]])
        return new.path

    def restamp(self, stamps: dict[str, int]) -> None:
        """Record new input stamps of unchanged samples (their file was touched, its content is the same)."""
        for key, stamp in stamps.items():
            check_stamp(key, stamp)
        if stamps:
            self.commit(restamp=sorted(stamps.items()))

    def finish(self) -> Manifest:
        """Commit every buffered sample and pending record (an empty cache gets its first commit) and release."""
        if not self._closed:
            self.flush()
            marked = self._marked and self.manifest.extra.get(ahead_marker(self.rank))
            if marked and not self._ahead and not self._texts_buffer and not self._inherited:
                self.set_extra(ahead_marker(self.rank), None)  # every text it committed is referred to: the mark goes
            if self._pending or self._texts_buffer or self.manifest.generation < 0:
                self.commit()
            self.close()
        return self.manifest

    def close(self) -> None:
        """Release the cache without publishing buffered samples."""
        if not self._closed:
            self._closed = True
            self._buffers.clear()
            self._texts_buffer.clear()
            self._writers_lock.release()
            self._lock.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Publish only on success: an exception in flight means the caller's state is suspect,
        # and everything already committed stays listed and valid.
        if exc_type is None:
            self.finish()
        else:
            self.close()

