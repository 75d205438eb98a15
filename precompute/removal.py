"""What leaves the cache, and when: samples whose inputs are gone (on evidence only), damaged shards
re-encoded in place (`--repair`), and the directory of a new cache whose run was refused.

A sample leaves the cache only on evidence: its input was listed completely, without error, and is gone
(or changed, and its new content was encoded). Inputs that fail to read never remove anything.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from precompute.config import PrecomputeConfig
from precompute.encode import Encoders, check_text_encoder
from precompute.inputs import where
from precompute.sources import Source
from precompute.tars import tar_name
from shards import ShardWriter, verify
from shards.lock import WRITERS_LOCK
from shards.reader import stat_problems
from shards.schema import dtype_from_name
from shards.texts import text_key

LOCK_FILE = re.compile(rf"\.lock(-r\d{{5}})?|{re.escape(WRITERS_LOCK)}")  # the lock files of a run, its ranks and its writers


class RemovalRefused(ValueError):
    """A run would remove more of the cache than allowed; nothing was removed."""


def removals(previous: np.ndarray, seen: np.ndarray, source_of: Callable[[int], str] | None, failed_sources: set[str],
             complete: bool) -> tuple[np.ndarray, int]:
    """The cached samples to remove on evidence, and how many unseen ones are kept because their input failed to
    read (or the listing was incomplete). On arrays: nothing is made per sample but for the unseen ones of a source
    whose read failed.

    Args:
        previous: (N,) int64 global indices of the cached samples (of one source).
        seen: bool per global index: the sample's input was read in this run (encoded or unchanged).
        source_of: global index -> the input it was cached from.
        failed_sources: sources whose read failed; a damaged tar protects every sample it held.
        complete: whether the listing itself succeeded everywhere.

    Returns:
        The global indices to remove (int64, in index order) and how many unseen ones are kept.
    """
    unseen = previous[~seen[previous]] if len(previous) else previous
    if not complete:
        return unseen[:0], len(unseen)
    if not failed_sources or not len(unseen):
        return unseen, 0
    tars = tuple(tar_name(s) + "/" for s in failed_sources)
    kept = np.array([(s := source_of(int(g))) in failed_sources or bool(tars and s.startswith(tars)) for g in unseen.tolist()],
                    dtype=bool)
    return unseen[~kept], int(kept.sum())


def removal_refused(config: PrecomputeConfig, source: Source, examples: list[str], gone: int, cached: int) -> RemovalRefused | None:
    """The refusal to remove `gone` cached samples of `source` whose inputs are no longer listed (`examples`: the
    inputs of some of them) when they are more of its `cached` samples than `config.max_removal_fraction` without
    `config.allow_removal`; None when they may go."""
    if not gone or config.allow_removal or gone <= config.max_removal_fraction * cached:
        return None
    return RemovalRefused(
        f"{gone} of the {cached} cached samples of source {source.name!r} are no longer in "
        f"{where(source)}={source.path} (e.g. {', '.join(sorted(examples)[:3])}), over "
        f"--max-removal-fraction {config.max_removal_fraction:g}; nothing was removed and everything encoded is kept. "
        f"If they really are gone, re-run with --allow-removal (or drop the whole source with --remove-source "
        f"{source.name}).")


def warn_damaged(cache: Path, manifest) -> None:
    """One stat per shard: a plain re-run reports unchanged inputs without reading their samples, so it says
    when listed shards are missing or truncated (what --repair re-encodes)."""
    tables = [manifest.shards] + ([manifest.texts] if manifest.texts is not None else [])  # text shards too
    bad = stat_problems((cache / path, int(size)) for t in tables for path, size in zip(t.paths(), t.column("bytes")))
    if bad:
        print(f"warning: {len(bad)} shard(s) of {cache} are missing or truncated (e.g. {bad[0][0]}: {bad[0][1]}); their "
              f"samples count as unchanged here. Re-run with --repair to re-encode them.", file=sys.stderr)


def damaged_shards(cache: Path, manifest) -> dict[str, list[str]]:
    """Shards of the newest generation that are missing or fail `verify` (size, sha256, digests): path -> keys."""
    report = verify(cache)
    bad = {Path(p).resolve() for p in report.bad_files}
    return {entry.path: manifest.shards.samples_of(int(j))[0]
            for j, entry in zip(manifest.shards.rows, manifest.shards) if (cache / entry.path).resolve() in bad}


def damaged_texts(cache: Path, manifest) -> dict[str, tuple[list[str], list[str]]]:
    """Text shards (a cache that stores each text once) of the newest generation that are missing or fail `verify`:
    path -> (text keys, captions), from the manifest, which keeps every text's caption."""
    if manifest.texts is None:
        return {}
    bad = {Path(p).resolve() for p in verify(cache).bad_files}
    table = manifest.texts
    return {entry.path: table.samples_of(int(j))[:2] for j, entry in zip(table.rows, table) if (cache / entry.path).resolve() in bad}


