"""What trains, and how: the transformer (released weights, LoRA, checkpointing, DDP/FSDP), the optimizer,
the learning-rate schedule, the EMA and the objective, built from the run's config."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shards import LatentSpec
from shards.options import DTYPES, install_extra
from train import checkpoint, controlnet, distributed, init_lora, lora, quant, tread
from train.config import TrainConfig
from train.ema import EMA
from train.families import get_family
from train.families.base import ModelPreset
from train.frozen import build_frozen, recomputed_blocks, swapped_blocks
from train.objectives import build_objective
from train.presets import build_transformer, load_saved, model_forward, resolve_weights, transformer_blocks
from train.swap import BlockSwap, checkpointed_forward

log = logging.getLogger("train")


@dataclass
class Model:
    """The transformer and what trains of it.

    `module` holds the transformer's weights; `net` is what a step calls and wraps in DDP (the module, or the
    ControlNet); `forward` calls the model with the family's inputs; `params` are the trained parameters (all,
    the LoRA adapters, or the ControlNet's); `adapter` is the LoRA config (None: no LoRA); `controlnet` the
    ControlNet trained beside the frozen transformer (None: none); `weights` records the weights the run
    (its transformer) started from."""

    module: torch.nn.Module
    net: torch.nn.Module
    forward: Callable
    params: list[torch.nn.Parameter]
    adapter: object | None
    weights: dict | None
    controlnet: torch.nn.Module | None = None
    router: tread.Router | None = None  # --tread's token routing of the training forward (None: none)


def own_memory(model: torch.nn.Module) -> None:
    """Give every CPU parameter and buffer loaded from a safetensors file at the file's offset (8-byte aligned) memory
    of its own (64-byte aligned, as torch allocates). CPU kernels round a one-row product (a transformer call on one
    sample, as an edit batch whose references differ in shape makes) differently on weights that are not 64-byte
    aligned: a run resumed from its checkpoint's file would not continue bit for bit the run that saved it."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.data_ptr() % 64:
                t.data = t.data.clone()


def build_model(cfg: TrainConfig, preset: ModelPreset, parallel: str, world: int, device: torch.device, *, resume_from: Path | None,
                state: dict, say: Callable = print, latent: LatentSpec | None = None) -> Model:
    """The transformer, and only it (or a ControlNet beside it, frozen): released weights unless told otherwise
    (a full fine-tune resumes its own from the checkpoint; a LoRA or ControlNet run rebuilds its base and resumes
    the adapters or the ControlNet), checkpointed, on the device, wrapped for DDP or sharded for FSDP. Optimizer
    states and the rest of the state come in `restore`. `latent`: the cache's latent spec (a ControlNet's input)."""
    weights_dtype = DTYPES[cfg.weights_dtype]
    if base_quant(cfg):
        quant.check_supported(cfg.base_quant, device)
    weights = None
    if not resume_from or cfg.lora_rank or cfg.controlnet:
        weights = resolve_weights(preset, cfg.pretrained, cfg.revision, cfg.from_scratch, cfg.seed)
        if state.get("weights") and (state["weights"]["source"], state["weights"].get("revision")) != (weights.source, weights.revision):
            what, rule = (("ControlNet was", "A ControlNet resumes beside the base it was trained with") if cfg.controlnet else
                          ("adapters were", "LoRA adapters resume onto the base they were trained on"))
            raise ValueError(f"{resume_from}: its {what} trained on {state['weights']['source']}; this run loads "
                             f"{weights.describe()}. {rule}.")
        say(f"transformer weights: {weights.describe()}")
    if cfg.controlnet:
        return build_controlnet_model(cfg, preset, weights, parallel, world, device, resume_from=resume_from, state=state,
                                      say=say, latent=latent)
    adapter = None
    if cfg.lora_rank:
        if weights.kind == "fresh" and preset.repo is not None:
            raise ValueError("LoRA on random weights adapts nothing: start from the preset's released weights or --pretrained")
        built = build_frozen(cfg, preset, functools.partial(released, preset, weights, cfg.seed), seed=cfg.seed)
        model, adapter = built.transformer, built.adapter
        layers = built.adapted_layers
        if resume_from:
            adapters = resume_from / checkpoint.ADAPTER_DIR
            lora.load_adapter_state(model, lora.read_adapter(adapters), adapters)
        elif cfg.init_lora:
            fresh = init_lora.load_init(model, init_lora.read_init(Path(cfg.init_lora), preset), adapter, cfg.init_lora)
            say(f"adapters start from {cfg.init_lora}" + (f"; {fresh} layers it does not hold start new" if fresh else ""))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(f"{lora.kind_title(adapter)} rank {cfg.lora_rank}, alpha {lora.alpha_of(adapter):g} on {layers} layers "
            f"({lora.layer_names(model, transformer_blocks(model))}): "
            f"{trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters; base frozen "
            f"{frozen_base(cfg, model)}")
    elif resume_from and not checkpoint.is_sharded(resume_from):
        model = load_saved(preset, resume_from / "transformer", weights_dtype)
    elif resume_from:  # FSDP: the architecture now, the weights after sharding
        model = build_transformer(preset, None, cfg.seed, weights_dtype)
    else:
        model = build_transformer(preset, weights, cfg.seed, weights_dtype)
    if weights is not None and weights.kind != "fresh" and preset.released_dtype not in (None, cfg.precision):
        log.warning("%s weights were released for %s training; this run uses %s", preset.name, preset.released_dtype, cfg.precision)
    if device.type == "cpu":  # (on an accelerator the weights move to memory of their own)
        own_memory(model)
    swap = build_swap(cfg, model, device, say)
    checkpoint_run(cfg, model, swap, "transformer", say)
    router = tread.install(cfg, model, get_family(preset.family), say=say)  # outside the swap's and checkpointing's wrappers
    model.train()
    # two experts: a batch whose timesteps all fall to one leaves the other without gradients (DDP must be told)
    net = distribute(cfg, model, parallel, world, device, say, swap=swap, find_unused=preset.paired)
    # a resumed run keeps the record of the weights it started from (a LoRA base re-resolved now may name a newer commit)
    record = state.get("weights") if resume_from else weights.to_json()
    forward = model_forward(net, preset.family, guidance=train_guidance(cfg, preset))
    return Model(model, net, forward if router is None else router.forward(forward),
                 [p for p in model.parameters() if p.requires_grad], adapter, record, router=router)


