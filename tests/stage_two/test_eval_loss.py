"""The held-out loss: samples of a source marked `eval = true`, or `--eval-fraction` of every source by key hash, are
left out of the data order (no batch of any epoch, rank or cache holds one; the set is stable as the cache grows);
their loss at fixed timesteps and noise is logged to metrics.jsonl, the trackers and loss.png; computing it changes
nothing of training."""

import json

import numpy as np
import pytest
import torch
from conftest import FINGERPRINT, SCHEMA, VALIDATION_PROMPTS, make_sample

from shards import Cache, ShardWriter
from train.config import TrainConfig
from train.order import BatchPlan
from train.streams import held_out, sample_fraction

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RECORDS = {"photos": {"path": "/data/photos", "repeats": 2}, "faces": {"path": "/data/faces", "repeats": 1},
           "holdout": {"path": "/data/holdout", "repeats": 1, "eval": True}}


def sourced_cache(root, indices, records=RECORDS):
    """A cache of `make_sample(i)` in shards of 3 (three buckets), every fifth sample in the `eval = true` source,
    the others in two training sources."""
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        for i in indices:
            w.write(*make_sample(i), dataset="holdout" if i % 5 == 0 else ("photos" if i % 2 else "faces"))
        w.set_extra("sources", records)
    return Cache(root)


def fractions(cache) -> dict[str, float]:
    """Each sample key's place in [0, 1) for --eval-fraction, from its recorded input."""
    names = cache.shards.datasets()
    return {key: sample_fraction(key, source, names[j]) for key, source, _, j, _ in cache.manifest.samples()}


def expected_held(cache, fraction, offset=0) -> set[int]:
    """Global indices held out, computed from the keys and sources alone."""
    names, where = cache.shards.datasets(), fractions(cache)
    out = set()
    for key, i in cache.keys():
        j, _ = cache.locate(i)
        if names[j] == "holdout" or where[key] < fraction:
            out.add(i + offset)
    return out


def trained(plan: BatchPlan, epochs: int) -> list[int]:
    return [i for e in range(epochs) for batch in plan(e) for i in batch]


@pytest.mark.parametrize("world", [1, 2])
def test_no_held_out_sample_enters_a_training_batch_in_any_epoch_or_rank(tmp_path, world):
    cache = sourced_cache(tmp_path / "c", range(90))
    held = expected_held(cache, 0.2)
    assert 20 < len(held) < 50  # the source and about a fifth of the rest
    assert {int(i) for idx, _ in held_out(cache, 0.2).values() for i in idx} == held
    seen = []
    for rank in range(world):
        plan = BatchPlan.of(cache, 2, eval_fraction=0.2, seed=3, rank=rank, world_size=world)
        seen += trained(plan, 4)
    assert not set(seen) & held
    assert set(seen) == set(range(90)) - held  # every other sample trains, every epoch
    draws = BatchPlan.of(cache, 2, eval_fraction=0.2).draws_by_source()
    names = cache.shards.datasets()
    kept = {name: sum(1 for i in set(range(90)) - held if names[cache.locate(i)[0]] == name) for name in ("photos", "faces")}
    assert draws == {"photos": 2 * kept["photos"], "faces": kept["faces"]}  # shares count what trains (repeats 2)


def test_an_image_is_held_out_at_every_resolution_or_at_none(tmp_path):
    """A fraction is drawn per input, not per key: an image's samples under two keys (at two resolutions) are held out
    or trained together, so the held-out loss never measures an image the run trains on at another resolution."""
    with ShardWriter(tmp_path / "c", FINGERPRINT, SCHEMA, max_shard_samples=4) as w:
        for i in range(60):
            for offset in (0, 1000):  # its two samples, of two keys and buckets (two resolutions, or a caption edit)
                w.write(*make_sample(i + offset), source=f"img{i}.png", dataset="photos")
    cache = Cache(tmp_path / "c")
    inputs = {i: source for i, (_, source, *_) in enumerate(cache.manifest.samples())}
    held = {int(i) for idx, _ in held_out(cache, 0.3).values() for i in idx}
    held_inputs = {inputs[i] for i in held}
    assert 5 < len(held_inputs) < 40 and len(held) == 2 * len(held_inputs)  # both copies of each held-out image
    seen = trained(BatchPlan.of(cache, 2, eval_fraction=0.3, seed=1), 3)
    assert seen and not {inputs[i] for i in seen} & held_inputs


