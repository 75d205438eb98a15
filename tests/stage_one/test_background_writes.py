"""Stage one writes on a background thread: the encoder goes on with the next batches while a shard is published, a
write that fails stops the run with its own error and exit code (what was committed stays), an interrupted run keeps
what was committed, and the summary says where the pass's time went."""

import errno
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import shards.writer
from precompute.__main__ import app
from precompute.background import QUEUE_BATCHES, BackgroundWrites
from precompute.encode import Encoders
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache, CacheLock, verify
from shards.lock import WRITERS_LOCK
from shards.texts import TEXT_DIR

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

COUNT = 12  # images; one per batch, one shard per sample (max_shard_mb=0): every write publishes and commits a shard


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "shapes", count=COUNT)


def run(data, cache, **kw):
    return precompute(str(data), "tiny-sana", Path(cache), workers=0, progress=False, max_shard_mb=0, batch_size=1, **kw)


class Recorder:
    """Counts `Encoders.encode_images` calls and sample-shard publications (`write_shard_file`, text shards left out),
    and lets a test make a publication wait for the encoder or fail."""

    def __init__(self, monkeypatch):
        self.encodes, self.published = 0, 0
        self.changed = threading.Condition()
        encode, publish = Encoders.encode_images, shards.writer.write_shard_file

        def encode_images(enc, pixels):
            with self.changed:
                self.encodes += 1
                self.changed.notify_all()
            self.on_encode(self.encodes)
            return encode(enc, pixels)

        def write_shard_file(root, bucket, rank, seq, data, folder=None):
            if folder != TEXT_DIR:
                self.published += 1
                self.on_publish(self.published, root / (folder or bucket.name))
            return publish(root, bucket, rank, seq, data, folder)

        monkeypatch.setattr(Encoders, "encode_images", encode_images)
        monkeypatch.setattr(shards.writer, "write_shard_file", write_shard_file)

    def on_encode(self, n: int) -> None:
        pass

    def on_publish(self, n: int, directory: Path) -> None:
        pass

    def wait_for_encodes(self, n: int) -> bool:
        """Block the calling (writer) thread until the encoder has made `n` calls; False if it never does (a minute)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.encodes >= n, timeout=60)


def test_the_encoder_goes_on_while_a_shard_is_published(folder, tmp_path, monkeypatch, capsys):
    """The first shard's publication is held until the encoder has encoded three more batches: written inline, it
    would hold the encoder and never be released. The cache ends whole, and the summary has the encoder's share."""
    recorder = Recorder(monkeypatch)
    seen = {}

    def on_publish(n, directory):
        if n == 1:
            seen["released"] = recorder.wait_for_encodes(4)
            seen["encodes"] = recorder.encodes

    recorder.on_publish = on_publish
    summary = run(folder, tmp_path / "cache")
    assert seen["released"] and seen["encodes"] >= 4, seen
    assert summary["new"] == COUNT and len(Cache(tmp_path / "cache")) == COUNT and verify(tmp_path / "cache").ok
    assert recorder.published == COUNT
    for name in ("encoder_busy_fraction", "data_wait_fraction", "writer_wait_fraction", "writer_busy_fraction"):
        assert 0.0 <= summary[name] <= 1.0, (name, summary[name])
    assert 0.0 < summary["encoder_s"] <= summary["encode_s"]
    assert summary["encoder_busy_fraction"] == pytest.approx(summary["encoder_s"] / summary["encode_s"])
    busy = f"encoder busy {summary['encoder_busy_fraction'] * 100:.0f} % of the pass; waiting on inputs "
    assert busy in capsys.readouterr().err


