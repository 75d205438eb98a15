"""Every option of a training run, in typed dataclasses, one per concern: each option's default, choices and help,
and each concern's rules beside its fields.

`TrainConfig` is all of them (its fields are the concerns' fields, `cfg.lr` as ever); the memory planner's
`PlanConfig` is the model, memory and parallelism concerns, so a flag both take is declared and checked once.
`python -m train --help` is built from the fields: a `Literal` type is the list of valid values (typer rejects
anything else, as the configs do when built in code), and `help` is the text shown. A concern's `check` may read
the fields of the concerns it names; every config that holds it holds those too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shards.options import SEED_MAX, Dtype, check_options, opt
from train.families import DEFAULT_PRESET, FAMILIES, PRESETS, get_family

Optimizer = Literal["adamw", "adamw-bf16", "came", "adafactor", "adamw-8bit"]
# what class batches (of `is_reg` sources) train towards: their data, or the base model's prediction
Preservation = Literal["prior", "output"]
# diffusers' flow-matching trainers' `--weighting_scheme`: it sets the timestep density and the loss weight together
WeightingScheme = Literal["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"]
# the mode density maps [0, 1] onto itself monotonically only for scales in [-1, 2 / (pi - 2) = 1.752...]
MODE_SCALE_MAX = 1.75


def shared(cls, name: str, help: str | None = None, **changes) -> dataclasses.Field:
    """Field `name` of concern `cls` for a config that takes that one option of the concern: the same default,
    range and help (`help`: other words, e.g. the planner's)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    metadata = {**f.metadata, **({"help": help} if help else {})}
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=metadata, **changes)
    return dataclasses.field(default=f.default, metadata=metadata, **changes)


def first_frame_presets() -> list[str]:
    """The presets whose models also generate a clip from an image given as its clean first latent frame
    (`Family.first_frame_conditioning`: what --i2v-probability trains)."""
    return [name for name, make in PRESETS.items() if get_family((preset := make()).family).first_frame_conditioning(preset)]


def frozen_base_rule(what: str) -> str:
    return (f"{what} applies to a frozen transformer: train LoRA adapters (--lora-rank) or a ControlNet (--controlnet) on "
            f"it; full fine-tuning updates every weight, which must stay on the device")


