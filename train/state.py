"""What a run continues from: its progress, and the checkpoints that save and restore it with the weights
(or adapters, or a ControlNet), optimizer, schedule, loss scaler and EMA (`train.checkpoint` holds the files' format)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards import Cache, CacheBusy, CacheLock, RemoteCache
from train import checkpoint, distributed, lora, safeload
from train.cache import cache_identity
from train.config import TrainConfig
from train.ema import EMA
from train.model import Model, apply_schedule
from train.order import BATCH_SAMPLER_VERSION

log = logging.getLogger("train")


@dataclass
class Progress:
    """Where a run is: optimizer steps, epoch and batches of it read (`cursor`), the smoothed loss as
    (sum, n), the precisions it has trained in (`history`, from which step) and the samples trained on per
    source (`drawn`)."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    smoothed: list = field(default_factory=lambda: [0.0, 0])  # (sum, n)
    history: list = field(default_factory=list)
    drawn: dict = field(default_factory=dict)  # source -> samples trained on so far


class TrainState:
    """Saves and restores everything a run continues from. Every rank calls `save` and `restore` together
    (FSDP ranks write and read their own shards; rank 0 writes the rest)."""

    def __init__(self, cfg: TrainConfig, model: Model, optimizer: torch.optim.Optimizer, scheduler,
                 scaler: torch.amp.GradScaler, ema: EMA | None, *, family: str, parallel: str, rank: int, world: int):
        self.cfg, self.model, self.optimizer, self.scheduler, self.scaler, self.ema = cfg, model, optimizer, scheduler, scaler, ema
        self.family, self.parallel, self.rank, self.world = family, parallel, rank, world

    def fresh(self) -> Progress:
        return Progress(history=[{"step": 0, "precision": self.cfg.precision, "weights_dtype": self.cfg.weights_dtype}])

    def restore(self, path: Path, state: dict, say: Callable = print) -> Progress:
        """Optimizer, schedule (made this run's: lr, warm-up, decay from the saved step), scaler and EMA from
        checkpoint `path` (the weights came with the model); returns the progress to continue from."""
        cfg, ema = self.cfg, self.ema
        if self.parallel == "fsdp":  # every rank reads its shards
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(self.model.module, self.optimizer)
            has_ema = ema is not None and state["config"].get("ema_decay", 0) > 0
            loaded = safeload.load_sharded(path, {"model": model_sd, "optimizer": optim_sd,
                                                    **({"ema": ema.state_dict()} if has_ema else {})})
            set_state_dict(self.model.module, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
            ema_state = loaded.get("ema")
        else:
            self.optimizer.load_state_dict(safeload.load_tensors(path, "optimizer"))
            ema_state = safeload.load_tensors(path, "ema") if ema is not None else None
        if ema_state:
            ema.load_state_dict(ema_state)  # back onto the EMA's device, with this run's decay
        elif ema is not None:
            say(f"{path.name} holds no EMA: it starts from the current weights")
        self.scheduler.load_state_dict(safeload.load_tensors(path, "scheduler"))
        apply_schedule(cfg, self.optimizer, self.scheduler)
        scaler_state = safeload.load_tensors(path, "scaler")
        if scaler_state and cfg.precision == "fp16":
            self.scaler.load_state_dict(scaler_state)
        elif scaler_state:
            log.warning("resuming an fp16 run in %s: the GradScaler state is dropped (loss scaling is not needed)", cfg.precision)
        was_dtype = state["config"].get("weights_dtype", "fp32")
        if was_dtype != cfg.weights_dtype:
            log.warning("weights were %s in %s and continue in %s", was_dtype, path.name, cfg.weights_dtype)
        if state["sampler"]["version"] != BATCH_SAMPLER_VERSION:
            raise ValueError(f"{path}: its data order was drawn by batch sampler version {state['sampler']['version']}, "
                             f"this trainer draws version {BATCH_SAMPLER_VERSION}; resume it with the version that wrote it")
        history = state["precision_history"]
        if (history[-1]["precision"], history[-1].get("weights_dtype", "fp32")) != (cfg.precision, cfg.weights_dtype):
            history.append({"step": state["step"], "precision": cfg.precision, "weights_dtype": cfg.weights_dtype})
        progress = Progress(state["step"], state["epoch"], state["cursor"], list(state.get("smoothed_loss", [0.0, 0])), history,
                            dict(state.get("samples_by_source", {})))
        say(f"resumed from {path} at step {progress.step} (epoch {progress.epoch}, batch {progress.cursor})")
        return progress

    def save(self, progress: Progress, caches: Cache | list[Cache], run_config: dict) -> Path:
        """Checkpoint `progress.step`: atomically, keeping the newest `--keep-checkpoints`. `caches`: the one cache
        (or the run's several) the current epoch reads; the first's fields keep the layout of one-cache runs."""
        cfg, ema = self.cfg, self.ema
        caches = caches if isinstance(caches, list) else [caches]
        cache = caches[0]
        tensors = {"scheduler": self.scheduler.state_dict()}
        if self.scaler.is_enabled():
            tensors["scaler"] = self.scaler.state_dict()
        sharded = None
        if self.parallel == "fsdp":  # every rank writes its shards; nothing is gathered
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model.module, self.optimizer)
            sharded = {"model": model_sd, "optimizer": optim_sd, **({"ema": ema.state_dict()} if ema is not None else {})}
        else:
            tensors["optimizer"] = self.optimizer.state_dict()
            if ema is not None:
                tensors["ema"] = ema.state_dict()
        adapter_files = None
        if self.model.adapter is not None:  # the adapters alone, as the family's pipeline loads them
            module, adapter, family = self.model.module, self.model.adapter, self.family
            # as trained (alpha not folded into lora_B): dividing a fold back out is not exact, and resuming must be
            adapter_files = (checkpoint.ADAPTER_DIR,
                             lambda d: lora.save_adapter(d, family, lora.adapter_state(module), adapter, fold=False))
        elif self.model.controlnet is not None:  # the ControlNet alone, as the family's ControlNet pipeline loads it
            controlnet = self.model.controlnet
            adapter_files = (checkpoint.CONTROLNET_DIR, lambda d: controlnet.save_pretrained(d, safe_serialization=True))
        state = {
            "step": progress.step, "epoch": progress.epoch, "cursor": progress.cursor, "world_size": self.world,
            "model": cfg.model, "parallel": self.parallel, "smoothed_loss": list(progress.smoothed),
            "samples_by_source": dict(progress.drawn),
            **({"caches": [cache_record(c) for c in caches]} if len(caches) > 1 else {}),
            **cache_record(cache),
            "precision_history": progress.history, "weights": self.model.weights,
            "sampler": {"version": BATCH_SAMPLER_VERSION, "batch_size": cfg.batch_size, "seed": cfg.seed, "remainder": cfg.remainder,
                        "shuffle_shards": cfg.shuffle_shards},
            "config": run_config,
        }
        return checkpoint.save(cfg.run, progress.step, model=self.model.module, tensors=tensors, keep=cfg.keep_checkpoints,
                               sharded=sharded, rank=self.rank, adapter=adapter_files, state=state)