def build_controlnet_model(cfg: TrainConfig, preset: ModelPreset, weights, parallel: str, world: int, device: torch.device, *,
                           resume_from: Path | None, state: dict, say: Callable, latent: LatentSpec | None) -> Model:
    """A ControlNet beside the frozen transformer: the transformer from `weights` in --weights-dtype, frozen; the
    ControlNet in fp32, new from the transformer, from --pretrained-controlnet, or the checkpoint's. Only the
    ControlNet trains and is wrapped in DDP; both are checkpointed when asked (the frozen transformer's blocks
    still keep activations: the ControlNet's residuals enter them)."""
    if weights.kind == "fresh" and preset.repo is not None:
        raise ValueError("a ControlNet on a random transformer steers nothing: start from the preset's released weights or --pretrained")
    if resume_from and not checkpoint.is_controlnet(resume_from):
        raise ValueError(f"{resume_from} holds no ControlNet ({controlnet.CONTROLNET_DIR}/): it is not a ControlNet run's "
                         f"checkpoint; start a new run (another --run-dir, or --resume '')")
    resumed = functools.partial(resumed_controlnet, resume_from, preset.family) if resume_from else None
    built = build_frozen(cfg, preset, functools.partial(released, preset, weights, cfg.seed), controlnet_of=resumed,
                         seed=cfg.seed)
    transformer, net = built.transformer, built.controlnet
    origin = f"from {resume_from.name}" if resume_from else (cfg.pretrained_controlnet or "new from the transformer's first blocks")
    trained = sum(p.numel() for p in net.parameters())
    say(f"{type(net).__name__} ({origin}): {net.config.num_layers} blocks, {trained:,} trainable parameters; transformer "
        f"({sum(p.numel() for p in transformer.parameters()):,}) frozen {frozen_base(cfg, transformer)}, conditioning scale "
        f"{cfg.controlnet_conditioning_scale:g}")
    if cfg.checkpoint_every_k():
        n = checkpoint_blocks(net, cfg.checkpoint_every_k())
        say(f"gradient checkpointing: {n} of {len(net.transformer_blocks)} ControlNet blocks recomputed in backward")
    swap = build_swap(cfg, transformer, device, say)
    checkpoint_run(cfg, transformer, swap, "transformer", say)
    net.train()
    transformer.eval()
    place(transformer, device, swap)
    # a ControlNet whose last block computes an output nothing reads gets no gradient for it: DDP must be told
    wrapped = distribute(cfg, net, parallel, world, device, say, find_unused=get_family(preset.family).controlnet.find_unused)
    forward = controlnet.controlled_forward(transformer, wrapped, preset.family, scale=cfg.controlnet_conditioning_scale,
                                            latent=latent)
    record = state.get("weights") if resume_from else weights.to_json()
    return Model(transformer, wrapped, forward, [p for p in net.parameters() if p.requires_grad], None, record, controlnet=net)