def test_held_out_samples_stay_out_across_several_caches(tmp_path):
    a, b = sourced_cache(tmp_path / "a", range(40)), sourced_cache(tmp_path / "b", range(100, 160))
    held = expected_held(a, 0.3) | expected_held(b, 0.3, offset=len(a))
    plan = BatchPlan.of([a, b], 3, eval_fraction=0.3, weights=[1, 2], seed=1)
    seen = trained(plan, 3)
    assert seen and not set(seen) & held
    assert {i for i in seen if i >= len(a)} and {i for i in seen if i < len(a)}


def test_the_held_out_set_is_stable_as_the_cache_grows(tmp_path):
    """Membership is a function of the key alone: samples held out before are held out after a later commit; the new
    samples are held out by their own keys."""
    before = sourced_cache(tmp_path / "c", range(60))
    keys_before = {k for k, i in before.keys() if i in expected_held(before, 0.25)}
    grown = sourced_cache(tmp_path / "c", range(60, 120))
    assert len(grown) == 120
    index = dict(grown.keys())
    held = expected_held(grown, 0.25)
    assert {index[k] for k in keys_before} <= held
    seen = trained(BatchPlan.of(grown, 2, eval_fraction=0.25), 2)
    assert not set(seen) & held and set(seen) == set(range(120)) - held


def test_the_plan_without_held_out_samples_is_the_plan_it_was(tmp_path):
    """Without an eval source or fraction, the batches are those of a plan that never heard of held-out samples (the
    runs before keep their order); a held-out sample is found by bisection exactly as a filter would find it."""
    cache = sourced_cache(tmp_path / "c", range(45), records={k: v for k, v in RECORDS.items() if k != "holdout"} |
                          {"holdout": {"path": "/data/holdout", "repeats": 1}})
    assert BatchPlan.of(cache, 2, seed=5)(1) == BatchPlan.of(cache, 2, seed=5, eval_fraction=0.0)(1)
    plan = BatchPlan({}, 1, held_out=np.array([2, 5, 6, 7, 11, 30]))
    kept = [i for i in range(50) if i not in {2, 5, 6, 7, 11, 30}]
    for start in (0, 3, 5, 8, 12):
        after = [i for i in kept if i >= start]
        assert [plan._trained(start, r) for r in range(len(after))] == after


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "none"])
def test_the_fixed_flow_timesteps_are_quantiles_of_the_training_density(scheme):
    """The eval loss averages the training loss over the density training draws from: each fixed noise level is a
    quantile (k + 1/2) / n of the drawn ones, shifted alike."""
    from train.objectives import DDPM, FlowMatching

    flow = FlowMatching(weighting_scheme=scheme, shift=3.0)
    drawn = flow.sigmas(200_000, 1024 * 1024, torch.Generator().manual_seed(0))
    fixed = flow.fixed_times(8, 1024 * 1024)
    below = (drawn[None, :] < fixed[:, None]).float().mean(1)
    assert torch.allclose(below, (torch.arange(8) + 0.5) / 8, atol=0.01)
    assert DDPM().fixed_times(4, 0).tolist() == [125, 375, 625, 875]


def test_an_eval_source_is_read_from_the_dataset_file_and_recorded(tmp_path):
    from precompute.sources import read_dataset_file

    file = tmp_path / "data.toml"
    file.write_text('[[source]]\npath = "/a"\n[[source]]\npath = "/b"\neval = true\n')
    a, b = read_dataset_file(file)
    assert not a.eval and b.eval and b.record() == {"path": "/b", "repeats": 1, "eval": True}
    assert "eval" not in a.record() and a.salt() == b.salt() == 0  # the cached samples do not change
    file.write_text('[[source]]\npath = "/a"\neval = "yes"\n')
    with pytest.raises(ValueError, match=r"data.toml:3: source 'a': eval = 'yes': must be true or false"):
        read_dataset_file(file)


