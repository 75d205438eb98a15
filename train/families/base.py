"""What stage two asks of a model family: the interface every `train/families/<family>.py` implements.

A family is one object (`Family`): the transformer class and its presets, how the cached fields become the
transformer's inputs (`TextInput` for the text, `forward` for the call), what the objective takes from it, the
repeated blocks, the LoRA layout, the ControlNet (`ControlNet`, or None), the validation sampler and the export's
pipeline names. Defaults are what most families share (a masked cross-attention transformer, classifier-free
guidance, diffusers' LoRA file); a family overrides what differs. Generic code asks the family and never compares
family names. Methods take the transformer's config as a mapping (`preset.transformer_config()` or `model.config`).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from importlib import import_module
from pathlib import Path
from typing import ClassVar

import torch

from shards import Bucket, CacheSpec, LatentSpec, TextSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Attention projections (query, key, value, output), the LoRA targets most families share; names match by suffix
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
# the experts of a two-expert model, as --expert names them: the high-noise one first (`ModelPreset.experts`); "both"
# trains the two in one run
EXPERT_NAMES = ("high", "low")
BOTH = "both"
# the text stream's projections of a joint (MMDiT) attention
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# a collated batch's valid tokens per caption, as host ints (`TextInput.collate`): what a forward that needs the captions'
# lengths as sizes reads, rather than the mask on the device (a read that would wait for it)
TEXT_TOKENS = "text_tokens"
# a collated batch's loss masks (--masked-loss) in host memory, one (1, h, w) uint8 per sample, beside `mask` (which goes to
# the device): what --tread counts the tokens it keeps on (`train.tread`), rather than the mask on the device
LOSS_MASKS = "loss_masks"


def reference_groups(batch: dict) -> list[list[int]]:
    """The samples of an edit batch whose references have equal shapes, in batch order: the groups a family's forward
    runs the transformer on one at a time (a reference is prepared at its own size, as its pipeline prepares it, so
    the samples of a bucket need not share their references' shapes; usually one group). `batch["references"]` holds
    per sample the list of its reference latents, (C, h, w) each."""
    groups: dict[tuple, list[int]] = {}
    for i, refs in enumerate(batch["references"]):
        groups.setdefault(tuple(tuple(r.shape) for r in refs), []).append(i)
    return list(groups.values())


def group_of(batch: dict, rows: list[int]) -> dict:
    """The batch restricted to samples `rows`: tensors with a batch dimension indexed, the references and the captions'
    token counts and the host loss masks picked, other entries as they are."""
    b = len(batch["references"])
    out = {}
    for name, value in batch.items():
        if name in ("references", TEXT_TOKENS, LOSS_MASKS):
            out[name] = type(value)(value[i] for i in rows)
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == b:
            out[name] = value[indices(rows, value.device)]
        else:
            out[name] = value
    return out


def indices(rows: list[int], device: torch.device | str) -> torch.Tensor:
    """Row numbers the host knows as a long tensor on `device`, copied from pinned memory without waiting for the device
    (a blocking copy would wait for every kernel queued before it)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(rows, dtype=torch.long, pin_memory=cuda).to(device, non_blocking=True)


def stacked_references(batch: dict) -> list[torch.Tensor]:
    """An edit batch whose references have one shape per position (`reference_groups` gave one group): reference j of
    every sample stacked, (B, C, h_j, w_j) each."""
    refs = batch["references"]
    return [torch.stack([sample[j] for sample in refs]) for j in range(len(refs[0]))]


def masked_call(model, xt: torch.Tensor, t: torch.Tensor, batch: dict, **kwargs) -> torch.Tensor:
    """A cross-attention transformer's call: the caption's tokens with their mask (`TextInput`'s batch)."""
    return model(hidden_states=xt, encoder_hidden_states=batch["text"].to(xt.dtype),
                 encoder_attention_mask=batch["text_mask"].to(xt.dtype), timestep=t, return_dict=False, **kwargs)[0]


@dataclass(frozen=True)
class ModelPreset:
    """What stage two trains.

    Args:
        name: the preset's name, the same stage one builds caches for.
        family: the family's name (`Family.name`), which must match the cache's (recorded by stage one).
        repo: Hub id or local directory of the released model (diffusers layout), loaded by default; None
            for tiny presets (seeded random weights).
        config: the transformer config for from-scratch training (dict, or a file in train/configs).
        objective: "flow" (rectified flow) or "ddpm".
        prediction: "flow" (velocity), "epsilon" or "v_prediction".
        flow_shift: timestep shift at the preset's base resolution.
        dynamic_shift: the shift follows the image's sequence length (shift = exp(mu), mu from `Family.mu`)
            instead of `flow_shift`.
        base_resolution: pixels of the square bucket the shift refers to.
        released_dtype: the precision the released weights were trained in (fp16, bf16).
        latent_downsample: pixels per latent pixel of the family's VAE (for planning memory per bucket).
        encoder_parameters: parameter counts of the VAE and text encoder(s) stage one uses, by name, from the
            published configs: what a trainer without a cache keeps resident (the memory planner's comparison).
        text_tokens: the most caption tokens it sees (stage one's limit); the planner's default.
        revision: Hub revision of `repo` (None: its default branch).
        validation_steps, guidance_scale: how validation samples by default (`--validation-steps`,
            `--guidance-scale`).
        train_guidance: the value a guidance-distilled model's guidance embedding gets while training
            (`--train-guidance`); None for models without one.
        subfolder: the folder of `repo` (a released pipeline) holding the transformer.
        experts: a model of two experts of one architecture: the subfolders of the released pipeline holding them,
            the high-noise one first (`--expert` chooses which trains); () for one transformer.
        expert_boundary: where they split, a fraction of the timestep range: the high-noise expert denoises timesteps
            at or above boundary x 1000, the low-noise one those below (the pipeline's `boundary_ratio`).
        paired: both experts of a two-expert model, as one `train.experts.Experts` (`--expert both`).
        guidance_scale_2: a two-expert model's validation guidance of its low-noise expert (the pipelines'
            `guidance_scale_2`; None: `guidance_scale`): `--expert low` validates at it, and `--expert both` past the
            boundary (the family's `denoise` then takes the `boundary` and this `guidance_2`).
        references: an edit model's most reference images (its pipeline's limit); 0 for a model that takes none. An
            edit preset trains from a cache whose samples have references (`shards.references`) and its forward
            concatenates their tokens to the target's.
        reference_pixels: the pixel area (height x width) its pipeline prepares a reference at by default: what the
            planner assumes for each reference of a planned sample.
        requires_references: an edit model that only edits (every sample has a reference image; validation has no
            prompt-only samples); False for one that also generates from text alone (its cache may hold text-to-image
            samples, and it may validate on cached prompts).
    """

    name: str
    family: str
    repo: str | None
    config: dict | str
    objective: str
    prediction: str
    flow_shift: float = 1.0
    dynamic_shift: bool = False
    base_resolution: int = 1024
    released_dtype: str | None = None
    latent_downsample: int = 8
    encoder_parameters: dict = field(default_factory=dict)
    text_tokens: int = 300
    revision: str | None = None
    validation_steps: int = 20
    guidance_scale: float = 4.5
    train_guidance: float | None = None
    subfolder: str = "transformer"
    experts: tuple[str, ...] = ()
    expert_boundary: float | None = None
    paired: bool = False
    guidance_scale_2: float | None = None
    references: int = 0
    reference_pixels: int = 1024 * 1024
    requires_references: bool = True

    @property
    def transformer_class(self) -> type:
        return registry().get_family(self.family).transformer_class()

    def expert(self, which: str | None) -> ModelPreset:
        """The preset of expert `which` ("high" or "low") of a two-expert model: its transformer's subfolder; "both":
        the two (`paired`); None: this preset as it is."""
        if which is None:
            return self
        if not self.experts:
            raise ValueError(f"--expert {which}: {self.name} is one transformer, not two experts; leave --expert out")
        if which == BOTH:
            return replace(self, subfolder=self.experts[0], paired=True)
        if which not in EXPERT_NAMES:
            raise ValueError(f"--expert {which!r}: choose {', '.join(EXPERT_NAMES)} or {BOTH}")
        chosen = replace(self, subfolder=self.experts[EXPERT_NAMES.index(which)])
        if which == EXPERT_NAMES[1] and self.guidance_scale_2 is not None:  # the low-noise expert at its own guidance
            chosen = replace(chosen, guidance_scale=self.guidance_scale_2)
        return chosen

    def expert_range(self, which: str | None) -> tuple[float, float]:
        """The noise levels (sigma = timestep / 1000) expert `which` trains on: [boundary, 1] for "high", [0, boundary)
        for "low"; all of them, (0, 1), for None and "both" (each sample's timestep picks its expert)."""
        if which is None:
            return (0.0, 1.0)
        self.expert(which)  # refuses what it cannot be
        if which == BOTH:
            return (0.0, 1.0)
        return (self.expert_boundary, 1.0) if which == "high" else (0.0, self.expert_boundary)

    def transformer_config(self) -> dict:
        cfg = self.config if isinstance(self.config, dict) else json.loads((CONFIGS / self.config).read_text())
        return {k: v for k, v in cfg.items() if not k.startswith("_")}


@dataclass(frozen=True)
class TokenRoute:
    """How token routing (`--tread`, `train.tread`) reaches a transformer's blocks.

    Args:
        blocks: the blocks in order, as a route's START and END count them.
        hidden: the name of the blocks' argument holding the image tokens (B, S, D), the routed sequence; text tokens
            travel in another argument and are never routed.
        output: where a block's output holds them: the index into its output tuple, or None (the output is them).
        shared: one selection for every sample of a call: a per-token argument has no batch dimension (one rotary table
            for the call, as Flux's).
        per_token: the blocks' other arguments that hold a row per image token, for the kept tokens: (the first routed
            block's arguments by name, kept positions (B | 1, K)) -> those arguments replaced (e.g. the rotary
            embedding's rows); None where there are none (absolute positions were added before the blocks).
    """

    blocks: list[torch.nn.Module]
    hidden: str = "hidden_states"
    output: int | None = None
    shared: bool = False
    per_token: Callable[[dict, torch.Tensor], dict] | None = None


class TextInput:
    """How the cached text fields of one layout (`shards.TextSpec.layout`) become the transformer's text input.

    This class is the "masked" layout: one `text` field of valid tokens per caption, padded per batch with a mask.
    A family with another layout subclasses it (and stage one writes that layout)."""

    layout: ClassVar[str] = "masked"
    description: ClassVar[str] = "one encoder's tokens with a mask"

    @staticmethod
    def captions(fields: Mapping) -> int:
        """How many captions a sample's fields hold (a cached prompt holds one)."""
        return len(fields["text_lengths"]) if "text_lengths" in fields else 1

    def caption(self, spec: TextSpec, fields: Mapping, pick: int = 0) -> dict[str, torch.Tensor]:
        """Caption `pick` of a sample's or a cached prompt's fields."""
        out = {}
        if "text" in fields:
            lengths = fields["text_lengths"].tolist() if "text_lengths" in fields else [len(fields["text"])]
            start = sum(lengths[:pick])
            out["text"] = fields["text"][start : start + lengths[pick]]
        return out

    def collate(self, spec: TextSpec, conds: list[dict[str, torch.Tensor]]) -> dict:
        """Per-caption fields -> the batch's: `text` padded to the longest caption (B, L, D) with `text_mask` (B, L), and
        each caption's token count as host ints (`TEXT_TOKENS`)."""
        out: dict = {}
        if "text" in conds[0]:
            lengths = tuple(c["text"].shape[0] for c in conds)
            text = torch.zeros(len(conds), max(lengths), conds[0]["text"].shape[1], dtype=conds[0]["text"].dtype)
            mask = torch.zeros(len(conds), max(lengths), dtype=torch.bool)
            for j, (c, n) in enumerate(zip(conds, lengths)):
                text[j, :n], mask[j, :n] = c["text"], True
            out.update({"text": text, "text_mask": mask, TEXT_TOKENS: lengths})
        return out

    def problems(self, spec: TextSpec, config: Mapping, family: Family) -> list[str]:
        """What in a cache's text spec of this layout the transformer cannot take (widths), one line each."""
        width = family.text_width(config)
        return [] if spec.width == width else [f"text width: cache {spec.width}, model {width}"]

    def example(self, config: Mapping, family: Family, batch: int, tokens: int, dtype: torch.dtype,
                device: torch.device | str = "meta") -> dict[str, torch.Tensor]:
        """A collated batch's text fields of `tokens` caption tokens (what the planner traces)."""
        return {"text": torch.zeros(batch, tokens, family.text_width(config), device=device, dtype=dtype),
                "text_mask": torch.ones(batch, tokens, device=device, dtype=torch.bool)}


class ControlNet(ABC):
    """A family's ControlNet: diffusers' class, how a new one is built from the transformer, and how ControlNet and
    transformer are called together as the family's ControlNet pipeline calls them."""

    model: ClassVar[str]  # diffusers' ControlNet model class
    pipeline: ClassVar[str]  # diffusers' ControlNet pipeline class
    default_layers: ClassVar[int]  # a new ControlNet's blocks (fewer where the transformer is too shallow)
    shared_config: ClassVar[tuple[str, ...]]  # config entries it shares with the transformer
    find_unused: ClassVar[bool] = False  # some trained parameters get no gradient in a step (DDP must be told)

    def model_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.model)

    @abstractmethod
    def max_layers(self, transformer_layers: int) -> int:
        """The deepest ControlNet whose every block's residual reaches a transformer block."""

    @abstractmethod
    def new(self, cls: type, transformer: torch.nn.Module, layers: int) -> torch.nn.Module:
        """A new ControlNet of `layers` blocks, copied from the transformer's first ones (seeded by the caller)."""

    def problems(self, controlnet_config: Mapping, transformer_config: Mapping) -> list[str]:
        """What else keeps this ControlNet from fitting the transformer (besides `shared_config` and depth)."""
        return []

    def control_input(self, controlnet_config: Mapping, control: torch.Tensor, latent: LatentSpec | None) -> torch.Tensor:
        """What the ControlNet receives, from the control latent as the cache stores it."""
        return control

    @abstractmethod
    def forward(self, transformer, controlnet, config: Mapping, xt: torch.Tensor, t: torch.Tensor, batch: dict,
                control: torch.Tensor, scale: float) -> torch.Tensor:
        """The transformer's prediction with the ControlNet's residuals; `config` is the ControlNet's, `control`
        what `control_input` made of the batch's control latent."""