@dataclass
class ModelOptions:
    """What trains: the preset, the weights it starts from, and LoRA adapters or a ControlNet on the frozen
    transformer (quantized or not). Reads `precision`."""

    model: str = opt(DEFAULT_PRESET, "Preset (see the README's table; python -m train plan --help lists them).")
    pretrained: str | None = opt(None, "Weights to start from: a Hub id or a directory with a transformer/ subfolder (default: "
                                       "the preset's released weights; tiny presets: seeded random weights).")
    revision: str | None = opt(None, "Hub revision (branch, tag or commit) of the weights (default: the preset's).")
    from_scratch: bool = opt(False, "Train the preset's architecture from random initialisation instead of released weights.")
    lora_rank: int = opt(0, "Train LoRA adapters of this rank on the frozen transformer instead of every weight (0: full "
                            "fine-tuning). Only the adapters get gradients and optimizer states; checkpoints hold the adapters "
                            "alone, in the format the family's pipeline loads. --weights-dtype bf16 halves the frozen base.",
                            at_least=0)
    lora_alpha: float | None = opt(None, "LoRA alpha (the adapters' output is scaled by alpha / rank; default: the rank).",
                                         above=0)
    lora_targets: list[str] = opt([], "Module names to adapt (repeatable, matched by suffix; default: the family's, the "
                                      "attention q/k/v/out projections of its image and text streams).")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA adapters' input (lora and dora).", at_least=0, below=1)
    adapter: Literal["lora", "dora", "lokr", "loha"] = opt(
        "lora", "The adapters --lora-rank trains, with peft's implementations: lora; dora (LoRA with a trained magnitude "
                "per output row, weight-decomposed); lokr (LyCORIS' Kronecker product of two factors, the larger one of "
                "rank --lora-rank); loha (LyCORIS' Hadamard product of two rank --lora-rank products). --lora-rank, "
                "--lora-alpha and --lora-targets apply to all. Checkpoints and export write lora and dora as the family's "
                "pipeline loads them, lokr and loha in peft's layout (PeftModel.from_pretrained); export --lora-format "
                "lycoris writes any of them for ComfyUI and LyCORIS.")
    lokr_factor: int = opt(-1, "--adapter lokr: split each weight's dimensions as FACTOR x the rest (LyCORIS' factor; the "
                               "smaller Kronecker factor is FACTOR x FACTOR). -1: as near square as possible.", at_least=-1)
    lokr_decompose_both: bool = opt(False, "--adapter lokr: factor the smaller Kronecker matrix into rank --lora-rank "
                                           "products too (LyCORIS' decompose_both).")
    init_lora: str | None = opt(None, "Start the adapters from this file or directory instead of new ones: diffusers' "
                                      "layout (pytorch_lora_weights.safetensors), peft's (a directory with "
                                      "adapter_config.json), the LyCORIS layout, the kohya layout export --lora-format kohya "
                                      "writes (read as written), or another trainer's that the family's diffusers "
                                      "pipeline converts (kohya's sd-scripts). Its type, rank and alpha are the run's "
                                      "(--adapter, --lora-rank, --lora-alpha may be left out; given, --adapter and "
                                      "--lora-rank must agree, another --lora-alpha keeps its deltas); it adapts the "
                                      "layers it holds unless --lora-targets says more.")
    controlnet: bool = opt(False, "Train a ControlNet (families with a ControlNet in diffusers) on the cache's control latents "
                                  "(stage one's --control) beside the frozen transformer: only the ControlNet gets gradients, "
                                  "optimizer states and EMA; checkpoints and export hold it alone, in diffusers layout "
                                  "(controlnet/). --weights-dtype sets the frozen transformer's dtype; the ControlNet trains in "
                                  "fp32.")
    controlnet_layers: int | None = opt(None, "Transformer blocks a new ControlNet copies (default: the family's, as its "
                                              "reference ControlNet trainer builds it; fewer where the transformer cannot "
                                              "take that many residuals).", at_least=1)
    pretrained_controlnet: str | None = opt(None, "Continue training this ControlNet instead of a new one: a directory or Hub "
                                                  "id (its controlnet/ subfolder if it has one). Implies --controlnet.")
    controlnet_conditioning_scale: float = opt(1.0, "Scale of the ControlNet's residuals in training (the pipelines' "
                                                    "controlnet_conditioning_scale; applied on resume when changed).",
                                                    at_least=0)
    expert: Literal["high", "low", "both"] | None = opt(
        None, "Presets of two experts (a high-noise transformer and a low-noise transformer_2, split at the preset's "
              "boundary timestep; python -m train plan --help lists them): what this run trains, from the released "
              "weights. high: transformer, with timesteps drawn only at or above the boundary x 1000; low: transformer_2, "
              "only below it (each from the run's timestep density cut to that range, its shape kept). both: the two in "
              "one run, timesteps drawn over the whole range and each sample's picking its expert, as the pipeline "
              "switches them (twice the weights: a LoRA run keeps the second expert's frozen weights in CPU memory with "
              "--blocks-to-swap of its block count; not with --parallel fsdp); checkpoints and exports hold transformer/ "
              "and transformer_2/ (a LoRA export: each expert's adapters in its folder). Required for those presets; "
              "other presets: leave it out.")
    base_quant: Literal["none", "int8", "fp8", "nf4"] = opt(
        "none", "Keep the frozen transformer of a LoRA or ControlNet run quantized: its Linear weights in int8 or fp8 (torchao "
                "weight-only, on any device) or nf4 (bitsandbytes 4-bit, CUDA), both from the quant extra; norms, biases "
                "and embeddings in bf16 (whatever --weights-dtype says). The adapters or ControlNet train in fp32 as usual and "
                "export unchanged. Pair it with --grad-checkpointing: the quantized layers keep a bf16 copy of each weight "
                "for the backward pass (python -m train plan shows both).")

    def check(self) -> None:
        from train.families import PRESETS, get_family, get_preset

        if self.model not in PRESETS:
            raise ValueError(f"--model {self.model!r}: choose one of {', '.join(PRESETS)}")
        if self.pretrained_controlnet:
            self.controlnet = True
        get_preset(self.model, self.expert)  # refuses --expert for a preset of one transformer
        if self.controlnet and (family := get_family(get_preset(self.model).family)).controlnet is None:
            raise ValueError(family.no_controlnet)
        if self.controlnet and self.lora_rank:
            raise ValueError("--controlnet with --lora-rank: a ControlNet run trains the ControlNet alone beside the frozen "
                             "transformer; LoRA adapters on that transformer would be a second trained model, which its "
                             "checkpoints, export and the ControlNet pipelines do not carry. Train them in separate runs, "
                             "not both in one.")
        if self.controlnet and self.from_scratch:
            raise ValueError("a ControlNet steers a trained transformer; with --from-scratch the frozen transformer would be "
                             "random. Drop --from-scratch (the preset's released weights load by default).")
        if self.controlnet_layers is not None and (not self.controlnet or self.pretrained_controlnet):
            raise ValueError(f"--controlnet-layers {self.controlnet_layers}: the depth of a new ControlNet, with "
                             f"--controlnet and without --pretrained-controlnet (which has its own)")
        if self.base_quant != "none" and not self.frozen_base:
            raise ValueError(frozen_base_rule("--base-quant"))
        if self.base_quant != "none" and self.precision != "bf16":
            raise ValueError(f"--base-quant {self.base_quant} computes in bf16 (its kernels' dtype): use --precision bf16")
        if self.init_lora:
            self.take_init_lora()
        if self.adapter != "lora" and not self.lora_rank:
            raise ValueError(f"--adapter {self.adapter} trains adapters of --lora-rank: set it (e.g. --lora-rank 16)")
        if self.adapter not in ("lora", "dora") and self.lora_dropout:
            raise ValueError(f"--lora-dropout drops the input of lora and dora adapters; {self.adapter} has none: drop it")
        if self.adapter != "lokr" and (self.lokr_factor != -1 or self.lokr_decompose_both):
            raise ValueError(f"--lokr-factor and --lokr-decompose-both shape --adapter lokr; this run trains {self.adapter}")
        if self.lokr_factor == 0:
            raise ValueError("--lokr-factor 0: choose -1 (near square) or a factor of at least 1")
        if self.adapter == "dora" and self.base_quant != "none":
            raise ValueError(f"--adapter dora normalises the sum of the base weight and the adapter, which --base-quant "
                             f"{self.base_quant} keeps quantized: train lora, lokr or loha on a quantized base")
        if self.lora_rank and self.from_scratch:
            raise ValueError("LoRA adapts released weights; with --from-scratch the frozen base would be random. Drop "
                             "--from-scratch (the preset's released weights load by default) or train every weight (--lora-rank 0).")
        if self.from_scratch and self.pretrained:
            raise ValueError("--from-scratch and --pretrained contradict each other: choose one")

    def take_init_lora(self) -> None:
        """--init-lora: the file's adapter type, rank, alpha and layers unless told otherwise (where they must agree)."""
        from train import init_lora
        from train.families import get_preset

        if self.controlnet:
            raise ValueError("--init-lora starts LoRA adapters; a ControlNet run trains none")
        init = init_lora.read_init(Path(self.init_lora), get_preset(self.model))
        if self.lora_rank and self.lora_rank != init.rank:
            raise ValueError(f"--init-lora {self.init_lora} holds rank-{init.rank} adapters; this run has --lora-rank "
                             f"{self.lora_rank}. Leave --lora-rank out (or give {init.rank}).")
        if self.adapter not in ("lora", init.adapter):
            raise ValueError(f"--init-lora {self.init_lora} holds {init.adapter} adapters; this run has --adapter "
                             f"{self.adapter}. Leave --adapter out (or give {init.adapter}).")
        self.adapter, self.lora_rank = init.adapter, init.rank
        if self.lora_alpha is None:
            self.lora_alpha = init.alpha
        if init.adapter == "lokr" and self.lokr_factor == -1 and not self.lokr_decompose_both:
            self.lokr_factor, self.lokr_decompose_both = init.factor, init.decompose_both
        if not self.lora_targets:
            self.lora_targets = init.modules

    @property
    def frozen_base(self) -> bool:
        """The transformer is frozen (LoRA or ControlNet): --weights-dtype is then its dtype."""
        return bool(self.lora_rank or self.controlnet)


