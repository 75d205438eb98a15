"""The run's memory plan at start-up, and `--dry-run`: the trainer's own step at the cache's largest bucket,
measured beside the plan, nothing saved."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch

from shards import Cache
from shards.options import DTYPES
from train import distributed
from train.cache import largest_bucket
from train.config import TrainConfig
from train.data import REFERENCES, TrainingSamples, to_device
from train.families import get_family
from train.host_memory import batch_sizes, loader_parts, peak_memory, refusal, with_loader
from train.metrics import device_memory
from train.objectives import FIRST_FRAME
from train.plan import cached_batch, cached_references, measure_peak, plan
from train.plan_config import CARD_RESERVED, PlanConfig
from train.step import TrainStep
from train.validate import Validator, generate


def startup_plan(cfg: TrainConfig, cache: Cache, device: torch.device, world: int, parallel: str, objective,
                 controlnet_layers: int | None = None, baseline: int | None = None) -> dict:
    """The memory plan of this run (its objective, at the cache's largest bucket, its loader's batches of the cache's
    samples); `controlnet_layers`: the depth of the ControlNet the run built (a pretrained or resumed one has its own).
    `baseline`: the process's host memory before any weights (default: now, measured once planned)."""
    largest = largest_bucket(cache)
    # the ControlNet planned is one of the depth built, whatever its weights
    setup = PlanConfig.of_run(cfg, bucket=largest, world_size=world, **cached_references(cache, largest),
                              parallel="fsdp" if parallel == "fsdp" else "ddp", text_tokens=cache.spec.text.tokens,
                              gpu_memory=device_memory(device) - (CARD_RESERVED if device.type == "cuda" else 0),
                              pretrained_controlnet=None,
                              controlnet_layers=controlnet_layers or cfg.controlnet_layers,
                              device="cpu" if device.type == "cpu" else "cuda",
                              ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return plan(setup, objective, buckets=list(cache.manifest.buckets()), batch=cached_batch(cache, setup, largest),
                baseline=baseline)


class HostMemoryError(ValueError):
    """The run's planned host memory is over --host-memory; nothing was loaded."""


def check_host_memory(planned: dict | None) -> None:
    """Stop before any weights load when rank 0's plan (`planned`; None on the other ranks) needs more host memory per
    node than --host-memory: every rank stops with its message."""
    problem = distributed.rank0_value(None if planned is None or planned["host"]["fits"] else refusal(planned["host"]))
    if problem:
        raise HostMemoryError(problem)


def dry_run(cfg: TrainConfig, cache: Cache, dataset: TrainingSamples, step: TrainStep, validator: Validator | None, preset,
            planned: dict, device: torch.device, say: Callable = print) -> dict:
    """One optimizer step as the loop runs it (every micro-batch of it, clipping, the optimizer, the EMA) at the
    largest bucket, and one validation sample; its measured peak next to the plan."""
    largest = largest_bucket(cache)
    first = list(itertools.islice(itertools.chain.from_iterable(cache.ranges_by_bucket()[largest]), cfg.batch_size))
    indices = (first * cfg.batch_size)[: cfg.batch_size]
    batch = dataset.collate([dataset[(0, i)] for i in indices])
    batch = to_device(batch, device)
    if cfg.preservation == "output":  # a class batch's step: output preservation's forward is measured with it
        batch["prior_loss_weight"] = 1.0

    def one_step() -> None:
        while not step.ready:
            step.accumulate(batch, 0)
        step.update(0)
        # a ControlNet run samples from the batch's first control latent, an edit run with its first references
        if validator is not None:
            cond = validator.items[0].cond if validator.items else validator.prompts[0].cond
            control = batch["control"][0] if "control" in batch else None
            conditioning = {name: batch[name][0] for name in get_family(preset.family).conditioning_fields(cache.spec)}
            if validator.first_frame and largest.frames > 1:  # image-to-video from a clip's first latent frame
                conditioning[FIRST_FRAME] = batch["latents"][0][:, :1]
            generate(step.model.module, preset, step.objective, cond, validator.null,
                     cache.spec.latent.shape(*largest), largest.pixels, steps=2,
                     guidance=cfg.guidance_scale, seed=0, precision=DTYPES[cfg.precision], layout=validator.layout,
                     forward=step.model.forward if control is not None else None, control=control,
                     conditioning=conditioning, references=batch[REFERENCES][0] if REFERENCES in batch else None,
                     guidance_2=validator.guidance_2)

    # Two steps with nothing else running, the process's peak host memory (VmHWM) read after them: the optimizer makes
    # its states at the end of the first, so the second is the first to hold them through its forward and backward, as
    # every later step does. The device's peak is measured on a third: on the CPU the profiler that measures it keeps
    # its own records in host memory.
    one_step()
    one_step()
    host_peak = peak_memory()
    measured = measure_peak(one_step, device)
    predicted = planned["predicted_peak"]
    say(f"dry run at {largest.name}, batch {cfg.batch_size}: measured peak {measured / 2**30:.3f} GiB, planned "
        f"{predicted / 2**30:.3f} GiB ({predicted / measured - 1:+.1%})")
    # the dry run builds its one batch in the training thread, as --workers 0 does
    host = with_loader(planned["host"], loader_parts(batch_sizes(batch), 0, cfg.prefetch, 0, pin=device.type == "cuda"))
    base = host["baseline"]
    say(f"dry run host memory: measured peak {host_peak / 2**30:.3f} GiB (VmHWM), planned {host['per_rank'] / 2**30:.3f} GiB "
        f"({host['per_rank'] / host_peak - 1:+.1%}); above the {base / 2**30:.3f} GiB baseline measured before the weights "
        f"loaded: measured {(host_peak - base) / 2**20:.1f} MiB, planned {(host['per_rank'] - base) / 2**20:.1f} MiB")
    return {"dry_run": True, "bucket": largest.name, "measured_peak": measured, "predicted_peak": predicted,
            "measured_host_peak": host_peak, "predicted_host_peak": host["per_rank"], "host_baseline": base,
            "host": host}
