"""From a run's checkpoint to what inference tools load: diffusers-format weights and sample images."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from shards import Cache, DamagedCache, exists, open_cache
from shards.atomic import atomic_write_json, fsync_dir, fsync_tree
from shards.options import DTYPES
from shards.remote import is_url
from train import card, checkpoint, controlnet, lora, lycoris, safeload
from train.cache import damaged_files
from train.data import has_references
from train.ema import load_shadow
from train.families import get_family, get_preset
from train.model import flow_shift_kind
from train.objectives import build_objective
from train.presets import Weights, build_transformer, load_saved, resolve_weights
from train.validate import Validator, add_prompts_command, slug

LoraFormat = Literal["diffusers", "kohya", "lycoris"]
# Every export's own record of itself: an existing OUT is replaced only when it carries one. Not pushed to the Hub (a
# downloaded copy is the user's, not an export this machine wrote).
RECORD = ".cachedit-export.json"
# `sample`'s folder in a step's RUN/samples/NNNNNNNN (the EMA weights' beside it): its own, so that neither a run's
# validation of that step (its videos and contact sheet) nor a sample of the other weights is written over
SAMPLE_DIR, SAMPLE_EMA_DIR = "sample", "sample-ema"
log = logging.getLogger("train")


def load_model(ckpt: Path, ema: bool, dtype: torch.dtype | None = None):
    """(transformer, preset, training state) of a checkpoint; with `ema`, the EMA weights. A ControlNet run's
    checkpoint is refused: its transformer is the frozen base (`write_controlnet` writes what it trained)."""
    state = checkpoint.load_state(ckpt)
    preset = get_preset(state["model"], state["config"].get("expert"))  # one expert of a two-expert model: its weights
    cls = preset.transformer_class
    if checkpoint.is_controlnet(ckpt):
        raise ValueError(f"{ckpt} trains a ControlNet, which samples with control images: export it (python -m train export "
                         f"RUN --out DIR) and load DIR/controlnet into the family's ControlNet pipeline")
    if checkpoint.is_lora(ckpt):  # the run's base weights, then its adapters
        cfg = state["config"]
        model = build_transformer(preset, base_weights(preset, state), cfg["seed"], dtype or DTYPES[cfg["weights_dtype"]])
        lora.add_lora(model, adapter_config(state))
        lora.load_adapter_state(model, lora.read_adapter(ckpt / checkpoint.ADAPTER_DIR), ckpt / checkpoint.ADAPTER_DIR)
        ema_state = saved_ema(ckpt) if ema else None
    elif checkpoint.is_sharded(ckpt):  # an FSDP run: assemble full tensors from every rank's shards
        model = cls.from_config(cls.load_config(ckpt / "transformer"))
        weights = model.state_dict()
        params = [p for p in model.parameters() if p.requires_grad]
        wanted = {"model": weights, **({"ema": {"shadow_params": [torch.empty_like(p) for p in params]}} if ema else {})}
        if ema and state["config"].get("ema_decay", 0) <= 0:
            raise ValueError(f"{ckpt} holds no EMA weights (the run had --ema-decay 0); export without --ema")
        loaded = safeload.load_sharded(ckpt, wanted)
        model.load_state_dict(loaded["model"])
        ema_state = loaded.get("ema")
        if dtype is not None:
            model.to(dtype)
    else:
        model = load_saved(preset, ckpt / "transformer", dtype, use_safetensors=True)
        ema_state = saved_ema(ckpt) if ema else None
    if ema:
        load_shadow(model, ema_state, ckpt)
    return model, preset, state


def saved_ema(ckpt: Path) -> dict:
    """A checkpoint's EMA state; refused, saying so, when the run kept none."""
    ema_state = safeload.load_tensors(ckpt, "ema")
    if ema_state is None:
        raise ValueError(f"{ckpt} holds no EMA weights (the run had --ema-decay 0); export without --ema")
    return ema_state