@dataclass
class MemoryOptions:
    """Where the bytes go: precisions, recomputation, the frozen blocks swapped to CPU memory, offloading.
    Reads `ModelOptions`."""

    precision: Dtype = opt("bf16", "Autocast precision: fp32, bf16 or fp16 (with a GradScaler). Changing it on resume keeps "
                                   "weights and optimizer moments and drops the scaler.")
    weights_dtype: Literal["fp32", "bf16"] = opt("fp32", "fp32 master weights, or bf16 weights (half the weight, gradient and "
                                                         "moment memory; full fine-tuning needs --optimizer adamw-bf16, whose "
                                                         "stochastic rounding keeps updates smaller than bf16's step). LoRA: the "
                                                         "frozen base's dtype. The EMA stays fp32.")
    grad_checkpointing: str = opt("off", "Recompute activations in the backward pass to save memory: off, all, or every-K "
                                         "(every K-th transformer block).")
    blocks_to_swap: int = opt(0, "Keep the frozen weights of this many transformer blocks (the last ones) in pinned CPU memory "
                                 "and bring each to the device just ahead of its use, forward and backward (a side CUDA "
                                 "stream, one block ahead); those blocks are recomputed in backward (gradient checkpointing). "
                                 "LoRA and ControlNet runs. Losses are identical to a run without it.", at_least=0)
    fsdp_cpu_offload: bool = opt(False, "Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP's "
                                        "CPUOffloadPolicy; CUDA only).")
    ema_device: Literal["device", "cpu"] = opt("device", "Keep the EMA on the training device, or on the CPU (pinned; each update "
                                                         "copies the weights there first).")
    host_memory: str | None = opt(None, "Host memory (system RAM) of one node for the run's ranks, e.g. 64GB (GB counted as "
                                        "GiB, as RAM is sold; a bare number is GiB). Default: this machine's physical memory "
                                        "(MemTotal in /proc/meminfo). python -m train plan, and the trainer before it loads "
                                        "any weights, refuse a setup whose planned host memory per node (a rank's peak times "
                                        "the ranks on the node) is over it, naming its largest part and what to change; give "
                                        "a larger value to go ahead anyway.")

    def check(self) -> None:
        if self.weights_dtype == "bf16" and self.precision != "bf16":
            raise ValueError(f"--weights-dtype bf16 trains in bf16; --precision {self.precision} needs --weights-dtype fp32")
        if self.blocks_to_swap and not self.frozen_base:
            raise ValueError(frozen_base_rule("--blocks-to-swap"))
        if self.blocks_to_swap and self.base_quant == "nf4":
            raise ValueError("--blocks-to-swap with --base-quant nf4: bitsandbytes' 4-bit weights keep their quantization "
                             "state beside the tensor, which the swap does not carry; use --base-quant int8 or fp8 with "
                             "block swapping, or nf4 alone")
        self.checkpoint_every_k()  # validates the spelling
        if self.host_memory is not None:
            from train.host_memory import parse_size

            parse_size(self.host_memory)  # refuses a malformed size before anything loads

    def checkpoint_every_k(self) -> int:
        """0: no gradient checkpointing; 1: every block; K: every K-th block."""
        return parse_checkpointing(self.grad_checkpointing)


