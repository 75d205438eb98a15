"""Stage one's encoder runs on a thread of its own, fed batches the pass prepares while it encodes: the cache written
is the serial pass's byte for byte, a failure in the encoder or the writer stops the run on the calling thread with
its own exception (what was committed is a valid prefix of the inputs), and the summary names the stage that bounds
the run with the advice that fits."""

import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

import precompute.run
import shards.writer
from bench.encoder_busy import SimulatedEncoders
from precompute.encode import Encoders
from precompute.encoding import EncodingPass
from precompute.report import BOUND_ADVICE, bound_by
from precompute.sample_data import make_folder
from shards import Cache, CacheLock, verify
from shards.lock import WRITERS_LOCK
from shards.texts import TEXT_DIR

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

COUNT = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "shapes", count=COUNT)


def run(data, cache, overlap: bool = True, monkeypatch=None, **kw):
    options = dict(workers=0, progress=False, max_shard_mb=0, batch_size=1) | kw
    if monkeypatch is not None and not overlap:
        monkeypatch.setattr(precompute.run, "EncodingPass", partial(EncodingPass, overlap=False))
    return precompute.run.main(str(data), "tiny-sana", Path(cache), **options)


def shard_bytes(cache: Path) -> dict[str, bytes]:
    """Every sample and text shard of a cache, by its path."""
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(cache.rglob("*.safetensors"))}


def committed_sources(cache: Path) -> list[str]:
    """The inputs of the cache's samples, in the order they were committed (shard by shard)."""
    c = Cache(cache)
    return [bytes(c[i]["source"].tolist()).decode() for i in range(len(c))]


def free_locks(cache: Path) -> None:
    for name in (".lock", ".lock-r00000", WRITERS_LOCK):
        CacheLock(cache, name).release()


def pass_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("encoder", "shard-writer")]


@pytest.mark.parametrize("dedup_texts", [True, False], ids=["texts-stored-once", "texts-with-samples"])
def test_the_overlapped_pass_writes_the_serial_pass_cache(tmp_path, monkeypatch, dedup_texts):
    """Two sources, one with flipped latents, batches of 3 over several buckets (full and partial ones): the encoder
    on its own thread writes the same shards, byte for byte, as the encoder called between the pass's steps."""
    flipped = make_folder(tmp_path / "flipped", count=6, seed=3)
    file = tmp_path / "data.toml"
    file.write_text(f'[[source]]\nname = "plain"\npath = "{make_folder(tmp_path / "plain", count=6)}"\n\n'
                    f'[[source]]\nname = "flipped"\npath = "{flipped}"\nflip = true\n')
    options = dict(batch_size=3, max_shard_mb=1, storage_dtype="bf16", dedup_texts=dedup_texts)
    overlapped = run(file, tmp_path / "overlapped", **options)
    serial = run(file, tmp_path / "serial", overlap=False, monkeypatch=monkeypatch, **options)
    assert overlapped["new"] == serial["new"] == 12
    ours, theirs = shard_bytes(tmp_path / "overlapped"), shard_bytes(tmp_path / "serial")
    assert any(name.startswith(TEXT_DIR) for name in ours) == dedup_texts and len(ours) > 2
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)
    assert list(Cache(tmp_path / "overlapped").manifest.samples()) == list(Cache(tmp_path / "serial").manifest.samples())


