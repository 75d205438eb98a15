"""Stage two's edit batches: an edit cache's references reach the family's forward as the batch contract says (per
sample, its reference latents on the device in the compute dtype), through the background loader, the training loop,
resume, the held-out loss; a cache and a preset that do not go together are refused before any weights load."""

import json

import pytest
import torch
from edit_testing import EDIT_PRESET, edit_preset, sample_references, write_edit_cache

from shards import Cache
from shards.references import unpack
from train.config import TrainConfig
from train.data import REFERENCES, BatchStream, Epoch, TrainingSamples, check_references, map_tensors, to_device
from train.families import get_preset
from train.order import BatchPlan

pytestmark = pytest.mark.model  # builds tiny diffusers models (left out of make test-fast)

# sample i has COUNTS[i] references: none (a text-to-image sample of a cache with edit samples too), one or two
COUNTS = [1, 2, 0, 1, 1, 2, 1, 0]


@pytest.fixture
def edit_cache(tmp_path):
    return write_edit_cache(tmp_path / "edit", COUNTS)


def stored(i: int) -> list[torch.Tensor]:
    return sample_references(i, COUNTS[i])


def index_of(key: str) -> int:
    """The sample's number as written (`write_edit_cache`), from its key."""
    return int(key[1:])


def positions(cache: Cache, numbers: list[int]) -> list[int]:
    """The cache's positions of the samples written as `numbers`."""
    at = {key: i for key, i in cache.keys()}
    return [at[f"s{n:03d}"] for n in numbers]


def test_a_batch_carries_each_samples_references_in_the_compute_dtype(edit_cache):
    cache = Cache(edit_cache)
    samples = TrainingSamples(cache, seed=0, caption_dropout=0.0, conditioning_dtype=torch.bfloat16, max_references=2)
    batch = samples.batch(0, positions(cache, [0, 2, 4, 6]))  # one bucket: 1, 0, 1 and 1 references
    assert len(batch[REFERENCES]) == 4 and [index_of(k) for k in batch["keys"]] == [0, 2, 4, 6]
    for key, refs in zip(batch["keys"], batch[REFERENCES]):
        want = stored(index_of(key))
        assert [r.shape for r in refs] == [w.shape for w in want]  # each at its own size, none for sample 2
        assert all(r.dtype == torch.bfloat16 and torch.equal(r, w.to(torch.bfloat16)) for r, w in zip(refs, want))
    assert batch["latents"].dtype == torch.float32  # the latents as ever
    moved = to_device(batch, "meta")
    assert all(r.device.type == "meta" for refs in moved[REFERENCES] for r in refs)
    assert moved["latents"].device.type == "meta" and moved["keys"] == batch["keys"]
    # what pinning does to a batch (a CUDA run's loader threads) reaches every reference
    copied = map_tensors(batch, torch.clone)
    assert all(a is not b and torch.equal(a, b) for x, y in zip(copied[REFERENCES], batch[REFERENCES]) for a, b in zip(x, y))


def test_a_cache_without_references_gives_batches_without_them(tmp_path):
    plain = write_edit_cache(tmp_path / "plain", COUNTS, references=False, preset="tiny-sana")
    assert REFERENCES not in TrainingSamples(Cache(plain), seed=0, caption_dropout=0.0).batch(0, [0])


def test_background_threads_give_the_references_the_synchronous_reader_gives(edit_cache):
    cache = Cache(edit_cache)

    def take(workers: int) -> list[dict]:
        first = Epoch(0, BatchPlan.of(cache, 2, seed=3), TrainingSamples(cache, 3, 0.0, conditioning_dtype=torch.bfloat16))
        out = []
        with BatchStream(first, workers=workers, prefetch=2, readahead=2) as stream:
            for _ in range(first.plan.batches_per_epoch()):
                out.append(next(stream))
        return out

    sync, threaded = take(0), take(2)
    assert [b["keys"] for b in sync] == [b["keys"] for b in threaded]
    for a, b in zip(sync, threaded):
        assert len(a[REFERENCES]) == len(b["keys"])
        for x, y in zip(a[REFERENCES], b[REFERENCES]):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))


def test_an_edit_preset_on_a_cache_without_references_and_the_reverse_are_refused(tmp_path, monkeypatch):
    edit_preset(monkeypatch)
    plain = Cache(write_edit_cache(tmp_path / "plain", COUNTS, references=False, preset="tiny-sana"))
    edit = Cache(write_edit_cache(tmp_path / "edit", COUNTS))
    with pytest.raises(ValueError, match=rf"{plain.location} holds no reference images.*{EDIT_PRESET} is an edit model"
                                         rf".*--model {EDIT_PRESET} .*--references"):
        check_references(plain, get_preset(EDIT_PRESET))
    with pytest.raises(ValueError, match=rf"{edit.location} is an edit cache .*built for {EDIT_PRESET}.*tiny-sana takes no "
                                         rf"reference images.*--model {EDIT_PRESET}"):
        check_references(edit, get_preset("tiny-sana"))
    check_references(edit, get_preset(EDIT_PRESET))
    check_references(plain, get_preset("tiny-sana"))
    # the trainer refuses before any weights load
    from train.loop import train

    with pytest.raises(ValueError, match="holds no reference images"):
        train(TrainConfig(model=EDIT_PRESET, cache=plain.root, run=tmp_path / "run", steps=1, validate=False, progress=False))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_sample_with_more_references_than_the_model_takes_is_named(edit_cache):
    cache = Cache(edit_cache)
    samples = TrainingSamples(cache, seed=0, caption_dropout=0.0, max_references=1)
    samples.batch(0, positions(cache, [0, 2]))
    with pytest.raises(ValueError, match="sample s001 of .* has 2 reference images; the model takes at most 1"):
        samples.batch(0, positions(cache, [1]))