def write_controlnet(ckpt: Path, directory: Path, ema: bool, dtype: str | None = None) -> Path:
    """A ControlNet run's ControlNet (trained or EMA) into DIRECTORY/controlnet in diffusers layout, which the family's
    ControlNet pipeline loads; the frozen transformer is the run's base, named in training.json, not written."""
    state = checkpoint.load_state(ckpt)
    preset = get_preset(state["model"])
    net = controlnet.load_checkpoint(ckpt, preset.family, saved_ema(ckpt) if ema else None,
                                     DTYPES[dtype] if dtype else None)
    target = Path(directory) / controlnet.CONTROLNET_DIR
    net.save_pretrained(target, safe_serialization=True)
    cfg = state["config"]
    started = cfg.get("pretrained_controlnet") or "the base's first blocks"
    write_provenance(target, ckpt, state, ema, base=recorded_base(preset, state),
                     pipeline=controlnet.hooks(preset.family).pipeline,
                     controlnet={"class": type(net).__name__, "started_from": started,
                                 "conditioning_scale": cfg.get("controlnet_conditioning_scale", 1.0)})
    return target


def base_weights(preset, state: dict):
    """The weights a run started from (a LoRA run's frozen base), as its checkpoints record them."""
    record, cfg = state.get("weights"), state["config"]
    if record is None:  # written before runs recorded it: released weights only when --pretrained named them
        return resolve_weights(preset, cfg["pretrained"]) if cfg.get("pretrained") else Weights("fresh", f"fresh weights (seed {cfg['seed']})")
    if record["kind"] == "fresh":
        return Weights("fresh", record["source"])
    return resolve_weights(preset, record["source"], record.get("revision"), seed=cfg["seed"])


def recorded_base(preset, state: dict) -> str:
    """The weights a run started from, as its checkpoint records them: an export of what trained beside a frozen base
    needs no Hub lookup (checkpoints from before runs recorded it: resolved as the run resolved them)."""
    record = state.get("weights")
    if record is None:
        return base_weights(preset, state).describe()
    return Weights(record["kind"], record["source"], record.get("revision"), record.get("commit")).describe()


def write_provenance(directory: Path, ckpt: Path, state: dict, ema: bool, **extra) -> None:
    """`training.json` beside exported weights: which checkpoint, step and weights they are, and the stock pipeline that
    samples them (`Family.pipeline_of`: an edit preset's edit pipeline)."""
    preset = get_preset(state["model"], state["config"].get("expert"))
    (directory / "training.json").write_text(json.dumps({
        "checkpoint": str(ckpt.resolve()), "step": state["step"], "weights": "ema" if ema else "trained", "preset": state["model"],
        "pipeline": extra.pop("pipeline", None) or get_family(preset.family).pipeline_of(preset),
        "precision_history": state["precision_history"],
        **({"expert": state["config"]["expert"]} if state["config"].get("expert") else {}), **extra,
    }, indent=1) + "\n")


def adapter_config(state: dict):
    """The peft config of a run's adapters, from its recorded options (runs from before --adapter trained LoRA)."""
    cfg = state["config"]
    return lora.lora_config(get_preset(state["model"]).family, cfg["lora_rank"], cfg["lora_alpha"], cfg["lora_targets"],
                            cfg["lora_dropout"], adapter=cfg.get("adapter", "lora"), factor=cfg.get("lokr_factor", -1),
                            decompose_both=cfg.get("lokr_decompose_both", False))


