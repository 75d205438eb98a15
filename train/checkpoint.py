"""Atomic, resumable checkpoints: weights in diffusers layout, training state beside them.

A checkpoint is written under a temp name, its `COMPLETE` marker written last, then renamed into
place; a kill at any instant leaves the previous complete checkpoint as the resume point. No pickled
objects: torch files hold only tensors and plain containers and load with `weights_only=True`.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from shards.atomic import atomic_write_bytes, atomic_write_json, fsync_tree, publish_directory
from train.distributed import barrier

MARKER = "COMPLETE"
SHARDED = "sharded"  # torch.distributed.checkpoint directory of an FSDP run
ADAPTER_DIR = "transformer_lora"  # a LoRA run's adapters, in the format the family's pipeline loads
CONTROLNET_DIR = "controlnet"  # a ControlNet run's ControlNet, in diffusers layout
STATE_VERSION = 1


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def complete_checkpoints(run: Path) -> list[Path]:
    root = run / "checkpoints"
    return sorted(p for p in root.glob("step-*") if (p / MARKER).exists()) if root.exists() else []


def save(run: Path, step: int, *, model: torch.nn.Module, state: dict, tensors: dict[str, dict], keep: int,
         sharded: dict | None = None, rank: int = 0, adapter: tuple | None = None) -> Path:
    """Write checkpoint `step`: the model via `save_pretrained`, each of `tensors` as NAME.pt, `state` as JSON.

    With `adapter` = (directory name, writer): a LoRA or ControlNet run, whose frozen base is not saved; the
    writer puts what trains (the adapters, the ControlNet) into that directory and the model's config goes to
    `transformer/`.

    With `sharded` (FSDP: model, optimizer and EMA state dicts of DTensors), every rank writes its own
    shards with `torch.distributed.checkpoint` into `sharded/` and only the model's config goes to
    `transformer/`: no rank ever gathers the full model. Rank 0 writes the rest and publishes; all
    ranks call this together.
    """
    final = checkpoint_dir(run, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if sharded is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(sharded, checkpoint_id=tmp / SHARDED)
    if rank == 0:
        if adapter is not None:
            name, write = adapter
            write(tmp / name)
            model.save_config(tmp / "transformer")
        elif sharded is None:
            model.save_pretrained(tmp / "transformer", safe_serialization=True)
        else:
            model.save_config(tmp / "transformer")
        for name, obj in tensors.items():
            torch.save(obj, tmp / f"{name}.pt")
        atomic_write_json(tmp / "state.json", {"version": STATE_VERSION, **state})
    if sharded is not None:
        fsync_tree(tmp / SHARDED)  # each rank its own files, before the checkpoint is marked complete
    barrier()
    if rank == 0:
        fsync_tree(tmp, skip=tmp / SHARDED)  # each rank flushed its own part of sharded/
        atomic_write_bytes(tmp / MARKER, b"ok\n")  # fsynced, with its directory
        publish_directory(tmp, final, flushed=True)  # a re-save of the same step replaces it
        for old in complete_checkpoints(run)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


def load_sharded(path: Path, state: dict) -> dict:
    """Fill `state` (nested state dicts, DTensors or plain tensors) from a checkpoint's `sharded/`.

    Works under any world size of the same sharding, and in one process without a process group,
    where it assembles full tensors (export)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    single = not dist.is_initialized()
    with warnings.catch_warnings():
        if single:  # loading in one process is what export means; torch warns about it every time
            warnings.filterwarnings("ignore", message="torch.distributed is .* uninitialized")
        dcp.load(state, checkpoint_id=path / SHARDED, no_dist=single)
    return state


def is_sharded(path: Path) -> bool:
    return (path / SHARDED).is_dir()


def load_state(path: Path) -> dict:
    state = json.loads((path / "state.json").read_text())
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{path} has training-state version {state.get('version')}, this trainer reads {STATE_VERSION}")
    return state


def load_tensors(path: Path, name: str):
    file = path / f"{name}.pt"
    return torch.load(file, map_location="cpu", weights_only=True) if file.exists() else None


def find(path: Path) -> Path:
    """A checkpoint directory as given, or the newest complete checkpoint of a run directory."""
    path = Path(path)
    if (path / MARKER).exists():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is neither a complete checkpoint (no {MARKER} marker) nor a run directory with one")
    return found[-1]


