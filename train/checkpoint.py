"""Atomic, resumable checkpoints: weights in diffusers layout, training state beside them.

A checkpoint is written under a temp name, its `COMPLETE` marker written last, then renamed into
place; a kill at any instant leaves the previous complete checkpoint as the resume point. No pickled
objects: torch files hold only tensors and plain containers, and load as `train.safeload` says. A checkpoint is
checked before anything loads from it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from shards.atomic import atomic_write_bytes, atomic_write_json, fsync_tree, publish_directory
from train.distributed import barrier
from train.safeload import EARLIER, SHARDED, DamagedCheckpoint, read_metadata

MARKER = "COMPLETE"
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
    try:
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
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if rank == 0:  # the partial checkpoint goes; the complete ones before it stay as they are
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) or type(e).__name__ == "CheckpointException":
            size = checkpoint_size(run, model, tensors, sharded, adapter)
            code = no_room(e, final.parent if final.parent.exists() else run, size)
            if code is not None:
                raise CheckpointWriteError(no_room_message(code, e, run, final, size)) from e
        raise
    if rank == 0:
        for old in complete_checkpoints(run)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


# The write errors that leave nothing to do but make room or change where checkpoints go
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class CheckpointWriteError(OSError, ValueError):
    """A checkpoint could not be written for want of space, quota or permission; the partial one was removed (the
    OSError is its `__cause__`). A ValueError as well: the command line reports it as bad input, with what to do."""


def no_room(e: BaseException, where: Path, size: int) -> int | None:
    """The errno of a write that failed for want of space, quota or permission, wherever the writer put it: an
    OSError (json, pathlib), an error chained to one, a message carrying its text (safetensors: "No space left on
    device (os error 28)"), each rank's failure of torch.distributed.checkpoint, or torch.save's zip writer, which
    says only "file write failed" (then the free space decides). None: another failure."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in NO_ROOM:
            return x.errno
        text = str(x)
        for code in NO_ROOM:
            if os.strerror(code) in text or f"os error {code})" in text:
                return code
        if "file write failed" in text and shutil.disk_usage(where).free < size:
            return errno.ENOSPC
        todo += [x.__cause__, x.__context__]
        todo += [f[0] if isinstance(f, tuple) else f for f in getattr(x, "failures", {}).values()]  # CheckpointException
    return None


def checkpoint_size(run: Path, model, tensors: dict, sharded: dict | None, adapter) -> int:
    """About how many bytes a checkpoint of the run takes: its last one's, or the tensors it writes."""
    earlier = complete_checkpoints(run)
    if earlier:  # the run's checkpoints are all alike in size
        return sum(f.stat().st_size for f in earlier[-1].rglob("*") if f.is_file())
    size = tensor_bytes([tensors, sharded])
    return size + tensor_bytes(model.state_dict() if adapter is None and sharded is None
                               else [p for p in model.parameters() if p.requires_grad])


def no_room_message(code: int, e: BaseException, run: Path, final: Path, size: int) -> str:
    """What failed, where, the space free there against the checkpoint's size, and what to do."""
    where = final.parent if final.parent.exists() else run
    free = shutil.disk_usage(where).free
    earlier = complete_checkpoints(run)
    filename = getattr(e, "filename", None)
    cause = os.strerror(code) + (f" writing {filename}" if filename else "")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        todo = f"make {where} writable, or give another --run-dir,"
    else:
        todo = (f"free space there (fewer --keep-checkpoints keeps fewer, {amount(size)} each), or resume in a "
                f"--run-dir on a disk with room (copy {run} there),")
    kept = f"{earlier[-1]} is intact" if earlier else "the run has no earlier checkpoint"
    return (f"could not write checkpoint {final} ({cause}): {amount(free)} free on its filesystem, the checkpoint needs "
            f"about {amount(size)}. The partial checkpoint was removed and {kept}; {todo} then run the same command "
            f"again to resume.")


def amount(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def is_sharded(path: Path) -> bool:
    return (path / SHARDED).is_dir()


def load_state(path: Path) -> dict:
    """A checkpoint's `state.json`, refused (`DamagedCheckpoint`) when missing, not JSON or of another version."""
    file = path / "state.json"
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing: {path} is not a complete checkpoint. {EARLIER}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(f"{file} is not JSON ({e}): the checkpoint is damaged. {EARLIER}") from None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "step" not in state or "model" not in state:
        raise DamagedCheckpoint(f"{file} is not a training state (no step, model and config): the checkpoint is damaged or "
                                f"was not written by this trainer. {EARLIER}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{path} has training-state version {state.get('version')}, this trainer reads {STATE_VERSION}")
    return state


def check(path: Path, resume: bool = False) -> Path:
    """Refuse (`DamagedCheckpoint`) a checkpoint missing a file its kind needs, with a safetensors file that is cut
    short or garbled, or sharded files its metadata does not account for; with `resume`, also the training state's
    files. Reads headers and sizes only. Returns `path`."""
    from safetensors import safe_open

    state = load_state(path)

    def need(file: Path, what: str) -> Path:
        if not file.exists():
            raise DamagedCheckpoint(f"{file} is missing ({what}): the checkpoint {path} is incomplete. {EARLIER}")
        return file

    need(path / "transformer" / "config.json", "the transformer's configuration")
    if is_lora(path):
        weights = sorted((path / ADAPTER_DIR).glob("*.safetensors"))
        need(weights[0] if weights else path / ADAPTER_DIR / "*.safetensors", "the LoRA adapters")
    elif is_controlnet(path):
        need(path / CONTROLNET_DIR / "config.json", "the ControlNet's configuration")
        weights = sorted((path / CONTROLNET_DIR).glob("*.safetensors"))
        need(weights[0] if weights else path / CONTROLNET_DIR / "*.safetensors", "the ControlNet's weights")
    elif is_sharded(path):
        metadata = read_metadata(path / SHARDED)
        for info in (metadata.storage_data or {}).values():
            file = need(path / SHARDED / str(info.relative_path), "a shard of the weights")
            if file.stat().st_size < info.offset + info.length:
                raise DamagedCheckpoint(f"{file} is cut short ({file.stat().st_size} bytes, its metadata needs "
                                        f"{info.offset + info.length}): the checkpoint is damaged. {EARLIER}")
    else:
        weights = sorted((path / "transformer").glob("*.safetensors"))
        need(weights[0] if weights else path / "transformer" / "diffusion_pytorch_model.safetensors", "the weights")
        for index in (path / "transformer").glob("*.safetensors.index.json"):
            for shard in set(json.loads(index.read_text())["weight_map"].values()):
                need(path / "transformer" / shard, f"a shard {index.name} names")
    for file in sorted(path.glob("*/*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except Exception as e:  # safetensors' own error: cut short, or not safetensors at all
            raise DamagedCheckpoint(f"{file} is damaged ({e}). {EARLIER}") from None
    if resume:
        need(path / "scheduler.pt", "the learning-rate schedule's state")
        if not is_sharded(path):
            need(path / "optimizer.pt", "the optimizer's state")
        if state["config"].get("precision") == "fp16":
            need(path / "scaler.pt", "the loss scaler's state")
    return path


def find(path: Path, resume: bool = False) -> Path:
    """A checkpoint directory as given, or the newest complete checkpoint of a run directory; checked (`check`)."""
    path = Path(path)
    if (path / MARKER).exists():
        return check(path, resume)
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is neither a complete checkpoint (no {MARKER} marker) nor a run directory with one")
    return checked_newest(found, resume)


def checked_newest(found: list[Path], resume: bool) -> Path:
    """The newest of a run's complete checkpoints, checked; a damaged one names the one before it."""
    try:
        return check(found[-1], resume)
    except DamagedCheckpoint as e:
        if len(found) > 1:
            raise DamagedCheckpoint(f"{e} The one before it is {found[-2]}.") from None
        raise


def resolve_resume(run: Path, resume: str | None) -> Path | None:
    """`auto`: the newest complete checkpoint of the run (or none); a path: that checkpoint (or that run's newest)."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(run)
        return checked_newest(found, resume=True) if found else None
    return find(Path(resume), resume=True)


def is_lora(path: Path) -> bool:
    return (path / ADAPTER_DIR).is_dir()


def is_controlnet(path: Path) -> bool:
    return (path / CONTROLNET_DIR).is_dir()


# What a resumed run may change. These take effect from the resumed step, each logged; the rest of the
# state-bearing options would make the checkpoint mean something else, so a change stops the run.
APPLIED_ON_RESUME = ("steps", "lr", "warmup_steps", "lr_schedule", "weight_decay", "grad_clip", "grad_accum", "ema_decay",
                     "ema_every", "caption_dropout", "caption_dropout_embedding", "weighting_scheme", "logit_mean", "logit_std",
                     "mode_scale", "precondition_outputs", "flow_shift", "resolution_shift", "learned_variance", "lora_dropout",
                     "controlnet_conditioning_scale", "train_guidance", "base_quant", "blocks_to_swap", "lr_cycles", "lr_power", "lr_end",
                     "prior_loss_weight", "preservation", "masked_loss", "i2v_probability")
REFUSED_ON_RESUME = {
    "model": "the checkpoint holds another preset's weights",
    "optimizer": "its moments do not carry over to another optimizer",
    "batch_size": "the data cursor counts batches of the checkpoint's size",
    "seed": "the data order, the draws and the noise are functions of the seed",
    "remainder": "the epoch's batches depend on it",
    "shuffle_shards": "the epoch's batches depend on it",
    "cache_weight": "the epoch's batches depend on it",
    "eval_fraction": "which samples train and which are held out depends on it",
    "resolution_weight": "the epoch's batches depend on it",
    "lora_rank": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "lora_alpha": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "lora_targets": "LoRA adapters resume with the rank, alpha and targets they were trained with",
    "adapter": "the checkpoint holds adapters of the type it trained",
    "lokr_factor": "LoKr adapters resume with the factors they were trained with",
    "lokr_decompose_both": "LoKr adapters resume with the factors they were trained with",
    "controlnet": "a ControlNet run's checkpoints hold the ControlNet alone, a full fine-tune's the transformer",
    "controlnet_layers": "the ControlNet resumes from the checkpoint, with its depth",
    "pretrained_controlnet": "the ControlNet resumes from the checkpoint, not from other weights",
    "expert": "the checkpoint holds the expert (or the two experts) of a two-expert model it trained",
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