def write_adapter(ckpt: Path, directory: Path, ema: bool, lora_format: LoraFormat = "diffusers") -> Path:
    """A LoRA run's adapters (trained or EMA) into DIRECTORY, in the format the family's pipeline loads (or another
    of its `lora_formats`: kohya's, the LyCORIS layout); the base weights are the ones the run started from, not written again. Returns the adapter file."""
    state = checkpoint.load_state(ckpt)
    preset, config = get_preset(state["model"], state["config"].get("expert")), adapter_config(state)
    weights = lora.read_adapter(ckpt / checkpoint.ADAPTER_DIR)
    if ema:
        ema_state = saved_ema(ckpt)
        # the EMA follows the trainable parameters in model order: their names, from the architecture on the meta device
        with torch.device("meta"):
            model = build_transformer(replace(preset, config=preset.transformer_class.load_config(ckpt / "transformer")),
                                      None, 0)
            lora.add_lora(model, config)
        names = [lora.state_key(n) for n, p in model.named_parameters() if p.requires_grad]
        shadow = ema_state["shadow_params"]
        if sorted(names) != sorted(weights) or len(shadow) != len(names):
            raise ValueError(f"{ckpt}: the EMA weights do not match the adapters")
        weights = {n: s.to(weights[n].dtype) for n, s in zip(names, shadow)}
    if preset.paired:  # two experts: each one's adapters in its own folder (the loaders' subfolder=), the first's returned
        parts = [{k.removeprefix(f"{name}."): v for k, v in weights.items() if k.startswith(f"{name}.")} for name in preset.experts]
        written = [lora.save_adapter(Path(directory) / name, preset.family, part, config, lora_format=lora_format)
                   for name, part in zip(preset.experts, parts)][0]
    else:
        written = lora.save_adapter(directory, preset.family, weights, config, lora_format=lora_format)
    write_provenance(Path(directory), ckpt, state, ema, base=recorded_base(preset, state),
                     **({"lora_format": lora_format} if lora_format != "diffusers" else {}))
    return Path(written)


def write_transformer(ckpt: Path, directory: Path, ema: bool, dtype: str | None, merge_lora: bool) -> Path:
    """The run's transformer (trained or EMA; a LoRA run's with its adapters merged) into DIRECTORY/transformer in the
    diffusers layout."""
    torch_dtype = DTYPES[dtype] if dtype else None
    model, _, state = load_model(ckpt, ema, torch_dtype)
    if merge_lora:
        lora.merge_adapters(model)
        if torch_dtype is None:  # the adapters were fp32: the merged weights take the base's dtype
            model.to(DTYPES[state["config"]["weights_dtype"]])
    target = Path(directory) / "transformer"
    model.save_pretrained(target, safe_serialization=True)
    write_provenance(target, ckpt, state, ema, **({"lora": "merged"} if merge_lora else {}))
    return target


def check_replaceable(out: Path) -> None:
    """An export replaces OUT whole: refuse an existing OUT unless it is empty or an earlier export (it carries the
    export's record) holding nothing but what an export writes."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a new directory")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    # only what an export writes: a diffusers pipeline folder holding an exported transformer/ is not replaced (its
    # vae/, text encoders and scheduler would go with it)
    # (an export of two experts: the second's in its folder, transformer_2)
    written = {RECORD, "README.md", "training.json", "images", "transformer", "transformer_2", controlnet.CONTROLNET_DIR, lora.DIFFUSERS_FILE,
               lora.KOHYA_FILE, lycoris.LYCORIS_FILE, lora.PEFT_FILE, "adapter_config.json", ".gitattributes"}
    others = [name for name in names if name not in written]
    added = f"files an export does not write ({', '.join(others[:5])})"
    if is_export(out):
        if not others:
            return
        what = f"is an earlier export holding {added}"
    else:
        what = "exists and is not an export" + (f": it holds {added}" if others else
                                                 f" (it has no {RECORD}, which every export writes; exports written by "
                                                 f"earlier versions have none either)")
    raise ValueError(f"--out {out} {what}. An export replaces its directory whole, so it replaces only an earlier export "
                     f"as written: choose another --out, or remove {out} yourself if nothing in it is needed. To put an "
                     f"exported transformer/ into a pipeline's folder, export to a new directory and copy it there.")


def is_export(directory: Path) -> bool:
    """`directory` carries an export's record (written by `export`, first, into the directory it builds)."""
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("product") == "cachedit" and record.get("kind") == "export"