def train_guidance(cfg: TrainConfig, preset: ModelPreset, saved: dict | None = None) -> float | None:
    """The value a guidance-distilled model's guidance embedding gets while training: --train-guidance, else the value
    the checkpoint `saved` trained with (a resumed run goes on as it began; runs before the option was renamed recorded
    it as guidance_scale_train), else the preset's (None for a model without the embedding)."""
    if cfg.train_guidance is not None or preset.train_guidance is None:
        return cfg.train_guidance
    was = (saved or {}).get("config", {})
    recorded = was.get("train_guidance", was.get("guidance_scale_train"))
    return float(recorded) if recorded is not None else preset.train_guidance


def released(preset: ModelPreset, weights, seed: int, dtype: torch.dtype, quantized: str | None) -> torch.nn.Module:
    """`train.frozen`'s `load`: the transformer from the run's weights."""
    return build_transformer(preset, weights, seed, dtype, quant=quantized)


def resumed_controlnet(resume_from: Path, family: str, transformer: torch.nn.Module) -> torch.nn.Module:
    """`train.frozen`'s `controlnet_of` for a resumed run: the checkpoint's ControlNet, checked against the transformer."""
    net = controlnet.load_checkpoint(resume_from, family)
    controlnet.check_fits(net, transformer, family)
    return net


def distribute(cfg: TrainConfig, model: torch.nn.Module, parallel: str, world: int, device: torch.device,
               say: Callable, find_unused: bool = False, swap: BlockSwap | None = None) -> torch.nn.Module:
    """Place the model: shard it per block (FSDP2), or on the device and wrapped in DDP, or just on the device
    (the swapped blocks' frozen weights stay in CPU memory). Returns what a step calls. `find_unused`: some trained
    parameters may get no gradient in a step (DDP)."""
    if parallel == "fsdp":
        blocks = distributed.find_blocks(model, cfg.fsdp_block)
        distributed.shard(model, blocks, reshard_after_forward=cfg.fsdp_reshard, cpu_offload=cfg.fsdp_cpu_offload,
                          param_dtype=None if cfg.precision == "fp32" else DTYPES[cfg.precision])
        if not cfg.fsdp_cpu_offload:
            model.to(device)
        say(f"FSDP over {world} ranks: {len(blocks)} {type(blocks[0]).__name__.removeprefix('FSDP')} blocks sharded, "
            f"reshard after forward {cfg.fsdp_reshard}, CPU offload {cfg.fsdp_cpu_offload}")
        return model
    place(model, device, swap)
    if parallel != "ddp":
        return model
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        # A frozen base is loaded alike on every rank: DDP neither broadcasts it at start (gigabytes, and quantized or
        # swapped weights it cannot send) nor its buffers before every forward; it reduces the trained parameters alone.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen + [n for n, _ in model.named_buffers()])
    say(f"DDP over {world} ranks")
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=find_unused)


def checkpoint_blocks(model: torch.nn.Module, every: int, skip=()) -> int:
    """Recompute every `every`-th transformer block in the backward pass, but those in `skip` (recomputed by the
    block swap already); returns how many blocks.

    diffusers' `enable_gradient_checkpointing()` covers all blocks; this trades memory for compute
    in finer steps by wrapping chosen blocks' forward in `torch.utils.checkpoint`.
    """
    if every == 1 and not skip:
        model.enable_gradient_checkpointing()
        return len(transformer_blocks(model))
    skipped = {id(b) for b in skip}
    chosen = [b for b in recomputed_blocks(model, every) if id(b) not in skipped]
    for block in chosen:
        block.forward = checkpointed_forward(block.forward)
    return len(chosen)


