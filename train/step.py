"""One training step, the same for the loop, the dry run and the benchmark.

A step is `grad_accum` micro-batches, each forward and backward under autocast, with gradients reduced
across ranks only on the last (DDP `no_sync`, FSDP `set_requires_gradient_sync`); a non-finite loss skips
the step on every rank alike; then unscaling (fp16), clipping, the optimizer step with its stochastic
rounding seeded by the step number, the schedule and the EMA.

A batch of a class source (`is_reg`: DreamBooth's class images) has its loss multiplied by the source's
prior_loss_weight (or --prior-loss-weight); with --preservation output its target is the base model's prediction,
the LoRA adapters off and without gradients, for the same noisy latent and caption.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from shards.options import DTYPES
from train import distributed, lora
from train.config import TrainConfig
from train.ema import EMA
from train.model import Model
from train.order import derived_seed, seeded_generator

log = logging.getLogger("train")


class Diverged(RuntimeError):
    """Training diverged: `max_bad_steps` non-finite steps in a row, or non-finite weights; nothing was saved."""


@dataclass
class Update:
    """What `TrainStep.update` did: the step's gradient norm, its micro-batches, whether it was skipped (non-finite), and
    the flags `TrainStep.report` raised for it as every rank agreed on them (true on all when true on any)."""

    grad_norm: float
    micros: list[MicroBatch]
    skipped: bool = False
    stop: bool = False  # a rank was told to stop (a signal): every rank stops after this step
    damaged: bool = False  # a rank's batches of the next step are damaged: every rank stops before it


@dataclass
class MicroBatch:
    loss: torch.Tensor  # this rank's mean loss, on the device (read when metrics are logged)
    per_sample: torch.Tensor  # this rank's samples' losses
    t: torch.Tensor  # and their timesteps in [0, 1)
    samples: int  # this rank's sample count
    source: str = ""  # the source (a named dataset of the cache) they were drawn from
    class_loss: torch.Tensor | None = None  # a class batch's mean loss before its prior_loss_weight (None: not one)


class TrainStep:
    """Forward and backward micro-batches with `accumulate`; once `ready`, `update` steps the optimizer.

    Nothing here waits for the device but the one decision that needs a value: whether the step's gradient
    norm is finite. A non-finite loss makes the gradients non-finite (DDP and FSDP reduce them, so every
    rank sees it alike): the step is skipped on every rank, logged with its sample keys, and
    `max_bad_steps` of them in a row stop the run. The same read brings the loop's flags (`report`) agreed across
    ranks, so a step waits for the device once, micro-batches never."""

    def __init__(self, cfg: TrainConfig, model: Model, objective, optimizer: torch.optim.Optimizer, scheduler,
                 scaler: torch.amp.GradScaler, ema: EMA | None, *, parallel: str, rank: int, world: int, device: torch.device):
        self.cfg, self.model, self.objective = cfg, model, objective
        self.optimizer, self.scheduler, self.scaler, self.ema = optimizer, scheduler, scaler, ema
        self.parallel, self.rank, self.world, self.device = parallel, rank, world, device
        self.autocast = torch.autocast(device.type, dtype=DTYPES[cfg.precision], enabled=cfg.precision != "fp32")
        self.micros: list[MicroBatch] = []  # accumulated towards the next step
        self.keys: list[str] = []  # their samples, named when the step is skipped
        self.bad_in_row = 0
        self.bad_keys: list[list[str]] = []  # the samples of each skipped batch in a row
        self.flags = {"stop": False, "damaged": False}  # this rank's, for the next update (`report`)
        self.base_forward = None  # output preservation's target: the transformer with its adapters off, no gradients
        if cfg.preservation == "output":
            assert model.adapter is not None, "--preservation output is refused without LoRA adapters (config)"
            # the run's own forward (its family's inputs, its guidance value): only the adapters differ; under DDP a forward
            # without gradients prepares no reduction
            self.base_forward = base_prediction(model.forward, model.module)
        optimizer.zero_grad(set_to_none=True)

    @property
    def micro(self) -> int:
        return len(self.micros)

    @property
    def ready(self) -> bool:
        return self.micro >= self.cfg.grad_accum

    def accumulate(self, batch: dict, step: int) -> bool:
        """Forward and backward one micro-batch of step `step`; returns whether the step is ready to `update`."""
        # Noise and timesteps of this micro-batch: drawn for the global batch, this rank's slice taken.
        g = seeded_generator(self.cfg.seed, 1_000_003, step, self.micro, device=self.device)
        if self.model.router is not None:  # --tread: this micro-batch's token routing, seeded like its noise
            self.model.router.at(step, self.micro, self.device)
        last = self.micro + 1 >= self.cfg.grad_accum  # gradients are reduced across ranks only on the last micro-batch
        if self.parallel == "fsdp":
            self.model.module.set_requires_gradient_sync(last)
        no_sync = self.model.net.no_sync() if self.parallel == "ddp" and not last else contextlib.nullcontext()
        weight = batch.get("prior_loss_weight")  # a class batch's (None: an instance batch)
        if weight is not None and self.cfg.prior_loss_weight is not None:
            weight = self.cfg.prior_loss_weight
        target = self.base_forward if weight is not None else None
        with no_sync:
            with self.autocast:
                per_sample, t = self.objective(self.model.forward, batch, g, part=(self.rank, self.world), target_fn=target)
                class_loss = per_sample.detach().mean() if weight is not None else None
                if weight is not None:
                    per_sample = per_sample * weight
                loss = per_sample.mean()
            self.scaler.scale(loss / self.cfg.grad_accum).backward()
        self.micros.append(MicroBatch(loss.detach(), per_sample.detach(), t, len(batch["keys"]), batch.get("source", ""),
                                      class_loss))
        self.keys += batch["keys"]
        return self.ready

    def report(self, *, stop: bool = False, damaged: bool = False) -> None:
        """This rank's flags for the coming `update`, which agrees them with every rank's in its one read: `stop` (a
        signal came), `damaged` (a batch of the next step could not be read)."""
        self.flags = {"stop": stop, "damaged": damaged}

    def update(self, step: int) -> Update:
        """Clip and step the optimizer, the schedule and the EMA; returns the gradient norm, the step's micro-batches
        and the flags of every rank, skipped when the gradients were non-finite (with fp16 the scaler's overflowing
        steps are skipped as the scaler skips them, and not counted as bad)."""
        micros, keys, self.micros, self.keys = self.micros, self.keys, [], []
        flags, self.flags = self.flags, {"stop": False, "damaged": False}
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = distributed.full_value(torch.nn.utils.clip_grad_norm_(self.model.params, clip))
        losses = torch.stack([m.loss for m in micros])
        overflow = (torch.stack([f.to(self.device) for f in self.scaler._found_inf_per_device(self.optimizer).values()]).sum() > 0
                    if self.scaler.is_enabled() else False)
        # the one read of the step: the norm (the same on every rank: the gradients are reduced) and the flags, true on
        # every rank when true on any (one small all-reduce beside the gradients')
        grad_norm, agreed = distributed.read_step(norm, {"bad_loss": ~torch.isfinite(losses).all(), "overflow": overflow,
                                                         **flags}, self.device)
        done = Update(grad_norm, micros, stop=agreed["stop"], damaged=agreed["damaged"])
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            what = "loss" if agreed["bad_loss"] else "gradients"
            self._skip(f"step {step}: non-finite {what}, skipped; samples {keys}", step, keys)
            done.skipped = True
            return done
        # Whatever draws from the global RNG in the step (stochastic rounding) is fixed by the step
        # number, so a resumed run rounds exactly as an uninterrupted one.
        # The same seed on every rank: DDP replicas must round alike; FSDP ranks round different shards.
        torch.manual_seed(derived_seed(self.cfg.seed, 2_000_003, step))
        if not agreed["overflow"]:  # as GradScaler.step decides, from the flag already read (it would read it again)
            self.optimizer.step()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.bad_in_row, self.bad_keys = 0, []
        if self.ema is not None and (step + 1) % self.cfg.ema_every == 0:
            self.ema.step(self.model.params)  # on the EMA's device
        return done

    def rewind(self) -> int:
        """Drop the micro-batches of an unfinished step (a stop between them); returns how many."""
        dropped, self.micros, self.keys = self.micro, [], []
        self.optimizer.zero_grad(set_to_none=True)
        return dropped

    def _skip(self, message: str, step: int, keys: list[str]) -> None:
        self.bad_in_row += 1
        self.bad_keys.append(keys)
        log.warning(message)
        self.optimizer.zero_grad(set_to_none=True)
        if self.bad_in_row >= self.cfg.max_bad_steps:
            cfg = self.cfg
            seen = list(dict.fromkeys(k for batch in self.bad_keys for k in batch))
            named = f"{seen[:32]}" + (f" and {len(seen) - 32} more" if len(seen) > 32 else "")
            raise Diverged(
                f"{self.bad_in_row} non-finite steps in a row; stopping (last: {message}). Training diverged after {step} step(s): "
                f"{self.bad_in_row} batches in a row gave non-finite values (each batch's samples are logged above: "
                f"{named}). The weights were not updated by them and no checkpoint was written. To "
                f"try: a lower --lr (this run: {cfg.lr:g}), a smaller --grad-clip (this run: {cfg.grad_clip:g}, 0 is off), --precision bf16 "
                f"or fp32 (this run: {cfg.precision}); if the same samples recur, check them with `python -m shards verify`.")


def base_prediction(forward, module: torch.nn.Module):
    """`forward` (noisy latents, timesteps, batch) -> the base model's prediction: `module`'s LoRA adapters off and no
    gradients (nothing of it is kept for backward)."""
    def predict(xt: torch.Tensor, t: torch.Tensor, batch: dict) -> torch.Tensor:
        with torch.no_grad(), lora.adapters_off(module):
            return forward(xt, t, batch)
    return predict