class Family(ABC):
    """Everything stage two knows of one model family. Subclasses set the class attributes and override what
    differs from the defaults; one instance per family is listed in `train.families`."""

    name: ClassVar[str]  # as stage one records it in the cache (`CacheSpec.family`)
    title: ClassVar[str]  # how messages and help texts name it
    transformer: ClassVar[str]  # diffusers' transformer class
    pipeline: ClassVar[str]  # diffusers' text-to-image pipeline class (LoRA files, the export's usage snippet)
    text: ClassVar[TextInput] = TextInput()  # the cache's text layout it reads
    lora_targets: ClassVar[tuple[str, ...]] = ATTENTION  # default `--lora-targets`
    lora_formats: ClassVar[tuple[str, ...]] = ("diffusers", "lycoris")  # adapter layouts an export writes; the first by default
    # the LyCORIS file's module names: `<prefix>_<diffusers module path, dots as underscores>`, as LyCORIS' wrapper names
    # a diffusers transformer's layers (SimpleTuner's files) and ComfyUI maps them for the diffusers-named families
    lycoris_prefix: ClassVar[str] = "lycoris"
    null_caption: ClassVar[str] = "empty"  # caption dropout: the empty caption's embedding, or "zeros"
    precondition_outputs: ClassVar[bool] = False  # default of --precondition-outputs (flow matching)
    controlnet: ClassVar[ControlNet | None] = None
    no_controlnet: ClassVar[str] = ""  # why --controlnet is refused, where `controlnet` is None
    no_tread: ClassVar[str] = ""  # why --tread is refused, for a family without `tread_route` (default: a generic reason)
    # a video family's VAE: pixel frames per latent frame after the first (a clip of F frames has (F - 1) // k + 1 latent
    # frames; the transformer patches one latent frame at a time); 0: the family's models take images
    temporal_downsample: ClassVar[int] = 0
    # frames per second of the clips a video family's models were trained on: its validation videos play at this rate
    # unless the cache records the rate its clips were resampled to
    frame_rate: ClassVar[float | None] = None

    # --- the transformer and its presets ---

    @abstractmethod
    def presets(self) -> dict[str, Callable[[], ModelPreset]]:
        """The family's presets by name: factories of `ModelPreset`, tiny (CPU-sized) ones included."""

    def transformer_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.transformer)

    def pipeline_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated blocks in order (of the transformer or its ControlNet): what gradient checkpointing, the
        block swap and FSDP work on."""
        return list(model.transformer_blocks)

    def tread_route(self, model: torch.nn.Module) -> TokenRoute:
        """Where `--tread` routes the image tokens of the transformer's blocks. A family whose blocks allow it overrides
        this; the default refuses, saying why (`no_tread`)."""
        raise ValueError(self.tread_refusal())

    def tread_refusal(self) -> str:
        """Why --tread is refused for this family's models, or "" where it routes them (`tread_route`)."""
        if type(self).tread_route is not Family.tread_route:
            return ""
        return self.no_tread or (f"--tread: token routing is not built for {self.title}: its blocks' per-token inputs "
                                 f"(positions, modulation) are not wired to the router; train without --tread")

    def tread_tokens(self, config: Mapping, xt: torch.Tensor) -> int | None:
        """How many tokens at the front of the blocks' image sequence `--tread` may route for noisy latents `xt`: the
        target's, where an edit's reference tokens follow them (never routed); None: all of them."""
        return None

    # --- the cache it reads ---

    def latent_channels(self, config: Mapping) -> int:
        """Channels of the cached latent the transformer takes."""
        return config["in_channels"]

    def output_channels(self, config: Mapping) -> int:
        """Channels of the prediction the loss sees (a learned variance's included)."""
        return config.get("out_channels") or config["in_channels"]

    def latent_patch(self, config: Mapping) -> int:
        """Latent pixels per side of one image token."""
        return config.get("patch_size", 1)

    def text_width(self, config: Mapping) -> int:
        """Width of the text embeddings the transformer consumes."""
        return config["caption_channels"]

    def cache_problems(self, spec: CacheSpec, config: Mapping) -> list[str]:
        """What in a cache's spec this transformer cannot take (family, latent channels, text layout and widths),
        one line each; bucket sizes against `latent_patch` are checked by the caller."""
        problems = []
        if spec.family and spec.family != self.name:
            problems.append(f"family: cache {spec.family!r}, model {self.name!r}")
        channels = self.latent_channels(config)
        if spec.latent.channels != channels:
            problems.append(f"latent channels: cache {spec.latent.channels}, model {self.channels_name()} {channels}")
        if spec.text.layout != self.text.layout:  # widths of another layout mean nothing to this model: not compared
            describe = registry().layout_description
            problems.append(f"text layout: cache {spec.text.layout!r} ({describe(spec.text.layout)}), model "
                            f"{self.name} takes {self.text.layout!r} ({describe(self.text.layout)})")
        else:
            problems += self.text.problems(spec.text, config, self)
        return problems

    def channels_name(self) -> str:
        """What the transformer's config calls its latent channels, for messages."""
        return "in_channels"

    def first_frame_conditioning(self, preset: ModelPreset) -> bool:
        """Whether `preset`'s model also generates a clip from an image given as its clean first latent frame: that
        frame's latent in place of the noise at every step, its tokens at timestep 0, the other frames denoised; what
        --i2v-probability trains. Its `forward` then takes the batch's `train.objectives.CLEAN_FIRST_FRAME` flags, and
        its `denoise` a validation batch's `FIRST_FRAME` latent. False by default."""
        return False

    def first_frame_preset(self, preset: ModelPreset) -> ModelPreset:
        """`preset` as a run that trained it image-to-video by a clean first frame (--i2v-probability) is sampled: what
        its export card's pipeline and usage name (`pipeline_of`, `usage_generate`). The preset itself by default."""
        return preset

    def conditioning_fields(self, spec: CacheSpec) -> tuple[str, ...]:
        """The per-sample fields of a cache (beside the latents and the text) the transformer's call takes: stage two
        stacks them into every batch under the same names, (B, ...) on the device in the compute dtype, for `forward`
        (e.g. an image-to-video model's cached first-frame condition). None by default."""
        return ()

    # --- the objective ---

    def mu(self, image_tokens: int) -> float:
        """The dynamic shift's mu for an image of `image_tokens` tokens (shift = exp(mu)), as the family's pipeline
        computes it; only for presets with `dynamic_shift`."""
        raise NotImplementedError(f"{self.title} has no dynamic shift")

    # --- the transformer's call ---

    def forward(self, model, config: Mapping, xt: torch.Tensor, t: torch.Tensor, batch: dict,
                guidance: float | None) -> torch.Tensor:
        """The transformer's prediction (B, C, h, w) (a clip's (B, C, T, h, w)) as the family's pipeline calls it, from
        noisy latents `xt` of that shape as the cache stores them, timesteps `t` (B,) in [0, 1000] (flow: 1000 sigma) and
        a batch of `TextInput.collate`'s fields and the `conditioning_fields` (packing, position ids, masks and timestep
        scaling happen here). `guidance`:
        the value of a guidance-distilled model's guidance embedding. `model` may be a DDP wrapper; `config` is
        the transformer's. Default: `masked_call`."""
        return masked_call(model, xt, t, batch)

    def example_batch(self, config: Mapping, preset: ModelPreset, bucket: tuple[int, ...], batch: int, tokens: int,
                      dtype: torch.dtype, device: torch.device | str = "meta", *, references: int | None = None,
                      reference_size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """A batch of `batch` samples of the bucket (a `shards.Bucket`: height, width and, for a clip, frames; or a
        (height, width) pair) with `tokens` caption tokens, zeros on `device` (the planner traces `forward` with it):
        `latents` (B, C, h, w), or (B, C, T, h, w) for a clip, and the text fields. For an edit preset
        (`ModelPreset.references` > 0) also `references`, as the batch contract has them: per sample `references`
        latents (default 1) of a reference image of `reference_size` (height, width) pixels (default:
        `reference_size`'s for the bucket). The keyword arguments are given for edit presets only."""
        bucket = Bucket(*bucket)
        down = preset.latent_downsample
        frames = (self.latent_frames(bucket.frames),) if bucket.frames else ()
        latents = torch.zeros(batch, self.latent_channels(config), *frames, bucket.height // down, bucket.width // down,
                              device=device, dtype=dtype)
        out = {"latents": latents, **self.text.example(config, self, batch, tokens, dtype, device)}
        if preset.references:
            count = 1 if references is None else references
            height, width = reference_size or self.reference_size(config, preset, bucket)
            shape = (self.latent_channels(config), height // down, width // down)
            out["references"] = [[torch.zeros(shape, device=device, dtype=dtype) for _ in range(count)] for _ in range(batch)]
        return out

    def reference_size(self, config: Mapping, preset: ModelPreset, bucket: tuple[int, ...]) -> tuple[int, int]:
        """The (height, width) in pixels the planner assumes for a reference of a sample of `bucket`: the bucket's aspect
        ratio at the preset's `reference_pixels` area, each side a multiple of one image token's pixels (the VAE's
        factor times the patch). A family whose pipeline prepares references otherwise (preferred resolutions)
        overrides it."""
        bucket = Bucket(*bucket)
        step = preset.latent_downsample * self.latent_patch(config)
        aspect = bucket.width / bucket.height
        height = max(step, round(math.sqrt(preset.reference_pixels / aspect) / step) * step)
        width = max(step, round(math.sqrt(preset.reference_pixels * aspect) / step) * step)
        return height, width

    def image_tokens(self, config: Mapping, preset: ModelPreset, bucket: tuple[int, ...]) -> int:
        """Tokens of one sample of the bucket in the transformer's sequence: an image's patches, or a clip's, latent
        frame by latent frame (latent frames x (h / patch) x (w / patch))."""
        bucket = Bucket(*bucket)
        per_token = preset.latent_downsample * self.latent_patch(config)
        frames = self.latent_frames(bucket.frames) if bucket.frames else 1
        return frames * (bucket.height // per_token) * (bucket.width // per_token)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` pixel frames (`temporal_downsample`)."""
        if not self.temporal_downsample:
            raise ValueError(f"{self.title} models take images, not clips of {frames} frames: plan an image bucket (HxW)")
        k = self.temporal_downsample
        if frames < 1 or (frames - 1) % k:
            below = max(1, (frames - 1) // k * k + 1)
            raise ValueError(f"a clip of {frames} frames: {self.title}'s VAE encodes clips of k x {k} + 1 frames; choose "
                             f"{below} or {below + k}")
        return (frames - 1) // k + 1

    # --- validation ---

    def sampling_scheduler(self, objective, pixels: int):
        """The family's inference scheduler for a bucket of `pixels`, set up as training defined the noise."""
        from train.objectives import DDPM, FlowMatching

        if isinstance(objective, FlowMatching):
            from diffusers import FlowMatchEulerDiscreteScheduler

            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=objective.shift_at(pixels))
        if isinstance(objective, DDPM):
            from diffusers import DPMSolverMultistepScheduler

            return DPMSolverMultistepScheduler.from_config(objective.scheduler.config)
        raise TypeError(f"no sampler for {type(objective).__name__}")

    def set_timesteps(self, scheduler, objective, steps: int, pixels: int, device: torch.device) -> None:
        """The scheduler's `steps` timesteps, as the family's pipeline sets them."""
        scheduler.set_timesteps(steps, device=device)

    def denoise(self, forward: Callable, scheduler, latents: torch.Tensor, text: dict, *, guidance: float,
                channels: int, autocast) -> torch.Tensor:
        """Run the sampler from noise `latents` (1, C, h, w) (a clip's (1, C, T, h, w)): classifier-free guidance over
        `text`, a batch of two captions (the null caption, then the prompt, with the `conditioning_fields` of one cached
        sample on both rows), combined by `combine`; returns the final latents."""
        for t in scheduler.timesteps:
            x = torch.cat([latents, latents])
            if hasattr(scheduler, "scale_model_input"):
                x = scheduler.scale_model_input(x, t)
            with autocast:
                pred = forward(x, t.expand(2), text).float()
            uncond, cond = pred[:, :channels].chunk(2)  # learned-sigma models append variance channels
            latents = scheduler.step(self.combine(uncond, cond, guidance), t, latents).prev_sample
        return latents

    def combine(self, uncond: torch.Tensor, cond: torch.Tensor, guidance: float) -> torch.Tensor:
        """Classifier-free guidance of the two predictions."""
        return uncond + guidance * (cond - uncond)

    # --- LoRA and export ---

    def save_adapter(self, directory: Path, state: dict[str, torch.Tensor], config, lora_format: str,
                     fold: bool) -> Path | None:
        """Write adapters (`<module>.lora_A.weight` -> tensor) in `lora_format` (one of `lora_formats`) as the
        family's pipeline loads them; returns the file, or None where that is the file the pipeline's own
        `save_lora_weights` writes, which `train.lora.save_adapter` then writes (the default)."""
        return None

    def read_lora(self, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> tuple[dict, dict[str, float]] | None:
        """The inverse of `save_adapter`'s own layouts (`--init-lora` reads diffusers', peft's and LyCORIS' itself): a
        LoRA file's tensors (and its header) as (peft's state by module path, `<module>.lora_A.weight` and
        `.lora_B.weight`; each module's alpha). None where the family writes no layout of its own; raises ValueError
        saying why where the file is not in it."""
        return None

    def lora_usage(self, location: str, weight_name: str | None, component: str = "transformer",
                   subfolder: str | None = None) -> tuple[list[str], list[str]]:
        """(imports, statements) that load exported adapters into `pipe`, the family's pipeline (into its `component`,
        an expert's transformer of a two-expert model; from `subfolder` of the export, the second expert's of two)."""
        name = f', weight_name="{weight_name}"' if weight_name else ""
        folder = f', subfolder="{subfolder}"' if subfolder else ""
        return [], [f'pipe.load_lora_weights("{location}"{name}{folder})']

    def pipeline_of(self, preset: ModelPreset) -> str:
        """The stock pipeline that samples `preset` (its export card's)."""
        return self.pipeline

    def usage_generate(self, preset: ModelPreset | None, extra: str) -> tuple[list[str], list[str]]:
        """(imports, statements) of the export card that sample from `pipe` (`extra`: ", " and `usage_call_args`, or "").
        An edit preset's pipeline edits an input image (`image=`) by an instruction."""
        if preset is not None and preset.references:
            return (["from diffusers.utils import load_image"],
                    ['reference = load_image("reference.png")  # the image to edit',
                     f'image = pipe(image=reference, prompt="an edit instruction"{extra}).images[0]'])
        return [], [f'image = pipe("a prompt"{extra}).images[0]']

    def usage_call_args(self) -> str:
        """Keyword arguments after the prompt in the export card's `pipe("a prompt", ...)` call, for a pipeline whose
        defaults do not sample as the trained model wants (e.g. no guidance without a negative prompt); "" for none."""
        return ""

    def tags(self) -> list[str]:
        """The export card's tags naming the family."""
        return [self.name, f"{self.name}-diffusers"]


def registry():
    """The registry of families (`train.families`), which imports this module: looked up by name when a method
    needs another family, once every family is registered, so that the interface depends on none of them."""
    return import_module("train.families")
