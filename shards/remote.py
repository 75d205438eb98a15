"""Caches in object storage (`s3://`, `gs://`, `hf://`, any fsspec URL): read through a local mirror.

Opening a `RemoteCache` mirrors the files the manifest is made of (`index.json`, the commits and snapshots a
generation needs, the prompts and decoder files it lists) into a local directory, fetching only what is new
or changed, and then reads that directory as a plain `Cache`. Shards are downloaded whole when first needed
(`fetch`), checked against the sizes the manifest lists, and kept in the local directory up to a byte limit,
least recently used removed first (the approach of mosaicml/streaming's local cache).

A cache is written locally by stage one and copied to the bucket as it is (e.g. `aws s3 sync CACHE s3://...`);
nothing here writes to object storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import posixpath
import tempfile
import threading
import zlib
from collections import Counter
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from shards.atomic import TMP_SUFFIX, atomic_write_bytes, publish
from shards.layout import LOG_DIR, LOG_NAME, MANIFEST, READERS_DIR, SNAPSHOT_DIR, parse_shard_name
from shards.log import gap_message
from shards.reader import REPAIR, Cache, ShardReader
from shards.schema import CorruptSample, DamagedLog
from shards.verify import file_sha256

DEFAULT_LOCAL_ROOT = Path("~/.cache/cachedit")


def is_url(location: str | os.PathLike) -> bool:
    """Whether a cache location is a URL (read through fsspec) rather than a directory."""
    return "://" in str(location)


def open_cache(location: str | os.PathLike, generation: int | None = None, *,
               local_dir: str | os.PathLike | None = None, limit_bytes: int | None = None, check_digests: bool = False,
               max_open: int = 128) -> Cache:
    """A cache at a directory or a URL, at one generation. `cache.location` is what was asked for.

    Args:
        location: a cache directory, or the URL of one in object storage (anything fsspec opens: `s3://`,
            `gs://`, `hf://`, `file://`...).
        generation: the generation to read (default: the newest).
        local_dir: for a URL, where its files are mirrored and its shards kept (default:
            `~/.cache/cachedit/<netloc>/<path>`).
        limit_bytes: for a URL, the bytes the local shards may take (default: no limit).
        check_digests, max_open: as for `Cache`.

    Returns:
        A `Cache` for a directory, a `RemoteCache` for a URL.
    """
    if is_url(location):
        return RemoteCache(str(location), generation, local_dir=local_dir, limit_bytes=limit_bytes,
                           check_digests=check_digests, max_open=max_open)
    return Cache(location, generation, check_digests=check_digests, max_open=max_open)


def default_local_dir(location: str) -> Path:
    """`~/.cache/cachedit/<netloc>/<path>` of a URL."""
    url = urlsplit(location)
    parts = [part for part in PurePosixPath(url.path).parts if part not in ("/", ".", "..")]
    return DEFAULT_LOCAL_ROOT.expanduser().joinpath(*[p for p in (url.netloc, *parts) if p])


def repair_hint(location: str) -> str:
    """The repair command for a cache in object storage: run on the directory it was copied from."""
    return REPAIR.format(root="DIR") + f" DIR is the directory {location} was copied from; copy it there again afterwards."


class RemoteCache(Cache):
    """A cache in object storage, read through a local directory: the manifest's files are mirrored at open,
    shards are downloaded whole on first use and the least recently used removed beyond `limit_bytes`.

    `root` is the local directory (every reader of a `Cache` works on it unchanged); `location` is the URL.
    `fetch` may be called from several threads (a read-ahead thread and the batch thread): a shard is
    downloaded once, and a shard already in the local directory with its listed size, left by an earlier
    run or another process, is not downloaded again.

    Args:
        location: the cache's URL.
        generation: the generation to read (default: the newest in the bucket).
        local_dir: the local directory (default: `~/.cache/cachedit/<netloc>/<path>`).
        limit_bytes: the bytes the local shards may take (default: no limit). Shards of other generations found
            there count too. The shard just fetched always stays, so one shard over the limit is possible.
        check_digests, max_open: as for `Cache`.

    Raises:
        FileNotFoundError: the URL holds no cache.
        CorruptSample: a file the manifest lists is missing from the bucket or differs from its listing.
        FormatError: as for `Cache`.
    """

    def __init__(self, location: str, generation: int | None = None, *, local_dir: str | os.PathLike | None = None,
                 limit_bytes: int | None = None, check_digests: bool = False, max_open: int = 128):
        from fsspec.core import url_to_fs

        location = location.rstrip("/")
        self.fs, base = url_to_fs(location)
        self._base = base.rstrip("/")
        root = Path(local_dir if local_dir is not None else default_local_dir(location))
        mirror_manifest(self.fs, self._base, root, generation, location)
        super().__init__(root, generation, check_digests=check_digests, max_open=max_open)
        self.location = location
        self.limit_bytes = limit_bytes
        self._listed_bytes = self.shards.column("bytes")
        self._fetch_lock = threading.Lock()  # guards the three below
        self._inflight: dict[str, Future] = {}  # shard path -> its download in progress
        self._opening: Counter[str] = Counter()  # shards between download and memory map: not evicted
        self._used: dict[str, int] = {}  # shard path -> this process's last access (a counter), to order equal mtimes
        self._clock = itertools.count()
        for entry in self.manifest.files.values():
            self._mirror_file(entry["path"], entry["bytes"], entry["sha256"])

    def url(self, j: int) -> str:
        """The URL of shard `j` (its repaired copy, if any)."""
        return f"{self.location}/{self._relative(j)}"

    def fetch(self, j: int) -> Path:
        """The local file of shard `j`, downloaded whole if it is not there yet.

        Raises:
            CorruptSample: the shard is missing from the bucket, or its size there differs from the manifest's.
        """
        return self._fetch(self._relative(j), self._expected_bytes(j))

    def fetch_text(self, t: int) -> Path:
        """The local file of text shard `t`, downloaded whole if it is not there yet (as `fetch`)."""
        rel = self.text_path(t).relative_to(self.root).as_posix()
        return self._fetch(rel, int(self.texts.column("bytes")[t]) if rel == self._text_paths[t] else None)

    def _fetch(self, rel: str, expected: int | None) -> Path:
        path = self.root / rel
        with self._fetch_lock:
            download = self._inflight.get(rel)
            mine = download is None
            if mine:
                if self._present(path, expected):
                    self._used[rel] = next(self._clock)
                    return path
                download = self._inflight[rel] = Future()
        if not mine:  # another thread is downloading it
            return download.result()
        try:
            # ranks of a node ask for the same shards at the same moment: one downloads, the others find it there
            with download_lock(self.root, rel):
                if not self._present(path, expected):
                    self._download(rel, path, expected)
        except BaseException as e:
            with self._fetch_lock:
                del self._inflight[rel]
            download.set_exception(e)
            raise
        with self._fetch_lock:
            del self._inflight[rel]
            self._used[rel] = next(self._clock)
        download.set_result(path)
        self.evict(keep=rel)
        return path

    def shard(self, j: int) -> ShardReader:
        with self._opening_file(self._relative(j)):
            return super().shard(j)

    def text_shard(self, t: int) -> ShardReader:
        with self._opening_file(self.text_path(t).relative_to(self.root).as_posix()):
            return super().text_shard(t)

    @contextlib.contextmanager
    def _opening_file(self, rel: str):
        with self._fetch_lock:
            self._opening[rel] += 1  # from its fetch until its reader maps it, no other thread evicts the shard
        try:
            yield
        finally:
            with self._fetch_lock:
                self._opening[rel] -= 1
                if not self._opening[rel]:
                    del self._opening[rel]

    def evict(self, keep: str | None = None) -> int:
        """Delete local shards, least recently used first, until they take at most `limit_bytes`; never `keep`
        (a path relative to the cache) or a shard being downloaded or opened. A shard a reader has mapped is
        deleted too (its mapping stays valid). Returns the bytes deleted.

        Recency is the file's mtime, which every access renews (so processes sharing the directory agree), with
        this process's access order among equal mtimes; shards found at open rank by their mtime alone."""
        if self.limit_bytes is None:
            return 0
        freed = 0
        with self._fetch_lock:
            files = self._local_shards()
            total = sum(size for _, _, size in files)
            busy = {keep, *self._inflight, *self._opening}
            for _, rel, size in sorted(files):
                if total <= self.limit_bytes:
                    break
                if rel in busy:
                    continue
                (self.root / rel).unlink(missing_ok=True)
                self._used.pop(rel, None)
                total -= size
                freed += size
        return freed

    def check_files(self) -> list[tuple[str, str]]:
        """Every shard of this generation is in the bucket with the size the manifest lists: (URL, problem) of
        those that are not. One listing per bucket directory, not one request per shard."""
        listings: dict[str, dict[str, int]] = {}
        problems = []
        files = [(self._relative(j), self._expected_bytes(j)) for j in range(len(self._paths))]
        if self.texts is not None:  # the text shards too
            sizes = self.texts.column("bytes")
            for t in range(len(self._text_paths)):
                rel = self.text_path(t).relative_to(self.root).as_posix()
                files.append((rel, int(sizes[t]) if rel == self._text_paths[t] else None))
        for rel, expected in files:
            directory, name = posixpath.split(rel)
            if directory not in listings:
                listings[directory] = list_files(self.fs, posixpath.join(self._base, directory))
            size = listings[directory].get(name)
            if size is None:
                problems.append((f"{self.location}/{rel}", "missing"))
            elif expected is not None and size != expected:
                problems.append((f"{self.location}/{rel}", f"{size} bytes, the manifest lists {expected} (truncated or replaced)"))
        return problems

    # -- internals -----------------------------------------------------------------------------------

    def _relative(self, j: int) -> str:
        return self.path(j).relative_to(self.root).as_posix()

    def _expected_bytes(self, j: int) -> int | None:
        """The listed size of shard `j`; None for a copy repaired after this generation (listed by a later one)."""
        return int(self._listed_bytes[j]) if self._relative(j) == self._paths[j] else None

    def _present(self, path: Path, expected: int | None) -> bool:
        """Whether `path` is in the local directory with the expected size; marks it used (its mtime)."""
        try:
            if expected is not None and path.stat().st_size != expected:
                return False
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def _download(self, rel: str, path: Path, expected: int | None) -> None:
        """Download one file of the cache to `path` through a temp file, checked against its listed size."""
        remote = posixpath.join(self._base, rel)
        with temp_beside(path) as tmp:
            try:
                self.fs.get_file(remote, str(tmp))
            except FileNotFoundError:
                raise CorruptSample(f"{self.location}/{rel} is listed in generation {self.generation} of "
                                    f"{self.location} but missing there. {repair_hint(self.location)}") from None
            size = tmp.stat().st_size
            if expected is None:  # a repaired copy an older generation reads: the bucket's size is all there is
                expected = self.fs.size(remote)
            if size != expected:
                raise CorruptSample(f"{self.location}/{rel} holds {size} bytes, the manifest lists {expected}: the copy "
                                    f"in the bucket is truncated or was replaced. {repair_hint(self.location)}")
            publish(tmp, path)
        os.utime(path)  # recency for eviction, whatever time the filesystem gave the copy

    def _mirror_file(self, rel: str, size: int, sha256: str) -> None:
        """Mirror an auxiliary file the manifest lists (prompts, decoder), unless the local copy matches it."""
        path = self.root / rel
        if path.is_file() and path.stat().st_size == size and file_sha256(path) == sha256:
            return
        self._download(rel, path, size)
        if file_sha256(path) != sha256:
            path.unlink()
            raise CorruptSample(f"{self.location}/{rel} does not match the sha256 its manifest lists. "
                                f"{repair_hint(self.location)}")

    def _local_shards(self) -> list[tuple[tuple[int, int], str, int]]:
        """((mtime, access order), path, bytes) of every shard file in the local directory, of any generation."""
        out = []
        with os.scandir(self.root) as top:
            # a symbolic link to a folder elsewhere is not entered: eviction deletes nothing outside the directory
            directories = [d.name for d in top if d.is_dir(follow_symlinks=False)
                           and d.name not in (LOG_DIR, SNAPSHOT_DIR, READERS_DIR, DOWNLOAD_LOCKS)]
        for directory in directories:
            with os.scandir(self.root / directory) as entries:
                for entry in entries:
                    if parse_shard_name(entry.name) is None or entry.is_symlink():
                        continue
                    try:
                        st = entry.stat()
                    except FileNotFoundError:  # evicted by another process meanwhile
                        continue
                    rel = f"{directory}/{entry.name}"
                    out.append(((st.st_mtime_ns, self._used.get(rel, -1)), rel, st.st_size))
        return out


