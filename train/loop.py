"""Stage two: train the diffusion transformer from the cache, nothing else on the device.

`train` reads top to bottom: options and resume point, the cache (checked against the model before any
weights load), the model, optimizer and state, the data, then the loop, and the summary.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from shards import CorruptSample, DamagedCache
from shards.options import DTYPES
from train import checkpoint, controlnet, distributed, host_memory, trackers
from train.cache import check_cache, check_cache_files, check_same_caches, check_same_encoders, open_generation, saved_generations
from train.config import TrainConfig
from train.data import BatchStream, CacheSamples, Epoch, TrainingSamples, check_masks, check_references, has_references
from train.dryrun import check_host_memory, dry_run, startup_plan
from train.evaluate import build_evaluator, eval_due, evaluate
from train.families import get_family, get_preset
from train.families.base import ModelPreset
from train.metrics import Metrics, progress_line, write_memory_report
from train.model import build_ema, build_model, build_optimizer, build_run_objective, build_schedule, null_caption, train_guidance
from train.order import BatchPlan
from train.plan import format_plan
from train.prefetch import Prefetcher, StepAhead
from train.state import TrainState, own_run
from train.step import Diverged, TrainStep
from train.streams import is_eval_source
from train.validate import Validator, add_prompts_command


def train(cfg: TrainConfig) -> dict:
    t_start = time.perf_counter()
    rank, world, _, device = distributed.setup()
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, until the run ends however it ends
            return _train(cfg, rank, world, device, t_start, held)
    finally:
        distributed.teardown()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device, t_start: float, held: contextlib.ExitStack) -> dict:
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)  # one voice for all ranks
    parallel = parallelism(cfg, world, device)
    preset = get_preset(cfg.model, cfg.expert)  # a two-expert model's: the trained expert's weights
    trackers.require(cfg.report_to)  # a tracker asked for but not installed stops the run before any weights load
    if preset.objective != "flow" and cfg.weighting_scheme != "logit_normal":
        raise ValueError(f"--weighting-scheme {cfg.weighting_scheme} sets flow matching timesteps; {cfg.model} trains with DDPM")
    cfg.run.mkdir(parents=True, exist_ok=True)

    resume_from = checkpoint.resolve_resume(cfg.run, cfg.resume)
    saved = checkpoint.load_state(resume_from) if resume_from else {}
    if done := finished(cfg, resume_from, saved, t_start, say):  # nothing to do writes nothing, not even the name of the run directory's owner
        return done
    lock = own_run(cfg.run, is_main)  # one process owns the run directory (under torchrun: rank 0 for all)
    if lock is not None:
        held.callback(lock.release)
    resume_from = checkpoint.resolve_resume(cfg.run, cfg.resume)  # again as its owner: another run may have saved since
    saved = checkpoint.load_state(resume_from) if resume_from else {}
    if done := finished(cfg, resume_from, saved, t_start, say):
        return done

    # 1. the cache must fit the model, checked before any weights load. With several caches, the first is the run's
    # cache for everything but the data (validation prompts, the plan).
    epochs = Epochs(cfg, preset, rank, world)
    group = epochs.open_all(saved_generations(saved, len(cfg.cache)))
    cache = group[0]
    config = preset.transformer_config()
    for c in group:
        check_cache(preset, c, config)
        if cfg.controlnet:  # a family with a ControlNet, a cache with control latents
            controlnet.check_cache(preset, c.spec, c.location)
        if cfg.masked_loss:  # a cache with loss masks
            check_masks(c)
        check_references(c, preset)  # an edit model's cache has reference images, another model's none
    check_same_encoders(group)
    check_class_sources(cfg, group)
    epochs.check_samples(group)  # before the plan, which reads a batch of the largest bucket
    for c in group:  # every listed shard exists with its size; the empty caption and validation prompts are sound
        check_cache_files(c, is_main, ("prompts",))
    objective = build_run_objective(cfg, preset, config)
    validator = build_validator(cfg, cache, preset, objective, device, say)  # missing prompts stop the run here
    if validator is not None:
        check_cache_files(cache, is_main, ("decoder",))  # the VAE decoder's weights the cache stores, before they load
    cfg.train_guidance = train_guidance(cfg, preset, saved)  # recorded as the value this run trains with
    run_config = {k: [str(c) for c in v] if k == "cache" else str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    if saved:
        for change in checkpoint.check_resumable(resume_from, saved, run_config, world, parallel,
                                                 [c.manifest.fingerprint_sha256 for c in group]):
            say(f"applied on resume: {change} from step {saved['step']}")
        check_same_caches(resume_from, saved, group)  # the data cursor continues over the samples it counted

    # the memory plan (rank 0's; every rank's for a dry run), made before any weights load: a run whose host memory
    # per node is over --host-memory stops here, on every rank, with what to change
    if cfg.dry_run:  # from here on the process's memory is its tensors' (what the plan counts and the dry run measures);
        # not in a run: on a CPU it makes every large allocation a fresh mapping (a tiny model's step 2.3x slower)
        host_memory.return_freed_memory()
    planned = startup_plan(cfg, cache, device, world, parallel, objective) if is_main or cfg.dry_run else None
    check_host_memory(planned)

    # 2. the transformer and only it, then what trains it; resumed from the checkpoint when there is one
    model = build_model(cfg, preset, parallel, world, device, resume_from=resume_from, state=saved, say=say, latent=cache.spec.latent)
    # validation samples with the training weights themselves: the ControlNet unwrapped, no copy of either model
    controlled = (controlnet.controlled_forward(model.module, model.controlnet, preset.family, scale=cfg.controlnet_conditioning_scale,
                                                latent=cache.spec.latent) if model.controlnet is not None else None)
    optimizer = build_optimizer(cfg, model.params, device)
    scheduler = build_schedule(cfg, optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    ema = build_ema(cfg, model.params, device)
    state = TrainState(cfg, model, optimizer, scheduler, scaler, ema, family=preset.family, parallel=parallel, rank=rank, world=world)
    progress = state.restore(resume_from, saved, say) if resume_from else state.fresh()
    step = TrainStep(cfg, model, objective, optimizer, scheduler, scaler, ema, parallel=parallel, rank=rank, world=world,
                     device=device)

    # 3. data (`Epochs`)
    first = epochs.epoch_of(progress.epoch, group, progress.cursor)
    dataset = first.samples
    say(f"{first.plan.batches_per_epoch()} batches of {cfg.batch_size} x {world} rank(s) per epoch")
    draws = first.plan.draws_by_source()
    for k, c in enumerate(group):
        say(f"cache {c.location}: {len(c)} samples")
        for bucket, stats in c.manifest.buckets().items():
            say(f"  {bucket.name:>10}: {stats.samples} samples")
        if set(draws) != {""}:
            label = f"{first.plan.labels[k]}/" if first.plan.labels else ""
            for name, totals in c.manifest.datasets().items():
                weight = first.plan.classes.get(label + name)
                role = "" if weight is None else (f", class (is_reg): loss weight "
                                                  f"{weight if cfg.prior_loss_weight is None else cfg.prior_loss_weight:g}, "
                                                  f"target {'the base model' if cfg.preservation == 'output' else 'its data'}")
                drawn = ("held out (eval = true)" if is_eval_source(c.manifest.extra.get("sources", {}).get(name, {}))
                         else f"{draws.get(label + name, 0)} drawn per epoch")
                say(f"  source {name or '(unnamed)'}: {totals['samples']} samples, {drawn}{role}")
    if by_resolution := first.plan.draws_by_resolution():
        say("resolutions: " + ", ".join(f"{r}: {n} drawn per epoch" for r, n in by_resolution.items()))
    if cfg.train_guidance is not None:
        say(f"guidance embedding at {cfg.train_guidance:g} in training (the unguided target), validation at {cfg.guidance_scale:g}")
    evaluator = build_evaluator(cfg, group, objective, rank, world, device)
    if evaluator is not None:
        say(evaluator.describe())
    if is_main or cfg.dry_run:
        if model.controlnet is not None and model.controlnet.config.num_layers != planned.get("controlnet_layers"):
            # a pretrained or resumed ControlNet has its own depth: planned again, from the same baseline
            planned = startup_plan(cfg, cache, device, world, parallel, objective, model.controlnet.config.num_layers,
                                   baseline=planned["host"]["baseline"])
        say(format_plan(planned))
        if "preservation_forward" in planned and first.plan.classes:  # its time over an epoch: the class batches' share
            plan_ = first.plan
            share = sum(n for b, n in enumerate(plan_.counts) if plan_.source_name(b) in plan_.classes) / plan_.batches_per_epoch()
            added = planned["preservation_forward"]["added_compute"]
            say(f"output preservation: class batches are {share:.0%} of an epoch's, each {added:.0%} more compute: about "
                f"{share * added:+.0%} for the epoch")
    if cfg.dry_run:
        return dry_run(cfg, cache, dataset, step, validator, preset, planned, device, say)

    # 4. the loop
    # trackers open before the signal handlers are swapped: one that fails to start leaves them as they were
    metrics = Metrics(cfg.run, progress.step, progress.smoothed, is_main=is_main, device=device, precision=cfg.precision,
                      drawn=progress.drawn, report_to=cfg.report_to, project=cfg.tracker_project,
                      run_name=cfg.tracker_run_name, run_config=run_config, classes=bool(first.plan.classes))
    stop = {"signal": None, "memory": False}
    handlers = {s: signal.signal(s, lambda signum, frame: stop.update(signal=signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    # `kill -USR1 PID` writes RUN/memory.txt at the next step
    handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.update(memory=True))
    held.callback(restore_handlers, handlers)  # also when the run stops with an error
    validated_at = None
    damaged: list[DamagedCache] = []
    # a bar for a person at a terminal; a plain line every --log-every steps for a log file or a pipe
    plain = not (cfg.progress and sys.stdout.isatty())
    bar = tqdm(total=cfg.steps, initial=progress.step, unit="step", disable=plain or not is_main, dynamic_ncols=True)
    if plain:
        say(f"training to step {cfg.steps} from step {progress.step}; a line every {cfg.log_every} steps", flush=True)
    caches = {progress.epoch: group}  # the generations each epoch in flight reads
    stream = BatchStream(first, workers=cfg.workers, prefetch=cfg.prefetch, readahead=cfg.readahead, pin=device.type == "cuda")
    ahead = StepAhead(stream, cfg.grad_accum)  # each step's batches taken (in host memory) before the step before it ends
    prefetch = Prefetcher(ahead, device)
    try:
        while epochs.due(stream, cfg.grad_accum + 1):
            epochs.hand_over(stream, caches)
        # The first step's batches, agreed on by every rank before any collective; every later step's ride the step
        # before's one read of the device (`TrainStep.report`): no rank waits for the device between micro-batches.
        if distributed.any_across(ahead.take_step(), device):
            damaged.append(damage(ahead))
        for batch in [] if damaged else prefetch:
            if step.micro == 0:  # a step begins, at the same batch on every rank: the next epochs are handed over in time
                while epochs.due(stream, cfg.grad_accum + 1):  # the batches taken before the next step begins, at most
                    epochs.hand_over(stream, caches)
            if batch["epoch"] != progress.epoch:  # the epoch before is done
                caches.pop(progress.epoch, None)
                group = caches[batch["epoch"]]
            progress.epoch, progress.cursor = batch["epoch"], batch["cursor"]
            if not step.accumulate(batch, progress.step):
                continue
            # the next step's batches are taken now: whether one is damaged, and whether a signal came, are agreed by every
            # rank in the update's one read (a signal after it is seen at the next step)
            step.report(stop=stop["signal"] is not None, damaged=progress.step + 1 < cfg.steps and ahead.take_step())
            try:
                done = step.update(progress.step)
            except Diverged as e:  # the weights are left as they were; the checkpoints before stay the resume point
                raise Diverged(f"{e} {resume_hint(cfg)}") from None
            if done.stop and world > 1:
                stop["signal"] = stop["signal"] or signal.SIGTERM  # a signal to any rank stops all at this step
            stopping = done.stop if world > 1 else stop["signal"] is not None  # in several processes: as all agreed
            if done.damaged:  # a batch of the next step is damaged on some rank: all stop after this one
                damaged.append(damage(ahead))
            if done.skipped:  # non-finite: skipped on every rank
                if stopping or damaged:
                    break
                continue
            for micro in done.micros:
                metrics.add(micro.loss, micro.per_sample, micro.t, micro.samples * world, micro.source, micro.class_loss)
            progress.step += 1
            bar.update(1)
            held = None  # the held-out loss, logged with this step
            if evaluator is not None and eval_due(progress.step, cfg.eval_every, cfg.steps):
                held = evaluate(evaluator, model, cfg, preset, controlled)
                metrics.exclude(held["eval_s"])
            if progress.step % cfg.log_every == 0 or progress.step == cfg.steps or held:
                record = metrics.log(progress.step, float(scheduler.get_last_lr()[0]), done.grad_norm,
                                     prefetch.wait_s + ahead.wait_s, held)
                if validator is not None:
                    metrics.report_grids(validator.finished())
                bar.set_postfix(loss=f"{record['loss']:.4f}", smooth=f"{record['smoothed_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                sps=f"{record['samples_per_s']:.1f}", wait=f"{record['data_wait']:.0%}")
                if plain:
                    say(progress_line(record, cfg.steps, metrics.step_s), flush=True)
            if stop["memory"]:
                stop["memory"] = False
                write_memory_report(cfg.run / ("memory.txt" if world == 1 else f"memory-rank{rank}.txt"), device, progress.step)
            if validator is not None and cfg.validate_every and progress.step % cfg.validate_every == 0:
                validate(validator, state, progress.step, metrics, controlled)
                validated_at = progress.step
            if cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0:
                save(state, progress, metrics, group, run_config, device)
            if progress.step >= cfg.steps or stopping or damaged:
                break
    finally:
        stream.close()
    bar.close()
    if damaged:  # checkpoint at the last whole step, then stop: resuming redoes the step whose batch was damaged
        progress.cursor -= step.rewind()
        save(state, progress, metrics, group, run_config, device)  # every rank stopped at the same batch
        metrics.close(plot=False)
        if validator is not None:
            validator.close()
        restore_handlers(handlers)
        kept = checkpoint.complete_checkpoints(cfg.run)
        resumes = f"; {kept[-1]} resumes the run" if kept else ""
        kind = CorruptSample if isinstance(damaged[0], CorruptSample) else DamagedCache
        raise kind(f"{damaged[0]} Training stopped at step {progress.step}{resumes} once it is repaired.")
    save(state, progress, metrics, group, run_config, device)
    if validator is not None:
        if stop["signal"] is None and validated_at != progress.step:
            validate(validator, state, progress.step, metrics, controlled)
        metrics.report_grids(validator.finished(wait=True))
    metrics.close()
    restore_handlers(handlers)  # a signal during the last checkpoint or validation was only recorded
    summary = {"step": progress.step, "epoch": progress.epoch, "elapsed_s": time.perf_counter() - t_start, "grids": metrics.grids,
               "last_loss": metrics.last_loss, "checkpoint": str(checkpoint.complete_checkpoints(cfg.run)[-1]),
               "signal": stop["signal"]}
    if stop["signal"] is not None:  # not finished: `python -m train` exits 128 + the signal's number
        say(f"stopped by {signal.Signals(stop['signal']).name} at step {progress.step} of {cfg.steps}, checkpoint "
            f"{summary['checkpoint']}; resume with the same command")
        return summary
    say(f"run {cfg.run}: step {progress.step}, checkpoint {summary['checkpoint']}, metrics {cfg.run / 'metrics.jsonl'}, "
        f"loss curve {cfg.run / 'loss.png'}")
    return summary


def check_class_sources(cfg: TrainConfig, group: list) -> None:
    """--prior-loss-weight and --preservation output act on class batches: refuse them for caches without a class
    source, which would train as if they were not given."""
    if cfg.prior_loss_weight is None and cfg.preservation == "prior":
        return
    if any(record.get("is_reg") for c in group for record in c.manifest.extra.get("sources", {}).values()):
        return
    given = "--preservation output" if cfg.preservation == "output" else f"--prior-loss-weight {cfg.prior_loss_weight:g}"
    raise ValueError(f"{given} acts on the batches of class sources, and {', '.join(str(c.location) for c in group)} holds "
                     f"none: mark the class images' source is_reg = true in the dataset file (and run stage one on it "
                     f"again: only the record changes), or leave {given.split()[0]} out")


def finished(cfg: TrainConfig, resume_from: Path | None, saved: dict, t_start: float, say) -> dict | None:
    """The summary of a run its newest checkpoint already finished (nothing to do), or None."""
    if not saved or saved["step"] < cfg.steps or cfg.dry_run:
        return None
    say(f"{cfg.run} already finished: {resume_from.name} is at step {saved['step']} of --steps {cfg.steps}. Nothing to do; "
        f"pass a larger --steps to train further.")
    return {"step": saved["step"], "epoch": saved["epoch"], "elapsed_s": time.perf_counter() - t_start, "grids": [],
            "last_loss": None, "checkpoint": str(resume_from), "finished": True}


@dataclass
class Epochs:
    """The run's epochs: one bucket per batch, the same number of batches on every rank. An epoch reads the cache
    generation it started with; samples committed or removed meanwhile count from the next epoch on."""

    cfg: TrainConfig
    preset: ModelPreset
    rank: int
    world: int
    sizes: dict[int, int | None] = field(default_factory=dict)  # batches of each epoch made (None: it failed to open)

    def open_all(self, generations: list[int | None]) -> list:
        """The run's caches at `generations` (None: the newest). Every rank reads the generation rank 0 opened (or the
        one the checkpoint's epoch was reading), registered for `shards gc` at once."""
        cfg = self.cfg
        return [open_generation(c, cfg.run, self.rank == 0, g, local_cache=cfg.local_cache, local_cache_gb=cfg.local_cache_gb)
                for c, g in zip(cfg.cache, generations)]

    def check_samples(self, cs: list) -> None:
        """Refuse caches that hold no sample at all, naming them and the command that fills them."""
        if not sum(len(c) for c in cs):
            where = ", ".join(f"{c.location} (generation {c.generation})" for c in cs)
            raise ValueError(f"{where} holds no samples: nothing to train on. Encode a dataset into it with python -m "
                             f"precompute DATA --model {self.cfg.model} --cache {cs[0].location}, or point --cache at a "
                             f"cache that holds one")

    def epoch_of(self, number: int, cs: list, start: int = 0) -> Epoch:
        cfg, world = self.cfg, self.world
        plan = BatchPlan.of(cs, cfg.batch_size, seed=cfg.seed, rank=self.rank, world_size=world, remainder=cfg.remainder,
                            shuffle_shards=cfg.shuffle_shards, weights=cfg.cache_weight or None, eval_fraction=cfg.eval_fraction,
                            resolution_weights=cfg.resolution_weights())
        if not plan.batches_per_epoch():
            where = ", ".join(f"{c.location} (generation {c.generation})" for c in cs)
            self.check_samples(cs)
            if not plan.streams:
                raise ValueError(f"every sample of {where} is held out (sources marked eval = true in the dataset file, "
                                 f"--eval-fraction {cfg.eval_fraction:g}): nothing to train on. Add a source to train on, "
                                 f"or hold out less")
            raise ValueError(f"{where} holds no full batch of {cfg.batch_size} x {world} sample(s) in any bucket with "
                             f"--remainder {cfg.remainder}; use a smaller --batch-size"
                             + (" or --remainder repeat" if cfg.remainder != "repeat" else ""))
        self.sizes[number] = plan.batches_per_epoch()
        parts, offset = [], 0
        family = get_family(self.preset.family)
        # a family's conditioning fields (an image-to-video model's first frame) and an edit cache's references in the
        # compute dtype
        for c in cs:
            parts.append(TrainingSamples(c, cfg.seed, cfg.caption_dropout, null_caption(cfg, self.preset),
                                         check_digests=cfg.check_digests, offset=offset, control=cfg.controlnet,
                                         masked=cfg.masked_loss, conditioning=family.conditioning_fields(c.spec),
                                         conditioning_dtype=DTYPES[cfg.precision], max_references=self.preset.references))
            offset += len(c)
        return Epoch(number, plan, parts[0] if len(parts) == 1 else CacheSamples(parts), start)

    def due(self, stream: BatchStream, ahead: int) -> bool:
        """Whether the next epoch must be handed over now: from the stream's position, the epochs handed over hold no
        more batches than `ahead` (what the loop takes before it asks again) plus the stream's own lead (its builders
        run ahead). Asked where every rank has taken the same batches: handing over is collective."""
        last = max(self.sizes)
        if self.sizes[last] is None:  # an epoch that could not be opened: its error stops the run where it begins
            return False
        epoch, cursor = stream.position
        return sum(n for e, n in self.sizes.items() if e >= epoch) - cursor <= ahead + stream.lead

    def hand_over(self, stream: BatchStream, caches: dict[int, list]) -> None:
        """Open the next epoch's generation (the same on every rank) before this epoch's last batches are taken;
        `caches`: the generations each epoch in flight reads."""
        number = max(self.sizes) + 1
        try:
            nxt = self.open_all([None] * len(self.cfg.cache))
            for c in nxt:
                check_cache_files(c, self.rank == 0, ("prompts",))
        except DamagedCache as e:  # every rank checks the same generation: all stop where the epoch begins
            self.sizes[number] = None
            stream.add_epoch(Epoch(number, None, None, error=e))
            return
        caches[number] = nxt
        stream.add_epoch(self.epoch_of(number, nxt))