@dataclass
class ParallelOptions:
    """How several processes share the work (under torchrun). Reads `ModelOptions` (`expert` too)."""

    parallel: Literal["auto", "ddp", "fsdp"] = opt("auto", "Under torchrun: ddp (replicated weights; auto picks it) or fsdp "
                                                           "(FSDP2: weights, gradients and optimizer states sharded per block).")
    fsdp_block: str | None = opt(None, "Class name of the modules FSDP shards one by one (default: the model's transformer blocks).")
    fsdp_reshard: bool = opt(True, "Free each block's gathered weights after its forward (ZeRO-3-like, least memory); "
                                   "--no-fsdp-reshard keeps them until backward (ZeRO-2-like, less communication).")

    def check(self) -> None:
        if self.parallel == "fsdp" and self.expert == "both":
            raise ValueError("--expert both keeps two transformers in one module, which FSDP does not shard; train the "
                             "experts as two runs (--expert high, --expert low) or use --parallel ddp")
        if self.parallel == "fsdp" and self.lora_rank:
            raise ValueError("LoRA trains with the frozen base replicated on every GPU: use --parallel ddp (the default)")
        if self.parallel == "fsdp" and self.controlnet:
            raise ValueError("--controlnet trains with the frozen transformer and the ControlNet replicated on every GPU (DDP "
                             "wraps the ControlNet alone): use --parallel ddp (the default)")


@dataclass
class DataOptions:
    """What a step reads: the caches, the batches and their buckets, caption dropout, and the loader. Reads `model`."""

    cache: list[str] = opt([], "Cache built by `make precompute` for this model: a directory (default: cache/MODEL) or a URL "
                               "of object storage (s3://, gs://, hf://... through fsspec; its shards are downloaded to "
                               "--local-cache ahead of need). Repeat it to train from several caches of the same family "
                               "and encoders (e.g. a 512 and a 1024 cache); the first one's prompts validate.")
    cache_weight: list[float] = opt([], "With several --cache: each one's share of every epoch, in their order (default: "
                                        "every cache's samples drawn as its sources' repeats and weights say).", above=0)
    resolution_weight: str | None = opt(None, "A cache built at several resolutions (stage one's --resolution 512,1024): "
                                              "each resolution's share of every epoch, as RESOLUTION=WEIGHT pairs, one per "
                                              "resolution the caches hold, e.g. 512=1,1024=2 (default: every sample of "
                                              "every resolution drawn as its source's repeats and weight say).")
    batch_size: int = opt(8, "Samples per batch on each process (all from one bucket).", at_least=1)
    remainder: Literal["repeat", "drop"] = opt("repeat", "Incomplete batches: repeat (complete them with samples of the same "
                                                         "bucket) or drop.")
    shuffle_shards: int = opt(4, "Shards whose samples are shuffled together: each epoch shuffles a bucket's shards and groups "
                                 "them by this many, so a batch reads from a few shards and every shard is read whole, once "
                                 "per epoch, ahead of need (cold or remote storage). Larger: closer to a full shuffle, more "
                                 "read ahead per bucket.", at_least=1)
    caption_dropout: float = opt(0.1, "Probability of dropping the caption (see --caption-dropout-embedding).",
                                      at_least=0, at_most=1)
    caption_dropout_embedding: Literal["auto", "empty", "zeros"] = opt(
        "auto", "What a dropped caption becomes: auto (the family's: zeroed embeddings where it was trained so, the cached "
                "empty caption otherwise and for every ControlNet), empty or zeros.")
    workers: int = opt(1, "Background threads that read, collate and pin batches ahead of the step, for the whole run; 0 "
                          "builds each batch in the training thread (the same batches, synchronously).", at_least=0)
    prefetch: int = opt(4, "Batches kept ready ahead of the step (a bound on the data path's memory).", at_least=1)
    readahead: int = opt(64, "Batches of the data order looked ahead by an I/O thread, which reads the shard ranges they need "
                             "(downloads their shards, for a remote cache) before the batch is built; 0: off.",
                             at_least=0)
    local_cache: Path | None = opt(None, "Where the shards of a remote --cache are kept (default: ~/.cache/cachedit/<bucket and "
                                         "path of the URL>).")
    local_cache_gb: float = opt(100.0, "Disk space the shards in --local-cache may take; least recently used are removed first.",
                                       above=0)
    check_digests: bool = opt(True, "Check every sample read against the digest stored with it; a mismatch stops the run "
                                    "after a checkpoint, naming the shard and the repair command.")

    def check(self) -> None:
        given = [self.cache] if isinstance(self.cache, (str, Path)) else list(self.cache or [])
        # a URL stays a string (Path would fold its "//")
        self.cache = [c if "://" in str(c) else Path(c) for c in given] or [Path("cache") / self.model]
        if self.cache_weight and len(self.cache_weight) != len(self.cache):
            raise ValueError(f"--cache-weight: {len(self.cache_weight)} weights for {len(self.cache)} caches; give one per --cache")
        if len({str(c) for c in self.cache}) != len(self.cache):
            raise ValueError(f"--cache names {self.cache[0]} twice; give each cache once (--cache-weight sets shares)")
        self.cache_weight = list(self.cache_weight)
        self.resolution_weights()  # refuses a malformed --resolution-weight before anything loads

    def resolution_weights(self) -> dict[int, float] | None:
        """--resolution-weight as {resolution: weight}, or None."""
        if not self.resolution_weight:
            return None
        weights: dict[int, float] = {}
        for pair in str(self.resolution_weight).split(","):
            resolution, _, weight = pair.partition("=")
            try:
                r, w = int(resolution), float(weight)
            except ValueError:
                r, w = 0, math.nan
            if r <= 0 or not math.isfinite(w) or w <= 0 or r in weights:
                raise ValueError(f"--resolution-weight {self.resolution_weight}: {pair.strip()!r} is not RESOLUTION=WEIGHT "
                                 f"with a resolution in pixels, given once, and a weight above 0; e.g. 512=1,1024=2")
            weights[r] = w
        return weights