class Published:
    """Counts sample-shard publications (text shards left out) and lets a test wait for a count or fail one."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.changed = threading.Condition()
        self.fail_at: int | None = None
        self.error = RuntimeError("the disk went away")
        publish = shards.writer.write_shard_file

        def write_shard_file(root, bucket, rank, seq, data, folder=None):
            if folder != TEXT_DIR:
                if self.count + 1 == self.fail_at:
                    raise self.error
                out = publish(root, bucket, rank, seq, data, folder)
                with self.changed:
                    self.count += 1
                    self.changed.notify_all()
                return out
            return publish(root, bucket, rank, seq, data, folder)

        monkeypatch.setattr(shards.writer, "write_shard_file", write_shard_file)

    def wait_for(self, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count >= n, timeout=60)


def test_an_encoder_failure_stops_the_run_with_its_exception(folder, tmp_path, monkeypatch):
    """The third encoder call fails on the encoder's thread, once the two batches before it are published: the run
    raises that exception on the calling thread, no batch after it is encoded or written, both threads end, the cache
    holds exactly the first two inputs (in the serial pass's order) and a re-run completes it."""
    serial = tmp_path / "serial"
    run(folder, serial)
    order = committed_sources(serial)
    published = Published(monkeypatch)
    encode, calls, failure = Encoders.encode_images, [], MemoryError("CUDA out of memory (simulated)")

    def encode_images(enc, pixels):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            assert published.wait_for(2)
            raise failure
        return encode(enc, pixels)

    monkeypatch.setattr(Encoders, "encode_images", encode_images)
    cache = tmp_path / "cache"
    with pytest.raises(MemoryError) as raised:
        run(folder, cache)
    assert raised.value is failure
    assert calls == ["encoder"] * 3 and not pass_threads()
    assert committed_sources(cache) == order[:2] and verify(cache).ok
    free_locks(cache)
    monkeypatch.undo()
    summary = run(folder, cache)
    assert summary["unchanged"] == 2 and summary["new"] == COUNT - 2 and verify(cache).ok


def test_a_writer_failure_stops_the_encoder_and_the_run(folder, tmp_path, monkeypatch):
    """The second shard's publication fails on the writer's thread while the encoder works ahead: the run raises the
    writer's exception, both threads end, the first shard stays committed and valid, and a re-run completes the cache."""
    published = Published(monkeypatch)
    published.fail_at = 2
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as raised:
        run(folder, cache)
    assert raised.value is published.error and not pass_threads()
    assert len(Cache(cache)) == 1 and verify(cache).ok
    free_locks(cache)
    monkeypatch.undo()
    summary = run(folder, cache)
    assert summary["unchanged"] == 1 and summary["new"] == COUNT - 1 and verify(cache).ok


@pytest.fixture(scope="module")
def simulated(folder):
    """The tiny Sana encoders, their calls simulated (`bench.encoder_busy`): outputs computed once."""
    config = precompute.run.PrecomputeConfig(str(folder), "tiny-sana")
    enc = SimulatedEncoders(config.preset(), torch.device("cpu"), rate=1.0)
    enc.warm([(b.height, b.width) for b in config.policy().buckets],
             [p.read_text(encoding="utf-8").strip() for p in sorted(Path(folder).glob("*.txt"))])
    return enc


def test_a_slow_loader_makes_the_summary_say_decoding_bounds(folder, tmp_path, monkeypatch, capsys, simulated):
    """Each input takes 50 ms to decode against 1 ms to encode: the encoder waits for decoded inputs most of the pass,
    and the summary says so with the advice to raise --workers."""
    simulated.rate = 1000.0
    monkeypatch.setattr(precompute.run, "Encoders", lambda *a, **k: simulated)
    build = precompute.run.build_loader

    def slow_loader(*args):
        for item in build(*args):
            time.sleep(0.05)  # the decoding's cost, simulated (not an ordering of events)
            yield item

    monkeypatch.setattr(precompute.run, "build_loader", slow_loader)
    summary = run(folder, tmp_path / "cache")
    assert summary["bound_by"] == "decoding", summary
    assert summary["data_wait_fraction"] > 0.5 and summary["encoder_busy_fraction"] < 0.5
    err = capsys.readouterr().err
    assert f"  {BOUND_ADVICE['decoding']}\n" in err and "raise --workers" in err


def test_a_slow_encoder_makes_the_summary_say_the_encoder_bounds(folder, tmp_path, monkeypatch, capsys, simulated):
    """An encoder of 4 samples/s in batches of 2 (500 ms a call) behind inputs decoded in a few milliseconds: it is
    busy at least 95 % of the pass (the first batch's decoding aside, it never waits), which the summary says needs
    nothing done."""
    simulated.rate = 4.0
    monkeypatch.setattr(precompute.run, "Encoders", lambda *a, **k: simulated)
    summary = run(folder, tmp_path / "cache", batch_size=2, max_shard_mb=128)
    assert summary["bound_by"] == "encoder" and summary["encoder_busy_fraction"] >= 0.95, summary
    assert f"  {BOUND_ADVICE['encoder']}\n" in capsys.readouterr().err


@pytest.mark.parametrize("shares, bound", [
    ({"encoder_busy_fraction": 0.97, "data_wait_fraction": 0.02, "writer_wait_fraction": 0.01}, "encoder"),
    ({"encoder_busy_fraction": 0.60, "data_wait_fraction": 0.35, "writer_wait_fraction": 0.02}, "decoding"),
    ({"encoder_busy_fraction": 0.70, "data_wait_fraction": 0.05, "writer_wait_fraction": 0.20}, "writer"),
    ({"encoder_busy_fraction": 0.80, "data_wait_fraction": 0.05, "writer_wait_fraction": 0.03}, "pass"),
])
def test_the_bound_is_what_the_encoder_idled_for_most(shares, bound):
    assert bound_by(shares) == bound


def test_the_encoder_thread_takes_a_cuda_device_without_an_index(monkeypatch):
    """Encoders on `torch.device("cuda")` (the current card, no index): the encoder's calls run inside
    `torch.cuda.device` of it, which takes such a device (`torch.cuda.set_device` refuses it), and only there."""
    import contextlib
    import types

    inside = []

    @contextlib.contextmanager
    def device(d):
        inside.append(d)
        yield
        inside.append(None)

    def set_device(d):
        raise ValueError(f"Expected a cuda device with a specified index or an integer, but got:{d}")

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    calls = []
    run_pass = types.SimpleNamespace(enc=types.SimpleNamespace(device=torch.device("cuda"), encode_text="encode_text"),
                                     text_batch_size=2, encoded=lambda fn, *args: calls.append((fn, list(inside))) or fn)
    batch = types.SimpleNamespace(pixels=None, reference_groups=[], captions=["a", "b", "c"], encode_texts=[0, 2],
                                  text_references=None, texts=[])
    EncodingPass.encode(run_pass, batch)
    assert calls == [("encode_text", [torch.device("cuda")])] and inside == [torch.device("cuda"), None]
    run_pass.enc.device, inside[:], calls[:] = torch.device("cpu"), [], []
    EncodingPass.encode(run_pass, batch)
    assert calls == [("encode_text", [])] and inside == []