DOWNLOAD_LOCKS = ".downloads"  # lock files of the local directory, one per stripe of shard paths
LOCK_STRIPES = 256


@contextlib.contextmanager
def download_lock(root: Path, rel: str):
    """Exclusive, across the processes sharing `root`, while shard `rel` is downloaded. An `flock` on one of
    `LOCK_STRIPES` fixed files (shards hashing alike share one; no lock file is ever deleted, which would race
    with its holders); released when its holder exits, however it exits."""
    directory = root / DOWNLOAD_LOCKS
    directory.mkdir(exist_ok=True)
    with open(directory / f"{zlib.crc32(rel.encode()) % LOCK_STRIPES:03d}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def mirror_manifest(fs, base: str, root: Path, generation: int | None, location: str) -> None:
    """Mirror into `root` the manifest files a reader of `generation` needs: `index.json`, the snapshot it
    starts from and the newest one (repairs made since), and the commits after the first. Files already there
    with the bucket's size are kept (commits and snapshots never change); local ones the bucket no longer holds
    (collected by gc) are deleted.

    Raises:
        FileNotFoundError: the URL holds no commit log or snapshot.
        DamagedLog: a commit the reader needs is missing from the bucket while later ones are there.
    """
    root.mkdir(parents=True, exist_ok=True)
    try:
        pointer = fs.cat_file(posixpath.join(base, MANIFEST))  # rewritten in place by writers: always read
    except FileNotFoundError:
        (root / MANIFEST).unlink(missing_ok=True)
    else:
        if not (root / MANIFEST).is_file() or (root / MANIFEST).read_bytes() != pointer:
            atomic_write_bytes(root / MANIFEST, pointer)
    for _ in range(3):  # a commit written while the log was listed is listed by the next look
        logs = {name: size for name, size in list_files(fs, posixpath.join(base, LOG_DIR)).items()
                if _numbered(name, ".json")}
        numbers = sorted(int(name.split(".")[0]) for name in logs)
        have = set(numbers)
        hole = next((g for g in range(numbers[0], numbers[-1]) if g not in have), None) if numbers else None
        if hole is None or not fs.exists(posixpath.join(base, LOG_DIR, LOG_NAME.format(hole))):
            break
    snapshots = {name: size for name, size in list_files(fs, posixpath.join(base, SNAPSHOT_DIR)).items()
                 if _numbered(name, ".safetensors")}
    if not logs and not snapshots:
        raise FileNotFoundError(f"{location} holds no cache (nothing under {LOG_DIR}/ or {SNAPSHOT_DIR}/). Build one "
                                f"with `make precompute DATA=... CACHE=DIR` and copy DIR there as it is (e.g. `aws s3 "
                                f"sync DIR {location}`)")
    generations = sorted(int(name.split(".")[0]) for name in snapshots)
    start = max((g for g in generations if generation is None or g <= generation), default=-1)
    first = start + 1 if start >= 0 or 0 in numbers else None  # None: gc collected the generation asked for
    have = set(numbers)
    missing = [g for g in range(first, numbers[-1]) if g not in have] if numbers and first is not None else []
    if missing:  # the log does not end there: a commit was lost (or is not copied yet)
        later = [g for g in numbers if g > missing[0]]
        raise DamagedLog(f"{location}/{LOG_DIR}/{LOG_NAME.format(missing[0])}", gap_message(location, missing[0], later))
    wanted = {f"{SNAPSHOT_DIR}/{name}": size for name, size in snapshots.items()
              if int(name.split(".")[0]) in (start, generations[-1] if generations else -1)}
    wanted |= {f"{LOG_DIR}/{name}": size for name, size in logs.items() if int(name.split(".")[0]) > start}
    for directory, listed in ((LOG_DIR, logs), (SNAPSHOT_DIR, snapshots)):
        (root / directory).mkdir(exist_ok=True)
        if (root / directory).is_symlink():  # nothing outside the local directory is deleted
            continue
        for path in (root / directory).iterdir():
            if path.name not in listed and not path.name.startswith(".") and not path.is_symlink():
                path.unlink(missing_ok=True)
    stale = [rel for rel, size in wanted.items() if not (root / rel).is_file() or (root / rel).stat().st_size != size]
    if not stale:
        return
    with contextlib.ExitStack() as stack:
        temps = [stack.enter_context(temp_beside(root / rel)) for rel in stale]
        # one batched transfer: concurrent on the asynchronous filesystems (s3, gcs, http)
        fs.get([posixpath.join(base, rel) for rel in stale], [str(t) for t in temps])
        for rel, tmp in zip(stale, temps):
            if tmp.stat().st_size != wanted[rel]:
                raise CorruptSample(f"{location}/{rel} holds {tmp.stat().st_size} bytes, listed with {wanted[rel]} a "
                                    f"moment before: the bucket is being rewritten; open the cache again once it is copied")
            publish(tmp, root / rel)


def list_files(fs, directory: str) -> dict[str, int]:
    """name -> size of the files directly in a bucket directory (none if it does not exist), listed afresh."""
    fs.invalidate_cache(directory)
    try:
        infos = fs.ls(directory, detail=True)
    except FileNotFoundError:
        return {}
    return {posixpath.basename(info["name"].rstrip("/")): int(info["size"]) for info in infos if info["type"] == "file"}


def _numbered(name: str, suffix: str) -> bool:
    return name.endswith(suffix) and name[: -len(suffix)].isdigit()


@contextlib.contextmanager
def temp_beside(path: Path):
    """A new temp file beside `path`, unique to the caller (threads and processes sharing a local directory
    never collide); deleted on exit unless it was renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