def validate(validator: Validator, state: TrainState, step: int, metrics: Metrics, controlled) -> None:
    """Queue a validation grid of `step`; its time is left out of the throughput."""
    t0 = time.perf_counter()
    model = state.model
    validator.run(model.module, step, DTYPES[state.cfg.precision], state.ema, model.params, submit=state.rank == 0,
                  controlnet=model.controlnet, forward=controlled)
    metrics.report_grids(validator.finished())
    metrics.exclude(time.perf_counter() - t0)


def save(state: TrainState, progress, metrics: Metrics, group: list, run_config: dict, device: torch.device) -> None:
    """Checkpoint `progress` (`group`: the caches the current epoch reads), never of non-finite weights."""
    cfg = state.cfg
    if not finite_weights(state.model.params, device):  # a checkpoint of non-finite weights resumes nothing
        raise Diverged(f"the weights became non-finite by step {progress.step}; no checkpoint was written. "
                       f"{resume_hint(cfg)} To try: a lower --lr (this run: {cfg.lr:g}), a smaller --grad-clip "
                       f"(this run: {cfg.grad_clip:g}), --precision bf16 or fp32 (this run: {cfg.precision}).")
    progress.smoothed, progress.drawn = metrics.smoothed, dict(metrics.drawn)
    state.save(progress, group, run_config)