@dataclass
class OptimizerOptions:
    """How the trained weights move: the optimizer, the learning-rate schedule, clipping and the EMA. Reads
    `ModelOptions` and `weights_dtype`."""

    steps: int = opt(200, "Total optimizer steps of the run; a resumed run continues until it.", at_least=1)
    grad_accum: int = opt(1, "Micro-batches per optimizer step.", at_least=1)
    optimizer: Optimizer = opt("adamw", "adamw (fused on CUDA); adamw-bf16: bf16 moments with stochastic rounding, for "
                                        "--weights-dtype bf16 (torchao: the bf16 extra); came (CAME, came-pytorch); adafactor; "
                                        "adamw-8bit (CUDA, bitsandbytes: the 8bit extra).")
    lr: float = opt(1e-4, "Peak learning rate. A resumed run given another value applies it from its step (logged).",
                          above=0)
    warmup_steps: int = opt(0, "Linear warm-up steps (applied on resume when changed).", at_least=0)
    lr_schedule: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = opt(
        "constant", "After warm-up (diffusers.optimization.get_scheduler): constant; linear, cosine or polynomial decay to 0 at "
                    "--steps (polynomial: to --lr-end with power --lr-power); cosine_with_restarts: --lr-cycles hard restarts.")
    lr_cycles: int = opt(1, "cosine_with_restarts: how many cosine cycles (hard restarts) over the run.", at_least=1)
    lr_power: float = opt(1.0, "polynomial: the decay's power (1: linear).", above=0)
    lr_end: float = opt(1e-7, "polynomial: the learning rate at --steps.", at_least=0)
    weight_decay: float = opt(0.0, "Weight decay (applied on resume when changed).", at_least=0)
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0: off).", at_least=0)
    max_bad_steps: int = opt(5, "Abort after this many non-finite steps in a row.", at_least=1)
    ema_decay: float = opt(0.0, "EMA decay of the trained weights (0: no EMA; applied on resume when changed).",
                                at_least=0, below=1)
    ema_every: int = opt(1, "Update the EMA every N steps.", at_least=1)

    def check(self) -> None:
        if self.controlnet and self.optimizer == "adamw-bf16":
            raise ValueError("the ControlNet trains in fp32 (--weights-dtype sets the frozen transformer's dtype); choose "
                             "adamw, came or adafactor")
        if self.optimizer == "adamw-bf16" and self.weights_dtype != "bf16" and not self.lora_rank:
            raise ValueError("--optimizer adamw-bf16 keeps bf16 states for bf16 weights; add --weights-dtype bf16 "
                             "(or choose adamw for fp32 master weights)")
        if self.weights_dtype == "bf16" and not self.frozen_base and self.optimizer != "adamw-bf16":
            raise ValueError(f"full fine-tuning with --weights-dtype bf16 and --optimizer {self.optimizer}: each update is rounded "
                             f"to the nearest bf16 value, so updates smaller than half a bf16 step (lr x 1 against weights "
                             f"around 1 lose everything below 2^-9) vanish and training silently stalls. Use --optimizer "
                             f"adamw-bf16 (stochastic rounding keeps them in expectation) or --weights-dtype fp32.")
        if self.lora_rank and self.optimizer == "adamw-bf16":
            raise ValueError("LoRA adapters train in fp32 (--weights-dtype sets the frozen base's dtype); choose adamw, came or adafactor")
        if self.lr_schedule == "polynomial" and self.lr_end >= self.lr:
            raise ValueError(f"--lr-end {self.lr_end:g} must be below --lr {self.lr:g} for a polynomial decay")


