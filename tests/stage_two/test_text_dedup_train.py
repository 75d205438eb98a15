"""Texts stored once, end to end: stage one encodes each distinct caption once and stores it once, a DreamBooth set of
one prompt holds one text, resume/repair/removal keep every reference whole, and training reads the same batches
and losses from a cache that stores texts once as from the same data stored with each sample."""

import json
import threading
from pathlib import Path

import pytest
import torch

from precompute.encode import Encoders
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache, verify
from train.config import TrainConfig
from train.data import BatchStream, Epoch, TrainingSamples
from train.loop import train
from train.order import BatchPlan

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RUN = dict(workers=0, progress=False)
PROMPT = "a photo of sks dog"


def dreambooth(root: Path, count: int) -> Path:
    """`count` sample images, every one captioned with the one prompt."""
    data = make_folder(root, count=count)
    for caption in data.glob("*.txt"):
        caption.write_text(PROMPT + "\n")
    return data


def files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors") if "_snapshots" not in p.parts)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_reads_the_same_batches_and_losses_from_either_layout(tmp_path):
    data = make_folder(tmp_path / "data", count=8)
    precompute(str(data), "tiny-sana", tmp_path / "once", **RUN, validation_prompt=("a red circle",))
    precompute(str(data), "tiny-sana", tmp_path / "inline", **RUN, dedup_texts=False, validation_prompt=("a red circle",))
    once, inline = Cache(tmp_path / "once"), Cache(tmp_path / "inline")
    assert once.manifest.text_schema is not None and inline.manifest.text_schema is None
    assert once.schema == inline.schema and once.fingerprint == inline.fingerprint  # the same values, laid out otherwise
    by_key = dict(inline.keys())
    for key, i in once.keys():
        a, b = once[i].fields, inline[by_key[key]].fields
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a), key
    batches = []
    for cache in (once, inline):
        samples = TrainingSamples(cache, seed=3, caption_dropout=0.3)
        plan = BatchPlan(cache.ranges_by_bucket(), 4, seed=3)
        with BatchStream(Epoch(0, plan, samples), workers=0, readahead=100) as stream:
            batches.append([next(stream) for _ in range(plan.batches_per_epoch())])
            # the read-ahead walks the epoch (an epoch that fails to open ends its walk there)
            stream.add_epoch(Epoch(1, None, None, error=RuntimeError("the end of the test")))
            walker = threading.Thread(target=stream._read_ahead)
            walker.start()
            walker.join()
            assert stream.read_ahead["failed"] == 0
            texts = len(cache.texts.paths()) if cache.texts is not None else 0
            assert stream.read_ahead["shards"] == len(cache.shards) + texts  # the text shards are read ahead too
    for x, y in zip(*batches):
        assert x["keys"] == y["keys"]
        for name in ("latents", "text", "text_mask"):
            assert torch.equal(x[name], y[name]), name
    for name in ("once", "inline"):
        train(TrainConfig(model="tiny-sana", cache=tmp_path / name, run=tmp_path / f"run-{name}", steps=6, batch_size=4,
                          progress=False, log_every=1, checkpoint_every=1000, caption_dropout=0.2, lr=1e-3, validate=False))
    assert [r["loss"] for r in metrics(tmp_path / "run-once")] == [r["loss"] for r in metrics(tmp_path / "run-inline")]


def test_a_dreambooth_set_stores_its_prompt_once_through_resume_removal_and_repair(tmp_path, monkeypatch):
    encoded = []  # every caption the text encoder is given
    real = Encoders.encode_text
    monkeypatch.setattr(Encoders, "encode_text", lambda self, captions, *a, **k: encoded.extend(captions) or real(self, captions, *a, **k))
    data = dreambooth(tmp_path / "data", 24)
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, **RUN, batch_size=4, max_shard_mb=1)
    assert encoded.count(PROMPT) == 1  # six batches of four images, one encoding
    stats = Cache(cache).manifest.text_stats()
    assert stats["texts"] == 1 and stats["references"] == 24
    precompute(str(data), "tiny-sana", tmp_path / "inline", **RUN, batch_size=4, dedup_texts=False)
    before, after = files_bytes(tmp_path / "inline"), files_bytes(cache)
    print(f"\n24 images, one prompt (tiny-sana): {before} bytes stored with each sample, {after} stored once")
    assert before - after >= stats["saved"] > 0.8 * stats["inline_bytes"]  # less the keys and a text shard's header

    # more images of the same prompt: nothing is encoded or stored again for the text
    more = dreambooth(tmp_path / "data", 30)  # the same 24 and 6 more
    encoded.clear()
    precompute(str(more), "tiny-sana", cache, **RUN, batch_size=4)
    assert PROMPT not in encoded  # cached: the new images refer to it
    stats = Cache(cache).manifest.text_stats()
    assert stats["texts"] == 1 and stats["references"] == 30 and verify(cache).ok

    # a damaged text shard is re-encoded by --repair from the caption the manifest keeps
    text_shard = cache / Cache(cache).texts.paths()[0]
    data_bytes = bytearray(text_shard.read_bytes())
    data_bytes[-40] ^= 0x10
    text_shard.write_bytes(bytes(data_bytes))
    assert not verify(cache).ok
    summary = precompute(str(more), "tiny-sana", cache, **RUN, repair=True)
    assert summary["repaired_text_shards"] == 1 and verify(cache).ok
    repaired = Cache(cache, check_digests=True)
    assert all(repaired[i].fields["text_lengths"].tolist() == [len(repaired[0].fields["text"])] for i in range(len(repaired)))

    # images removed: their samples go; the text stays while any sample refers to it, and goes with the last
    for image in sorted(more.glob("*.png"))[:10]:
        image.unlink()
    precompute(str(more), "tiny-sana", cache, **RUN, allow_removal=True)
    assert Cache(cache).manifest.text_stats()["references"] == 20 and verify(cache).ok
    for image in more.glob("*.png"):
        image.unlink()
    for caption in more.glob("*.txt"):
        caption.unlink()
    precompute(str(more), "tiny-sana", cache, **RUN, allow_removal=True)
    assert Cache(cache).manifest.text_stats() == {**Cache(cache).manifest.text_stats(), "texts": 0, "references": 0}
    assert verify(cache).ok
