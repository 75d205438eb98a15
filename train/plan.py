"""Memory plan of a training setup, from the real architecture, before anything is allocated.

The transformer is built on the meta device by the trainer's own builder (`train.frozen`): parameters are counted
exactly, and one forward pass at the requested bucket and batch is traced with saved-tensor hooks
(`train.plan_trace`), so activation memory is what autograd actually keeps for the backward pass (deduplicated by
storage); with gradient checkpointing the backward runs too, recomputations included, and its peak of live tensors
counts. Weights (quantized ones at their kind's size, swapped blocks off the device), gradients, optimizer states
(per optimizer, from the parameter shapes) and the EMA are accounted per rank (`train.plan_costs`), with FSDP
sharding and CPU offload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from shards import ASPECT_RATIO_TABLES, Bucket, bucket_table, resolution_table
from shards.options import DTYPE_BYTES, DTYPES
from shards.references import unpack as unpack_references
from train import host_memory
from train.config import TrainConfig
from train.data import has_references
from train.families import get_family, get_preset
from train.families.base import EXPERT_NAMES
from train.frozen import build_frozen, meta_loader, quiet_diffusers, swapped_blocks
from train.lora import TITLES
from train.model import build_run_objective
from train.plan_config import GiB, PlanConfig, card_memory
from train.plan_costs import cpu_peak, frozen_bytes, objective_bytes, optimizer_state_bytes
from train.plan_trace import example_inputs, trace_activations, trace_base_forward, trace_flops
from train.presets import transformer_blocks

CARDS = (16, 24, 32, 40, 48, 80)  # the cards of `largest_batch_by_card`, by their memory as sold (GB)


@dataclass
class _Budget:
    """What a step holds besides its batch's activations, and those of the traced batch and of one more sample."""

    static: float
    grads: float
    act: float
    per_sample: float
    batch_size: int

    def largest_batch(self, memory: float) -> int:
        room = memory - self.static
        if room < max(self.grads, self.act - self.per_sample * (self.batch_size - 1)):  # not even one sample
            return 0
        if self.per_sample <= 0:
            return self.batch_size
        return max(1, int(self.batch_size + (room - self.act) // self.per_sample))

    def largest_batch_at(self, memory: float, scale: float) -> int:
        """The largest batch of a bucket whose activations per sample are `scale` times the traced bucket's."""
        room = memory - self.static
        fixed = self.act - self.per_sample * self.batch_size  # what does not grow with the batch (autocast copies, ...)
        if self.per_sample <= 0 or room <= max(self.grads, fixed):
            return 0
        return max(int((room - fixed) // (self.per_sample * scale)), 0)


def plan(pc: PlanConfig, objective=None, say: Callable[[str], None] = lambda message: None,
         buckets: list[Bucket] | None = None, batch: list[int] | None = None, baseline: int | None = None) -> dict:
    """Bytes per component on one rank's device, the predicted peak, the verdict and the largest batch; and the host
    memory of a rank and a node by part (`train.host_memory`).

    `objective`: the run's (its memory is traced); default: the preset's with the trainer's default options. `say`
    hears what the planner is doing (tracing a real-size model takes a while). `buckets`: the buckets to give the
    largest batch of (a cache's); default: the preset's base table. `batch`: the bytes of each tensor of one batch
    as the loader builds it (a cache's, `cached_batch`); default: the family's example batch at the traced bucket.
    `baseline`: the process's memory before any weights; default: this process's, measured once planned."""
    t0 = time.perf_counter()
    preset = get_preset(pc.model, pc.expert)  # --expert both: the two experts
    say(f"planning {pc.model}: building it on the meta device (no memory) ...")
    family = get_family(preset.family)
    wb = DTYPE_BYTES[pc.weights_dtype]
    with quiet_diffusers():
        built = build_frozen(pc, preset, meta_loader(preset), device="meta")
    model = built.transformer
    modules = [model] + ([built.controlnet.to(torch.float32)] if built.controlnet is not None else [])
    params = [p for m in modules for p in m.parameters()]
    n_params = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_buffers = sum(b.numel() for m in modules for b in m.buffers())
    shard = pc.world_size if pc.parallel == "fsdp" else 1
    on_device = 0.0 if pc.fsdp_cpu_offload else 1.0
    # Full fine-tuning: every weight trains in the weights dtype. LoRA (ControlNet): the base is frozen in the weights
    # dtype and the adapters (the ControlNet: the only gradients, optimizer states and EMA) are fp32.
    tb = 4 if pc.frozen_base else wb
    # the frozen base: quantized Linear weights at their kind's size, the rest in bf16 (or in the weights dtype)
    fb = DTYPE_BYTES["bf16"] if pc.base_quant != "none" else wb
    swapped = [frozen_bytes(b, pc.base_quant, fb) for b in swapped_blocks(model, pc.blocks_to_swap)]
    frozen = sum(frozen_bytes(m, pc.base_quant, fb) for m in modules) - sum(swapped)
    components = {
        "weights": on_device * (frozen + n_trainable * tb) / shard + n_buffers * fb,
        "gradients": on_device * n_trainable * tb / shard,
        "optimizer states": on_device * optimizer_state_bytes(trainable, pc.optimizer, tb) / shard,
        "ema": n_trainable * 4 / shard if pc.ema_placement() == "device" else 0.0,
    }
    if swapped:  # the block the GPU is finishing, the one in use and the one arriving (`train.swap.BlockSwap`)
        components["swapped blocks in flight"] = max(sum(swapped[i:i + 3]) for i in range(max(1, len(swapped) - 2)))
    if pc.parallel == "fsdp" and pc.world_size > 1:
        # one block's full parameters gathered in the compute dtype, and the next prefetched
        block_params = max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(model))
        components["fsdp all-gather buffers"] = 2 * block_params * DTYPE_BYTES[pc.precision]

    config = preset.transformer_config()
    if objective is None:
        # a two-expert model's experts share one architecture: the high-noise one's plan, unless --expert names one
        expert = pc.expert or (EXPERT_NAMES[0] if preset.experts else None)
        objective = build_run_objective(TrainConfig(model=pc.model, lora_rank=pc.lora_rank, expert=expert,
                                                    i2v_probability=pc.i2v_probability), preset, config)
    per_element = objective_bytes(objective, family.latent_channels(config), family.output_channels(config))
    passes = "forward/backward" if pc.checkpoint_every_k() or pc.blocks_to_swap else "forward"
    if pc.traced.frames:  # a clip the family's VAE encodes, refused before the trace otherwise
        family.latent_frames(pc.traced.frames)
    tokens = family.image_tokens(config, preset, pc.traced)
    # an edit preset's references: their tokens join each sample's sequence
    refs = pc.planned_references(family, config, preset)
    ref_tokens = refs[0] * family.image_tokens(config, preset, refs[1]) if refs else 0
    with_refs = f" with {refs[0]} reference(s) of {refs[1][0]}x{refs[1][1]}" if refs else ""
    say(f"tracing {pc.model} {passes} at {pc.traced.name}{with_refs}, batch {pc.batch_size} and {pc.batch_size + 1}, "
        f"{pc.precision} ...")
    act = activations(pc, preset, pc.batch_size, per_element, refs)
    # activations grow linearly with the batch: the slope from two traces gives the largest batch
    per_sample = activations(pc, preset, pc.batch_size + 1, per_element, refs) - act
    say(f"traced in {time.perf_counter() - t0:.1f} s")
    # autocast keeps a compute-dtype copy of each trained fp32 weight for the step (frozen ones are cast per use)
    if pc.precision != "fp32" and tb == 4 and pc.parallel != "fsdp":
        act += n_trainable * DTYPE_BYTES[pc.precision] / shard
    components["activations"] = act
    grads = components["gradients"]
    static = sum(v for k, v in components.items() if k not in ("activations", "gradients"))
    preservation = preservation_costs(pc, preset, refs) if pc.preservation == "output" else None
    # Backward frees saved activations as it creates gradients: the step peaks at the larger of the two (and output
    # preservation's forward, which runs before the trained one, of a class batch: the largest of the three).
    peak = static + max(act, grads, preservation["peak"] if preservation else 0)
    if preservation and preservation["peak"] > act:  # the batch is bounded by that forward's peak
        act, per_sample = preservation["peak"], preservation["peak_per_sample"]
    budget = _Budget(static, grads, act, per_sample, pc.batch_size)
    # Per bucket (of the cache, or the preset's table, at the traced clip length): activations per sample scale with
    # the bucket's pixels, times its latent frames for a clip (every layer is linear in the tokens with fused
    # attention), so the traced slope is rescaled, not retraced; an edit sample's references, prepared at their own
    # size whatever the bucket, add their pixels to every bucket's.
    def size(b: Bucket) -> int:
        return b.pixels * (family.latent_frames(b.frames) if b.frames else 1) + (refs[0] * refs[1][0] * refs[1][1] if refs else 0)

    table = buckets or [b.with_frames(pc.traced.frames) for b in default_table(preset, family, config)]
    by_bucket = {b.name: budget.largest_batch_at(pc.gpu_memory, size(b) / size(pc.traced)) for b in table}
    # What a trainer without a cache adds: the VAE and text encoder(s) resident, frozen, in bf16.
    encoders = {name: 2 * n for name, n in preset.encoder_parameters.items()}
    host = host_costs(pc, preset, family, config, built, components, peak, refs, tb, fb, sum(swapped), frozen + sum(swapped),
                      batch, baseline)
    return {
        "config": {**asdict(pc), "bucket": pc.traced.name, "ema": pc.ema_placement()},
        "tokens_per_sample": tokens,
        **({"references": {"count": refs[0], "size": f"{refs[1][0]}x{refs[1][1]}", "tokens": ref_tokens}} if refs else {}),
        "encoders_resident": encoders,
        "peak_with_encoders_resident": peak + sum(encoders.values()),
        "parameters": n_params,
        "host_bytes": sum(swapped),
        "host": host,
        "trainable_parameters": n_trainable,
        **({"controlnet_layers": built.controlnet.config.num_layers} if built.controlnet is not None else {}),
        "buffers": n_buffers,
        "bytes": components,
        "predicted_peak": peak,
        "fits": peak <= pc.gpu_memory,
        "largest_batch": budget.largest_batch(pc.gpu_memory),
        "largest_batch_with_encoders_resident": budget.largest_batch(pc.gpu_memory - sum(encoders.values())),
        # the same setup on the cards people train on (GiB as GPU memory is quoted), less what the CUDA context,
        # cuBLAS's workspace and the allocator's slack take before any tensor
        "largest_batch_by_card": {f"{g}GB": budget.largest_batch(card_memory(f"{g}GB")) for g in CARDS},
        "largest_batch_per_bucket": by_bucket,
        "activation_bytes_per_sample": per_sample,
        **({"preservation_forward": preservation} if preservation else {}),
    }


def host_costs(pc: PlanConfig, preset, family, config, built, components: dict, peak: float, refs, tb: int, fb: int,
               swapped: float, frozen: float, batch: list[int] | None, baseline: int | None) -> dict:
    """The host memory of the setup (`train.host_memory.host_plan`) from the device plan's figures: `frozen` the frozen
    weights' bytes (swapped ones included), `swapped` those of the swapped blocks."""
    model = built.transformer
    shard = pc.world_size if pc.parallel == "fsdp" else 1
    trained = [p for m in ([model] + ([built.controlnet] if built.controlnet is not None else [])) for p in m.parameters()
               if p.requires_grad]
    sizes = [p.numel() for p in trained]
    file_params = sum(p.numel() for p in model.parameters() if not (pc.frozen_base and p.requires_grad))
    buffers = sum(b.numel() for b in model.buffers()) * fb
    base = frozen if pc.frozen_base else sum(sizes) * tb
    weights, mapped, how = host_memory.loaded_weights(pc, preset, file_params, base, sum(sizes) * tb if pc.frozen_base else 0,
                                                      buffers)
    if pc.device != "cpu" and weights < base:  # used from the mapped file: the swapped blocks' pinned copies are new
        weights += swapped
    hm = host_memory.HostModel(weights=weights, mapped=mapped, trainable_sizes=sizes,
                               swapped=swapped if pc.device != "cpu" else 0.0, shard=shard,
                               optimizer_states=components["optimizer states"] or optimizer_state_bytes(trained, pc.optimizer, tb) / shard,
                               gradients=sum(sizes) * tb / shard,
                               saved=0.0 if pc.parallel == "fsdp" or pc.device == "cpu" else sum(sizes) * tb, weights_how=how)
    if batch is None:  # the preset's shapes, in the cache's default bf16
        example = example_inputs(family, model, preset, pc.traced, pc.batch_size, pc.text_tokens or preset.text_tokens,
                                 torch.bfloat16, refs)
        batch = host_memory.batch_sizes(example)
    loader = host_memory.loader_parts(batch, pc.workers, pc.prefetch, pc.readahead, pin=pc.device != "cpu")
    static = sum(v for k, v in components.items() if k not in ("activations", "gradients"))
    limit, where = host_memory.host_limit(pc.host_memory)
    return host_memory.host_plan(pc, hm, loader, peak, static, host_memory.process_memory() if baseline is None else baseline,
                                 pc.node_ranks, limit, where)


def cached_batch(cache, pc: PlanConfig, bucket: Bucket | None = None) -> list[int]:
    """Bytes of each tensor of a batch of `cache` as the trainer's loader builds it (`train.data.TrainingSamples`): its
    first samples of `bucket` (default: its largest, the dry run's), batch size `pc.batch_size`."""
    import itertools

    from train.cache import largest_bucket
    from train.data import TrainingSamples

    preset = get_preset(pc.model, pc.expert)
    family = get_family(preset.family)
    bucket = bucket or largest_bucket(cache)
    # the cache's own digest setting: this must not change what the run's later reads check
    samples = TrainingSamples(cache, 0, 0.0, check_digests=cache.check_digests, control=pc.controlnet,
                              conditioning=family.conditioning_fields(cache.spec), conditioning_dtype=DTYPES[pc.precision],
                              max_references=preset.references)
    first = list(itertools.islice(itertools.chain.from_iterable(cache.ranges_by_bucket()[bucket]), pc.batch_size))
    indices = (first * pc.batch_size)[: pc.batch_size]
    return host_memory.batch_sizes(samples.collate([samples[(0, i)] for i in indices]))


def cached_references(cache, bucket: Bucket | None = None) -> dict:
    """An edit cache's references as the plan takes them (`PlanConfig.references`, `reference_size`): those of the first
    sample of `bucket` (the dry run's; default, or a bucket the cache does not hold: its largest), each planned at the
    largest one's size; {} for a cache without references."""
    if not has_references(cache):
        return {}
    ranges = cache.ranges_by_bucket()
    if bucket not in ranges:
        bucket = max(ranges, key=lambda b: (b.pixels, b))
    first = cache[ranges[bucket][0].start]
    refs = unpack_references(first.fields)
    if not refs:
        return {"references": 0}
    down = cache.spec.latent.downsample
    h, w = max((tuple(r.shape[-2:]) for r in refs), key=lambda hw: (hw[0] * hw[1], hw))
    return {"references": len(refs), "reference_size": f"{h * down}x{w * down}"}


def default_table(preset, family, config) -> tuple[Bucket, ...]:
    """The buckets of the preset's base resolution: the published table, or the 1024 table's aspect ratios scaled to
    its area (as stage one builds one for another resolution)."""
    if preset.base_resolution in ASPECT_RATIO_TABLES:
        return bucket_table(preset.base_resolution)
    return resolution_table(preset.base_resolution, preset.latent_downsample * family.latent_patch(config))


def activations(pc: PlanConfig, preset, batch: int, per_element: tuple[float, float],
                references: tuple[int, tuple[int, int]] | None = None) -> float:
    """Activation bytes of a batch of `batch`, traced through the setup built in the compute dtype (as autocast runs
    it): with checkpointing or swapped blocks, the peak of the backward pass that recomputes them. `references`: an
    edit preset's (count, (height, width) pixels) of each sample's references."""
    compute = DTYPES[pc.precision]
    with quiet_diffusers():
        built = build_frozen(pc, preset, meta_loader(preset), dtype=compute, device="meta", adapter_dtype=compute)
        net = built.controlnet.to(compute) if built.controlnet is not None else None
    every = pc.checkpoint_every_k()
    traced = trace_activations(built.transformer, preset, batch, pc.traced, pc.text_tokens or preset.text_tokens, compute,
                               every, per_element, controlnet=net, swapped=pc.blocks_to_swap, references=references,
                               first_frame=pc.i2v_probability > 0)
    return traced["checkpointed"] if every or pc.blocks_to_swap else traced["full"]


def preservation_costs(pc: PlanConfig, preset, references: tuple[int, tuple[int, int]] | None = None) -> dict:
    """What output preservation adds to a class batch's step: one forward of the base model (LoRA adapters off) without
    gradients, before the trained forward. Its peak of live tensors (traced at the batch and one more sample: it grows
    with the batch too) and its floating-point operations next to the step's (forward, backward, recomputations)."""
    compute = DTYPES[pc.precision]
    tokens = pc.text_tokens or preset.text_tokens

    def built():
        with quiet_diffusers():
            return build_frozen(pc, preset, meta_loader(preset), dtype=compute, device="meta", adapter_dtype=compute).transformer

    peak = trace_base_forward(built(), preset, pc.batch_size, pc.traced, tokens, compute, references)
    more = trace_base_forward(built(), preset, pc.batch_size + 1, pc.traced, tokens, compute, references)
    flops = trace_flops(built(), preset, pc.batch_size, pc.traced, tokens, compute, pc.checkpoint_every_k(), pc.blocks_to_swap,
                        references)
    return {"peak": peak, "peak_per_sample": more - peak, "flops": flops["base_forward"], "step_flops": flops["step"],
            "added_compute": flops["base_forward"] / flops["step"] if flops["step"] else 0.0}


def format_plan(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"{cfg['model']}: {result['parameters']:,} parameters ({result['buffers']:,} buffer values)"
        + (f", {TITLES[cfg.get('adapter', 'lora')]} rank {cfg['lora_rank']}: {result['trainable_parameters']:,} trainable"
           if cfg["lora_rank"] else "")
        + (f", ControlNet of {result['controlnet_layers']} blocks: {result['trainable_parameters']:,} trainable, the "
           f"transformer frozen" if cfg["controlnet"] else "")
        + f"; batch {cfg['batch_size']} at "
        f"{cfg['bucket']}{' (' + format(result['tokens_per_sample'], ',') + ' tokens a sample)' if 'tokens_per_sample' in result else ''}"
        f"{describe_references(result.get('references'))}, "
        f"{cfg['precision']} compute, "
        f"{cfg['weights_dtype'] + ' weights' if cfg['base_quant'] == 'none' else 'frozen base in ' + cfg['base_quant'] + ' (the rest bf16)'}"
        f"{', blocks swapped: the last ' + str(cfg['blocks_to_swap']) if cfg['blocks_to_swap'] else ''}, {cfg['optimizer']}, checkpointing "
        f"{cfg['grad_checkpointing']}, EMA {cfg['ema']}, {cfg['world_size']} rank(s) {cfg['parallel'] if cfg['world_size'] > 1 else ''}"
        f"{' + CPU offload' if cfg['fsdp_cpu_offload'] else ''}",
    ]
    for name, value in result["bytes"].items():
        lines.append(f"  {name:<24} {value / GiB:9.2f} GiB")
    preservation = result.get("preservation_forward")
    if preservation:
        lines.append(f"  {'preservation forward':<24} {preservation['peak'] / GiB:9.2f} GiB at its peak (output preservation: "
                     f"the base model, adapters off, no gradients, before each class batch's trained forward; the step "
                     f"peaks at the largest of it, the activations and the gradients)")
    lines.append(f"  {'predicted peak':<24} {result['predicted_peak'] / GiB:9.2f} GiB per device")
    if preservation:
        lines.append(f"  output preservation adds {preservation['added_compute']:.0%} to a class batch's compute "
                     f"({preservation['flops'] / 1e12:.3g} TFLOP on top of the step's {preservation['step_flops'] / 1e12:.3g}: "
                     f"forward, backward and recomputations); instance batches are unchanged")
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"  {verdict} in {cfg['gpu_memory'] / GiB:.2f} GiB for tensors; largest batch at {cfg['bucket']}: "
                 f"{result['largest_batch']}")
    per_bucket = result["largest_batch_per_bucket"]
    if per_bucket:
        shown = sorted(per_bucket.items(), key=lambda kv: Bucket.parse(kv[0]).aspect)
        picks = [shown[0], *[kv for kv in shown if Bucket.parse(kv[0]).aspect == 1.0][:1], shown[-1]]
        lines.append("  largest batch per bucket (estimated from the traced one): "
                     + ", ".join(f"{k}: {v}" for k, v in dict(picks).items()) + f" ... ({len(per_bucket)} buckets in --json)")
    if result["encoders_resident"]:
        resident = sum(result["encoders_resident"].values())
        names = " + ".join(f"{k} {v / GiB:.1f} GiB" for k, v in result["encoders_resident"].items())
        lines.append(f"  with the encoders resident in bf16, as trainers without a cache run ({names}): "
                     f"{result['peak_with_encoders_resident'] / GiB:.2f} GiB, largest batch "
                     f"{result['largest_batch_with_encoders_resident']}; the cache saves {resident / GiB:.2f} GiB per device")
    lines += host_memory.format_host(result["host"])
    lines.append("  (activations traced at one forward on the meta device, and with checkpointing its backward's recomputations "
                 "too; backward frees activations as it makes gradients, so the peak counts the larger of the two)")
    return "\n".join(lines)




def describe_references(refs: dict | None) -> str:
    """The plan's words on an edit sample's references (nothing for a preset without)."""
    if not refs:
        return ""
    if not refs["count"]:
        return " without reference images (a text-to-image sample)"
    return (f" with {refs['count']} reference image(s) of {refs['size']} ({refs['tokens']:,} more tokens a sample, the "
            f"target's and theirs in one sequence)")


def measure_peak(step, device: torch.device) -> int:
    """Peak bytes of tensors during `step()`: the CUDA allocator's peak, or on the CPU the torch profiler's memory
    timeline (every tensor alive at each instant, parameters and states included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return cpu_peak(step)
