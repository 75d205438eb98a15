"""Caches and datasets in object storage, through fsspec. The bucket is a local fsspec filesystem (`file://`,
`memory://`); everything else is the product's real path: stage one builds the cache, `open_cache` mirrors it,
shards are downloaded, evicted and checked, and stage two trains from the URL."""

import shutil
import tarfile
import threading
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import pytest
import torch

from precompute.config import PrecomputeConfig
from precompute.run import main as precompute
from precompute.sample_data import make_folder, make_tars
from precompute.tars import TarDataset, expand_tar_urls
from shards import Cache, CorruptSample, RemoteCache, open_cache

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """A stage-one cache of 12 images, one sample per shard (12 shards in 4 buckets), with validation prompts
    and the tiny preset's decoder files: the bucket's copy of a cache."""
    root = tmp_path_factory.mktemp("bucket")
    data = make_folder(root / "data", count=12)
    precompute(str(data), "tiny-sana", root / "cache", workers=0, progress=False, batch_size=2, max_shard_mb=0,
               validation_prompt=["a large red circle on a blue background"])
    return root / "cache"


class CountingFS:
    """The bucket's filesystem, counting downloads; `get_file` may be held until `release` is set."""

    def __init__(self, fs, release: threading.Event | None = None):
        self.fs, self.release, self.started = fs, release, threading.Event()
        self.gets: Counter[str] = Counter()
        self._lock = threading.Lock()

    def get_file(self, rpath, lpath, **kw):
        with self._lock:
            self.gets[rpath] += 1
        self.started.set()
        if self.release is not None:
            assert self.release.wait(timeout=30), "never released"
        return self.fs.get_file(rpath, lpath, **kw)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def local_shards(root: Path) -> dict[str, int]:
    """The shards of samples in a local directory (text shards, which every read needs, aside)."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.glob("*/r*.safetensors") if p.parent.name != "texts"}


def test_a_url_reads_every_sample_the_directory_holds(bucket, tmp_path):
    url = f"file://{bucket}"
    remote, local = open_cache(url, local_dir=tmp_path / "local"), Cache(bucket)
    assert isinstance(remote, RemoteCache) and remote.location == url and remote.root == tmp_path / "local"
    assert open_cache(bucket).location == str(bucket) and type(open_cache(bucket)) is Cache
    assert (remote.generation, len(remote), remote.fingerprint) == (local.generation, len(local), local.fingerprint)
    assert local_shards(remote.root) == {}  # nothing but the manifest's files until a shard is read
    for i in range(len(local)):
        a, b = local[i], remote[i]
        assert (a.key, a.bucket) == (b.key, b.bucket)
        assert all(torch.equal(a[name], b[name]) for name in a.fields)
    assert {k: p.text for k, p in remote.prompts().items()} == {k: p.text for k, p in local.prompts().items()}
    decoder = remote.spec.decoder.located(remote.root)
    assert (Path(decoder.source) / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (bucket / "vae/diffusion_pytorch_model.safetensors").read_bytes()
    assert remote.check_files() == []

    # a restart finds the shards it downloaded and downloads none again
    inodes = {rel: (remote.root / rel).stat().st_ino for rel in local_shards(remote.root)}
    again = open_cache(url, local_dir=tmp_path / "local")
    again.fs = CountingFS(again.fs)
    assert [again[i].key for i in range(len(again))] == [local[i].key for i in range(len(local))]
    assert sum(again.fs.gets.values()) == 0
    assert {rel: (again.root / rel).stat().st_ino for rel in local_shards(again.root)} == inodes


def test_local_shards_stay_under_the_limit_least_recently_used_removed_first(bucket, tmp_path):
    sizes = Cache(bucket).shards.column("bytes")
    limit = int(sizes.min()) * 2 - 1  # less than any two shards
    remote = open_cache(f"file://{bucket}", local_dir=tmp_path / "local", limit_bytes=limit)
    remote.fs = CountingFS(remote.fs)
    for i in range(len(remote)):
        remote[i]  # through Cache.shard: readers stay open, their files are evicted all the same
        held = local_shards(remote.root)
        assert sum(held.values()) <= limit + int(sizes.max())
        assert list(held) == [remote.path(i).relative_to(remote.root).as_posix()]  # only the shard just read
    assert sum(n for path, n in remote.fs.gets.items() if "/texts/" not in path) == len(remote)
    assert torch.equal(remote[0]["latent"], Cache(bucket)[0]["latent"])  # its reader is still open: no download
    remote.fetch(0)  # the file itself was evicted: downloaded again
    assert remote.fs.gets[f"{bucket}/{remote.shards.paths()[0]}"] == 2

    # room for three shards: touching shard 0 again makes shard 1 the least recently used
    lru = open_cache(f"file://{bucket}", local_dir=tmp_path / "lru", limit_bytes=int(sizes[:3].sum()) - 1)
    for j in (0, 1, 0, 2):
        lru.fetch(j)
    assert set(local_shards(lru.root)) == {lru.shards.paths()[0], lru.shards.paths()[2]}


def test_a_shard_of_another_size_in_the_bucket_is_refused(bucket, tmp_path):
    copy = tmp_path / "bucket"
    shutil.copytree(bucket, copy)
    remote = open_cache(f"file://{copy}", local_dir=tmp_path / "local")
    truncated, missing = remote.shards.paths()[3], remote.shards.paths()[5]
    data = (copy / truncated).read_bytes()
    (copy / truncated).write_bytes(data[:-100])
    (copy / missing).unlink()
    with pytest.raises(CorruptSample, match=rf"file://{copy}/{truncated} holds {len(data) - 100} bytes, the manifest "
                                            rf"lists {len(data)}.*--repair"):
        remote.fetch(3)
    with pytest.raises(CorruptSample, match=rf"file://{copy}/{missing} is listed .* but missing there.*--repair"):
        remote[5]
    assert local_shards(remote.root) == {}  # nothing partial is left behind
    assert set(remote.check_files()) == {
        (f"file://{copy}/{truncated}", f"{len(data) - 100} bytes, the manifest lists {len(data)} (truncated or replaced)"),
        (f"file://{copy}/{missing}", "missing"),
    }
    assert remote.fetch(4) == remote.root / remote.shards.paths()[4]  # the others read as ever


def test_concurrent_fetches_of_a_shard_download_it_once(bucket, tmp_path):
    remote = open_cache(f"file://{bucket}", local_dir=tmp_path / "local")
    release = threading.Event()
    remote.fs = CountingFS(remote.fs, release)
    threads = 4
    start = threading.Barrier(threads + 1)
    paths, errors = [], []

    def fetch():
        start.wait()
        try:
            paths.append(remote.fetch(7))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    workers = [threading.Thread(target=fetch) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    assert remote.fs.started.wait(timeout=30)  # one thread is downloading and held there
    release.set()
    for w in workers:
        w.join(timeout=30)
    assert errors == [] and paths == [remote.root / remote.shards.paths()[7]] * threads
    assert sum(remote.fs.gets.values()) == 1
    assert paths[0].read_bytes() == (bucket / remote.shards.paths()[7]).read_bytes()
    assert [p.name for p in paths[0].parent.iterdir() if p.name.startswith(".")] == []  # no temp file left


def waiting_on_flock(path: Path) -> bool:
    """Whether a process waits for an flock on `path`: /proc/locks lists waiters as "-> FLOCK ..." lines."""
    inode = f":{path.stat().st_ino} "
    return any(line.split(":", 1)[1].lstrip().startswith("->") and inode in line
               for line in Path("/proc/locks").read_text().splitlines())


def test_caches_sharing_a_local_directory_download_a_shard_once(bucket, tmp_path):
    """Ranks of a node (here: two caches, each with its own open lock file, as two processes have) ask for the
    same shard together: one downloads it, the other waits for it and finds it there."""
    first, second = (open_cache(f"file://{bucket}", local_dir=tmp_path / "local") for _ in range(2))
    release = threading.Event()
    first.fs, second.fs = CountingFS(first.fs, release), CountingFS(second.fs, release)
    results, errors = {}, []

    def fetch(name, cache):
        try:
            results[name] = cache.fetch(7)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    a = threading.Thread(target=fetch, args=("first", first))
    a.start()
    assert first.fs.started.wait(timeout=30)  # the first holds the shard's lock, its download held
    b = threading.Thread(target=fetch, args=("second", second))
    b.start()
    locks = list((tmp_path / "local" / ".downloads").glob("*.lock"))
    while not (second.fs.started.is_set() or any(waiting_on_flock(p) for p in locks)):
        b.join(timeout=0.01)  # until the second downloads too (wrong) or waits for the lock (right)
    release.set()
    a.join(timeout=30), b.join(timeout=30)
    assert errors == [] and results["first"] == results["second"]
    assert sum(first.fs.gets.values()) == 1 and sum(second.fs.gets.values()) == 0


@pytest.fixture
def memory_tars(tmp_path):
    """Webdataset tars on disk and the same tars in a `memory://` bucket."""
    local = make_tars(tmp_path / "tars", count=6, per_tar=3)
    fs, prefix = fsspec.filesystem("memory"), f"/tars-{uuid.uuid4().hex}"
    for path in local:
        fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
    yield local, f"memory://{prefix}", prefix
    fs.rm(prefix, recursive=True)


def test_stage_one_reads_tars_from_object_storage(memory_tars, tmp_path):
    local, url, prefix = memory_tars
    names = [f"{url}/data-0000.tar", f"{url}/data-0001.tar"]
    assert expand_tar_urls(f"{url}/data-{{0000..0001}}.tar") == expand_tar_urls(f"{url}/*.tar") == expand_tar_urls(url) == names
    with pytest.raises(FileNotFoundError, match=f"{url}/nothing-\\*.tar matches no file"):
        expand_tar_urls(f"{url}/nothing-*.tar")
    with pytest.raises(FileNotFoundError, match=f"tar shard {url}/data-0002.tar does not exist"):
        expand_tar_urls(f"{url}/data-{{0000..0002}}.tar")

    precompute(f"{url}/data-{{0000..0001}}.tar", "tiny-sana", tmp_path / "from-url", workers=1, progress=False)
    precompute(str(local[0].parent), "tiny-sana", tmp_path / "from-dir", workers=0, progress=False)
    from_url, from_dir = Cache(tmp_path / "from-url"), Cache(tmp_path / "from-dir")
    assert len(from_url) == 6
    assert dict(from_url.keys()).keys() == dict(from_dir.keys()).keys()
    assert from_url.manifest.by_source() == from_dir.manifest.by_source()  # "data-0000.tar/00000000", ...

    # a tar cut short in the bucket is reported with its URL, and so is one that is not a tar at all
    fs = fsspec.filesystem("memory")
    data = local[1].read_bytes()
    with tarfile.open(local[1]) as tar:
        cut = tar.getmembers()[3].offset_data + 100
    fs.pipe_file(f"{prefix}/data-0001.tar", data[:cut])
    fs.pipe_file(f"{prefix}/junk.tar", bytes(range(256)) * 8)
    items = list(TarDataset([f"{url}/data-0001.tar", f"{url}/junk.tar"], PrecomputeConfig("unused").policy(), frozenset(),
                            ("caption",)))
    assert [(it["source"], it["reason"]) for it in items] == [(f"{url}/data-0001.tar", "corrupt_tar"),
                                                                (f"{url}/junk.tar", "corrupt_tar")]


def test_training_from_a_cache_url(bucket, tmp_path):
    from train.config import TrainConfig
    from train.loop import train

    result = train(TrainConfig(model="tiny-sana", cache=f"file://{bucket}", run=tmp_path / "run", local_cache=tmp_path / "local",
                               local_cache_gb=1.0, steps=3, batch_size=4, progress=False, validate=False, log_every=1,
                               checkpoint_every=1000))
    assert result["step"] == 3
    assert local_shards(tmp_path / "local")  # the shards were read from the local directory
    assert not (bucket / "_readers").exists()  # nothing was written to the bucket