@dataclass
class ObjectiveOptions:
    """What the loss is: the timestep density, its weights and the family's objective parameters, and what the training
    forward computes of it (--tread). Reads `model`, `expert` and `controlnet`."""

    weighting_scheme: WeightingScheme = opt(
        "logit_normal", "Flow matching, as diffusers' flow-matching trainers name it: the timestep density and the loss weight "
                        "together. logit_normal (their default) and mode draw timesteps from those densities with unit weights; "
                        "sigma_sqrt (weight 1/sigma^2) and cosmap draw them uniformly and weight the loss; none: uniform, unit "
                        "weights.")
    logit_mean: float = opt(0.0, "Mean of the logit_normal timestep density.")
    logit_std: float = opt(1.0, "Standard deviation of the logit_normal timestep density.", above=0)
    mode_scale: float = opt(1.29, "Scale of the mode timestep density.", at_least=-1, at_most=MODE_SCALE_MAX)
    precondition_outputs: bool | None = opt(
        None, "Flow matching: turn the prediction into an x0 estimate (x_t - sigma * v) and take the loss against the clean "
              "latent, as diffusers' trainers of some families do (default: the family's). Without it sigma_sqrt is refused: "
              "1/sigma^2 on the velocity loss lets a few low-noise samples outweigh the rest a million-fold.")
    flow_shift: float | None = opt(None, "Flow matching timestep shift (default: the preset's).", above=0)
    resolution_shift: bool = opt(False, "Scale the shift with each bucket's resolution.")
    learned_variance: bool | None = opt(
        None, "DDPM models with variance channels: train them with the VLB term as their reference trainer does (learned-range "
              "sigma, mean detached). Default: on for full fine-tuning, off for LoRA (an epsilon-only loss).")
    train_guidance: float | None = opt(
        None, "Models with a guidance embedding (guidance-distilled): the value fed to it while training. Default: the "
              "preset's, 1.0, as kohya, SimpleTuner and ai-toolkit train them: the embedding was distilled from "
              "classifier-free guidance, and the loss target (the data's velocity) is the unguided prediction, which the "
              "model gives at guidance 1; training at 3.5 teaches the embedding that 3.5 means no guidance. Validation "
              "still samples at --guidance-scale (the preset's, e.g. 3.5). A resumed run keeps the value it trained with "
              "unless this is given.", at_least=0)
    prior_loss_weight: float | None = opt(
        None, "The loss weight of class batches, those of a source the dataset file marks is_reg = true (DreamBooth's "
              "class images): it multiplies their loss (default: each class source's prior_loss_weight, recorded by stage "
              "one; 1.0 unless given there).", above=0)
    preservation: Preservation = opt(
        "prior", "What class batches train towards. prior: DreamBooth's prior preservation, the class images' own noise "
                 "or velocity target. output: output preservation (ai-toolkit's Differential Output Preservation), the "
                 "base model's own prediction, adapters off and without gradients, for the same noisy class latent and "
                 "caption: the adapters learn to leave the class as the base draws it. One more forward per class batch "
                 "(python -m train plan --preservation output shows its memory and compute). Adapter runs only (--lora-rank, "
                 "any --adapter).")
    masked_loss: bool = opt(False, "Weight each latent element's loss by the sample's cached loss mask (stage one's --masks "
                                   "or --alpha-mask: per latent cell, the fraction of its pixels kept; 1 for samples of "
                                   "sources without masks, and mirrored with a flipped view), then take the mean over every "
                                   "element, masked ones included, as kohya's and SimpleTuner's masked loss do: a kept "
                                   "region trains exactly as it would unmasked and an all-white mask gives the unmasked "
                                   "loss bit for bit (dividing by the mask's sum instead would scale up images with small "
                                   "masks, so a few kept pixels would take a whole image's step). Flow and DDPM objectives, "
                                   "every family (packed latents are unpacked before the loss). A cache without masks is "
                                   "refused.")
    i2v_probability: float = opt(
        0.0, "Models that generate a clip from text or from an image given as its clean first latent frame (presets: "
             f"{', '.join(first_frame_presets())}): the share of clips trained as image-to-video, drawn per clip and step. Such a clip keeps its first "
             "latent frame clean (its own latent, which the pipeline's image latent equals), that frame's tokens get "
             "timestep 0 and the rest the sample's, and the loss is over the other frames, as the image-to-video "
             "pipeline samples. 0: text-to-video only; 1: image-to-video only, as DiffSynth-Studio's input_image and "
             "ai-toolkit's do_i2v train; between: both, as the model was released for both. Validation then samples "
             "image-to-video from the first latent frame of a cached clip, and the held-out loss is image-to-video. "
             "One-frame clips (images) always train text-to-image.", at_least=0, at_most=1)
    tread: str | None = opt(
        None, "TREAD token routing (faster steps): in training forwards, a random share of the image tokens skips a range "
              "of transformer blocks and rejoins the sequence after it, at its place, as it was. The value: "
              "RATIO:START:END, comma-separated for several (not overlapping): RATIO of the image tokens (0 <= RATIO < 1) "
              "leave before block START and return after block END, both included, counted from 0 (negative: from the "
              "end, -1 the last block), e.g. 0.5:2:-2 (half the tokens skip the third block to the second-to-last). Text "
              "tokens and an edit's reference tokens are never routed; rotary positions go with the kept tokens. With "
              "--masked-loss the tokens the loss mask weights are never routed (the ratio is taken from the others; fewer "
              "are routed where the weighted ones outnumber the kept share). Families: "
              f"{', '.join(f.title for f in FAMILIES if not f.tread_refusal())}; the others refuse it, saying why. The "
              "held-out loss, validation and export use every token.")

    def check(self) -> None:
        check_preservation(self)
        check_tread(self)
        from train.families import get_preset

        check_first_frame(self)
        preset = get_preset(self.model)
        if preset.experts and self.expert is None:
            raise ValueError(f"{self.model} is two experts, a high-noise and a low-noise transformer split at timestep "
                             f"{preset.expert_boundary * 1000:g}: choose what this run trains with --expert high, --expert "
                             f"low or --expert both")