def leftovers(out: Path) -> list[Path]:
    """Temp directories of exports to OUT that were killed before publishing (they carry the record); others' files
    of similar names are not ours to name."""
    return sorted(p for prefix in (f".tmp-{out.name}-", f".old-{out.name}-") for p in out.parent.glob(f"{prefix}*")
                  if p.is_dir() and is_export(p))


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished export `tmp` over OUT: a reader (or a crash) sees the earlier export or the new one whole.
    An existing OUT is first renamed onto an empty directory made for it, so nothing of another's is ever removed."""
    fsync_tree(tmp)
    check_replaceable(out)  # again: OUT may have changed while the export was written
    aside = None
    if out.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
        os.rename(out, aside)  # onto our own empty directory, which the rename replaces
    try:
        os.rename(tmp, out)
    except BaseException:
        if aside is not None:
            os.rename(aside, out)
        raise
    fsync_dir(out.parent)
    if aside is not None:
        shutil.rmtree(aside)


def export(run: Path, out: Path, ema: bool = False, dtype: str | None = None, merge_lora: bool = False,
           lora_format: LoraFormat = "diffusers", hub_repo: str | None = None) -> Path:
    """Export a run's newest checkpoint (or a given checkpoint) to OUT, with a model card (OUT/README.md, the last
    validation grid in OUT/images) and a note of where the weights came from (training.json):

    - full fine-tuning: the transformer to OUT/transformer in the diffusers layout;
    - LoRA: the adapters to OUT itself (`lora_format` "kohya": kohya's layout, where the family writes it), or with `merge_lora` folded
      into the base weights and the whole transformer written to OUT/transformer;
    - ControlNet: the ControlNet to OUT/controlnet.

    The export is built beside OUT and renamed over it, so OUT is a complete export or the earlier one, never
    partial. `hub_repo`: the Hub repository it will be pushed to, which the card's loading code names. Returns the
    weights written (OUT/transformer, the adapter file or OUT/controlnet)."""
    if hub_repo is not None and hub_repo.count("/") != 1:  # the card's loading code names the repository as given
        raise ValueError(f"--push-to-hub {hub_repo}: give the repository as owner/name (your user or organisation)")
    ckpt = checkpoint.find(run)
    is_lora, is_controlnet = checkpoint.is_lora(ckpt), checkpoint.is_controlnet(ckpt)
    if is_controlnet and merge_lora:
        raise ValueError(f"{ckpt} is a ControlNet checkpoint, not a LoRA one; export it without --merge-lora")
    if merge_lora and not is_lora:
        raise ValueError(f"{ckpt} is not a LoRA checkpoint; export it without --merge-lora")
    if lora_format != "diffusers" and (not is_lora or merge_lora):
        raise ValueError(f"--lora-format {lora_format} applies to LoRA adapters; {ckpt} exports "
                         f"{'a merged transformer' if merge_lora else 'no adapters'}: drop --lora-format")
    out = Path(out).resolve()
    check_replaceable(out)
    state = checkpoint.load_state(ckpt)
    for left in leftovers(out):
        log.warning("%s is left from an export to %s that did not finish; remove it if no export is running", left, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))  # ours alone: no other's is touched
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's is private; the export gets what a new directory gets
    try:
        atomic_write_json(tmp / RECORD, {"product": "cachedit", "kind": "export", "run": str(Path(run).resolve()),
                                         "checkpoint": str(ckpt.resolve()), "step": state["step"], "ema": ema})
        if is_controlnet:
            kind, written = "controlnet", write_controlnet(ckpt, tmp, ema, dtype)
        elif is_lora and not merge_lora:
            kind, written = "lora", write_adapter(ckpt, tmp, ema, lora_format)
        else:
            kind, written = "full", write_transformer(ckpt, tmp, ema, dtype, merge_lora)
        default_names = (lora.DIFFUSERS_FILE, lora.PEFT_FILE)
        card.write_card(tmp, ckpt, state, kind, ema=ema, location=hub_repo or str(out), merged=merge_lora,
                        weight_name=written.name if kind == "lora" and written.name not in default_names else None)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / written.relative_to(tmp)


