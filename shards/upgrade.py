"""`upgrade`: convert a version 1 cache (one `index.json` listing every shard) to the commit log, in place.

No shard is rewritten: their layout is the same in both versions. The conversion writes the first commit
(every listed shard, with its keys and sources read from the shard) and a snapshot, and only then replaces
`index.json`, keeping the old one as `index.v1.json`. A crash before that leaves the version 1 cache as it
was (a new attempt starts over).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from shards.buckets import Bucket
from shards.gc import exclusive
from shards.generations import compact
from shards.layout import LOG_DIR, MANIFEST, SNAPSHOT_DIR, confined
from shards.log import write_commit
from shards.manifest import Manifest
from shards.reader import ShardReader
from shards.schema import FORMAT_NAME, FormatError, schema_from_json, schema_to_json
from shards.table import ShardEntry


def upgrade(root: str | os.PathLike) -> Manifest:
    """Convert the version 1 cache at `root`; returns its manifest (generation 0).

    Raises:
        FormatError: `root` holds no version 1 cache, or one that lists a path outside it.
        CacheBusy: a run or a writer uses the cache.
    """
    root = Path(root)
    index = root / MANIFEST
    if not index.is_file():
        raise FormatError(f"{root} has no {MANIFEST}: there is no version 1 cache to upgrade")
    locks = exclusive(root)
    try:
        obj = json.loads(index.read_text())
        if obj.get("format") != FORMAT_NAME or obj.get("format_version") != 1:
            raise FormatError(f"{index} is not a version 1 {FORMAT_NAME} manifest; nothing to upgrade")
        if any(root.glob("index.rank-*.json")):
            raise FormatError(f"{root} has unmerged per-rank manifests of an unfinished version 1 run; finish it with the "
                              f"version that started it first")
        for leftover in (root / LOG_DIR, root / SNAPSHOT_DIR):  # an interrupted earlier attempt
            if leftover.is_symlink():  # nothing outside the cache is deleted, nor written through a link
                raise FormatError(f"{leftover} is a symbolic link; a version 1 cache has none. Remove the link (what it "
                                  f"points at is not part of the cache) and upgrade again")
            shutil.rmtree(leftover, ignore_errors=True)
        manifest = Manifest(obj["fingerprint"], schema_from_json(obj["fields"]))
        commit = {"generation": 0, "rank": 0, "init": {"fingerprint": manifest.fingerprint,
                                                       "fingerprint_sha256": manifest.fingerprint_sha256,
                                                       "fields": schema_to_json(manifest.schema)},
                  "shapes": {}, "add": [], "files": obj.get("files", {}), "extra": {**obj.get("extra", {}), "upgraded_from": 1}}
        for s in obj["shards"]:
            reader = ShardReader(root / confined(s["path"], str(index)))
            if len(reader) != s["samples"]:
                raise FormatError(f"{reader.path} holds {len(reader)} samples, {index} lists {s['samples']}: the cache is "
                                  f"damaged; repair it with the version that wrote it before upgrading")
            commit["shapes"].setdefault(Bucket(*s["bucket"]).name, s["shapes"])
            sources = ([bytes(reader.fields(i)["source"].numpy()).decode("utf-8", "surrogateescape") for i in range(len(reader))]
                       if "source" in manifest.schema else [""] * len(reader))
            commit["add"].append(ShardEntry(s["path"], Bucket(*s["bucket"]), s["samples"], s["bytes"], s["sha256"], s["field_bytes"],
                                            keys=reader.keys, sources=sources, stamps=[0] * len(reader)).to_json())
        manifest.apply(commit, str(index))  # checks every path before anything is written
        if not write_commit(root, commit):
            raise FormatError(f"{root / LOG_DIR} already holds a commit; the cache was upgraded meanwhile")
        shutil.copy2(index, root / "index.v1.json")
        compact(root, manifest)  # replaces index.json last
        return manifest
    finally:
        for lock in reversed(locks):
            lock.release()