def test_samples_with_references_are_never_flipped_those_without_are(tmp_path):
    cache = Cache(write_edit_cache(tmp_path / "flip", COUNTS, flip=True))
    samples = TrainingSamples(cache, seed=0, caption_dropout=0.0)
    flipped = {i: 0 for i in range(len(COUNTS))}
    for epoch in range(12):
        for i in range(len(COUNTS)):
            item = samples[(epoch, i)]
            latent = cache[i].fields["latent"]
            if torch.equal(item["latent"], -latent):
                flipped[index_of(item["key"])] += 1
            else:
                assert torch.equal(item["latent"], latent)
    assert all(flipped[i] == 0 for i, n in enumerate(COUNTS) if n)
    assert all(flipped[i] > 0 for i, n in enumerate(COUNTS) if not n)  # 12 fair draws each: never none by chance here


def run_cfg(cache, run, **kw):
    base = dict(model=EDIT_PRESET, cache=cache, run=run, steps=6, batch_size=2, progress=False, log_every=1,
                checkpoint_every=1000, caption_dropout=0.0, lr=1e-3, validate=False, workers=2)
    return TrainConfig(**{**base, **kw})


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_an_edit_run_trains_on_its_references_and_resumes_exactly(edit_cache, tmp_path, monkeypatch):
    from train.loop import train

    forward = edit_preset(monkeypatch)
    train(run_cfg(edit_cache, tmp_path / "straight", precision="bf16"))
    # every step's call got each sample's references, of their stored shapes, in the compute dtype on the device (the
    # start-up plan's calls, on the meta device, are left out)
    steps = [call for call in forward.seen if any(device == "cpu" for sample in call for _, _, device in sample)]
    assert len(steps) == 6
    shapes = sorted({tuple(s for s, _, _ in sample) for call in steps for sample in call})
    assert shapes == sorted({tuple(tuple(r.shape) for r in stored(i)) for i in range(len(COUNTS))})
    assert {(dtype, device) for call in steps for sample in call for _, dtype, device in sample} == {(torch.bfloat16, "cpu")}
    train(run_cfg(edit_cache, tmp_path / "resumed", steps=3, precision="bf16"))
    train(run_cfg(edit_cache, tmp_path / "resumed", precision="bf16"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def test_the_references_change_the_loss(tmp_path, monkeypatch):
    """The same samples with other references train to other losses: the references reach the prediction."""
    from train.loop import train

    edit_preset(monkeypatch)
    a = write_edit_cache(tmp_path / "a", COUNTS)
    b = write_edit_cache(tmp_path / "b", COUNTS, shapes=((2, 2), (5, 3)))
    train(run_cfg(a, tmp_path / "ra", steps=2, workers=0))
    train(run_cfg(b, tmp_path / "rb", steps=2, workers=0))
    assert losses(tmp_path / "ra") != losses(tmp_path / "rb")


def test_the_held_out_loss_takes_the_references(edit_cache, tmp_path, monkeypatch):
    from train.evaluate import Evaluator
    from train.model import build_run_objective

    forward = edit_preset(monkeypatch)
    preset = get_preset(EDIT_PRESET)
    cache = Cache(edit_cache)
    cfg = run_cfg(edit_cache, tmp_path / "run", eval_fraction=0.5)
    evaluator = Evaluator([cache], build_run_objective(cfg, preset, preset.transformer_config()), fraction=0.5, batch_size=2,
                          rank=0, world=1, timesteps=2, limit=0, device=torch.device("cpu"), precision=torch.bfloat16)
    model = preset.transformer_class.from_config(preset.transformer_config())
    from train.presets import model_forward

    out = evaluator.run(model_forward(model, preset.family), [model])
    assert out["eval_samples"] == evaluator.evaluated > 0 and out["eval_loss"] == out["eval_loss"]
    assert forward.seen and all(dtype == torch.bfloat16 for call in forward.seen for sample in call for _, dtype, _ in sample)
    seen = {tuple(s for s, _, _ in sample) for call in forward.seen for sample in call}
    assert seen <= {tuple(tuple(r.shape) for r in stored(i)) for i in range(len(COUNTS))}
    assert any(seen)


def test_unpacked_references_are_the_stored_ones(edit_cache):
    cache = Cache(edit_cache)
    for key, i in cache.keys():
        got, want = unpack(cache[i].fields), stored(index_of(key))
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