class UploadError(RuntimeError):
    """Pushing an export to the Hub failed; the export on disk is intact."""


def push_to_hub(out: Path, repo: str, private: bool = False, commit_message: str | None = None) -> str:
    """Upload exactly the export directory OUT to the Hub model repository `repo` (created if missing, `private` then).

    Returns:
        The repository's id as the Hub names it.

    Raises:
        UploadError: not logged in, no network, no permission...; the message says how to retry without exporting again.
    """
    from huggingface_hub import HfApi

    out = Path(out)
    api = HfApi()
    try:
        # None: a new repository takes its owner's default visibility; an existing one keeps its own
        repo_id = api.create_repo(repo, private=True if private else None, exist_ok=True, repo_type="model").repo_id
        if private and not api.repo_info(repo_id, repo_type="model").private:
            raise ValueError(f"{repo_id} exists and is public; --private would not make it private (change it on the Hub "
                             f"or push to another repository)")
        # the repository holds exactly the export: files of earlier pushes it no longer has are deleted
        api.upload_folder(folder_path=out, repo_id=repo_id, repo_type="model", delete_patterns="*", ignore_patterns=RECORD,
                          commit_message=commit_message or f"Upload {out.name} (cachedit export)")
    except Exception as e:  # the Hub client's errors (auth, HTTP, offline mode, connection) all end here, reported
        raise UploadError(
            f"pushing {out} to the Hub repository {repo} failed ({type(e).__name__}: {e}). The export in {out} is complete "
            f"and intact. Log in with `huggingface-cli login` (now `hf auth login`) or set HF_TOKEN to a token with write "
            f"access, check the network, then push it without exporting again: hf upload {repo} {out} . --repo-type model "
            f"--exclude {RECORD}"
            + (" --private" if private else "")) from e
    return repo_id