def test_a_failed_write_stops_the_run_with_its_error(folder, tmp_path, monkeypatch):
    """The disk fills at the third shard: the command stops promptly (not after every input) with the write's own
    message and exit code 2, the two shards committed before stay, the locks are free and a re-run completes."""
    recorder = Recorder(monkeypatch)
    failed = {}

    def on_publish(n, directory):
        if n == 3:
            failed["path"] = str(directory / "r00000-000002.safetensors")
            raise OSError(errno.ENOSPC, "No space left on device", failed["path"])

    recorder.on_publish = on_publish
    cache = tmp_path / "cache"
    out = CliRunner().invoke(app, [str(folder), "--model", "tiny-sana", "--cache", str(cache), "--no-progress", "--workers", "0",
                                   "--max-shard-mb", "0", "--batch-size", "1"])
    assert out.exit_code == 2, out.output
    assert f"error: {failed['path']}: No space left on device" in out.output and "Traceback" not in out.output, out.output
    # the writer fails at batch 3; the encoder is at most the queue's length ahead, then stops at its next batch
    assert recorder.encodes <= 3 + QUEUE_BATCHES + 1 < COUNT, recorder.encodes
    assert len(Cache(cache)) == 2 and verify(cache).ok
    for name in (".lock", ".lock-r00000", WRITERS_LOCK):
        CacheLock(cache, name).release()
    monkeypatch.undo()
    summary = run(folder, cache)
    assert summary["unchanged"] == 2 and summary["new"] == COUNT - 2 and verify(cache).ok


def test_an_interrupted_run_keeps_what_was_committed(folder, tmp_path, monkeypatch):
    """Ctrl-C while a shard is being published: the shard in flight is committed, the queued batches are dropped,
    the run stops at once and a re-run encodes exactly the rest."""
    recorder = Recorder(monkeypatch)

    def on_encode(n):
        if n == 3:
            raise KeyboardInterrupt

    recorder.on_encode = on_encode
    recorder.on_publish = lambda n, directory: recorder.wait_for_encodes(3) if n == 1 else None
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        run(folder, cache)
    assert not [t for t in threading.enumerate() if t.name == "shard-writer"]  # the writer's thread ended
    done = len(Cache(cache))
    assert 1 <= done <= 2 and verify(cache).ok  # the shard in flight, and the one after if the writer took it first
    for name in (".lock", ".lock-r00000", WRITERS_LOCK):
        CacheLock(cache, name).release()
    monkeypatch.undo()
    summary = run(folder, cache)
    assert summary["unchanged"] == done and summary["new"] == COUNT - done and verify(cache).ok


def test_the_queue_is_bounded_by_batches_and_bytes():
    """While a batch is being written, `submit` takes batches up to the byte bound and then waits; the batches are
    written in the order submitted."""
    held, order = threading.Event(), []
    writes = BackgroundWrites(max_batches=4, max_bytes=100)

    def write(name):
        def run():
            if name == "a":
                held.wait()
            order.append(name)
        return run

    writes.submit([write("a")], 60)
    writes.submit([write("b")], 30)  # 90 bytes queued: taken
    third = threading.Thread(target=writes.submit, args=([write("c")], 30))  # 120 bytes: waits for "a"
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive() and order == []
    held.set()
    third.join()
    writes.drain()
    assert order == ["a", "b", "c"] and writes.wait_s > 0


def test_a_failed_write_is_raised_and_drops_the_batches_after_it():
    """The exception of a write is the submitter's, as raised; the batches queued after it are never written."""
    held, order = threading.Event(), []
    writes = BackgroundWrites()
    refused = ValueError("sample k holds NaN or Inf")

    def fail():
        held.wait()
        raise refused

    writes.submit([fail], 1)
    writes.submit([lambda: order.append("after")], 1)
    held.set()
    with pytest.raises(ValueError) as raised:
        writes.drain()
    assert raised.value is refused and order == []
    with pytest.raises(ValueError):
        writes.check()


def test_a_sample_another_rank_committed_first_counts_as_a_duplicate(folder, tmp_path, monkeypatch):
    """A sample another writer committed between its encoding and its write (the same image and captions, found by
    the background writer) is not written, and counts as a duplicate, not as new."""
    first = {}
    listed = shards.writer.ShardWriter.listed

    def committed_meanwhile(writer, key):
        return first.setdefault("key", key) == key or listed(writer, key)

    monkeypatch.setattr(shards.writer.ShardWriter, "listed", committed_meanwhile)
    summary = run(folder, tmp_path / "cache")
    assert summary["new"] == COUNT - 1 and summary["duplicates"] == 1 and summary["sources"]["shapes"]["new"] == COUNT - 1
    assert first["key"] not in {key for key, *_ in Cache(tmp_path / "cache").manifest.samples()}
    assert len(Cache(tmp_path / "cache")) == COUNT - 1 and verify(tmp_path / "cache").ok