@dataclass
class ValidationOptions:
    """The grids sampled while training. Reads `model`, `expert` and `controlnet`."""

    validate: bool = opt(True, "Sample validation grids (--no-validate: never).")
    validation_prompt: list[str] = opt([], "Validation prompt (repeatable); its embedding must be in the cache (precompute "
                                           "--validation-prompt). Default: every prompt cached with the data.")
    validate_every: int = opt(0, "Sample a validation grid every N steps (0: only at the end).", at_least=0)
    validation_bucket: list[str] = opt([], "Bucket HxW to sample at (repeatable; default: the cache's 3 most populous); a "
                                           "cache of clips: FRAMESxHxW, e.g. 81x480x832, or HxW at --validation-frames "
                                           "(default: its most populous clip bucket).")
    validation_frames: int | None = opt(None, "Frames of each validation video of a cache of clips (a clip length the "
                                              "model takes, e.g. 81; default: the frames of the cache's most populous clip "
                                              "bucket).", at_least=1)
    validation_steps: int | None = opt(None, "Sampler steps per validation image (default: the preset's, e.g. 20; fewer for a "
                                             "step-distilled model, as it was distilled for).", at_least=1)
    guidance_scale: float | None = opt(None, "Classifier-free guidance scale (the cached empty caption is the unconditional "
                                             "input); default: the preset's. A guidance-distilled model samples without "
                                             "classifier-free guidance: this is the value fed to its guidance embedding, as its "
                                             "pipeline's guidance_scale; a model without one takes none.", at_least=0)
    guidance_scale_2: float | None = opt(
        None, "Two-expert models trained together (--expert both): the low-noise expert's guidance scale, below the "
              "boundary timestep, as the pipelines' guidance_scale_2 (--guidance-scale is the high-noise expert's); "
              "default: the preset's low-noise guidance (its released inference setting). An --expert low run "
              "validates at --guidance-scale, which defaults to that.", at_least=0)
    validation_seed: int = opt(0, "Seed of the validation noise (fixed per prompt and bucket).",
                                  at_least=0, at_most=SEED_MAX)
    validation_items: int = opt(4, "ControlNet and edit runs: validate on this many cached dataset items, spread evenly over "
                                   "the cache (a grid row each: a ControlNet run's control image, image generated from its "
                                   "control latent and caption, ground truth; an edit run's reference image(s), image "
                                   "generated from its references and caption, target); 0: no grids.", at_least=0)
    decode_device: Literal["cpu", "device"] = opt("cpu", "Decode validation latents in a background CPU process (cpu) or on the "
                                                         "training device after releasing memory (device).")

    def check(self) -> None:
        if self.validation_steps is None or self.guidance_scale is None:  # the preset's sampling defaults
            from train.families import get_preset

            preset = get_preset(self.model, self.expert)  # one expert of two: its own guidance
            self.validation_steps = preset.validation_steps if self.validation_steps is None else self.validation_steps
            self.guidance_scale = preset.guidance_scale if self.guidance_scale is None else self.guidance_scale
        from train.families import get_preset

        preset = get_preset(self.model, self.expert)
        if self.guidance_scale_2 is not None and not preset.paired:
            raise ValueError("--guidance-scale-2 is the low-noise expert's guidance of a run of both experts (--expert "
                             "both); this run samples with one transformer at --guidance-scale: leave it out")
        if self.guidance_scale_2 is None and preset.paired:
            self.guidance_scale_2 = get_preset(self.model, "low").guidance_scale
        if self.controlnet and (self.validation_prompt or self.validation_bucket):
            raise ValueError("a ControlNet run validates on cached dataset items (--validation-items: their control images, "
                             "captions and buckets), not on --validation-prompt / --validation-bucket: leave those out")


@dataclass
class EvalOptions:
    """The held-out loss: samples no batch trains on, their loss at fixed timesteps and noise. Reads
    `validate_every`, `checkpoint_every` and `steps`."""

    eval_fraction: float = opt(0.0, "Hold this fraction of every source's samples out of training (chosen by a hash of each "
                                    "sample's input, so an image's copies at every resolution go together: the same "
                                    "samples in every run, resume, world size and as the cache grows) and report their loss (--eval-every). Sources the dataset file marks eval = "
                                    "true are held out whole, with or without it. 0: only those.", at_least=0, below=1)
    eval_every: int | None = opt(None, "Compute the held-out loss every N steps, and at the end (0: only at the end). "
                                       "Default: --validate-every if set, else --checkpoint-every.", at_least=0)
    eval_batches: int = opt(32, "Evaluate at most this many batches of held-out samples (each source and bucket takes its "
                                "turn; the same ones every time), so a large held-out set costs a bounded time every "
                                "--eval-every steps (32 batches x --eval-timesteps forwards); 0: all of them.", at_least=0)
    eval_timesteps: int = opt(8, "Fixed noise levels each held-out sample is evaluated at: the training timestep density's "
                                 "quantiles (flow matching) or evenly spaced timesteps (DDPM), each with noise fixed by "
                                 "the sample's key. Each costs one forward of the batch.", at_least=1)

    def check(self) -> None:
        if self.eval_every is None:
            self.eval_every = self.validate_every or self.checkpoint_every