def sample(run: Path, prompt_cache: Path | str | None = None, out: Path | None = None, *, prompts: list[str] = (),
           buckets: list[str] = (), frames: int | None = None, steps: int | None = None, guidance: float | None = None,
           seed: int | None = None,
           ema: bool = False, decode_device: str | None = None, precision: str | None = None,
           say: Callable[[str], None] = lambda message: None) -> list[Path]:
    """Images for cached prompts from a checkpoint: one PNG per prompt and bucket (a cache of clips: one mp4 each and
    their contact sheet; an edit cache: the edit of each of the run's `--validation-items` dataset items, and its row
    beside its reference image(s) and target, `NAME-row.png`), in `out` (default: RUN/samples/NNNNNNNN/sample, or
    sample-ema with `ema`: in the step's folder, beside the validation videos a run of clips writes there, and outside
    the checkpoints, which a run rotates away). The prompts come from `prompt_cache` (default: the run's own
    first --cache). Sampler steps, guidance, seed, decode device and precision default to the run's own validation
    settings. `say` hears the progress: which image is being sampled, then decoded."""
    from train.decode import decode, grid, load_decoder, render_clips
    from train.video import SHEET

    ckpt = checkpoint.find(run)
    saved = checkpoint.load_state(ckpt)
    cfg = saved["config"]
    cache = open_prompt_cache(prompt_cache, cfg)  # checked before any weights load
    if damaged := damaged_files(cache, ("prompts", "decoder")):  # what sampling reads, against the manifest's digests
        raise DamagedCache(damaged)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    say(f"loading {ckpt}{' (EMA weights)' if ema else ''} ...")
    model, preset, state = load_model(ckpt, ema)
    model.to(device)
    steps = steps if steps is not None else cfg["validation_steps"]
    guidance = guidance if guidance is not None else cfg["guidance_scale"]
    seed = seed if seed is not None else cfg["validation_seed"]
    decode_device = decode_device or cfg["decode_device"]
    precision = precision or cfg["precision"]
    objective = build_objective(preset.objective, preset.prediction, shift=cfg.get("flow_shift") or preset.flow_shift,
                                resolution_shift=cfg.get("resolution_shift", False), base_resolution=preset.base_resolution,
                                clean_first_frame=cfg.get("i2v_probability", 0.0),  # samples image-to-video as it validated
                                **flow_shift_kind(cfg.get("flow_shift"), cfg.get("resolution_shift", False), preset))
    # a run's checkpoints are rotated (--keep-checkpoints): samples go beside them, into the step's folder that a run's
    # validation videos go to (RUN/samples/NNNNNNNN, `Validator.run`), in a folder of their own there, never over them
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    out = Path(out) if out else run_dir / "samples" / f"{saved['step']:08d}" / (SAMPLE_EMA_DIR if ema else SAMPLE_DIR)
    # an edit model edits cached dataset items (their references and captions), as its run validated
    items = cfg.get("validation_items", 4) if has_references(cache) else 0
    validator = Validator(cache, preset, objective, prompts=list(prompts), buckets=list(buckets), steps=steps, guidance=guidance,
                          seed=seed, decode_device="cpu", out=out, model_name=preset.name, items=items,
                          frames=frames if frames is not None else cfg.get("validation_frames"),
                          guidance_2=cfg.get("guidance_scale_2"))
    if not validator:
        if has_references(cache):
            raise ValueError(f"the run validated on --validation-items 0 dataset items of {cache.location}: nothing to edit")
        raise ValueError(f"{cache.location} holds no prompts; add some with {add_prompts_command(cache, [])}")
    out.mkdir(parents=True, exist_ok=True)  # after the checks: a refused command leaves no empty folder behind
    dtype = DTYPES[precision]
    latents = validator.sample(model, dtype, progress=say)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    decoding = device if decode_device == "device" else torch.device("cpu")
    say(f"decoding {len(latents)} {'video' if validator.fps else 'image'}(s) on {decoding.type} into {out} ...")
    vae = load_decoder(validator.recipe, decoding)
    if validator.fps:  # a clip cache: an mp4 per prompt and bucket, and their contact sheet
        rows = [(f"{text} ({bucket.name})", [z]) for (text, bucket), z in latents.items()]
        names = [f"{slug(text)}-{bucket.name}-seed{seed}" for text, bucket in latents]
        sheet = render_clips(vae, validator.recipe, {"title": f"{ckpt.name} · {steps} steps, guidance {guidance} · "
                                                              f"{validator.fps:g} fps", "rows": rows, "names": names,
                                                     "fps": validator.fps, "path": str(out / SHEET)})
        return [out / f"{name}.mp4" for name in names] + [sheet]
    written = []
    for key, z in latents.items():
        image = decode(vae, validator.recipe, z[None])[0]
        if isinstance(key, int):  # a dataset item an edit model edited: the edit, and its row beside its inputs
            item = validator.items[key]
            path = out / f"{slug(Path(item.name).stem)}-{item.bucket.name}-seed{seed}.png"
            label, row = validator.item_row(key, z)
            side = path.with_name(f"{path.stem}-row.png")
            grid(f"{ckpt.name} · {steps} steps, guidance {guidance}",
                 [(label, [decode(vae, validator.recipe, x[None])[0] for x in row if x is not None])]).save(side)
            written.append(side)
        else:
            text, bucket = key
            path = out / f"{slug(text)}-{bucket.name}-seed{seed}.png"
        image.save(path)
        written.append(path)
    return written


def open_prompt_cache(location: Path | str | None, cfg: dict) -> Cache:
    """The cache whose prompts a checkpoint samples: `location`, or the run's own first --cache (a directory as the run
    was given it, or a URL read through the run's --local-cache)."""
    if location is not None:
        return open_cache(str(location))
    own = cfg["cache"][0] if isinstance(cfg["cache"], list) else cfg["cache"]
    if not is_url(own) and not exists(own):
        raise FileNotFoundError(f"the run's cache {own} (its --cache) is not there from {Path.cwd()}: pass --prompt-cache "
                                f"CACHE (the cache, or any cache of the same encoders with the prompts)")
    return open_cache(own, local_dir=cfg.get("local_cache"))
