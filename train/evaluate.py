"""The held-out loss: the training loss of samples no batch trains on, at fixed timesteps and noise.

The held-out samples are the plan's (`train.streams.held_out`: sources stage one marked `eval = true`, and
`--eval-fraction` of the others by key hash); training never draws them. Every `--eval-every` steps each of them is
taken at `--eval-timesteps` fixed noise levels (the training density's quantiles, `fixed_times`) with noise fixed by
its key and the level, its latent the cached posterior's mean (or the deterministic latent), its first caption and an edit sample's
references, never dropped or flipped. So the number moves only with the weights: comparable across steps, runs, resumes and world
sizes, drawn beside the training loss (it is the same loss, averaged over the same density).

It runs without gradients, in eval mode (no dropout), on the trained weights (the ones the training loss measures;
an EMA's quality is what the validation grids show), and draws nothing from any RNG the training reads: a run with
it trains exactly as one without. Ranks split every global batch as training does and sum their losses; every rank
runs the same number of forwards of the same shapes (the last batch of a stream is completed with its first samples,
which count for nothing), so FSDP's gathers line up. Memory: a forward without gradients, at most the training
batch's: nothing the memory planner need add.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from shards.options import DTYPES
from shards.references import unpack as unpack_references
from train import distributed
from train.config import TrainConfig
from train.data import REFERENCES, TextLayout, has_references, sample_mask, to_device
from train.families import get_family, get_preset
from train.families.base import ModelPreset
from train.order import derived_seed
from train.presets import model_forward
from train.streams import cache_labels, held_out, holds_out

EVAL_NOISE = 4_000_037  # a stream of seeds of its own: no seed a training draw uses


@dataclass(frozen=True)
class EvalBatch:
    """A global batch of held-out samples: one source and bucket, `indices` (global, `batch_size x world` long) of
    which the first `real` count (the rest complete the batch)."""

    source: str
    indices: list[int]
    where: list[float]  # each sample's sample_fraction: its noise seed
    real: int


def eval_batches(held: dict, global_size: int, labels: list[str] | None, limit: int = 0) -> list[EvalBatch]:
    """The held-out samples (`train.streams.held_out`) as global batches, each of one stream (source and bucket). Streams
    take turns batch by batch and `limit` (0: all) keeps the first batches of that order, so every stream is evaluated
    on as many as it can be; a stream cut short keeps the samples first in key-hash order (a random subset of it, the
    same every time). A stream's batches read its samples in index order: shard by shard."""
    sizes = {stream: -(-len(indices) // global_size) for stream, (indices, _) in held.items()}
    if limit:  # batches each stream gets in the first `limit` of the turns
        turns = [stream for k in range(max(sizes.values(), default=0)) for stream in held if k < sizes[stream]][:limit]
        sizes = {stream: turns.count(stream) for stream in held}
    per_stream = []
    for stream, (indices, where) in held.items():
        keep = np.sort(np.argsort(where, kind="stable")[: sizes[stream] * global_size])
        indices, where = indices[keep], where[keep]
        name = stream.source if labels is None else f"{labels[stream.cache]}/{stream.source}"
        batches = []
        for a in range(0, len(indices), global_size):
            take = np.arange(a, a + global_size) % len(indices)  # a short last batch: completed from the start
            batches.append(EvalBatch(name, indices[take].tolist(), where[take].tolist(), min(global_size, len(indices) - a)))
        per_stream.append(batches)
    return [batches[k] for k in range(max(map(len, per_stream), default=0)) for batches in per_stream if k < len(batches)]


class Evaluator:
    """The run's held-out loss (see the module's docstring).

    Args:
        caches: the run's caches (the generations it started with: the held-out set stays fixed for the run).
        objective: the run's `FlowMatching` or `DDPM`.
        fraction: `--eval-fraction`.
        batch_size, rank, world: the run's (every global batch is split as training splits it).
        timesteps: the fixed noise levels per sample.
        limit: at most this many global batches (0: all).
        control: ControlNet runs: batches carry the samples' control latents.
        conditioning: the cached fields the family's transformer takes beside the latents (`Family.conditioning_fields`).
        device, precision: where and under which autocast dtype the forwards run.
    """

    def __init__(self, caches: list, objective, *, fraction: float, batch_size: int, rank: int, world: int,
                 timesteps: int, limit: int, device: torch.device, precision: torch.dtype, control: bool = False,
                 conditioning: tuple[str, ...] = ()):
        self.caches, self.objective, self.control = caches, objective, control
        self.conditioning, self.precision = tuple(conditioning), precision
        self.batch_size, self.rank, self.timesteps, self.device = batch_size, rank, timesteps, device
        self.starts = np.cumsum([0] + [len(c) for c in caches])
        labels = cache_labels([c.location for c in caches]) if len(caches) > 1 else None
        held = held_out(caches, fraction)
        self.samples = {}  # held-out samples per source
        for stream, (indices, _) in held.items():
            name = stream.source if labels is None else f"{labels[stream.cache]}/{stream.source}"
            self.samples[name] = self.samples.get(name, 0) + len(indices)
        self.batches = eval_batches(held, batch_size * world, labels, limit)
        self.evaluated = sum(b.real for b in self.batches)
        self.sources = sorted({b.source for b in self.batches})
        self.layouts = [TextLayout.of(c) for c in caches]
        self.autocast = torch.autocast(device.type, dtype=precision, enabled=precision != torch.float32)

    def __bool__(self) -> bool:
        return bool(self.batches)

    def describe(self) -> str:
        held = ", ".join(f"{name or '(unnamed)'} {n}" for name, n in sorted(self.samples.items()))
        return (f"held-out loss on {self.evaluated} of {sum(self.samples.values())} held-out samples ({held}), "
                f"{len(self.batches)} batch(es) at {self.timesteps} fixed timesteps each")

    def _batch(self, eb: EvalBatch) -> dict:
        """This rank's slice of a held-out batch, on the device, with its noise and which samples count."""
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        indices, where = eb.indices[mine], eb.where[mine]
        k = int(np.searchsorted(self.starts, indices[0], side="right")) - 1
        cache, layout = self.caches[k], self.layouts[k]
        latent = cache.spec.latent
        latents, controls, conds, masks, references = [], [], [], [], []
        fields: dict[str, list[torch.Tensor]] = {name: [] for name in self.conditioning}
        for i in indices:
            s = cache[i - int(self.starts[k])]
            shape = latent.shape(*s.bucket)  # a clip's (C, T, h, w)
            latents.append(s.fields[latent.fields[0]].float().reshape(shape))  # the posterior's mean, or the latent
            if self.control:
                controls.append(s.fields[latent.control_fields[0]].float().reshape(shape))
            conds.append(layout.caption(s.fields, 0))
            if getattr(self.objective, "masked_loss", False):  # the training loss's mask weights this loss too
                masks.append(sample_mask(s.fields, shape[-2:]))
            for name in self.conditioning:
                fields[name].append(s.fields[name])
            if has_references(cache):  # an edit sample's references, as training takes them
                references.append([r.to(self.precision) for r in unpack_references(s.fields)])
        batch = {"latents": torch.stack(latents), **({"control": torch.stack(controls)} if self.control else {}),
                 **({"mask": torch.stack(masks)} if masks else {}),
                 **{name: torch.stack(rows).to(self.precision) for name, rows in fields.items()},
                 **({REFERENCES: references} if references else {}),
                 **layout.collate(conds), "bucket": tuple(s.bucket)}
        batch = to_device(batch, self.device)
        position = self.rank * self.batch_size + torch.arange(len(indices))
        batch["weight"] = (position < eb.real).float().to(self.device)  # (B,) 0 for the samples completing the batch
        batch["where"] = where
        return batch

    def _noise(self, where: list[float], t: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The fixed noise of each sample (by its key) at level `t` (B, C, h, w) or (B, C, T, h, w), drawn on the CPU: the same numbers on
        any device."""
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
            derived_seed(EVAL_NOISE, int(w * 2**53), t))) for w in where]).to(self.device)

    @torch.no_grad()
    def run(self, forward, modules: list[torch.nn.Module]) -> dict:
        """The held-out loss of the weights now: {"eval_loss", "eval_loss_by_source" (with several sources),
        "eval_loss_by_timestep", "eval_samples", "eval_s"}, the same on every rank. `forward`: the family's call of the
        trained weights (`train.presets.model_forward`, or the ControlNet run's), unwrapped from DDP; `modules`: the
        trained modules, put in eval mode for the pass."""
        t0 = time.perf_counter()
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        k = len(self.sources)
        sums = torch.zeros(k + self.timesteps, 2, dtype=torch.float64, device=self.device)  # per source, per level
        try:
            for eb in self.batches:
                batch = self._batch(eb)
                weight, where = batch.pop("weight"), batch.pop("where")
                x0 = batch["latents"]
                times = self.objective.fixed_times(self.timesteps, batch["bucket"][0] * batch["bucket"][1])
                row = self.sources.index(eb.source)
                for j, t in enumerate(times.tolist()):
                    noise = self._noise(where, j, tuple(x0.shape[1:]))
                    level = torch.full((x0.shape[0],), t, device=self.device, dtype=times.dtype)
                    with self.autocast:
                        loss = self.objective.loss_at(forward, batch, level, noise).double()
                    total = torch.stack([(loss * weight).sum(), weight.double().sum()])
                    sums[row] += total
                    sums[k + j] += total
        finally:
            for m, mode in zip(modules, was):
                m.train(mode)
        flat = distributed.sum_across(sums.flatten().tolist(), self.device)
        per = [(flat[2 * r], flat[2 * r + 1]) for r in range(k + self.timesteps)]
        total = sum(s for s, _ in per[:k]), sum(n for _, n in per[:k])
        out = {"eval_loss": total[0] / total[1] if total[1] else float("nan"),
               "eval_loss_by_timestep": [s / n if n else None for s, n in per[k:]],
               "eval_samples": self.evaluated}
        if k > 1:
            out["eval_loss_by_source"] = {name or "(unnamed)": s / n for name, (s, n) in zip(self.sources, per[:k]) if n}
        out["eval_s"] = time.perf_counter() - t0
        return out


def eval_due(step: int, every: int, last: int) -> bool:
    """Whether the held-out loss is computed after `step`: every `every` steps (0: only at the end) and at the last."""
    return (every > 0 and step % every == 0) or step == last


def build_evaluator(cfg: TrainConfig, group: list, objective, rank: int, world: int, device: torch.device) -> Evaluator | None:
    """The held-out loss of the run's caches (the generations it started with), or None when nothing is held out."""
    if not holds_out(group, cfg.eval_fraction):
        return None
    evaluator = Evaluator(group, objective, fraction=cfg.eval_fraction, batch_size=cfg.batch_size, rank=rank, world=world,
                          timesteps=cfg.eval_timesteps, limit=cfg.eval_batches, device=device,
                          precision=DTYPES[cfg.precision], control=cfg.controlnet,
                          conditioning=get_family(get_preset(cfg.model).family).conditioning_fields(group[0].spec))
    return evaluator if evaluator else None


def evaluate(evaluator: Evaluator, model, cfg: TrainConfig, preset: ModelPreset, controlled) -> dict:
    """The held-out loss of the weights now, computed with the module itself (not through DDP: no collective but the
    loss sums; FSDP's module is its own), the ControlNet run's with its ControlNet."""
    forward = controlled or model_forward(model.module, preset.family, guidance=cfg.train_guidance)
    return evaluator.run(forward, [m for m in (model.module, model.controlnet) if m is not None])