def test_eval_batches_take_turns_and_a_limit_keeps_a_fixed_random_subset_read_in_index_order():
    from shards import Bucket
    from train.evaluate import eval_batches
    from train.streams import Stream

    big, small = Stream(Bucket(64, 64), "a"), Stream(Bucket(48, 80), "a")
    held = {big: (np.arange(10), np.linspace(0.9, 0.0, 10)), small: (np.arange(20, 23), np.array([0.3, 0.1, 0.2]))}
    every = eval_batches(held, 4, None)
    assert [(b.indices, b.real) for b in every] == [([0, 1, 2, 3], 4), ([20, 21, 22, 20], 3), ([4, 5, 6, 7], 4),
                                                    ([8, 9, 0, 1], 2)]  # short batches completed, the extras not counted
    assert [b.indices for b in eval_batches(held, 4, None, limit=1)] == [[6, 7, 8, 9]]  # the four lowest in key order
    assert [b.indices for b in eval_batches(held, 4, None, limit=2)] == [[6, 7, 8, 9], [20, 21, 22, 20]]


# ---- end to end --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny-sana cache of 16 sample images with validation prompts."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("eval")
    precompute(str(make_folder(root / "data", count=16)), "tiny-sana", root / "cache", workers=0, progress=False,
               validation_prompt=VALIDATION_PROMPTS)
    return root / "cache"


def config(cache, run, **kw) -> TrainConfig:
    base = dict(model="tiny-sana", cache=[str(cache)], run=str(run), steps=4, batch_size=2, workers=0, progress=False,
                log_every=1, checkpoint_every=2, precision="fp32", validate=False, eval_fraction=0.3, eval_timesteps=3)
    return TrainConfig(**{**base, **kw})


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trained_keys(monkeypatch) -> list[str]:
    """The keys of every batch a training step takes, from here on."""
    from train.step import TrainStep

    keys, accumulate = [], TrainStep.accumulate
    monkeypatch.setattr(TrainStep, "accumulate", lambda self, batch, step: keys.extend(batch["keys"]) or accumulate(self, batch, step))
    return keys


def test_the_held_out_loss_is_logged_and_its_samples_never_train(cache, tmp_path, monkeypatch):
    from train.loop import train

    keys = trained_keys(monkeypatch)
    train(config(cache, tmp_path / "run", steps=6, eval_every=2, report_to=["tensorboard"]))
    held = {k for k, f in fractions(Cache(cache)).items() if f < 0.3}
    assert held and keys and not set(keys) & held
    logged = rows(tmp_path / "run")
    evaluated = [r for r in logged if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4, 6]
    for r in evaluated:
        assert np.isfinite(r["eval_loss"]) and r["eval_samples"] == len(held) and len(r["eval_loss_by_timestep"]) == 3
        assert r["eval_loss"] == pytest.approx(np.mean(r["eval_loss_by_timestep"]))
    assert all("loss" in r for r in logged)  # every row is a training row; the held-out loss joins its step's
    assert (tmp_path / "run" / "loss.png").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/loss")] == \
        [(r["step"], pytest.approx(r["eval_loss"])) for r in evaluated]


