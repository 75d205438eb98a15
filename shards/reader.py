"""Readers: `ShardReader` for one memory-mapped shard, `Cache` for a whole cache directory."""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shards.buckets import Bucket
from shards.contract import CacheSpec
from shards.generations import load, newest_copy, replacements
from shards.prompts import Prompt, stored_prompts
from shards.schema import (
    DIGEST,
    KEY,
    OFFSETS_SUFFIX,
    CorruptSample,
    DamagedCache,
    FormatError,
    Schema,
    open_file,
    sample_digest,
    schema_from_json,
)
from shards.texts import TEXT_KEYS, TEXTS_KIND, TextIndex, keys_of, resolved_schema, table_prefixes
from shards.texts import resolve as resolve_texts


@dataclass
class Sample:
    """One cached sample: its key, bucket and one tensor per field."""

    key: str
    bucket: Bucket
    fields: dict[str, torch.Tensor]
    texts: list[dict[str, torch.Tensor]] | None = None  # `Cache.read(i, resolve=False)`: each caption's text row

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]


_sound_prompts: dict[tuple[str, str], dict[str, Prompt]] = {}  # (path, sha256) of prompts files found sound: hashed once


class ShardReader:
    """One shard, memory-mapped.

    Opening reads only the header. Each tensor is a copy-on-write private mapping of the file
    (safetensors' `safe_open`), so reading sample `i` touches only that sample's pages, and the
    returned tensors are zero-copy views that callers may even write to without changing the file.

    Args:
        path: the shard file.
        kind: `"texts"` for a text shard (`shards.texts`), whose rows are texts keyed by their text key.

    Raises:
        FormatError: not a shard of this format and kind, an unknown format version, or a damaged header.
    """

    def __init__(self, path: str | os.PathLike, kind: str = "shard"):
        self.path = Path(path)
        metadata, tensors = open_file(self.path, kind)
        try:
            self.bucket = Bucket.parse(metadata["bucket"])
            self.num_samples = int(metadata["samples"])
            self.schema: Schema = schema_from_json(json.loads(metadata["fields"]))
            self.shapes: dict[str, list] = json.loads(metadata["shapes"])
            self.fingerprint_sha256 = metadata["fingerprint_sha256"]
        except (KeyError, ValueError) as e:
            raise FormatError(f"{self.path}: shard metadata is incomplete ({e})") from e
        self.metadata = metadata
        self._tensors = tensors
        self._check_tensors()
        self._offsets = {name: tensors[name + OFFSETS_SUFFIX].tolist() for name in [*self.ragged_fields, KEY]}
        key_bytes = tensors[KEY].numpy().tobytes()
        offs = self._offsets[KEY]
        try:
            self.keys = [key_bytes[offs[i] : offs[i + 1]].decode("ascii") for i in range(self.num_samples)]
        except UnicodeDecodeError as e:
            raise FormatError(f"{self.path}: a sample key is not ASCII ({e}); the file was damaged after it was written") from None

    def _check_tensors(self) -> None:
        """Every tensor the header promises is there, with one row per sample (offsets: one more, rising from 0 to
        at most the rows they index), so a damaged header fails here naming the file, not later as a KeyError."""
        n = self.num_samples
        rows = {KEY: None, KEY + OFFSETS_SUFFIX: n + 1, DIGEST: n}
        for name, spec in self.schema.items():
            rows |= {name: None, name + OFFSETS_SUFFIX: n + 1} if spec.ragged else {name: n}
        for name, want in rows.items():
            t = self._tensors.get(name)
            if t is None or t.dim() == 0 or (want is not None and len(t) != want):
                found = "missing" if t is None else f"of shape {tuple(t.shape)}"
                raise FormatError(f"{self.path}: tensor {name!r} is {found}, not one row per sample of its {n}; the "
                                  f"shard's header was damaged after it was written")
            if name.endswith(OFFSETS_SUFFIX):
                rows_indexed = len(self._tensors[name[: -len(OFFSETS_SUFFIX)]])
                if t[0] != 0 or t[-1] > rows_indexed or bool((t[1:] < t[:-1]).any()):
                    raise FormatError(f"{self.path}: the offsets of tensor {name[: -len(OFFSETS_SUFFIX)]!r} do not fit "
                                      f"its {rows_indexed} rows; the file was damaged after it was written")

    @property
    def ragged_fields(self) -> list[str]:
        return [name for name, spec in self.schema.items() if spec.ragged]

    def __len__(self) -> int:
        return self.num_samples

    def tensor(self, name: str) -> torch.Tensor:
        """A stored tensor by its name in the file, e.g. a field's packed rows."""
        return self._tensors[name]

    def fields(self, i: int) -> dict[str, torch.Tensor]:
        """Sample `i`'s fields as zero-copy views: fixed `(*shape)`, ragged `(L_i, *trailing)`."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.path} ({self.num_samples} samples)")
        out = {}
        for name, spec in self.schema.items():
            t = self._tensors[name]
            if spec.ragged:
                offs = self._offsets[name]
                out[name] = t[offs[i] : offs[i + 1]]
            else:
                out[name] = t[i]
        return out

    def __getitem__(self, i: int) -> Sample:
        return Sample(self.keys[i], self.bucket, self.fields(i))

    def digest(self, i: int) -> bytes:
        """The per-sample content digest stored at write time."""
        return self._tensors[DIGEST][i].numpy().tobytes()

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(self.num_samples))


class Cache:
    """A cache directory at one generation: its manifest plus shards opened on demand, indexed globally.

    Global sample index `i` runs over the generation's shards in commit order; every shard holds one
    bucket, so a bucket's samples are a union of contiguous ranges (see `ranges_by_bucket`). At most
    `max_open` shards are open (memory-mapped) at once, least recently used closed first, whatever the
    cache's size. A shard that was repaired since the generation was written is read from its repaired copy.

    In a cache that stores each text once (`shards.texts`), a sample read resolves its `text_keys` into the text
    fields and `text_lengths` the per-sample layout stores (`shards.texts.resolve`), from text shards opened like
    shards; the first read builds the index of the text rows (`TextIndex`, 16 bytes per text).

    Args:
        root: the cache directory.
        generation: the generation to read (default: the newest); a training run keeps reading the one its
            epoch started with while new ones are committed.
        check_digests: compare every sample read with the digest stored beside it; a mismatch raises
            `CorruptSample` naming the shard.
        max_open: shards kept open at once.

    Raises:
        FileNotFoundError: nothing was committed here; the message says how to build the cache.
        FormatError: another format version, or a damaged log.
    """

    def __init__(self, root: str | os.PathLike, generation: int | None = None, *, check_digests: bool = False,
                 max_open: int = 128):
        self.root = Path(root)
        self.location = str(self.root)  # what messages name: the directory, or a remote cache's URL
        self.manifest = load(self.root, generation)
        self.generation = self.manifest.generation
        self.check_digests = check_digests
        self.max_open = max_open
        self.shards = self.manifest.shards
        self._paths = self.shards.paths()
        self._starts = np.zeros(len(self._paths) + 1, dtype=np.int64)
        np.cumsum(self.shards.column("samples"), out=self._starts[1:])
        # repairs committed after an older generation apply to its readers too
        self._replaced = self.manifest.replaced if generation is None else replacements(self.root, self.manifest)
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._lock = threading.Lock()  # background readers share the open shards
        self._spec: CacheSpec | None = None
        self.texts = self.manifest.texts  # the text shards (a cache that stores texts once), else None
        self._text_paths = self.texts.paths() if self.texts is not None else []
        self._text_readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._text_index: TextIndex | None = None
        self._text_shards_of: OrderedDict[int, list[int]] = OrderedDict()  # shard -> the text shards its samples need

    @property
    def schema(self) -> Schema:
        """The fields of a sample as a read returns them: in a cache that stores each text once, the per-sample
        layout's (the text fields and `text_lengths` in place of `text_keys`; `Manifest.schema` is what is stored)."""
        m = self.manifest
        if m.text_schema is None:
            return m.schema
        return resolved_schema(m.schema, m.text_schema)

    @property
    def fingerprint(self) -> dict:
        return self.manifest.fingerprint

    @property
    def spec(self) -> CacheSpec:
        """What the cached values are (latents, text, decoder): the typed view of the fingerprint.

        Raises:
            FormatError: the cache was not written by this product's stage one.
        """
        if self._spec is None:
            self._spec = CacheSpec.of(self.manifest, self.root)
        return self._spec

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shard_starts(self) -> np.ndarray:
        """Global index of each shard's first sample, and the total: shard j holds [starts[j], starts[j + 1])."""
        return self._starts

    def path(self, j: int) -> Path:
        """The file of shard `j` (its repaired copy, if any)."""
        return self.root / newest_copy(self._paths[j], self._replaced)[-1]

    def fetch(self, j: int) -> Path:
        """The local file of shard `j`, ready to read. A directory's files are local already; a cache in object
        storage (`shards.remote`) downloads the shard here."""
        return self.path(j)

    def shard(self, j: int) -> ShardReader:
        """The reader of shard `j`, opened on first use and kept among the `max_open` most recent."""
        with self._lock:
            reader = self._readers.get(j)
            if reader is not None:
                self._readers.move_to_end(j)
                return reader
        entry = self.shards[j]
        try:
            reader = ShardReader(self.fetch(j))
        except FileNotFoundError:
            raise CorruptSample(f"{self.path(j)} is listed in generation {self.generation} of {self.root} but missing: "
                                f"{REPAIR.format(root=self.root)}") from None
        except FormatError as e:  # a damaged header or key, listed by this generation
            raise CorruptSample(f"{self.path(j)} cannot be read ({e}): {REPAIR.format(root=self.root)}") from None
        if reader.num_samples != entry.samples or reader.bucket != entry.bucket:
            raise CorruptSample(f"{reader.path} holds {reader.num_samples} samples of {reader.bucket}, the manifest says "
                              f"{entry.samples} of {entry.bucket}: {REPAIR.format(root=self.root)}")
        with self._lock:
            self._readers[j] = reader
            if len(self._readers) > self.max_open:
                self._readers.popitem(last=False)
        return reader

    def locate(self, i: int) -> tuple[int, int]:
        """(shard index, row in shard) of global sample `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        j = int(np.searchsorted(self._starts, i, side="right")) - 1
        return j, i - int(self._starts[j])

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def read(self, i: int, resolve: bool = True) -> Sample:
        """Sample `i`. In a cache that stores each text once its texts are resolved into the per-sample layout
        (`shards.texts.resolve`, the captions' rows concatenated); with `resolve=False` they are left as the text rows
        themselves, zero-copy views, one per caption in `Sample.texts` (each laid out as a cached prompt's fields), the
        sample's own fields as stored."""
        j, row = self.locate(i)
        reader = self.shard(j)
        sample = reader[row]
        if self.check_digests and sample_digest(sample.key, sample.fields) != reader.digest(row):
            raise CorruptSample(f"sample {sample.key} (row {row} of {reader.path}) does not match its stored digest: the file "
                                f"was damaged after it was written. {REPAIR.format(root=self.root)}")
        if self.texts is not None:
            texts = [self.text(key, f"sample {sample.key} of {reader.path}") for key in keys_of(sample.fields[TEXT_KEYS])]
            if not resolve:
                sample.texts = texts
                return sample
            sample.fields = resolve_texts(sample.fields, texts, self.manifest.text_schema)
        return sample

    # -- texts stored once ---------------------------------------------------------------------------

    def text_path(self, t: int) -> Path:
        """The file of text shard `t` (its repaired copy, if any)."""
        return self.root / newest_copy(self._text_paths[t], self._replaced)[-1]

    def fetch_text(self, t: int) -> Path:
        """The local file of text shard `t`, ready to read (`fetch` for text shards)."""
        return self.text_path(t)

    def text_shard(self, t: int) -> ShardReader:
        """The reader of text shard `t`, opened on first use and kept among the `max_open` most recent."""
        with self._lock:
            reader = self._text_readers.get(t)
            if reader is not None:
                self._text_readers.move_to_end(t)
                return reader
        entry = self.texts[t]
        try:
            reader = ShardReader(self.fetch_text(t), TEXTS_KIND)
        except FileNotFoundError:
            raise CorruptSample(f"{self.text_path(t)} is listed in generation {self.generation} of {self.root} but missing: "
                                f"{REPAIR.format(root=self.root)}") from None
        except FormatError as e:
            raise CorruptSample(f"{self.text_path(t)} cannot be read ({e}): {REPAIR.format(root=self.root)}") from None
        if reader.num_samples != entry.samples:
            raise CorruptSample(f"{reader.path} holds {reader.num_samples} texts, the manifest says {entry.samples}: "
                                f"{REPAIR.format(root=self.root)}")
        with self._lock:
            self._text_readers[t] = reader
            if len(self._text_readers) > self.max_open:
                self._text_readers.popitem(last=False)
        return reader

    def text_index(self) -> TextIndex:
        """Where each text row is (built on first use from the manifest's text table, which is checked then)."""
        if self._text_index is None:
            index = TextIndex(*table_prefixes(self.texts))
            with self._lock:
                self._text_index = index
        return self._text_index

    def locate_text(self, key: str) -> tuple[int, int] | None:
        """(text shard, row) of text key `key` in this generation, None when it holds no such text."""
        for t, row in self.text_index().candidates(key):
            if self.text_shard(t).keys[row] == key:
                return t, row
        return None

    def text(self, key: str, referrer: str = "") -> dict[str, torch.Tensor]:
        """The text fields of text key `key` (zero-copy views), checked against its digest with `check_digests`.

        Raises:
            CorruptSample: the generation holds no such text (`referrer` names who refers to it), or its row fails
                its digest.
        """
        found = self.locate_text(key)
        if found is None:
            raise CorruptSample(f"{referrer or 'a sample'} refers to text {key}, which generation {self.generation} of "
                                f"{self.root} does not hold: the log was edited or damaged. `python -m shards verify "
                                f"{self.root}` lists what is wrong")
        t, row = found
        reader = self.text_shard(t)
        fields = reader.fields(row)
        if self.check_digests and sample_digest(key, fields) != reader.digest(row):
            raise CorruptSample(f"text {key} (row {row} of {reader.path}) does not match its stored digest: the file was "
                                f"damaged after it was written. {REPAIR.format(root=self.root)}")
        return fields

    def text_shards_of(self, j: int) -> list[int]:
        """The text shards the samples of shard `j` refer to (what a read-ahead fetches beside it); opens shard `j`."""
        if self.texts is None:
            return []
        with self._lock:
            if j in self._text_shards_of:
                return self._text_shards_of[j]
        keys = set(keys_of(self.shard(j).tensor(TEXT_KEYS)))
        found = {self.locate_text(k) for k in keys}
        needed = sorted({t for t, _ in found - {None}})
        with self._lock:
            self._text_shards_of[j] = needed
            if len(self._text_shards_of) > 4096:
                self._text_shards_of.popitem(last=False)
        return needed

    def bucket_of(self, i: int) -> Bucket:
        return self.shards[self.locate(i)[0]].bucket

    def ranges_by_bucket(self) -> dict[Bucket, list[range]]:
        """Global index ranges of each bucket's samples, without opening any shard."""
        out: dict[Bucket, list[range]] = {}
        heights, widths, frames = (self.shards.column(c) for c in ("height", "width", "frames"))
        for j in range(len(self._paths)):
            out.setdefault(Bucket(int(heights[j]), int(widths[j]), int(frames[j])), []).append(range(int(self._starts[j]), int(self._starts[j + 1])))
        return dict(sorted(out.items()))

    def prompts(self) -> dict[str, Prompt]:
        """The cached prompt embeddings (empty caption, validation prompts), by `prompt_key(text)`.

        Raises:
            DamagedCache: the prompts file is missing, or differs from the size and sha256 the manifest lists.
        """
        entry = self.manifest.files.get("prompts")
        if not entry:
            return {}
        checked = (str(self.root / entry["path"]), entry["sha256"])
        if checked not in _sound_prompts:
            prompts, problem = stored_prompts(self.root, entry)
            if problem:
                raise DamagedCache(f"{problem}. The prompt embeddings (the empty caption and the validation prompts) "
                                   f"are re-encoded by `python -m precompute prompts {self.location} --prompt TEXT ...` "
                                   f"(every validation prompt) or by re-running stage one on the cache with the DATA "
                                   f"and options that built it")
            # copies, not maps of the file: what was checked stays what is read, whatever happens to the file later
            _sound_prompts[checked] = {k: Prompt(p.text, {n: t.clone() for n, t in p.fields.items()}) for k, p in prompts.items()}
        return dict(_sound_prompts[checked])

    def keys(self) -> Iterator[tuple[str, int]]:
        """(key, global index) of every sample, from the manifest's sample index (no shard is opened)."""
        for i, (key, *_) in enumerate(self.manifest.samples()):
            yield key, i

    def check_files(self) -> list[tuple[str, str]]:
        """Every shard of this generation exists with the size the manifest lists: (path, problem) of those
        that do not. One `stat` per shard."""
        sizes = self.shards.column("bytes")
        paths = [self.path(j) for j in range(len(self._paths))]
        listed = list(self._paths)
        if self.texts is not None:  # the text shards too
            sizes = np.concatenate([sizes, self.texts.column("bytes")])
            paths += [self.text_path(t) for t in range(len(self._text_paths))]
            listed += self._text_paths
        return stat_problems((path, int(size) if path.relative_to(self.root).as_posix() == listed else None)  # a copy's size is its own
                             for path, listed, size in zip(paths, listed, sizes))


def stat_problems(files) -> list[tuple[str, str]]:
    """(path, problem) of the `(path, expected size or None)` pairs whose file is missing or of another size."""
    problems = []
    for path, expected in files:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append((str(path), "missing"))
            continue
        if expected is not None and size != expected:
            problems.append((str(path), f"{size} bytes, the manifest lists {expected} (truncated or replaced)"))
    return problems


REPAIR = ("Re-encode the damaged samples with `python -m precompute DATA --model MODEL --cache {root} --repair` (the same "
          "DATA and options that built it); `python -m shards verify {root}` lists every damaged file.")