@dataclass
class RunOptions:
    """The run itself: its directory and seed, checkpoints, resuming, logs and trackers. Reads `model`."""

    run: Path | None = opt(None, "Run directory: checkpoints, metrics.jsonl, loss.png (default: runs/MODEL).")
    seed: int = opt(0, "Seed of fresh weights, data order and noise.", at_least=0, at_most=SEED_MAX)
    resume: str | None = opt("auto", "auto (newest complete checkpoint of the run, if any), a checkpoint directory (or "
                                     "another run's directory: its newest), or '' to start over.")
    checkpoint_every: int = opt(100, "Save a checkpoint every N steps (also at the end and on SIGTERM/SIGINT; 0: only then).",
                                     at_least=0)
    keep_checkpoints: int = opt(3, "Keep the newest K checkpoints (0: keep every one).", at_least=0)
    dry_run: bool = opt(False, "Run one full step (forward, backward, optimizer step, a validation sample) at the cache's "
                               "largest bucket and print its measured peak memory next to the plan; nothing is saved.")
    log_every: int = opt(10, "Write metrics (metrics.jsonl, the trackers) every N steps. Where no progress bar is shown (stdout "
                             "is not a terminal, or --no-progress) each of these steps also prints one plain line: step, loss, "
                             "smoothed loss, lr, samples/s, ETA.", at_least=1)
    progress: bool = opt(True, "Show the progress bar when stdout is a terminal; --no-progress prints the plain lines of "
                               "--log-every instead, as output to a file or a pipe gets.")
    report_to: list[str] = opt([], "Send the logged scalars, the validation grids and the run's config to a tracker: tensorboard "
                                   "(RUN/tensorboard; the tensorboard extra) or wandb (the wandb extra; "
                                   "WANDB_MODE=offline works without an account). Repeatable; none: "
                                   "metrics.jsonl alone (the default; it is always written).")
    tracker_project: str = opt("cachedit", "The tracker's project (wandb's project).")
    tracker_run_name: str | None = opt(None, "The run's name in the tracker (default: the run directory's name).")

    def check(self) -> None:
        self.run = Path(self.run) if self.run is not None else Path("runs") / self.model
        self.report_to = [r for r in self.report_to if r != "none"]
        unknown = sorted(set(self.report_to) - {"tensorboard", "wandb"})
        if unknown:
            raise ValueError(f"--report-to {', '.join(unknown)}: choose none, tensorboard or wandb (repeatable)")


# dataclasses collects fields from the last base to the first: --help lists the model first, the run last
@dataclass
class TrainConfig(RunOptions, EvalOptions, ValidationOptions, ObjectiveOptions, OptimizerOptions, DataOptions, ParallelOptions,
                  MemoryOptions, ModelOptions):
    """Every option of a training run, one concern per base class; the CLI is built from it (see `python -m train
    --help`). A number's range is declared with it (`opt(..., at_least=1)`), shown in --help and checked before
    anything else, then each concern's rules."""

    def __post_init__(self) -> None:
        check_options(self)
        for concern in (ModelOptions, DataOptions, RunOptions, ValidationOptions, EvalOptions, MemoryOptions,
                        ParallelOptions, OptimizerOptions, ObjectiveOptions):
            concern.check(self)


def check_preservation(cfg) -> None:
    """The rule of --preservation output, for the trainer's config and the planner's."""
    if cfg.preservation != "output":
        return
    if cfg.controlnet:
        raise ValueError("--preservation output takes the frozen transformer's prediction with the adapters off as the target "
                         "of class batches; a ControlNet run has no adapters on it: use --preservation prior")
    if not cfg.lora_rank:
        raise ValueError("--preservation output needs the base model's prediction beside the trained one: with adapters "
                         "(--lora-rank, any --adapter) the frozen base is that model, the adapters turned off for one forward. "
                         "A full fine-tune would have to keep a second, frozen copy of every weight (twice the weights' "
                         "memory): train LoRA adapters, or use --preservation prior")


def check_first_frame(cfg) -> None:
    """The rule of --i2v-probability, for the trainer's config and the planner's: a model that takes a clean first frame."""
    from train.families import get_preset

    preset = get_preset(cfg.model)
    if cfg.i2v_probability and not get_family(preset.family).first_frame_conditioning(preset):
        raise ValueError(f"--i2v-probability {cfg.i2v_probability:g}: {cfg.model} does not generate a clip from an image "
                         f"given as its clean first latent frame (presets that do: {', '.join(first_frame_presets())}; an "
                         f"image-to-video preset takes its first frame from the cache anyway); leave it out")


def check_tread(cfg) -> None:
    """--tread's syntax, and that the run's family and kind of training take it (the block range is checked against
    the transformer when it is built)."""
    from train.tread import parse_routes

    if not parse_routes(cfg.tread or ""):
        return
    from train.families import get_family, get_preset

    refusal = get_family(get_preset(cfg.model).family).tread_refusal()
    if refusal:
        raise ValueError(refusal)
    if cfg.controlnet:
        raise ValueError("--tread with --controlnet: the ControlNet's residuals are added to every image token of the "
                         "transformer's blocks, routed or not; train the ControlNet without --tread")


def parse_checkpointing(value: str) -> int:
    """`off` -> 0, `all` -> 1, `every-K` -> K."""
    value = str(value).lower()
    if value in ("off", "false", "0", ""):
        return 0
    if value in ("all", "true", "1"):
        return 1
    if value.startswith("every-") and value[6:].isdigit() and int(value[6:]) >= 1:
        return int(value[6:])
    raise ValueError(f"--grad-checkpointing {value!r}: choose off, all or every-K (e.g. every-2)")
