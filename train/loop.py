"""Stage two: train the diffusion transformer from the cache, nothing else on the device.

Read top to bottom: config, data, model, optimizer, resume, loop, checkpoint, summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import torch
import torch.utils.checkpoint
from tqdm import tqdm

from shards import Cache, CorruptSample, register_reader
from shards.atomic import atomic_write_bytes
from shards.reader import REPAIR
from train import checkpoint, distributed
from train.data import (BATCH_SAMPLER_VERSION, BucketBatchSampler, Prefetcher, TrainingSamples, _generator, derived_seed,
                        epoch_loader)
from train.objectives import TIMESTEP_BINS, build_objective
from train.plan import PlanConfig, format_plan, measure_peak, plan
from train import lora
from train.checkpoint import ADAPTER_DIR
from train.config import TrainConfig
from train.ema import EMA
from train.presets import DTYPES as PRECISIONS
from train.presets import build_transformer, get_preset, model_forward, resolve_weights, text_width
from train.validate import Validator

log = logging.getLogger("train")


def check_cache(preset, cache: Cache, config: dict) -> None:
    """Stop before loading weights when the cache cannot feed this model, naming the fields."""
    fp, extra = cache.fingerprint, cache.manifest.extra.get("precompute", {})
    absent = []
    for part, keys in (("vae", ("latent_channels", "downsample")), ("text_encoder", ())):
        if not isinstance(fp.get(part), dict):
            absent.append(part)
        else:
            absent += [f"{part}.{key}" for key in keys if key not in fp[part]]
    if absent:
        raise ValueError(f"the cache {cache.root} was not built by this product's stage one (its fingerprint has no "
                         f"{', '.join(absent)}); build one with make precompute DATA=... MODEL={preset.name}")
    patch = config.get("patch_size", 1)
    problems = []
    if extra.get("family") and extra["family"] != preset.family:
        problems.append(f"family: cache {extra['family']!r}, model {preset.family!r}")
    if fp["vae"]["latent_channels"] != config["in_channels"]:
        problems.append(f"latent channels: cache {fp['vae']['latent_channels']}, model in_channels {config['in_channels']}")
    layout = fp["text_encoder"].get("layout") or {}
    if layout.get("kind") == "sd3_joint":
        if layout["clip_width"] > config["joint_attention_dim"]:
            problems.append(f"CLIP width: cache {layout['clip_width']}, over the model's joint width {config['joint_attention_dim']}")
        if layout["pooled_width"] != config["pooled_projection_dim"]:
            problems.append(f"pooled width: cache {layout['pooled_width']}, model pooled_projection_dim {config['pooled_projection_dim']}")
        if layout["t5_width"] not in (None, config["joint_attention_dim"]):
            problems.append(f"T5 width: cache {layout['t5_width']}, model joint_attention_dim {config['joint_attention_dim']}")
    elif fp["text_encoder"]["hidden_size"] != text_width(config):
        problems.append(f"text width: cache {fp['text_encoder']['hidden_size']}, model {text_width(config)}")
    down = fp["vae"]["downsample"]
    for bucket in cache.manifest.buckets():
        if (bucket.height // down) % patch or (bucket.width // down) % patch:
            problems.append(f"bucket {bucket}: latent {bucket.height // down}x{bucket.width // down} is not a multiple of patch size {patch}")
    if problems:
        raise ValueError(
            f"the cache {cache.root} does not fit model {preset.name}:\n  " + "\n  ".join(problems)
            + f"\nBuild a matching cache: make precompute DATA=... MODEL={preset.name} CACHE={cache.root}-{preset.name}"
        )


def null_caption(cfg: TrainConfig, preset) -> str:
    """What caption dropout feeds: SD3 was trained with zeroed embeddings, PixArt and Sana with the empty caption."""
    if cfg.caption_dropout_embedding != "auto":
        return cfg.caption_dropout_embedding
    return "zeros" if preset.family == "sd3" else "empty"


def build_optimizer(cfg: TrainConfig, params, device: torch.device) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    if cfg.optimizer == "came":  # Sana's default
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
            raise ValueError("--optimizer adamw-bf16 needs torchao: pip install 'cachedit[bf16]'") from None
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA kernels are absent on CPU
        return _AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, bf16_stochastic_round=True)
    if device.type != "cuda":
        raise ValueError("adamw-8bit needs CUDA (bitsandbytes); choose adamw, came or adafactor on this machine")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("--optimizer adamw-8bit needs bitsandbytes: pip install 'cachedit[8bit]'") from None

    return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def checkpoint_blocks(model: torch.nn.Module, every: int) -> int:
    """Recompute every `every`-th transformer block in the backward pass; returns how many blocks.

    diffusers' `enable_gradient_checkpointing()` covers all blocks; this trades memory for compute
    in finer steps by wrapping chosen blocks' forward in `torch.utils.checkpoint`.
    """
    if every == 1:
        model.enable_gradient_checkpointing()
        return len(model.transformer_blocks)
    chosen = list(model.transformer_blocks)[every - 1 :: every]
    for block in chosen:
        block.forward = _checkpointed(block.forward)
    return len(chosen)


def _checkpointed(forward):
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return wrapped


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def apply_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make a resumed schedule this run's: its peak lr, warm-up, schedule and weight decay at the saved step.

    A loaded optimizer and scheduler carry the checkpoint's lr and weight decay; LambdaLR's lambda is this
    run's already, so only the base values and the current lr need setting."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    factor = lr_lambda(cfg)(scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
            group["lr"].fill_(cfg.lr * factor)
        else:
            group["lr"] = cfg.lr * factor
    scheduler._last_lr = [cfg.lr * factor for _ in optimizer.param_groups]


def build_run_objective(cfg: TrainConfig, preset, config: dict):
    """The objective with this run's options and the preset's defaults (SD3 preconditions its outputs as
    diffusers' SD3 trainers do; PixArt-Sigma's full fine-tunes train the variance channels)."""
    if preset.objective == "flow":
        precondition = cfg.precondition_outputs if cfg.precondition_outputs is not None else preset.family == "sd3"
        return build_objective("flow", preset.prediction, weighting_scheme=cfg.weighting_scheme, logit_mean=cfg.logit_mean,
                               logit_std=cfg.logit_std, mode_scale=cfg.mode_scale, precondition_outputs=precondition,
                               shift=cfg.flow_shift or preset.flow_shift, resolution_shift=cfg.resolution_shift,
                               base_resolution=preset.base_resolution)
    variance_channels = config.get("out_channels", config["in_channels"]) == 2 * config["in_channels"]
    learned = cfg.learned_variance if cfg.learned_variance is not None else (variance_channels and not cfg.lora_rank)
    if learned and not variance_channels:
        raise ValueError(f"--learned-variance: {preset.name} predicts no variance channels")
    return build_objective("ddpm", preset.prediction, learned_variance=learned)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return psutil.Process().memory_info().rss


def train(cfg: TrainConfig) -> dict:
    t_start = time.perf_counter()
    rank, world, _, device = distributed.setup()
    try:
        return _train(cfg, rank, world, device, t_start)
    finally:
        distributed.teardown()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device, t_start: float) -> dict:
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)  # one voice for all ranks
    parallel = "none" if world == 1 else ("ddp" if cfg.parallel == "auto" else cfg.parallel)
    if cfg.parallel == "fsdp" and world == 1:
        raise ValueError("--parallel fsdp shards over processes: launch with torchrun (make train NPROC=2 ...)")
    if parallel == "fsdp" and cfg.precision == "fp16":
        raise ValueError("--parallel fsdp trains in bf16 or fp32 (fp16 would need a sharded loss scaler); use --precision bf16")
    if cfg.fsdp_cpu_offload and (parallel != "fsdp" or device.type != "cuda"):
        raise ValueError("--fsdp-cpu-offload moves FSDP's shards between GPU and CPU memory: it needs --parallel fsdp on CUDA")
    if parallel == "fsdp" and cfg.lora_rank:
        raise ValueError("LoRA trains with the frozen base replicated on every GPU: use --parallel ddp (the default)")
    if parallel == "fsdp" and cfg.ema_decay > 0 and cfg.ema_device == "cpu":
        raise ValueError("under FSDP the EMA is sharded like the weights; use --fsdp-cpu-offload instead of --ema-device cpu")
    preset = get_preset(cfg.model)
    if preset.objective != "flow" and cfg.weighting_scheme != "logit_normal":
        raise ValueError(f"--weighting-scheme {cfg.weighting_scheme} sets flow matching timesteps; {cfg.model} trains with DDPM")
    cfg.run.mkdir(parents=True, exist_ok=True)

    resume_from = checkpoint.resolve_resume(cfg.run, cfg.resume)
    state = checkpoint.load_state(resume_from) if resume_from else {}
    if state and state["step"] >= cfg.steps and not cfg.dry_run:
        say(f"{cfg.run} already finished: {resume_from.name} is at step {state['step']} of --steps {cfg.steps}. Nothing to do; "
            f"pass a larger --steps to train further.")
        return {"step": state["step"], "epoch": state["epoch"], "elapsed_s": time.perf_counter() - t_start, "grids": [],
                "last_loss": None, "checkpoint": str(resume_from), "finished": True}

    # 1. the cache must fit the model: checked before any weights are loaded. Every rank reads the generation
    # rank 0 opened (or the one the checkpoint's epoch was reading, whatever was committed since), registered
    # for `shards gc` at once.
    cache = open_generation(cfg, is_main, state.get("cache_generation"))
    config = preset.transformer_config()
    check_cache(preset, cache, config)
    objective = build_run_objective(cfg, preset, config)
    validator = None
    if cfg.validate:  # prompts without a cached embedding stop the run here, before any weights load
        validator = Validator(cache, preset, objective, prompts=cfg.validation_prompt, buckets=cfg.validation_bucket,
                              steps=cfg.validation_steps, guidance=cfg.guidance_scale, seed=cfg.validation_seed,
                              decode_device="cpu" if cfg.decode_device == "cpu" else str(device), out=cfg.run,
                              model_name=cfg.model)
        if not validator:
            say(f"no validation prompts cached in {cache.root} (add some with precompute --validation-prompt); not validating")
            validator.close()
            validator = None
    run_config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    check_cache_files(cache, is_main)  # every listed shard exists with its size, before any weights load
    if state:
        for change in checkpoint.check_resumable(resume_from, state, run_config, world, parallel, cache.manifest.fingerprint_sha256):
            say(f"applied on resume: {change} from step {state['step']}")

    # 2. the transformer, and only it: released weights unless told otherwise (a full fine-tune resumes its own)
    weights_dtype = PRECISIONS[cfg.weights_dtype]
    weights = None
    if not resume_from or cfg.lora_rank:
        weights = resolve_weights(preset, cfg.pretrained, cfg.revision, cfg.from_scratch, cfg.seed)
        if state and state.get("weights") and (state["weights"]["source"], state["weights"].get("revision")) != (weights.source, weights.revision):
            raise ValueError(f"{resume_from}: its adapters were trained on {state['weights']['source']}; this run loads "
                             f"{weights.describe()}. LoRA adapters resume onto the base they were trained on.")
        say(f"transformer weights: {weights.describe()}")
    adapter = None  # the LoRA config when only adapters train
    if cfg.lora_rank:
        if weights.kind == "fresh" and preset.repo is not None:
            raise ValueError("LoRA on random weights adapts nothing: start from the preset's released weights or --pretrained")
        model = build_transformer(preset, weights, cfg.seed, weights_dtype)
        adapter = lora.lora_config(preset.family, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout)
        layers = lora.add_lora(model, adapter, seed=cfg.seed)
        if resume_from:
            lora.load_adapter_state(model, lora.read_adapter(resume_from / ADAPTER_DIR), resume_from / ADAPTER_DIR)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(f"LoRA rank {cfg.lora_rank}, alpha {adapter.lora_alpha:g} on {layers} layers ({', '.join(sorted(adapter.target_modules))}): "
            f"{trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters; base frozen in {cfg.weights_dtype}")
    elif resume_from and not checkpoint.is_sharded(resume_from):
        model = preset.transformer_class.from_pretrained(resume_from / "transformer", torch_dtype=weights_dtype)
    elif resume_from:  # FSDP: the architecture now, the weights after sharding
        model = build_transformer(preset, None, cfg.seed, weights_dtype)
    else:
        model = build_transformer(preset, weights, cfg.seed, weights_dtype)
    if weights is not None and weights.kind != "fresh" and preset.released_dtype and \
            cfg.precision != {"float16": "fp16", "bfloat16": "bf16"}.get(preset.released_dtype):
        log.warning("%s weights were released for %s training; this run uses %s", preset.name, preset.released_dtype, cfg.precision)
    if cfg.checkpoint_every_k():
        n = checkpoint_blocks(model, cfg.checkpoint_every_k())
        say(f"gradient checkpointing: {n} of {len(model.transformer_blocks)} transformer blocks recomputed in backward")
    model.train()
    net = model  # what the step calls: the model itself, or its DDP wrapper
    if parallel == "fsdp":
        blocks = distributed.find_blocks(model, cfg.fsdp_block)
        distributed.shard(model, blocks, reshard_after_forward=cfg.fsdp_reshard, cpu_offload=cfg.fsdp_cpu_offload,
                          param_dtype=None if cfg.precision == "fp32" else PRECISIONS[cfg.precision])
        if not cfg.fsdp_cpu_offload:
            model.to(device)
        say(f"FSDP over {world} ranks: {len(blocks)} {type(blocks[0]).__name__.removeprefix('FSDP')} blocks sharded, "
            f"reshard after forward {cfg.fsdp_reshard}, CPU offload {cfg.fsdp_cpu_offload}")
    else:
        model.to(device)
        if parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            say(f"DDP over {world} ranks")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    ema = EMA(params, cfg.ema_decay, ema_device_for(cfg, device)) if cfg.ema_decay > 0 else None

    # 3. resume: weights came with the model; now optimizer, schedule, scaler, EMA, data cursor
    step, epoch, cursor = 0, 0, 0
    smooth_sum, smooth_n = 0.0, 0  # debiased EMA of the loss, carried across resumes
    history = [{"step": 0, "precision": cfg.precision, "weights_dtype": cfg.weights_dtype}]
    if resume_from:
        if parallel == "fsdp":  # every rank reads its shards
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            has_ema = ema is not None and state["config"].get("ema_decay", 0) > 0
            loaded = checkpoint.load_sharded(resume_from, {"model": model_sd, "optimizer": optim_sd,
                                                           **({"ema": ema.state_dict()} if has_ema else {})})
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
            ema_state = loaded.get("ema")
        else:
            optimizer.load_state_dict(checkpoint.load_tensors(resume_from, "optimizer"))
            ema_state = checkpoint.load_tensors(resume_from, "ema") if ema is not None else None
        if ema_state:
            ema.load_state_dict(ema_state)  # back onto the EMA's device, with this run's decay
        elif ema is not None:
            say(f"{resume_from.name} holds no EMA: it starts from the current weights")
        scheduler.load_state_dict(checkpoint.load_tensors(resume_from, "scheduler"))
        apply_schedule(cfg, optimizer, scheduler)  # this run's lr, warm-up, schedule and weight decay, from its step
        scaler_state = checkpoint.load_tensors(resume_from, "scaler")
        if scaler_state and cfg.precision == "fp16":
            scaler.load_state_dict(scaler_state)
        elif scaler_state:
            log.warning("resuming an fp16 run in %s: the GradScaler state is dropped (loss scaling is not needed)", cfg.precision)
        previous = state["config"]
        if previous.get("weights_dtype", "fp32") != cfg.weights_dtype:
            log.warning("weights were %s in %s and continue in %s", previous.get("weights_dtype", "fp32"), resume_from.name, cfg.weights_dtype)
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        smooth_sum, smooth_n = state.get("smoothed_loss", [0.0, 0])
        if state["sampler"]["version"] != BATCH_SAMPLER_VERSION:
            raise ValueError(f"{resume_from}: its data order was drawn by batch sampler version {state['sampler']['version']}, "
                             f"this trainer draws version {BATCH_SAMPLER_VERSION}; resume it with the version that wrote it")
        history = state["precision_history"]
        if (history[-1]["precision"], history[-1].get("weights_dtype", "fp32")) != (cfg.precision, cfg.weights_dtype):
            history.append({"step": step, "precision": cfg.precision, "weights_dtype": cfg.weights_dtype})
        weights_record = state.get("weights")
        say(f"resumed from {resume_from} at step {step} (epoch {epoch}, batch {cursor})")
    else:
        weights_record = weights.to_json()

    # 4. data: one bucket per batch, the same number of batches on every rank
    def sampler_for(c: Cache) -> BucketBatchSampler:
        return BucketBatchSampler(c.ranges_by_bucket(), cfg.batch_size, cfg.seed, rank, world, cfg.remainder)

    # An epoch reads the cache generation it started with; samples committed or removed meanwhile count from
    # the next epoch on.
    sampler = sampler_for(cache)
    say(f"cache {cache.root}: {len(cache)} samples, {sampler.batches_per_epoch()} batches of {cfg.batch_size} x {world} "
        f"rank(s) per epoch")
    for bucket, st in cache.manifest.buckets().items():
        say(f"  {bucket.name:>10}: {st.samples} samples")
    dataset = TrainingSamples(cache, cfg.seed, cfg.caption_dropout, null_caption(cfg, preset), check_digests=cfg.check_digests)
    autocast = torch.autocast(device.type, dtype=PRECISIONS[cfg.precision], enabled=cfg.precision != "fp32")
    forward = model_forward(net, preset.family)
    if is_main or cfg.dry_run:
        planned = startup_plan(cfg, cache, device, world, parallel)
        say(format_plan(planned))
    if cfg.dry_run:
        return dry_run(cfg, cache, dataset, objective, forward, model, optimizer, scaler, autocast, validator, preset, planned,
                       device, rank, world, say)

    stop = {"signal": None, "memory": False}
    def on_signal(signum, frame):
        stop["signal"] = signum
    def on_memory_request(signum, frame):  # `kill -USR1 PID` writes RUN/memory.txt at the next step
        stop["memory"] = True
    previous_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous_handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_memory_request)
    tensorboard = None
    try:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(str(cfg.run / "tensorboard")) if is_main else None
    except ImportError:  # TensorBoard is optional
        pass

    def save_checkpoint() -> None:
        tensors = {"scheduler": scheduler.state_dict()}
        if scaler.is_enabled():
            tensors["scaler"] = scaler.state_dict()
        sharded = None
        if parallel == "fsdp":  # every rank writes its shards; nothing is gathered
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            sharded = {"model": model_sd, "optimizer": optim_sd, **({"ema": ema.state_dict()} if ema is not None else {})}
        else:
            tensors["optimizer"] = optimizer.state_dict()
            if ema is not None:
                tensors["ema"] = ema.state_dict()
        adapter_files = None
        if adapter is not None:  # the adapters alone, as the family's pipeline loads them
            adapter_files = (ADAPTER_DIR, lambda d: lora.save_adapter(d, preset.family, lora.adapter_state(model), adapter))
        checkpoint.save(cfg.run, step, model=model, tensors=tensors, keep=cfg.keep_checkpoints, sharded=sharded, rank=rank,
                        adapter=adapter_files, state={
            "step": step, "epoch": epoch, "cursor": cursor, "world_size": world, "model": cfg.model,
            "parallel": parallel,
            "smoothed_loss": [smooth_sum, smooth_n],
            "cache_fingerprint_sha256": cache.manifest.fingerprint_sha256, "cache_generation": cache.generation,
            "cache_root": str(cache.root.resolve()), "precision_history": history, "weights": weights_record,
            "sampler": {"version": BATCH_SAMPLER_VERSION, "batch_size": cfg.batch_size, "seed": cfg.seed, "remainder": cfg.remainder},
            "config": run_config,
        })

    validated_at = None

    def validate() -> float:
        """Queue a validation grid of this step; returns the seconds it took the training process."""
        nonlocal validated_at
        t0 = time.perf_counter()
        validator.run(model, step, PRECISIONS[cfg.precision], ema, params, submit=is_main)
        validated_at = step
        report_grids(validator.finished())
        return time.perf_counter() - t0

    grids: list[str] = []

    def report_grids(done: list[tuple[str, str]]) -> None:
        for status, message in done:
            if status != "ok":
                log.warning("validation grid failed: %s", message)
                continue
            grids.append(message)
            tqdm.write(f"validation samples: {message}")
            if tensorboard is not None:
                import numpy as np
                from PIL import Image

                tensorboard.add_image("validation", np.asarray(Image.open(message).convert("RGB")),
                                      int(Path(message).stem.removeprefix("samples-step")), dataformats="HWC")

    # 5. the loop
    if is_main:  # a resumed run's metrics restart at its step: what came after the checkpoint is redone
        truncate_metrics(cfg.run / "metrics.jsonl", step)
    metrics = open(cfg.run / "metrics.jsonl", "a") if is_main else None
    damaged: list[CorruptSample] = []
    bar = tqdm(total=cfg.steps, initial=step, unit="step", disable=not cfg.progress or not is_main, dynamic_ncols=True)
    bad_in_row, micro = 0, 0
    window = {"loss": 0.0, "n": 0, "samples": 0, "t0": time.perf_counter(), "wait": 0.0, "bins": [[0.0, 0] for _ in range(TIMESTEP_BINS)]}
    losses = []
    wait_before = 0.0  # data wait of finished epochs' prefetchers
    optimizer.zero_grad(set_to_none=True)
    while step < cfg.steps and stop["signal"] is None:
        batches = sampler(epoch, start=cursor)
        prefetch = Prefetcher(epoch_loader(dataset, batches, epoch, cfg.workers, device), device)
        for batch in until_damaged(prefetch, damaged):
            if world > 1 and distributed.any_across(False, device):  # a rank's batch is damaged: all stop here
                damaged.append(CorruptSample("another rank read a damaged sample (its error names the shard)."))
                break
            cursor += 1
            # Noise and timesteps of this micro-batch: drawn for the global batch, this rank's slice taken.
            g = _generator(cfg.seed, 1_000_003, step, micro, device=device)
            last = micro + 1 >= cfg.grad_accum  # gradients are reduced across ranks only on the last micro-batch
            if parallel == "fsdp":
                model.set_requires_gradient_sync(last)
            with net.no_sync() if parallel == "ddp" and not last else contextlib.nullcontext():
                with autocast:
                    per_sample, t = objective(forward, batch, g, part=(rank, world))
                    loss = per_sample.mean()
                local = float(loss.detach())  # one sync per micro-batch, for the bar and metrics
                finite = math.isfinite(local)
                # one collective: every rank skips together, and the logged loss is the global batch's
                total, bad = distributed.sum_across([local if finite else 0.0, 0.0 if finite else 1.0], device)
                if not bad:
                    scaler.scale(loss / cfg.grad_accum).backward()
            micro += 1
            if bad:
                bad_in_row += 1
                log.warning("step %d: non-finite loss, skipped; samples %s", step, batch["keys"])
                optimizer.zero_grad(set_to_none=True)
                micro = 0
                if bad_in_row >= cfg.max_bad_steps:
                    raise RuntimeError(f"{bad_in_row} non-finite losses in a row; stopping (last samples {batch['keys']})")
                continue
            value = total / world
            smooth_sum, smooth_n = 0.95 * smooth_sum + 0.05 * value, smooth_n + 1
            window["loss"] += value
            window["n"] += 1
            window["samples"] += len(batch["keys"]) * world
            for value, tt in zip(per_sample.detach().float().tolist(), t.tolist()):
                b = window["bins"][min(TIMESTEP_BINS - 1, int(tt * TIMESTEP_BINS))]
                b[0] += value
                b[1] += 1
            if micro < cfg.grad_accum:
                continue
            micro = 0
            scaler.unscale_(optimizer)
            grad_norm = distributed.full_value(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")))
            if not torch.isfinite(grad_norm) and not scaler.is_enabled():
                bad_in_row += 1
                log.warning("step %d: non-finite gradients, skipped; samples %s", step, batch["keys"])
                optimizer.zero_grad(set_to_none=True)
                if bad_in_row >= cfg.max_bad_steps:
                    raise RuntimeError(f"{bad_in_row} non-finite gradients in a row; stopping")
                continue
            # Whatever draws from the global RNG in the step (stochastic rounding) is fixed by the step
            # number, so a resumed run rounds exactly as an uninterrupted one.
            # The same seed on every rank: DDP replicas must round alike; FSDP ranks round different shards.
            torch.manual_seed(derived_seed(cfg.seed, 2_000_003, step))
            scaler.step(optimizer)  # with fp16 the scaler skips steps whose gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            bad_in_row = 0
            step += 1
            if ema is not None and step % cfg.ema_every == 0:
                ema.step(params)  # on the EMA's device
            bar.update(1)
            if world > 1 and distributed.any_across(stop["signal"] is not None, device):
                stop["signal"] = stop["signal"] or signal.SIGTERM  # a signal to any rank stops all at this step
            if step % cfg.log_every == 0 or step == cfg.steps:
                elapsed = time.perf_counter() - window["t0"]
                mean = window["loss"] / max(window["n"], 1)
                flat = distributed.sum_across([v for b in window["bins"] for v in b], device)
                window["bins"] = [flat[i : i + 2] for i in range(0, len(flat), 2)]
                smoothed = smooth_sum / (1 - 0.95**smooth_n)  # debiased EMA over ~20 micro-batches
                record = {
                    "step": step, "loss": mean, "smoothed_loss": smoothed, "lr": float(scheduler.get_last_lr()[0]),
                    "grad_norm": float(grad_norm), "samples_per_s": window["samples"] / elapsed,
                    "data_wait": (wait_before + prefetch.wait_s - window["wait"]) / elapsed, "peak_memory": peak_memory(device),
                    "loss_by_timestep": [b[0] / b[1] if b[1] else None for b in window["bins"]], "precision": cfg.precision,
                }
                if is_main:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                if tensorboard is not None:
                    for name in ("loss", "smoothed_loss", "lr", "grad_norm", "samples_per_s", "data_wait", "peak_memory"):
                        tensorboard.add_scalar(f"train/{name}", record[name], step)
                losses.append((step, mean))
                if validator is not None:
                    report_grids(validator.finished())
                bar.set_postfix(loss=f"{mean:.4f}", smooth=f"{smoothed:.4f}", lr=f"{record['lr']:.2e}",
                                sps=f"{record['samples_per_s']:.1f}", wait=f"{record['data_wait']:.0%}")
                window.update(loss=0.0, n=0, samples=0, t0=time.perf_counter(), wait=wait_before + prefetch.wait_s,
                              bins=[[0.0, 0] for _ in range(TIMESTEP_BINS)])
            if stop["memory"]:
                stop["memory"] = False
                write_memory_report(cfg.run / ("memory.txt" if world == 1 else f"memory-rank{rank}.txt"), device, step)
            if validator is not None and cfg.validate_every and step % cfg.validate_every == 0:
                window["t0"] += validate()
            if step % cfg.checkpoint_every == 0:
                save_checkpoint()
            if step >= cfg.steps or stop["signal"] is not None:
                break
        else:
            if damaged:
                if world > 1:
                    distributed.any_across(True, device)  # answers the other ranks' check of this batch
                break
            # the epoch is done: the next one starts at its first batch and sees shards added meanwhile
            epoch, cursor = epoch + 1, 0
            wait_before += prefetch.wait_s
            cache = open_generation(cfg, is_main)
            try:
                check_cache_files(cache, is_main)
            except CorruptSample as e:  # every rank checks the same generation: all stop, at a whole step
                damaged.append(e)
                break
            sampler = sampler_for(cache)
            dataset = TrainingSamples(cache, cfg.seed, cfg.caption_dropout, null_caption(cfg, preset), check_digests=cfg.check_digests)
        if damaged:
            break
    bar.close()
    if metrics is not None:
        metrics.close()
    if damaged:  # checkpoint at the last whole step, then stop: resuming redoes the step whose batch was damaged
        cursor -= micro
        save_checkpoint()  # every rank stopped at the same batch
        if validator is not None:
            validator.close()
        for s, h in previous_handlers.items():
            signal.signal(s, h)
        saved = checkpoint.complete_checkpoints(cfg.run)
        resumes = f"; {saved[-1]} resumes the run" if saved else ""
        raise CorruptSample(f"{damaged[0]} Training stopped at step {step}{resumes} once it is repaired.")
    save_checkpoint()
    if validator is not None:
        if stop["signal"] is None and validated_at != step:
            validate()
        report_grids(validator.finished(wait=True))
    if tensorboard is not None:
        tensorboard.close()
    for s, h in previous_handlers.items():
        signal.signal(s, h)
    if stop["signal"] is not None:
        say(f"stopped by signal {stop['signal']} at step {step}; resume with the same command")
    if is_main:
        plot_losses(cfg.run)
    summary = {"step": step, "epoch": epoch, "elapsed_s": time.perf_counter() - t_start, "grids": grids,
               "last_loss": losses[-1][1] if losses else None, "checkpoint": str(checkpoint.complete_checkpoints(cfg.run)[-1])}
    say(f"run {cfg.run}: step {step}, checkpoint {summary['checkpoint']}, metrics {cfg.run / 'metrics.jsonl'}, "
          f"loss curve {cfg.run / 'loss.png'}")
    return summary


def open_generation(cfg: TrainConfig, is_main: bool, generation: int | None = None) -> Cache:
    """The cache at `generation` (default: the newest rank 0 sees), the same on every rank, registered by rank 0
    so that `python -m shards gc` keeps its files for this run."""
    cache = Cache(cfg.cache, generation) if is_main else None
    generation = distributed.rank0_value(cache.generation if is_main else None)
    if is_main and not register_reader(cfg.cache, cfg.run, generation):
        log.warning("%s is read-only for this run: `python -m shards gc` on it cannot know that %s reads generation %d",
                    cfg.cache, cfg.run, generation)
    return cache if is_main else Cache(cfg.cache, generation)


def ema_device_for(cfg: TrainConfig, device: torch.device) -> torch.device:
    """Where the EMA's shadow weights live: the training device, the CPU when asked, and beside the weights
    under FSDP's CPU offload (sharded like them, so an update never mixes devices or DTensors with tensors)."""
    return torch.device("cpu") if cfg.ema_device == "cpu" or cfg.fsdp_cpu_offload else device