def resolve_resume(run: Path, resume: str | None) -> Path | None:
    """`auto`: the newest complete checkpoint of the run (or none); a path: that checkpoint (or that run's newest)."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(run)
        return found[-1] if found else None
    return find(Path(resume))


def is_lora(path: Path) -> bool:
    return (path / ADAPTER_DIR).is_dir()


def is_controlnet(path: Path) -> bool:
    return (path / CONTROLNET_DIR).is_dir()


# What a resumed run may change. These take effect from the resumed step, each logged; the rest of the
# state-bearing options would make the checkpoint mean something else, so a change stops the run.
APPLIED_ON_RESUME = ("steps", "lr", "warmup_steps", "lr_schedule", "weight_decay", "grad_clip", "grad_accum", "ema_decay",
                     "ema_every", "caption_dropout", "caption_dropout_embedding", "weighting_scheme", "logit_mean", "logit_std",
                     "mode_scale", "precondition_outputs", "flow_shift", "resolution_shift", "learned_variance", "lora_dropout",
                     "controlnet_conditioning_scale", "guidance_scale_train", "base_quant", "blocks_to_swap", "lr_cycles", "lr_power", "lr_end")
REFUSED_ON_RESUME = {
    "model": "the checkpoint holds another preset's weights",
    "optimizer": "its moments do not carry over to another optimizer",
    "batch_size": "the data cursor counts batches of the checkpoint's size",
    "seed": "the data order, the draws and the noise are functions of the seed",
    "remainder": "the epoch's batches depend on it",
    "shuffle_shards": "the epoch's batches depend on it",
    "cache_weight": "the epoch's batches depend on it",
    "lora_rank": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "lora_alpha": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "lora_targets": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "controlnet": "a ControlNet run's checkpoints hold the ControlNet alone, a full fine-tune's the transformer",
    "controlnet_layers": "the ControlNet resumes from the checkpoint, with its depth",
    "pretrained_controlnet": "the ControlNet resumes from the checkpoint, not from other weights",
}


def check_resumable(path: Path, state: dict, config: dict, world: int, parallel: str, fingerprint: str | list[str]) -> list[str]:
    """Refuse to resume `path` with settings that change what it means; return the applied changes, one
    line each (e.g. `lr 0.0001 -> 5e-05`), for the start-up log.

    Args:
        state: the checkpoint's `state.json`.
        config: this run's options (`TrainConfig` as a dict).
        world, parallel: this run's number of processes and parallelism.
        fingerprint: the cache's fingerprint hash (or each of the run's caches', in their order).
    """
    fingerprints = fingerprint if isinstance(fingerprint, list) else [fingerprint]
    saved = [entry.get("cache_fingerprint_sha256") for entry in state.get("caches") or [state]]
    if len(state.get("caches") or [state]) != len(fingerprints):
        raise ValueError(f"{path} was trained from {len(saved)} cache(s), this run has {len(fingerprints)}; resume with the "
                         f"same --cache list, or start a new run (--resume '').")
    fingerprint = fingerprints[0]
    for k, (was, now) in enumerate(zip(saved[1:], fingerprints[1:]), 1):
        if was is not None and was != now:
            raise ValueError(f"{path} was trained from a cache built differently as --cache number {k + 1} (fingerprint "
                             f"{was[:16]}, this cache {now[:16]}); use the caches it was trained from, in their order.")
    if state["world_size"] != world:
        raise ValueError(f"{path} was saved with world size {state['world_size']}, this run has {world}; resume with the "
                         f"same number of processes (the data cursor and the batch split depend on it)")
    if state.get("parallel", "none") != parallel:
        raise ValueError(f"{path} was saved under --parallel {state.get('parallel', 'none')}, this run is {parallel}; "
                         f"resume the same way")
    if state.get("cache_fingerprint_sha256", fingerprint) != fingerprint:
        raise ValueError(f"{path} was trained from a cache built differently (fingerprint "
                         f"{state['cache_fingerprint_sha256'][:16]}, this cache {fingerprint[:16]}): its latents or embeddings "
                         f"mean something else. Use the cache it was trained from, or start a new run (--resume '').")
    was = state["config"]
    if not config.get("lora_rank") and not config.get("controlnet"):  # those rebuild their frozen base, checked then
        check_start_weights(path, state.get("weights") or {}, config)
    for name, why in REFUSED_ON_RESUME.items():
        if name in was and _same(was[name]) != _same(config[name]):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{path} was trained with {flag} {was[name]}, this run has {config[name]}: {why}. Resume with "
                             f"{flag} {was[name]}, or start a new run (another --run-dir, or --resume '').")
    return [f"{name.replace('_', '-')} {was[name]} -> {config[name]}" for name in APPLIED_ON_RESUME
            if name in was and _same(was[name]) != _same(config[name])]


def check_start_weights(path: Path, was: dict, config: dict) -> None:
    """A full fine-tune resumes its own weights from the checkpoint: refuse --pretrained, --revision or
    --from-scratch asking for other starting weights (they would be ignored otherwise)."""
    asked = []
    if config.get("from_scratch") and was.get("kind") not in (None, "fresh"):
        asked.append("--from-scratch")
    pretrained = config.get("pretrained")
    if pretrained:
        local = Path(pretrained).expanduser()
        if (str(local.resolve()) if local.is_dir() else pretrained) != was.get("source"):
            asked.append(f"--pretrained {pretrained}")
    if config.get("revision") and config["revision"] != was.get("revision"):
        asked.append(f"--revision {config['revision']}")
    if asked:
        raise ValueError(f"{path} continues its own weights (the run started from {was.get('source', 'unrecorded weights')}); "
                         f"{' '.join(asked)} would start from others. Resume without it, or start a new run (another "
                         f"--run-dir, or --resume '').")


def _same(value):
    return sorted(value) if isinstance(value, (list, tuple)) else value