def base_quant(cfg: TrainConfig) -> str | None:
    """The frozen base's quantization (None: none)."""
    return None if cfg.base_quant == "none" else cfg.base_quant


def frozen_base(cfg: TrainConfig, model: torch.nn.Module) -> str:
    """How the frozen transformer is held, for the start-up log."""
    if not base_quant(cfg):
        return f"in {cfg.weights_dtype}"
    return f"with {quant.quantized_linears(model)} Linear layers in {cfg.base_quant}, the rest in bf16"


def build_swap(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, say: Callable) -> BlockSwap | None:
    """The block swap of the frozen transformer `model` (None without --blocks-to-swap); installed before any
    checkpointing wraps its blocks, since it checkpoints the blocks it swaps itself."""
    if not cfg.blocks_to_swap:
        return None
    swapped_blocks(model, cfg.blocks_to_swap)  # at most the transformer's blocks
    swap = BlockSwap(transformer_blocks(model), cfg.blocks_to_swap, device)
    say(swap.describe())
    if device.type == "cpu":
        log.warning("--blocks-to-swap on the CPU: the weights are in CPU memory already, so swapping saves nothing and the "
                    "swapped blocks are recomputed in backward")
    return swap


def checkpoint_run(cfg: TrainConfig, model: torch.nn.Module, swap: BlockSwap | None, what: str, say: Callable) -> None:
    """The run's gradient checkpointing of `model`'s blocks, beside the swapped ones (always recomputed)."""
    if not cfg.checkpoint_every_k():
        if base_quant(cfg) and (swap is None or len(swap.swapped) < len(transformer_blocks(model))):
            log.warning("--base-quant %s without --grad-checkpointing: each quantized layer of a block that is not recomputed "
                        "keeps a bf16 copy of its weight for the backward pass, more memory than an unquantized base; add "
                        "--grad-checkpointing all", cfg.base_quant)
        return
    skip = swap.swapped if swap is not None else ()
    n = checkpoint_blocks(model, cfg.checkpoint_every_k(), skip=skip)
    if skip:
        say(f"gradient checkpointing: {n} of the {len(transformer_blocks(model)) - len(skip)} resident {what} blocks recomputed in "
            f"backward, and the {len(skip)} swapped")
    else:
        say(f"gradient checkpointing: {n} of {len(transformer_blocks(model))} {what} blocks recomputed in backward")


def place(model: torch.nn.Module, device: torch.device, swap: BlockSwap | None) -> None:
    """The model on the device, but the swapped blocks' frozen weights (kept in CPU memory)."""
    if swap is not None:
        swap.place(model, device)
    else:
        model.to(device)


def build_optimizer(cfg: TrainConfig, params, device: torch.device) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    if cfg.optimizer == "came":  # as some families' own trainers
        from came_pytorch import CAME

        return CAME(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16))
    if cfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, scale_parameter=False, relative_step=False)
    if cfg.optimizer == "adamw-bf16":
        # bf16 moments and bf16 weights; stochastic rounding keeps updates smaller than bf16's resolution
        # in expectation, which plain rounding would drop. torchao compiles the step on first use.
        try:
            from torchao.optim import _AdamW
        except ImportError:
            raise ValueError(f"--optimizer adamw-bf16 needs torchao: {install_extra('bf16')}") from None
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA kernels are absent on CPU
        return _AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, bf16_stochastic_round=True)
    if device.type != "cuda":
        raise ValueError("adamw-8bit needs CUDA (bitsandbytes); choose adamw, came or adafactor on this machine")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError(f"--optimizer adamw-8bit needs bitsandbytes: {install_extra('8bit')}") from None

    return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule, as diffusers' training scripts build it (`diffusers.optimization.get_scheduler`): a
    linear warm-up from 0 over --warmup-steps, then constant, linear, cosine (with --lr-cycles restarts) or polynomial
    decay to --steps. A LambdaLR: its state is the step count, and the lambda is rebuilt from this run's options on
    resume (`apply_schedule`)."""
    from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler

    if cfg.lr_schedule == "polynomial":  # get_scheduler does not pass lr_end through (--lr-end < --lr: TrainConfig)
        return get_polynomial_decay_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps, lr_end=cfg.lr_end,
                                                         power=cfg.lr_power)
    name = "constant_with_warmup" if cfg.lr_schedule == "constant" and cfg.warmup_steps else cfg.lr_schedule
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps,
                         num_cycles=cfg.lr_cycles)


def apply_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make a resumed schedule this run's: its peak lr, warm-up, schedule and weight decay at the saved step.

    A loaded LambdaLR keeps this run's lambda (a function is not part of its state) and the checkpoint's base lrs, and
    the optimizer the checkpoint's lr and weight decay: the base values and the current lr are set here."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
            group["lr"].fill_(cfg.lr * factor)
        else:
            group["lr"] = cfg.lr * factor
    scheduler._last_lr = [cfg.lr * factor for _ in optimizer.param_groups]


def ema_device_for(cfg: TrainConfig, device: torch.device) -> torch.device:
    """Where the EMA's shadow weights live: the training device, the CPU when asked, and beside the weights
    under FSDP's CPU offload (sharded like them, so an update never mixes devices or DTensors with tensors)."""
    return torch.device("cpu") if cfg.ema_device == "cpu" or cfg.fsdp_cpu_offload else device