def damage(ahead: StepAhead) -> DamagedCache:
    """The error a rank stops with when a batch of the next step is damaged: its own (naming the file and its repair), or
    the other rank's."""
    if isinstance(ahead.failed, DamagedCache):
        return ahead.failed
    return DamagedCache("another rank read a damaged sample (its error names the shard).")


def finite_weights(params, device: torch.device) -> bool:
    """Whether every trained parameter is finite, on every rank (one read of the device)."""
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP rank checks its shard
        bad |= ~torch.isfinite(local.detach()).all().to(device)
    return not distributed.any_across(bad, device)


def resume_hint(cfg: TrainConfig) -> str:
    """Where a stopped run can continue from."""
    kept = checkpoint.complete_checkpoints(cfg.run)
    return (f"The newest checkpoint, {kept[-1]}, resumes it (with the same command and the changed options)." if kept
            else "No checkpoint was written yet: start again with changed options.")


def restore_handlers(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def parallelism(cfg: TrainConfig, world: int, device: torch.device) -> str:
    """none (one process), ddp or fsdp; refuses combinations that cannot work, saying what would (those that need no
    knowledge of the processes, e.g. fsdp with LoRA, were refused with the options: `ParallelOptions.check`)."""
    parallel = "none" if world == 1 else ("ddp" if cfg.parallel == "auto" else cfg.parallel)
    if cfg.parallel == "fsdp" and world == 1:
        raise ValueError("--parallel fsdp shards over processes: launch with torchrun (make train NPROC=2 ...)")
    if parallel == "fsdp" and cfg.precision == "fp16":
        raise ValueError("--parallel fsdp trains in bf16 or fp32 (fp16 would need a sharded loss scaler); use --precision bf16")
    if cfg.fsdp_cpu_offload and (parallel != "fsdp" or device.type != "cuda"):
        raise ValueError("--fsdp-cpu-offload moves FSDP's shards between GPU and CPU memory: it needs --parallel fsdp on CUDA")
    if parallel == "fsdp" and cfg.ema_decay > 0 and cfg.ema_device == "cpu":
        raise ValueError("under FSDP the EMA is sharded like the weights; use --fsdp-cpu-offload instead of --ema-device cpu")
    return parallel


def build_validator(cfg: TrainConfig, cache, preset, objective, device: torch.device, say) -> Validator | None:
    """The run's validation sampler, or None (--no-validate, or no prompts cached)."""
    if not cfg.validate:
        return None
    # a ControlNet run and an edit run validate on cached dataset items (their control images, their references)
    on_items = cfg.controlnet or has_references(cache)
    if on_items and not cfg.validation_items and (cfg.controlnet or preset.requires_references):
        say("no validation grids: --validation-items 0")
        return None
    validator = Validator(cache, preset, objective, prompts=cfg.validation_prompt, buckets=cfg.validation_bucket,
                          steps=cfg.validation_steps, guidance=cfg.guidance_scale, seed=cfg.validation_seed,
                          decode_device="cpu" if cfg.decode_device == "cpu" else str(device), out=cfg.run, model_name=cfg.model,
                          items=cfg.validation_items if on_items else 0, frames=cfg.validation_frames,
                          guidance_2=cfg.guidance_scale_2)
    if validator:
        return validator
    say(f"no validation prompts cached in {cache.location} (add some with {add_prompts_command(cache, [])}); not validating")
    validator.close()
    return None