def cache_record(cache: Cache) -> dict:
    """What a checkpoint records of a cache it reads: where it is, its generation, fingerprint (how its values were
    computed) and shard table (which samples the data cursor counts through; `train.cache.cache_identity`)."""
    # a remote cache's generations live in its bucket: `shards gc` of a directory must not count them
    where = {"cache_url": cache.location} if isinstance(cache, RemoteCache) else {"cache_root": str(cache.root.resolve())}
    return {"cache_fingerprint_sha256": cache.manifest.fingerprint_sha256, "cache_generation": cache.generation,
            "cache_shards_sha256": cache_identity(cache), **where}


RUN_LOCK = ".lock"


class RunBusy(RuntimeError):
    """Another process owns the run directory."""


def own_run(run: Path, is_main: bool) -> CacheLock | None:
    """The run directory's lock (`RUN/.lock`), taken by rank 0 for the whole run (its other ranks write only
    where rank 0's run writes): two runs in one directory would overwrite each other's checkpoints and metrics.
    Raises `RunBusy` on every rank, naming the holder, when another process has it."""
    lock, busy = None, None
    if is_main:
        try:
            lock = CacheLock(run, RUN_LOCK, "the run directory")
        except CacheBusy:
            try:
                holder = (run / RUN_LOCK).read_text().strip()
            except OSError:
                holder = ""
            busy = (f"{run} is owned by another training process ({holder or 'its holder wrote no name yet'}): two runs "
                    f"in one directory would overwrite each other's checkpoints and metrics. Wait for it to finish, or stop "
                    f"it (kill -TERM PID writes a checkpoint at its next step) and resume with the same command; or train "
                    f"into another --run-dir.")
        except OSError as e:  # a read-only or foreign directory: every rank stops with the reason, none waits
            busy = f"!cannot claim the run directory {run} ({e}): give a --run-dir this user can write to"
    busy = distributed.rank0_value(busy)
    if busy and busy.startswith("!"):
        raise ValueError(busy[1:])
    if busy:
        raise RunBusy(busy)
    return lock