def test_computing_the_held_out_loss_changes_nothing_of_training(cache, tmp_path):
    """A run that evaluates every step trains exactly as one that evaluates only at the end (the same losses step for
    step), and both report the same held-out loss of the same weights; a resumed run too (fixed noise and
    timesteps: the number depends on the weights alone)."""
    from train.loop import train

    train(config(cache, tmp_path / "often", eval_every=1))
    train(config(cache, tmp_path / "end", eval_every=0))
    train(config(cache, tmp_path / "resumed", steps=2, eval_every=1))
    train(config(cache, tmp_path / "resumed", eval_every=1))
    often, end, resumed = rows(tmp_path / "often"), rows(tmp_path / "end"), rows(tmp_path / "resumed")
    assert [r["loss"] for r in often] == [r["loss"] for r in end] == [r["loss"] for r in resumed]
    assert [r["step"] for r in often if "eval_loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in end if "eval_loss" in r] == [4]
    assert often[-1]["eval_loss"] == end[-1]["eval_loss"] == resumed[-1]["eval_loss"]
    assert [r["eval_loss"] for r in often] == [r["eval_loss"] for r in resumed]
    assert len({r["eval_loss"] for r in often}) == 4  # it moves with the weights


def test_an_eval_source_is_evaluated_per_source_and_eval_batches_limits_it(tmp_path, monkeypatch):
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder
    from train.loop import train

    data = tmp_path / "data.toml"
    make_folder(tmp_path / "a", count=6, seed=1)
    make_folder(tmp_path / "b", count=4, seed=2)
    data.write_text('[[source]]\npath = "a"\n[[source]]\npath = "b"\neval = true\n')
    precompute(str(data), "tiny-sana", tmp_path / "cache", workers=0, progress=False, validation_prompt=VALIDATION_PROMPTS)
    built = Cache(tmp_path / "cache")
    eval_keys = {k for k, i in built.keys() if built.shards.datasets()[built.locate(i)[0]] == "b"}
    keys = trained_keys(monkeypatch)
    train(config(tmp_path / "cache", tmp_path / "run", eval_fraction=0.5, eval_every=2))
    assert eval_keys and keys and not set(keys) & eval_keys
    last = rows(tmp_path / "run")[-1]
    assert set(last["eval_loss_by_source"]) == {"a", "b"} and last["samples_by_source"] == {"a": 8}
    where = fractions(built)
    assert last["eval_samples"] == len(eval_keys) + sum(1 for k, f in where.items() if k not in eval_keys and f < 0.5)
    train(config(tmp_path / "cache", tmp_path / "limited", eval_fraction=0.5, eval_batches=1, steps=1))
    assert 1 <= rows(tmp_path / "limited")[-1]["eval_samples"] <= 2 < last["eval_samples"]  # one batch of at most 2
    everything = min(max(f for k, f in where.items() if k not in eval_keys) + 1e-9, 0.999999)
    with pytest.raises(ValueError, match="is held out .*nothing to train on"):
        train(config(tmp_path / "cache", tmp_path / "none", eval_fraction=everything))


def test_a_run_resumes_only_with_the_fraction_it_held_out(cache, tmp_path):
    from train.loop import train

    train(config(cache, tmp_path / "run", steps=1))
    with pytest.raises(ValueError, match="--eval-fraction 0.3, this run has 0.2: which samples train"):
        train(config(cache, tmp_path / "run", eval_fraction=0.2))


@pytest.mark.slow
def test_two_ranks_share_the_held_out_batches_and_report_what_one_process_does(cache, tmp_path):
    """Under DDP each rank evaluates its slice of every held-out batch and the sums are reduced: the same held-out loss
    as one process with the global batch (and the same training losses)."""
    from conftest import train_processes

    args = ["--model", "tiny-sana", "--cache", str(cache), "--steps", "2", "--precision", "fp32", "--log-every", "1",
            "--no-validate", "--no-progress", "--workers", "0", "--eval-fraction", "0.3", "--eval-every", "1",
            "--eval-timesteps", "2"]
    train_processes(1, tmp_path / "one", *args, "--batch-size", "4")
    train_processes(2, tmp_path / "two", *args, "--batch-size", "2")
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["eval_loss"] for r in two] == pytest.approx([r["eval_loss"] for r in one], rel=1e-5)
    assert one[-1]["eval_samples"] == two[-1]["eval_samples"] > 0


def test_loss_png_draws_the_held_out_loss_beside_the_training_loss(tmp_path, monkeypatch):
    import matplotlib.axes

    from train.metrics import plot_losses

    drawn, plot = {}, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: drawn.update({k.get("label"): (x, y)})
                        or plot(self, x, y, *a, **k))
    rows = [{"step": s, "loss": 1.0 / s, "smoothed_loss": 1.0 / s} for s in (1, 2, 3, 4)]
    rows[1] |= {"eval_loss": 0.7}
    rows[3] |= {"eval_loss": 0.6}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_losses(tmp_path)
    assert drawn["held-out (eval)"] == ([2, 4], [0.7, 0.6]) and drawn["loss"][0] == [1, 2, 3, 4]
    assert (tmp_path / "loss.png").stat().st_size > 0
