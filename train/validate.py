"""Validation samples from the training transformer itself and the prompt embeddings stage one cached.

No text encoder and no second transformer: prompts come from the cache (`prompts.safetensors`), the
null embedding drives classifier-free guidance, and the family samples as its pipeline does (`Family.sampling_scheduler`,
`set_timesteps` and `denoise`: its diffusers scheduler, classifier-free guidance or a distilled guidance embedding);
EMA weights are swapped in for the duration, and the latents go to `train.decode.Decoder` (a CPU process by default).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards import Bucket, Cache
from shards.prompts import prompt_key
from shards.references import unpack as unpack_references
from shards.remote import is_url
from shards.texts import TEXT_KEYS, keys_of
from train.data import REFERENCES, TextLayout, has_references
from train.decode import Decoder, decoder_recipe
from train.families import get_family
from train.families.base import ModelPreset
from train.objectives import FIRST_FRAME
from train.order import derived_seed
from train.presets import model_forward
from train.video import SHEET


@dataclass
class ValidationPrompt:
    text: str
    cond: dict[str, torch.Tensor]  # one caption's text fields (`TextLayout.caption`)


def resolve_prompts(cache: Cache, requested: list[str], model: str) -> list[ValidationPrompt]:
    """The requested prompts (all the cache's validation prompts when none are), with their cached
    embeddings; a prompt that was never encoded stops the run here, naming the command that adds it."""
    stored, layout = cache.prompts(), TextLayout.of(cache)
    if not requested:
        return [ValidationPrompt(p.text, layout.caption(p.fields)) for p in sorted(stored.values(), key=lambda p: p.text) if p.text]
    missing = [text for text in requested if prompt_key(text) not in stored]
    if missing:
        args = " ".join(f"--validation-prompt {json.dumps(t)}" for t in missing)
        raise ValueError(
            f"validation prompt(s) {missing} have no cached embedding in {cache.location}. Add them (only the cache's text "
            f"encoder runs; its dataset is not needed):\n  {add_prompts_command(cache, missing)}\nor with stage one's run "
            f"(nothing else is re-encoded):\n  make precompute DATA=<your data> MODEL={model} CACHE={cache.root} "
            f"PRECOMPUTE_ARGS={shlex.quote(args)}"
        )
    return [ValidationPrompt(t, layout.caption(stored[prompt_key(t)].fields)) for t in requested]


def add_prompts_command(cache: Cache, prompts: list[str]) -> str:
    """The command that caches `prompts` in `cache` (`--prompt TEXT` when there are none to name); for a cache
    read from object storage, the directory it was copied from."""
    args = " ".join(f"--prompt {shlex.quote(t)}" for t in prompts) or "--prompt TEXT"
    if is_url(cache.location):
        return (f"python -m precompute prompts DIR {args}  (DIR: the directory {cache.location} was copied from; "
                f"copy it there again afterwards)")
    return f"python -m precompute prompts {shlex.quote(cache.location)} {args}"


def default_buckets(cache: Cache, n: int = 3) -> list[Bucket]:
    """The cache's `n` most populous buckets."""
    stats = cache.manifest.buckets()
    return sorted(stats, key=lambda b: (-stats[b].samples, b))[:n]


def clip_buckets(cache: Cache, requested: list[str], frames: int | None) -> list[Bucket]:
    """The clip buckets a cache of clips validates at: the requested ones (FxHxW, or HxW at `frames`), else its most
    populous clip bucket (at `frames` when given). A clip length the VAE cannot encode (F = k x temporal factor + 1) is
    refused."""
    step = cache.spec.latent.temporal_downsample
    stats = cache.manifest.buckets()
    clips = sorted((b for b in stats if b.frames > 1), key=lambda b: (-stats[b].samples, b)) or default_buckets(cache, 1)
    common = clips[0] if clips else Bucket(cache.spec.base_resolution or 256, cache.spec.base_resolution or 256, 1)
    out = []
    for b in [Bucket.parse(name) for name in requested] or [common]:
        b = b.with_frames(frames or b.frames or common.frames)
        if (b.frames - 1) % step:
            raise ValueError(f"validation clips of {b.frames} frames: the cache's VAE encodes clips of k x {step} + 1 frames "
                             f"(the nearest: {', '.join(map(str, sorted({max(1, (b.frames - 1) // step * step + 1), (b.frames - 1) // step * step + step + 1})))}); "
                             f"choose --validation-frames or a --validation-bucket FxHxW of such a length")
        out.append(b)
    return out


def frame_rate(cache: Cache, preset: ModelPreset) -> float:
    """Frames per second of a cache's clips: the rate stage one resampled them to, as its fingerprint (the clips' part of
    its buckets) or its record says, else the rate the family's models were trained at."""
    clips = (cache.fingerprint.get("buckets") or {}).get("clips") or {}
    rate = clips.get("frame_rate") or cache.spec.extra.get("frame_rate") or get_family(preset.family).frame_rate
    if not rate:
        raise ValueError(f"{cache.location} records no frame rate for its clips and {preset.family} models have none")
    return float(rate)


def slug(text: str) -> str:
    """A file name's part made of `text`: lower-case letters and digits, dashes between."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "prompt"


def sampling_scheduler(preset: ModelPreset, objective, pixels: int):
    """The family's inference scheduler, set up as training defined the noise."""
    return get_family(preset.family).sampling_scheduler(objective, pixels)


@torch.no_grad()
def generate(model, preset: ModelPreset, objective, cond: dict, null: dict, latent_shape: tuple[int, ...],
             pixels: int, *, steps: int, guidance: float, seed: int, precision: torch.dtype,
             layout: TextLayout | None = None, forward: Callable | None = None,
             control: torch.Tensor | None = None, conditioning: dict[str, torch.Tensor] | None = None,
             references: list[torch.Tensor] | None = None, guidance_2: float | None = None) -> torch.Tensor:
    """One sample (C, h, w), a clip's (C, T, h, w), at the cache's latent scale, guided as the family's pipeline guides
    (`Family.denoise`); `pixels` of its bucket (of one frame).
    `cond` and `null` are one caption's cached text fields each. `forward` (default: the model's own) is called as
    (latents, timesteps, batch); `control`, a control latent (C, h, w) as the cache stores it, goes into that batch
    for both halves of the guidance, as the stock ControlNet pipelines condition them, and so do the `conditioning`
    fields of one cached sample (`Family.conditioning_fields`: an image-to-video model's first frame). `references`: an
    edit sample's reference latents (C, h, w) each, as the cache stores them: the batch's `references` for both halves
    (an edit pipeline conditions its negative prompt on the same images), in `precision` on the device, as training
    passes them (`train.data.TrainingSamples`). Both experts of a two-expert model (`preset.paired`, `model` routing each
    timestep to its expert) guide at `guidance` from the start and at `guidance_2` (default: `guidance`) below the
    boundary, as the pipelines' guidance_scale and guidance_scale_2."""
    device = next(model.parameters()).device
    c = latent_shape[0]
    family = get_family(preset.family)
    scheduler = family.sampling_scheduler(objective, pixels)
    family.set_timesteps(scheduler, objective, steps, pixels, device)
    g = torch.Generator().manual_seed(seed)
    latents = (torch.randn(1, *latent_shape, generator=g) * getattr(scheduler, "init_noise_sigma", 1.0)).to(device)
    text = (layout or TextLayout()).collate([{k: v.float() for k, v in fields.items()} for fields in (null, cond)])
    for name, value in (conditioning or {}).items():
        text[name] = value.to(precision)[None].expand(2, *value.shape)
    if control is not None:
        text["control"] = control.float()[None].expand(2, *control.shape[-3:])
    text = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in text.items()}
    if references is not None:
        refs = [r.to(device, precision) for r in references]
        text[REFERENCES] = [refs, list(refs)]
    forward = forward or model_forward(model, preset.family, guidance=guidance)
    autocast = torch.autocast(device.type, dtype=precision, enabled=precision != torch.float32)
    experts = {"boundary": preset.expert_boundary, "guidance_2": guidance_2} if preset.paired else {}
    return family.denoise(forward, scheduler, latents, text, guidance=guidance, channels=c, autocast=autocast, **experts)[0]