def until_damaged(batches, damaged: list):
    """The batches, until one holds a sample that fails its digest: the error goes into `damaged` and the
    iteration ends (the caller checkpoints and stops)."""
    try:
        yield from batches
    except CorruptSample as e:
        damaged.append(e)


def check_cache_files(cache: Cache, is_main: bool) -> None:
    """Every shard of the generation exists with its listed size: rank 0 stats each once (ranks share the
    filesystem, so one pass serves all) and every rank stops alike."""
    problems = distributed.rank0_value(cache.check_files() if is_main else None)
    if problems:
        listed = "; ".join(f"{path}: {what}" for path, what in problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CorruptSample(f"{len(problems)} shard(s) of {cache.root} (generation {cache.generation}) are missing or damaged: "
                            f"{listed}. {REPAIR.format(root=cache.root)}")


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps up to `step` (the resumed one; 0: none), written atomically."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


def _logged_step(line: str) -> float:
    """The step of a metrics line; a line torn by a crash counts as after every checkpoint (it is dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def largest_bucket(cache: Cache):
    return max(cache.manifest.buckets(), key=lambda b: (b.height * b.width, b))


def startup_plan(cfg: TrainConfig, cache: Cache, device: torch.device, world: int, parallel: str) -> dict:
    """The memory plan of this run at the cache's largest bucket."""
    largest = largest_bucket(cache)
    ema = "off" if cfg.ema_decay <= 0 else cfg.ema_device if cfg.ema_device == "cpu" else "device"
    return plan(PlanConfig(cfg.model, batch=cfg.batch_size, bucket=(largest.height, largest.width), precision=cfg.precision,
                           weights_dtype=cfg.weights_dtype, optimizer=cfg.optimizer, grad_ckpt=str(cfg.grad_checkpointing),
                           ema=ema, world_size=world, parallel="fsdp" if parallel == "fsdp" else "ddp",
                           cpu_offload=cfg.fsdp_cpu_offload, text_tokens=cache_text_tokens(cache),
                           gpu_memory=device_memory(device), lora_rank=cfg.lora_rank, lora_targets=tuple(cfg.lora_targets)))


def cache_text_tokens(cache: Cache) -> int:
    """The most text tokens a batch of this cache feeds the transformer (SD3: CLIP's 77 and T5's)."""
    text = cache.fingerprint["text_encoder"]
    layout = text.get("layout") or {}
    return layout["clip_tokens"] + layout["t5_tokens"] if layout.get("kind") == "sd3_joint" else text["max_length"]


def dry_run(cfg, cache, dataset, objective, forward, model, optimizer, scaler, autocast, validator, preset, planned,
            device, rank, world, say) -> dict:
    """One full step at the largest bucket (forward, backward, optimizer step, one validation sample),
    its measured peak next to the plan. Nothing is written to the run."""
    from train.validate import generate

    largest = largest_bucket(cache)
    indices = [i for r in cache.ranges_by_bucket()[largest] for i in r]
    indices = (indices * cfg.batch_size)[: cfg.batch_size]
    batch = dataset.collate([dataset[(0, i)] for i in indices])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step() -> None:
        with autocast:
            per_sample, _ = objective(forward, batch, _generator(cfg.seed, 0, device=device), part=(rank, world))
        scaler.scale(per_sample.mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if validator is not None:
            prompt = validator.prompts[0]
            shape = (model.config.in_channels, largest.height // cache.fingerprint["vae"]["downsample"],
                     largest.width // cache.fingerprint["vae"]["downsample"])
            generate(model, preset, objective, prompt.cond, validator.null, shape, largest.height * largest.width,
                     steps=2, guidance=cfg.guidance_scale, seed=0, precision=PRECISIONS[cfg.precision], layout=validator.layout)

    measured = measure_peak(step, device)
    predicted = planned["predicted_peak"]
    say(f"dry run at {largest.name}, batch {cfg.batch_size}: measured peak {measured / 2**30:.3f} GiB, planned "
        f"{predicted / 2**30:.3f} GiB ({predicted / measured - 1:+.1%})")
    return {"dry_run": True, "bucket": largest.name, "measured_peak": measured, "predicted_peak": predicted}


def write_memory_report(path: Path, device: torch.device, step: int) -> None:
    """The allocator's `memory_summary()` on CUDA; the process's memory figures on the CPU."""
    if device.type == "cuda":
        text = torch.cuda.memory_summary(device)
    else:
        info = psutil.Process().memory_full_info()
        text = "\n".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in info._asdict().items())
    path.write_text(f"step {step}\n{text}\n")
    print(f"memory report written to {path}")


def plot_losses(run: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], alpha=0.4, label="loss")
    ax.plot([r["step"] for r in rows], [r["smoothed_loss"] for r in rows], label="smoothed")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(str(run))
    ax.legend()
    fig.tight_layout()
    fig.savefig(run / "loss.png", dpi=100)
    plt.close(fig)