def build_ema(cfg: TrainConfig, params, device: torch.device) -> EMA | None:
    return EMA(params, cfg.ema_decay, ema_device_for(cfg, device)) if cfg.ema_decay > 0 else None


def build_run_objective(cfg: TrainConfig, preset: ModelPreset, config: dict):
    """The objective with this run's options and the preset's and family's defaults (`Family.precondition_outputs`;
    a `dynamic_shift` preset shifts by the image's sequence length unless --flow-shift or --resolution-shift says
    otherwise; one expert of a two-expert model draws its own timestep range (--expert); DDPM models with variance
    channels train them in full fine-tunes)."""
    if preset.objective == "flow":
        precondition = cfg.precondition_outputs if cfg.precondition_outputs is not None else get_family(preset.family).precondition_outputs
        return build_objective("flow", preset.prediction, weighting_scheme=cfg.weighting_scheme, logit_mean=cfg.logit_mean,
                               logit_std=cfg.logit_std, mode_scale=cfg.mode_scale, precondition_outputs=precondition,
                               shift=cfg.flow_shift or preset.flow_shift, resolution_shift=cfg.resolution_shift,
                               base_resolution=preset.base_resolution, masked_loss=cfg.masked_loss,
                               timestep_range=preset.expert_range(getattr(cfg, "expert", None)),
                               clean_first_frame=cfg.i2v_probability,
                               **flow_shift_kind(cfg.flow_shift, cfg.resolution_shift, preset))
    variance_channels = config.get("out_channels", config["in_channels"]) == 2 * config["in_channels"]
    learned = cfg.learned_variance if cfg.learned_variance is not None else (variance_channels and not cfg.lora_rank)
    if learned and not variance_channels:
        raise ValueError(f"--learned-variance: {preset.name} predicts no variance channels")
    return build_objective("ddpm", preset.prediction, learned_variance=learned, masked_loss=cfg.masked_loss)


def flow_shift_kind(flow_shift: float | None, resolution_shift: bool, preset: ModelPreset) -> dict:
    """The shift from the sequence length (a `dynamic_shift` preset's: the family's mu of the image's tokens), unless
    a fixed or resolution-scaled one is asked for."""
    dynamic = preset.dynamic_shift and not flow_shift and not resolution_shift
    if not dynamic:
        return {}
    family = get_family(preset.family)
    per_token = preset.latent_downsample * family.latent_patch(preset.transformer_config())
    return {"dynamic_shift": True, "pixels_per_token": per_token ** 2, "mu_of": family.mu}


def null_caption(cfg: TrainConfig, preset: ModelPreset) -> str:
    """What caption dropout feeds: the family's (`Family.null_caption`: what it was trained with, and what its pipeline
    encodes for an empty prompt); ControlNets of every family train with the empty caption."""
    if cfg.caption_dropout_embedding != "auto":
        return cfg.caption_dropout_embedding
    if cfg.controlnet:  # every diffusers ControlNet trainer drops a caption to the empty prompt's embedding
        return "empty"
    return get_family(preset.family).null_caption