def repair_texts(config: PrecomputeConfig, manifest, device) -> tuple[dict, dict[str, list[str]]]:
    """Re-encode every damaged text shard from the captions the manifest keeps (no input is read) and commit each
    copy in its place. The text encoder built must be the cache's (refused otherwise, naming the differing fields).

    A text that depends on its sample's reference images as well (an edit model whose text encoder sees them: its key
    is not its caption's alone, `shards.texts.text_key`) cannot be rebuilt from its caption: its text shard is left to
    the repair's pass, which reads the inputs of the samples referring to its texts (`text_referrers`) and encodes
    each text again with its sample's references (`replace_texts`).

    Returns:
        The summary's entries, and those text shards: path -> their text keys, in order.
    """
    damaged = damaged_texts(config.cache, manifest)
    seeing = {path: keys for path, (keys, captions) in damaged.items() if any(k != text_key(c) for k, c in zip(keys, captions))}
    for path in seeing:
        del damaged[path]
    if not damaged:
        return {"repaired_text_shards": 0}, seeing
    enc = Encoders(config.preset(), device, text_dtype=config.text_dtype, pretrained=config.pretrained, vae=False)
    check_text_encoder(manifest.fingerprint["text_encoder"], enc.text_fingerprint(), config.cache)
    storage = dtype_from_name(manifest.fingerprint["storage_dtype"])
    with ShardWriter(config.cache, manifest.fingerprint, manifest.schema) as writer:
        for path, (keys, captions) in damaged.items():
            rows = []
            for i in range(0, len(captions), config.text_batch_size):
                batch = enc.encode_text(list(captions[i : i + config.text_batch_size])).fields
                rows += [{name: t.to(storage) for name, t in fields.items()} for fields in batch]
            writer.replace(path, list(zip(keys, rows)))
    print(f"\n{config.cache}: repaired {len(damaged)} damaged text shard(s), "
          f"{sum(len(k) for k, _ in damaged.values())} texts re-encoded from their captions", file=sys.stderr)
    return {"repaired_text_shards": len(damaged)}, seeing


def text_referrers(manifest, texts: dict[str, list[str]]) -> set[str]:
    """The keys of the samples referring to any text of `texts` (text shard path -> text keys)."""
    wanted = {k for keys in texts.values() for k in keys}
    if not wanted:
        return set()
    table = manifest.shards
    return {key for j in (int(j) for j in table.rows) if wanted.intersection(table.texts_of(j)) for key in table.samples_of(j)[0]}


def replace_texts(writer: ShardWriter | None, texts: dict[str, list[str]], encoded: dict[str, dict], cache: Path) -> dict:
    """Commit a re-encoded copy of every text shard of `texts` (path -> text keys) whose texts were all encoded again
    from their samples' inputs (`encoded`: text key -> fields); one with a text no sample's input gave (its input is
    gone or changed) is left as it is and named (`writer`: None when no input was read)."""
    repaired, unrepairable = [], []
    for path, keys in texts.items():
        if all(k in encoded for k in keys):
            writer.replace(path, [(k, encoded[k]) for k in keys])
            repaired.append(path)
        else:
            unrepairable.append(path)
            print(f"  not repaired: text shard {path}: {sum(k not in encoded for k in keys)} of its texts depend on their "
                  f"samples' reference images, and no sample referring to them was read again (its input is gone or "
                  f"changed since it was cached); restore the inputs and run --repair again", file=sys.stderr)
    if repaired:
        print(f"\n{cache}: repaired {len(repaired)} damaged text shard(s) from the inputs of the samples that refer to "
              f"their texts (encoded with their reference images)", file=sys.stderr)
    return {"repaired_text_shards": len(repaired), **({"unrepairable_text_shards": unrepairable} if unrepairable else {})}


def replace_damaged(writer: ShardWriter, damaged: dict[str, list[str]], encoded: dict, inputs, cache: Path) -> dict:
    """Commit a re-encoded copy of every damaged shard whose samples were all encoded again, in their order:
    a training run of any generation reads the copy at the same global indices. A shard with a sample whose input
    is gone or changed is left as it is, and named with every such input (`inputs(keys)`: key -> where it was
    read, asked only for those keys)."""
    repaired, unrepairable = [], []
    missing = {path: [k for k in keys if k not in encoded] for path, keys in damaged.items()}
    where = inputs({k for keys in missing.values() for k in keys}) if any(missing.values()) else {}
    for path, keys in damaged.items():
        if missing[path]:
            unrepairable.append({"shard": path, "inputs_missing_or_changed": [where.get(k, k) for k in missing[path]]})
        else:
            writer.replace(path, [(k, encoded[k]) for k in keys])
            repaired.append(path)
    samples = sum(len(damaged[p]) for p in repaired)
    print(f"\n{cache}: repaired {len(repaired)} of {len(damaged)} damaged shard(s), {samples} samples re-encoded", file=sys.stderr)
    for u in unrepairable:
        print(f"  not repaired: {u['shard']}: {len(u['inputs_missing_or_changed'])} input(s) missing or changed since they "
              f"were cached: {', '.join(u['inputs_missing_or_changed'])}; restore them and run --repair again", file=sys.stderr)
    return {"repaired_shards": len(repaired), "repaired_samples": samples, "unrepairable": unrepairable}


def forget_created(created: list[Path]) -> None:
    """Leave no trace of a refused run in the cache directory it created (`created`: it and the parents it made,
    deepest first): removed only while it holds nothing but the lock files of this run, before the lock is let go."""
    cache = created[0]
    entries = list(cache.iterdir())
    if not all(LOCK_FILE.fullmatch(e.name) and e.is_file() and not e.is_symlink() for e in entries):
        return  # something was committed, or someone else's file: the directory stays
    for entry in entries:
        entry.unlink()
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return


def cached_inputs(manifest, sources: list, keys: set[str]) -> dict[str, str]:
    """key -> where its input was read from, for messages, for `keys` alone: the file under its source's path, or
    the source's name when this run does not list it."""
    paths, table, out = {s.name: s.path for s in sources}, manifest.shards, {}
    for key in keys:
        found = table.find_key(key)
        if found is None:
            continue
        name, src = table.dataset_of(found[0]), table.samples_of(found[0])[1][found[1]]
        out[key] = f"{paths[name].rstrip('/')}/{src}" if name in paths else f"{src} (source {name!r}, which DATA does not list)"
    return out