@dataclass
class ValidationItem:
    """A cached dataset item a ControlNet or edit run validates on: its first caption's text fields, its control latent
    (a ControlNet cache's) or its reference images' latents (an edit cache's), and its own latent (the ground truth),
    as the cache stores them, at its bucket."""

    name: str  # the input it was encoded from
    bucket: Bucket
    cond: dict[str, torch.Tensor]
    control: torch.Tensor | None  # (C, h, w); a KL VAE's posterior mean; None in an edit cache
    target: torch.Tensor  # (C, h, w)
    references: list[torch.Tensor] = field(default_factory=list)  # (C, h_i, w_i) each, an edit sample's
    caption: str | None = None  # its first caption, where the cache records it (texts stored once)


def validation_items(cache: Cache, n: int) -> list[ValidationItem]:
    """`n` dataset items spread evenly over the cache (by position, so buckets and sources come in proportion),
    the same ones every time. The control latent is the posterior's mean: validation is deterministic where
    training draws from the posterior. An edit cache's items carry their references (the posteriors' means, as
    stored) and no control latent."""
    layout, spec = TextLayout.of(cache), cache.spec.latent
    edit = has_references(cache)
    k = min(n, len(cache))
    out = []
    for i in (j * len(cache) // k for j in range(k)):  # k distinct positions, the first sample first
        s = cache[i]
        shape = spec.shape(s.bucket.height, s.bucket.width)
        control = None if edit else s.fields[spec.control_fields[0]].float().reshape(shape).clone()
        out.append(ValidationItem(Path(bytes(s.fields["source"].numpy()).decode("utf-8", "replace")).name, s.bucket,
                                  {k: v.clone() for k, v in layout.caption(s.fields, 0).items()}, control,
                                  s.fields[spec.fields[0]].float().reshape(shape).clone(),
                                  [r.float().clone() for r in unpack_references(s.fields)] if edit else [],
                                  first_caption(cache, i)))
    return out


def first_caption(cache: Cache, i: int) -> str | None:
    """The first caption of sample `i` as the cache records it: a cache that stores each text once keeps its caption
    beside its text row; one that stores texts with each sample keeps none (None)."""
    if cache.texts is None:
        return None
    s = cache.read(i, resolve=False)
    keys = keys_of(s.fields[TEXT_KEYS]) if TEXT_KEYS in s.fields else []
    found = cache.locate_text(keys[0]) if keys else None
    if found is None:
        return None
    t, row = found
    return cache.texts.samples_of(t)[1][row] or None


class Validator:
    """Generates one grid per call: a row per prompt, a column per bucket, and a row of dataset latents
    decoded the same way, so generated samples can be judged against what the model learns from.

    With `items` (ControlNet runs), a row per cached dataset item instead: its control image, the image generated
    from its control latent and caption, and its own image (all decoded by the background decoder).

    An edit cache (its samples have reference images) validates on `items` as well: a row per item, its reference
    image(s), the image generated from its caption (the instruction) and references, and its target, decoded as
    targets are, labelled with the caption where the cache records it. A model that edits only (the preset's
    `requires_references`) has no prompt-only validation (`prompts` are refused); one that also generates from text
    alone samples the requested `prompts` too (all cached ones when `items` is 0), in rows after the items'."""

    def __init__(self, cache: Cache, preset: ModelPreset, objective, *, prompts: list[str], buckets: list[str], steps: int,
                 guidance: float, seed: int, decode_device: str, out: Path, model_name: str, items: int = 0,
                 frames: int | None = None, guidance_2: float | None = None):
        if items < 0:
            raise ValueError(f"--validation-items {items}: give 0 (no grids) or more")
        self.items = validation_items(cache, items) if items else []
        if items and not self.items:
            raise ValueError(f"{cache.location} holds no samples to validate on")
        self.edit = has_references(cache)
        if self.edit and preset.requires_references and prompts:
            raise ValueError(f"{preset.name} edits an input image: it validates on cached dataset items (--validation-items: "
                             f"their reference images and captions), not on --validation-prompt alone; leave it out")
        if self.edit and preset.requires_references:
            self.prompts = []
        elif self.edit:  # edits and generates from text alone: the items and any prompts asked for
            self.prompts = resolve_prompts(cache, prompts, model_name) if prompts or not items else []
        else:
            self.prompts = [] if items else resolve_prompts(cache, prompts, model_name)
        null = cache.prompts().get(prompt_key(""))
        if null is None:
            raise ValueError(f"{cache.location} holds no empty-caption embedding for guidance; it is stored with any prompt: "
                             f"{add_prompts_command(cache, prompts)}")
        self.layout = TextLayout.of(cache)
        self.null = self.layout.caption(null.fields)  # the empty caption, as the family's pipeline guides
        latent = cache.spec.latent
        # a cache of clips validates with videos: at its most common clip length, at a frame rate stage one recorded
        self.fps = frame_rate(cache, preset) if latent.temporal_downsample else None
        if frames is not None and not self.fps:
            raise ValueError(f"--validation-frames {frames}: {cache.location} holds images, not clips")
        # items come with their own buckets and ground truth; prompts are sampled at these buckets beside dataset latents
        self.buckets = ([] if self.items and not self.prompts else clip_buckets(cache, buckets, frames) if self.fps else
                        [Bucket.parse(b) for b in buckets] or default_buckets(cache))
        bad = [b.name for b in self.buckets if b.height % latent.downsample or b.width % latent.downsample]
        if bad:
            raise ValueError(f"validation buckets {bad} are not multiples of the VAE's downsampling factor {latent.downsample}")
        self.shapes = [latent.shape(*b) for b in self.buckets]
        self.preset, self.objective = preset, objective
        self.steps, self.guidance, self.seed = steps, guidance, seed
        self.guidance_2 = guidance_2 if preset.paired else None  # both experts: the low-noise one's
        self.out = out
        # one dataset clip (decoding a video costs many images'), or a few dataset images
        self.references = [] if self.items else reference_latents(cache, self.buckets, 1 if self.fps else 4)
        # the fields the family's transformer takes beside the caption (an image-to-video model's first frame): each
        # bucket samples with those of its first cached sample, the dataset clip shown beside the samples
        names = get_family(preset.family).conditioning_fields(cache.spec)
        self.conditioning = {b: first_fields(cache, b, names) for b in self.buckets} if names else {}
        # a run training image-to-video by a clean first latent frame samples so: from that of the bucket's first clip
        self.first_frame = bool(getattr(objective, "clean_first_frame", 0)) and bool(self.fps)
        if self.first_frame:
            for b in self.buckets:
                self.conditioning.setdefault(b, {})[FIRST_FRAME] = first_latent_frame(cache, b)
        self.recipe = decoder_recipe(cache)
        self.decode_device = None if decode_device == "cpu" else torch.device(decode_device)
        self.decoder: Decoder | None = None  # started at the first grid

    def __bool__(self) -> bool:
        return bool(self.prompts or self.items)

    def sample(self, model, precision: torch.dtype, ema=None, params=None, *, controlnet=None,
               forward: Callable | None = None, progress: Callable[[str], None] | None = None) -> dict:
        """Latents of every prompt at every bucket, by (prompt, bucket), or of every item, by its position in
        `items`; EMA weights when given (`params`: the weights they stand for). A ControlNet run passes its
        ControlNet and `forward` (`train.controlnet.controlled_forward`): the training weights sample. `progress`
        hears which prompt and bucket each sample is, before it is sampled."""
        modules = [m for m in (model, controlnet) if m is not None]
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()
        swapped = ema is not None and _swappable(params, ema.shadow_params)
        backup = []
        if swapped:  # the EMA's tensors take the weights' place and back: no copy of either
            _swap(params, ema.shadow_params)
        elif ema is not None:  # one tensor at a time: foreach copies have no DTensor (FSDP) rule
            with torch.no_grad():
                for p, s in zip(params, ema.shadow_params):
                    backup.append(p.detach().clone())
                    p.copy_(s)
        try:
            latents = {}
            for i, item in enumerate(self.items):
                if progress is not None:
                    progress(f"sampling item {i + 1}/{len(self.items)}: {item.name} at {item.bucket.name}, {self.steps} steps ...")
                shape = tuple(item.target.shape)
                latents[i] = generate(model, self.preset, self.objective, item.cond, self.null, shape,
                                      item.bucket.height * item.bucket.width, steps=self.steps, guidance=self.guidance,
                                      guidance_2=self.guidance_2,
                                      seed=derived_seed(self.seed, i, *shape), precision=precision, layout=self.layout,
                                      forward=forward, control=item.control,
                                      references=item.references if self.edit else None)
            jobs = [(i, prompt, shape, b) for i, prompt in enumerate(self.prompts) for shape, b in zip(self.shapes, self.buckets)]
            for k, (i, prompt, shape, b) in enumerate(jobs):
                if progress is not None:
                    progress(f"sampling {k + 1}/{len(jobs)}: {prompt.text!r} at {b.name}, {self.steps} steps ...")
                latents[prompt.text, b] = generate(model, self.preset, self.objective, prompt.cond, self.null, shape,
                                                   b.height * b.width, steps=self.steps, guidance=self.guidance,
                                                   guidance_2=self.guidance_2,
                                                   seed=derived_seed(self.seed, i, *shape), precision=precision,
                                                   layout=self.layout, conditioning=self.conditioning.get(b))
            return latents
        finally:
            if swapped:
                _swap(params, ema.shadow_params)
            with torch.no_grad():
                for p, b in zip(params or [], backup):
                    p.copy_(b)
            for m, mode in zip(modules, was_training):
                m.train(mode)

    def run(self, model, step: int, precision: torch.dtype, ema=None, params=None, submit: bool = True, *,
            controlnet=None, forward: Callable | None = None) -> Path:
        """Sample every prompt at every bucket (every item) and queue the grid's decoding; returns the grid's path.

        Under FSDP every rank samples (the weights are sharded) and only one submits the grid."""
        latents = self.sample(model, precision, ema, params, controlnet=controlnet, forward=forward)
        path = self.out / "samples" / f"{step:08d}" / SHEET if self.fps else self.out / f"samples-step{step:08d}.png"
        if not submit:
            return path
        if self.decoder is None:
            self.decoder = Decoder(self.recipe, self.decode_device)
        if self.fps:  # a video per prompt and bucket, and the dataset clip, beside their contact sheet
            rows, names = self.clip_rows(latents)
            self.decoder.submit(f"step {step} · {self.steps} steps, guidance {self.guidance_text()} · {self.fps:g} fps", rows, path,
                                names=names, fps=self.fps, kept=tuple(names[len(names) - len(self.references):]))
            return path
        rows = self.item_rows(latents)
        rows += [(p.text, [latents[p.text, b] for b in self.buckets]) for p in self.prompts]
        if self.references and not self.items:
            rows.append(("dataset latents, decoded: " + ", ".join(name for name, _ in self.references),
                         [z for _, z in self.references]))
        buckets = ", ".join([*(["each item's own"] if self.items else []), *(b.name for b in self.buckets)])
        self.decoder.submit(f"step {step} · {self.steps} steps, guidance {self.guidance_text()} · buckets {buckets}", rows, path)
        return path

    def guidance_text(self) -> str:
        """The guidance as a grid's title says it: both experts' (high-noise, then low-noise) of a run of both."""
        return f"{self.guidance} / {self.guidance_2}" if self.guidance_2 is not None else f"{self.guidance}"

    def item_rows(self, latents: dict) -> list[tuple[str, list[torch.Tensor]]]:
        """The grid's rows of the items (`item_row`), from `sample`'s latents."""
        return [self.item_row(i, latents[i]) for i in range(len(self.items))]

    def item_row(self, i: int, generated: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
        """Item `i`'s row (label, latents) around the latent generated for it: a ControlNet item's control image,
        generated image and ground truth; an edit item's reference image(s), generated image and target, labelled with
        the caption it was edited by."""
        item = self.items[i]
        if not self.edit:
            return f"{item.name} ({item.bucket.name}): control, generated, ground truth", [item.control, generated, item.target]
        n = len(item.references)
        shown = f"{n} reference{'s' if n > 1 else ''}, " if n else "no reference (text to image), "
        said = f'"{item.caption}"' if item.caption else "its cached caption"
        # empty cells before an item's references when another has more: generated and target in the last two columns
        blank = [None] * (max(len(it.references) for it in self.items) - n)
        return (f"{item.name} ({item.bucket.name}): {said}. {shown}generated, target",
                [*blank, *item.references, generated, item.target])

    def clip_rows(self, latents: dict) -> tuple[list[tuple[str, list[torch.Tensor]]], list[str]]:
        """The rows of a contact sheet of clips (label, [latent]) and their videos' file names: every prompt at every
        bucket, then the dataset clip."""
        given = ", from the first frame of the bucket's first dataset clip" if self.first_frame else ""
        rows = [(f"{p.text} ({b.name}{given})", [latents[p.text, b]]) for p in self.prompts for b in self.buckets]
        names = [f"{k:02d}-{slug(p.text)}-{b.name}" for k, (p, b) in enumerate((p, b) for p in self.prompts for b in self.buckets)]
        for name, z in self.references:
            rows.append((f"dataset clip, decoded: {name}", [z]))
            names.append(f"dataset-{slug(Path(name).stem)}")
        return rows, names

    def finished(self, wait: bool = False) -> list[tuple[str, str]]:
        """Grids decoded since the last call; `wait` waits for all and stops the decoder."""
        if self.decoder is None:
            return []
        return self.decoder.close() if wait else self.decoder.finished()

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()


def _swappable(params: list[torch.Tensor], shadow: list[torch.Tensor]) -> bool:
    """Whether the EMA's shadow tensors can stand in for the weights: plain tensors of the same device and dtype (not
    an EMA on the CPU for weights on a GPU, nor FSDP's sharded DTensors)."""
    return all(type(p.data) is torch.Tensor and type(s) is torch.Tensor and p.device == s.device and p.dtype == s.dtype
               and p.shape == s.shape for p, s in zip(params, shadow))


def _swap(params: list[torch.Tensor], shadow: list[torch.Tensor]) -> None:
    """Exchange the storage of each weight and its shadow; a second call puts both back."""
    for p, s in zip(params, shadow):
        p.data, s.data = s.data, p.data


def first_fields(cache: Cache, bucket: Bucket, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Fields `names` of the first cached sample of `bucket`, as stored."""
    ranges = cache.ranges_by_bucket()
    if bucket not in ranges:
        raise ValueError(f"validation at {bucket.name} samples with the cached {', '.join(names)} of a clip of that bucket, "
                         f"and {cache.location} holds none; choose a --validation-bucket (and --validation-frames) it holds: "
                         f"{', '.join(b.name for b in ranges)}")
    sample = cache[ranges[bucket][0].start]
    return {name: sample.fields[name].clone() for name in names}


def first_latent_frame(cache: Cache, bucket: Bucket) -> torch.Tensor:
    """The first latent frame (C, 1, h, w) of the first cached clip of `bucket`: its posterior's mean, which is the latent
    an image-to-video pipeline encodes of that frame as an image (the VAE is causal)."""
    ranges = cache.ranges_by_bucket()
    if bucket not in ranges or bucket.frames < 2:
        held = ", ".join(b.name for b in ranges if b.frames > 1)
        raise ValueError(f"image-to-video validation at {bucket.name} starts from the first frame of a cached clip of that "
                         f"bucket, and {cache.location} holds none; choose a --validation-bucket (and --validation-frames) "
                         f"it holds: {held}")
    sample, latent = cache[ranges[bucket][0].start], cache.spec.latent
    return sample.fields[latent.fields[0]].float().reshape(latent.shape(*bucket))[:, :1].clone()


def reference_latents(cache: Cache, buckets: list[Bucket], n: int = 4) -> list[tuple[str, torch.Tensor]]:
    """Up to `n` cached latents (posterior means), the validation buckets' first samples first."""
    ranges = cache.ranges_by_bucket()
    order = [b for b in buckets if b in ranges] + [b for b in ranges if b not in buckets]
    out = []
    for bucket in order[:n]:
        sample = cache[ranges[bucket][0].start]
        latent = sample.fields[cache.spec.latent.fields[0]]  # the posterior's mean, or the deterministic latent
        source = bytes(sample.fields["source"].numpy()).decode("utf-8", "replace")
        out.append((Path(source).name, latent.float().clone()))
    return out
