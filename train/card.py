"""The model card every export carries: OUT/README.md, what the Hub shows for a pushed export.

Built with diffusers' card helpers (`load_or_create_model_card`, `populate_model_card`) from what the checkpoint
records: the base weights and their commit, the preset, what trained (full weights, LoRA, ControlNet), the
optimisation settings, a summary of the cache the run read, the last validation grid (copied to OUT/images as the
card's widget) and the stock diffusers code that loads the export. The licence is left for the owner to set.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shards import Cache, FormatError
from shards.remote import is_url
from train.families import get_family, get_preset
from train.lora import TITLES
from train.lycoris import LYCORIS_FILE

Kind = Literal["full", "lora", "controlnet"]
CARD = "README.md"
IMAGES = "images"
@dataclass(frozen=True)
class Base:
    """The weights a run started from, as its checkpoint records them (no Hub lookup).

    Args:
        kind: "hub", "local" or "fresh" (as `train.presets.Weights`).
        source: the Hub id, the directory, or what was initialised.
        revision: the Hub revision asked for (None: the default branch).
        commit: the Hub commit the run's snapshot held (None: not recorded).
    """

    kind: str
    source: str
    revision: str | None = None
    commit: str | None = None

    @classmethod
    def of(cls, state: dict) -> Base:
        record, cfg = state.get("weights"), state["config"]
        if record is not None:
            return cls(record["kind"], record["source"], record.get("revision"), record.get("commit"))
        # a checkpoint written before runs recorded their weights: what the options named
        source = cfg.get("pretrained") or get_preset(state["model"]).repo
        if source is None or cfg.get("from_scratch"):
            return cls("fresh", f"fresh weights (seed {cfg['seed']})")
        return cls("local" if Path(source).expanduser().is_dir() else "hub", source, cfg.get("revision"))

    def pipeline_source(self) -> tuple[str, str]:
        """(what the loading snippet passes to the pipeline's `from_pretrained`, a comment on it)."""
        if self.kind == "hub":
            return self.source, ""
        if self.kind == "local":
            return self.source, "  # the base model's directory on the machine that trained this"
        return "BASE", "  # the run started from fresh weights: the pipeline whose VAE and text encoder(s) built its cache"


def write_card(directory: Path, ckpt: Path, state: dict, kind: Kind, *, ema: bool, location: str,
               weight_name: str | None = None, merged: bool = False) -> Path:
    """Write `directory`/README.md (and the run's last validation grid under `directory`/images) for an export.

    Args:
        directory: the export's directory (OUT, or the temp directory published as OUT).
        ckpt: the checkpoint exported.
        state: its training state (`state.json`).
        kind: "full" (OUT/transformer), "lora" (adapters in OUT) or "controlnet" (OUT/controlnet).
        ema: the EMA weights were exported.
        location: where users load the export from, for the snippet: the Hub repository or OUT.
        weight_name: a LoRA file other than the format's default name (passed as `weight_name=`).
        merged: a LoRA run's adapters were folded into the full transformer.

    Returns:
        The card's path.
    """
    from diffusers.utils.hub_utils import load_or_create_model_card, populate_model_card
    from huggingface_hub import ModelCardData

    directory = Path(directory)
    preset, cfg, base = get_preset(state["model"]), state["config"], Base.of(state)
    sampled = get_preset(state["model"], cfg.get("expert"))
    if cfg.get("i2v_probability"):  # trained image-to-video by a clean first frame: the card samples so
        sampled = get_family(preset.family).first_frame_preset(sampled)
    summary, prompts = describe_caches(state)
    grid = copy_grid(ckpt, state["step"], directory)
    url = grid.relative_to(directory).as_posix() if grid else None
    licence_of_base = f" ([{base.source}](https://huggingface.co/{base.source}))" if base.kind == "hub" else ""
    body = "\n".join([
        f"# {location.rstrip('/').split('/')[-1]}", "",
        describe_kind(kind, state, directory, merged), "",
        "## Base model", "", describe_base(base, preset.name, preset.family), "",
        "## Training", "", *describe_training(state, ema), "",
        "## Data", "", *summary, "",
        "## Validation samples", "",
        f"The run's last validation grid (step {grid_step(grid)}): ![validation samples]({url})" if grid
        else "The run left no validation grid at or before this step.", "",
        "## How to use", "", "```python", usage(preset.family, kind, base, location, weight_name, cfg.get("adapter", "lora"),
                                                 preset=sampled),
        "```", "", *comfyui_note(kind, weight_name),
        "## License", "",
        f"Not set by cachedit: choose one, compatible with the base model's license{licence_of_base}, and add it to this "
        "card's metadata (`license:`).", "",
        "## Provenance", "",
        "Trained and exported with cachedit from a cache of precomputed latents; `training.json` beside the weights names "
        f"the checkpoint (`{ckpt.name}`), its step and the precision history.", "",
    ])
    widget = None
    if grid is not None:
        text = ("validation items: control image, generated image, dataset image" if cfg.get("controlnet")
                else "validation edits: reference image(s), edited image, target" if preset.references
                else "; ".join(prompts) or "validation samples")
        widget = [{"text": text, "output": {"url": url}}]
    # an edit model's pipeline takes an image and an instruction
    task = ("text-to-video" if get_family(preset.family).temporal_downsample else
            "image-to-image" if preset.references else "text-to-image")
    data = ModelCardData(base_model=base.source if base.kind == "hub" else None, pipeline_tag=task, widget=widget)
    # The card is written, then loaded back with diffusers' helper: given a Hub id instead, `load_or_create_model_card`
    # would fetch that repository's card first; an export is the same whether it is pushed or not, and offline.
    path = directory / CARD
    path.write_text(f"---\n{data.to_yaml()}\n---\n\n{body}", encoding="utf-8")
    card = load_or_create_model_card(str(path))
    tags = [task, "diffusers", "diffusers-training", "cachedit", *get_family(preset.family).tags()]
    tags += {"lora": ["lora", "template:sd-lora"], "controlnet": ["controlnet"], "full": []}[kind]
    card = populate_model_card(card, tags=tags)
    card.save(path)
    return path


def describe_kind(kind: Kind, state: dict, directory: Path, merged: bool) -> str:
    cfg, preset = state["config"], get_preset(state["model"])
    what = f"the {preset.family} transformer of preset `{preset.name}`"
    if kind == "lora":
        targets = cfg["lora_targets"] or list(get_family(preset.family).lora_targets)
        alpha = cfg["lora_alpha"] if cfg["lora_alpha"] is not None else cfg["lora_rank"]
        adapter = cfg.get("adapter", "lora")
        title = TITLES[adapter]
        shape = (f", Kronecker factor {cfg['lokr_factor'] if cfg['lokr_factor'] != -1 else 'near square'}"
                 f"{', both factors decomposed' if cfg.get('lokr_decompose_both') else ''}") if adapter == "lokr" else ""
        dropout = f", dropout {cfg['lora_dropout']:g}" if adapter in ("lora", "dora") else ""
        on = ", ".join(f"`{t}`" for t in targets) if len(targets) <= 16 else f"{len(targets)} layers"
        started = f" Training started from `{Path(cfg['init_lora']).name}`." if cfg.get("init_lora") else ""
        return (f"{title} adapters for {what}: rank {cfg['lora_rank']}, alpha {alpha:g}{shape}{dropout}, on {on}.{started} "
                f"The base weights are not included.")
    if kind == "controlnet":
        config = json.loads((directory / "controlnet" / "config.json").read_text())
        started = cfg.get("pretrained_controlnet") or "a copy of the transformer's first blocks, zero-initialised outputs"
        return (f"A ControlNet for {what}: {config.get('num_layers')} blocks (started from {started}), trained beside the "
                f"frozen transformer at conditioning scale {cfg.get('controlnet_conditioning_scale', 1.0):g}. The transformer "
                f"is the base model, not included.")
    if merged:
        return (f"A full transformer: {what} with LoRA adapters (rank {cfg['lora_rank']}) trained on it and merged into "
                f"its weights.")
    return f"A full fine-tune of {what} (every weight trained), in `transformer/`."


def describe_base(base: Base, preset: str, family: str) -> str:
    if base.kind == "hub":
        return (f"[{base.source}](https://huggingface.co/{base.source}), revision `{base.revision or 'main'}`, commit "
                f"`{base.commit or 'not recorded'}`; preset `{preset}` (family {family}).")
    if base.kind == "local":
        return f"A local directory, `{base.source}`; preset `{preset}` (family {family})."
    return f"None: {base.source}; preset `{preset}` (family {family})."


def describe_training(state: dict, ema: bool) -> list[str]:
    cfg = state["config"]
    world = state.get("world_size", 1)
    schedule = cfg["lr_schedule"] + (f", {cfg['warmup_steps']} warmup steps" if cfg.get("warmup_steps") else "")
    history = state.get("precision_history") or []
    precision = f"{cfg['precision']} autocast, {cfg['weights_dtype']} weights"
    if len(history) > 1:
        precision += " (changed during the run: " + ", ".join(f"step {h['step']}: {h['precision']}/{h['weights_dtype']}"
                                                               for h in history) + ")"
    rows = [
        ("steps", f"{state['step']} of {cfg['steps']}"),
        ("batch", f"{cfg['batch_size']} per device × {cfg['grad_accum']} accumulation × {world} device(s) = "
                  f"{cfg['batch_size'] * cfg['grad_accum'] * world} samples per step"),
        ("precision", precision),
        ("optimizer", f"{cfg['optimizer']}, weight decay {cfg['weight_decay']:g}, gradient clip {cfg['grad_clip']:g}"),
        ("learning rate", f"{cfg['lr']:g}, schedule {schedule}"),
        ("caption dropout", f"{cfg['caption_dropout']:g}"),
        ("EMA", f"decay {cfg['ema_decay']:g}" if cfg.get("ema_decay") else "none"),
        *([("guidance embedding", f"{cfg['train_guidance']:g} in training (the unguided target); validation sampled at "
                                  f"guidance_scale {cfg['guidance_scale']:g}")]
          if cfg.get("train_guidance") is not None else []),
        ("weights exported", "EMA" if ema else "trained"),
        ("seed", str(cfg["seed"])),
    ]
    return ["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def describe_caches(state: dict) -> tuple[list[str], list[str]]:
    """Markdown lines summarising each cache the run read (samples, buckets, sources), and the cached validation
    prompts. A cache that is remote or no longer readable is named as such: the card is written regardless."""
    lines, prompts = [], []
    cfg = state["config"]
    entries = state.get("caches") or [state]
    for k, entry in enumerate(entries):
        location = entry.get("cache_url") or entry.get("cache_root") or (cfg["cache"][k] if k < len(cfg["cache"]) else "?")
        generation = entry.get("cache_generation")
        head = f"Cache `{location}`" + (f" (generation {generation})" if generation is not None else "")
        if is_url(location):
            lines.append(f"- {head}: remote, not opened by the export, so it is not summarised.")
            continue
        try:
            cache = Cache(location, generation)
        except (OSError, FormatError) as e:
            lines.append(f"- {head}: not readable when this was exported ({type(e).__name__}), so it is not summarised.")
            continue
        lines.append(f"- {head}: {len(cache)} samples.")
        buckets = cache.manifest.buckets()
        clips = any(b.frames for b in buckets)
        lines.append(f"  - buckets ({'frames×' if clips else ''}height×width: samples): " + ", ".join(
            f"{b.name.replace('x', '×')}: {s.samples}" for b, s in buckets.items()))
        lines.append("  - sources: " + ", ".join(f"{name or '(unnamed)'}: {t['samples']} samples"
                                                 for name, t in cache.manifest.datasets().items()))
        prompts += [p.text for p in sorted(cache.prompts().values(), key=lambda p: p.text) if p.text]
    drawn = state.get("samples_by_source") or {}
    if drawn:
        lines.append("- Samples drawn in training, by source: "
                     + ", ".join(f"{name or '(unnamed)'}: {n}" for name, n in drawn.items()))
    return lines, cfg.get("validation_prompt") or prompts


def comfyui_note(kind: Kind, weight_name: str | None) -> list[str]:
    """The card's words for ComfyUI and kohya's tools, for a LyCORIS-layout file."""
    if kind != "lora" or weight_name != LYCORIS_FILE:
        return []
    return [f"ComfyUI: copy `{weight_name}` into `ComfyUI/models/loras` and apply it with the *LoraLoaderModelOnly* node. "
            "Its layers are named as LyCORIS names a diffusers transformer's (`lycoris_<module path>`).", ""]


def copy_grid(ckpt: Path, step: int, directory: Path) -> Path | None:
    """Copy the run's newest validation grid at or before `step` (RUN/samples-stepN.png, or a run of clips' contact
    sheet, RUN/samples/N/contact-sheet.png) into `directory`/images."""
    run = Path(ckpt).parent.parent  # RUN/checkpoints/step-N
    found = [*run.glob("samples-step*.png"), *run.glob("samples/*/contact-sheet.png")]
    grids = [(grid_step(p), p) for p in found if grid_step(p) <= step]
    if not grids:
        return None
    at, source = max(grids)
    name = source.name if source.name.startswith("samples-step") else f"samples-step{at:08d}-contact-sheet.png"
    target = directory / IMAGES / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def grid_step(path: Path) -> int:
    """The step of a validation grid or contact sheet, from its path or an export's copy of it (-1: not one)."""
    match = re.fullmatch(r"samples-step(\d+)(-contact-sheet)?\.png", path.name)
    if match:
        return int(match.group(1))
    return int(path.parent.name) if path.name == "contact-sheet.png" and path.parent.name.isdigit() else -1


def usage(family: str, kind: Kind, base: Base, location: str, weight_name: str | None = None, adapter: str = "lora",
          preset=None) -> str:
    """Python that loads the export into the family's stock diffusers pipeline (`adapter`: a LoRA run's `--adapter`;
    `preset`: the run's, whose pipeline samples it and whose transformer, `preset.subfolder`, the export takes the place
    of: one expert of a two-expert model)."""
    source, note = base.pipeline_source()
    revision = f', revision="{base.revision}"' if base.kind == "hub" and base.revision else ""
    kind_of = get_family(family)
    pipe = kind_of.pipeline_of(preset) if preset is not None else kind_of.pipeline
    # (the pipeline's component, the export's folder holding it): one transformer in transformer/ (one expert of two:
    # in the component it is), or both experts of a two-expert model, each in its own
    if preset is not None and preset.paired:
        parts = list(zip(preset.experts, preset.experts))
    else:
        parts = [(preset.subfolder if preset is not None else "transformer", "transformer")]
    extra = f", {kind_of.usage_call_args()}" if kind_of.usage_call_args() else ""
    sample_imports, generate = kind_of.usage_generate(preset, extra)
    if kind == "controlnet":
        pipe, model = kind_of.controlnet.pipeline, kind_of.controlnet.model
        return "\n".join([
            "import torch", f"from diffusers import {pipe}, {model}", "",
            f'controlnet = {model}.from_pretrained("{location}", subfolder="controlnet", torch_dtype=torch.bfloat16)',
            f'pipe = {pipe}.from_pretrained("{source}"{revision}, controlnet=controlnet, torch_dtype=torch.bfloat16).to("cuda"){note}',
            f'image = pipe("a prompt", control_image=control_image{extra}).images[0]  # control_image: a PIL image like the training ones'])
    if kind == "full":
        model = kind_of.transformer
        given = "".join(f", {component}={component}" for component, _ in parts)
        return "\n".join([
            "import torch", f"from diffusers import {pipe}, {model}", *sample_imports, "",
            *[f'{component} = {model}.from_pretrained("{location}", subfolder="{folder}", torch_dtype=torch.bfloat16)'
              for component, folder in parts],
            f'pipe = {pipe}.from_pretrained("{source}"{revision}{given}, torch_dtype=torch.bfloat16).to("cuda"){note}',
            *generate])
    # adapters: in the export's directory, or both experts' each in its folder
    adapters = [(component, folder if len(parts) > 1 else None) for component, folder in parts]
    imports, loading = [], []
    if weight_name == LYCORIS_FILE:  # LyCORIS' own loader, which names a diffusers transformer's layers as the file does
        local = Path(location).is_absolute()  # an export directory, or the Hub repository it is pushed to
        imports = [*([] if local else ["from huggingface_hub import hf_hub_download"]), "from lycoris import create_lycoris_from_weights"]
        for component, folder in adapters:
            file = f"{folder}/{weight_name}" if folder else weight_name
            fetch = f'"{Path(location) / file}"' if local else f'hf_hub_download("{location}", "{file}")'
            loading += [f"wrapper, _ = create_lycoris_from_weights(1.0, {fetch}, pipe.{component})  # pip install lycoris-lora",
                        "wrapper.merge_to()"]
    elif adapter in ("lokr", "loha"):  # peft's layout: diffusers' LoRA loader takes LoRA alone
        imports = ["from peft import PeftModel"]
        for component, folder in adapters:
            sub = f', subfolder="{folder}"' if folder else ""
            loading.append(f'pipe.{component} = PeftModel.from_pretrained(pipe.{component}, "{location}"{sub})')
    else:
        for component, folder in adapters:
            imports, lines = kind_of.lora_usage(location, weight_name, component, folder)
            loading += lines
    lines = ["import torch", f"from diffusers import {pipe}", *sample_imports, *imports]
    lines += ["", f'pipe = {pipe}.from_pretrained("{source}"{revision}, torch_dtype=torch.bfloat16).to("cuda"){note}']
    return "\n".join(lines + loading + generate)
