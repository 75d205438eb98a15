"""Host memory (the machine's RAM) of a training run: what each part of the trainer holds in its process's memory,
per rank and per node, planned before anything is allocated; the limit it is checked against; and the process's own
memory as Linux reports it (/proc), which the plan starts from and a dry run measures.

What counts is anonymous memory (the process's own pages: copies, conversions, pinned buffers), which the kernel cannot
drop under pressure. A safetensors file that is memory-mapped and used as it is stays page cache: it is shown, shared
by every rank of a node, and not counted. Pinned (page-locked) CPU memory is counted at what PyTorch's caching host
allocator takes: each allocation rounded up to a power of two, except the swapped blocks' weights, which
`train.swap.exact_pinned_sizes` pins at their size.

The parts, and where in a run they are alive (the peak of a rank is its baseline plus the largest phase):
  loading weights   the transformer built in CPU memory before it moves to the device: a dtype conversion, a
                    quantized base, fresh weights (built in fp32) or, on a CPU run, the weights' own copy; the
                    trained adapters or ControlNet (fp32).
  training          block swap's pinned weights, the EMA kept in CPU memory (and its pinned staging copy of the
                    weights), FSDP's CPU offload (each rank's shard of the weights, gradients and optimizer states):
                    these three from loading to the end, in every later phase; the data loader's batches (queued, being
                    built, in use) and its read-ahead buffer; on a CPU run also everything the plan counts as device
                    memory (weights, gradients, optimizer states, activations).
  resuming          a checkpoint's optimizer states (and EMA), loaded to CPU memory before they move to the device.
  saving            a checkpoint's weights, copied to CPU memory whole per file before safetensors writes them.
The product has no optimizer-state offload apart from FSDP's CPU offload (which moves the states with the shards).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
# diffusers' save_pretrained splits a transformer into files of at most this many bytes (its max_shard_size "10GB")
SAVE_SHARD_BYTES = 10 * 10**9
READ_AHEAD_BUFFER = 8 << 20  # `train.data.BatchStream._read_ahead`'s buffer
LASTING = ("pinned swap blocks", "EMA in CPU memory", "FSDP CPU offload")  # alive from loading to the end
LOADER = ("data loader batches", "read-ahead buffer")
PHASES = ("loading weights", "resuming", "training", "saving")

# --- the process, as Linux reports it ---

def _proc_fields(path: str) -> dict[str, int]:
    """Fields of /proc/meminfo or /proc/self/status that are sizes, in bytes."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[name] = int(parts[0]) * 1024
    except OSError:  # not Linux
        pass
    return out


def machine_memory() -> int | None:
    """This machine's physical memory (MemTotal), or None where /proc/meminfo is not there."""
    return _proc_fields("/proc/meminfo").get("MemTotal")


def available_memory() -> int | None:
    """Memory the kernel could give new allocations now without swapping (MemAvailable)."""
    return _proc_fields("/proc/meminfo").get("MemAvailable")


def process_memory() -> int:
    """This process's resident memory now (VmRSS: its own pages and the file pages it maps)."""
    return _proc_fields("/proc/self/status").get("VmRSS", 0)


def peak_memory() -> int:
    """This process's peak resident memory since it started (VmHWM)."""
    return _proc_fields("/proc/self/status").get("VmHWM", 0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024  # its default


def return_freed_memory() -> bool:
    """Make glibc's malloc give a freed tensor's memory back to the system at once, as it does before the first large
    free: it serves allocations of 128 KiB and more with their own mappings, but by default raises that threshold to
    the size of each large block freed (up to 32 MiB), after which a training step's tensors come from its heap, which
    keeps their pages when they are freed: on a CPU run, about 40 % of a step's activations more than its tensors from
    the second step on (a dry run of an 18.6 M-parameter tiny preset). Fixing the threshold at its default keeps the process's
    memory its tensors' (what the plan counts). The trainer does it for a dry run (the measurement) only: every large
    allocation then maps fresh pages, which made a tiny model's CPU step 2.3x slower (the demo: 54 against 121 samples/s,
    most of it in the kernel). Returns whether it applied (glibc only)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def parse_size(text: str, flag: str = "--host-memory") -> int:
    """Bytes of '64GB', '64GiB', '64G' or '64' (GB counted as GiB, as RAM is sold; M and T likewise)."""
    t = str(text).strip().lower().removesuffix("b").removesuffix("i")
    units = {"m": 2**20, "g": 2**30, "t": 2**40}
    try:
        size = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t) * GiB
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give the memory as a size, e.g. 64GB, 512GiB or 128") from None
    if not 0 < size < 2**60:  # also NaN
        raise ValueError(f"{flag} {text!r}: give a size above 0, e.g. 64GB")
    return int(size)


def host_limit(text: str | None) -> tuple[int, str]:
    """(bytes, where from) of --host-memory: the value given, else this machine's MemTotal."""
    if text is not None:
        return parse_size(text), "--host-memory"
    total = machine_memory()
    if total is None:
        raise ValueError("this system has no /proc/meminfo to read its memory from: give --host-memory (e.g. 64GB)")
    return total, "this machine's MemTotal"


def pinned(nbytes: int) -> int:
    """What PyTorch's caching host allocator takes for a pinned allocation of `nbytes`: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


# --- the plan ---

@dataclass
class Part:
    """One part of a rank's host memory: its bytes, the phase it is alive in, and what makes it smaller."""

    name: str
    bytes: float
    phase: str  # "loading weights", "resuming", "training" or "saving"
    remedy: str
    detail: str = ""


@dataclass
class HostModel:
    """What the host plan needs to know of the model and the run (bytes per rank unless said).

    `weights`: the transformer's and trained modules' bytes in CPU memory once loaded (quantized layers at their
    kind's size); `mapped`: a released file's bytes used as they are (page cache); `trainable_sizes`: element counts of
    the trained parameters (their pinned EMA copies are rounded one by one); `swapped`: block swap's host bytes;
    `shard`: FSDP's shards (1 otherwise); `optimizer_states`, `gradients`: bytes per rank as the device plan counts
    them; `saved`: the bytes a checkpoint serialises from the device (0 for FSDP, which writes tensor by tensor)."""

    weights: float
    mapped: float
    trainable_sizes: list[int]
    swapped: float
    shard: int
    optimizer_states: float
    gradients: float
    saved: float
    weights_how: str


def loaded_weights(pc, preset, file_params: int, base: float, adapters: float, buffers: float) -> tuple[float, float, str]:
    """(anonymous bytes, mapped bytes, how) of the transformer in CPU memory once loaded, before it is placed.

    `file_params`: the transformer's parameters as its file holds them; `base`: their bytes as the run keeps them
    (quantized layers at their kind's size); `adapters`: the trained modules built beside it (LoRA, a ControlNet).
    Fresh weights are built in fp32 and converted parameter by parameter; released ones are safetensors files in the
    dtype their headers give (`file_dtype`; files not on this machine: the preset's `released_dtype`; unknown: taken
    as a conversion), memory-mapped by diffusers: used as they are when --weights-dtype is that dtype on an
    accelerator (page cache; a CPU run copies them into memory of its own, `train.model.own_memory`), else converted
    into new memory; a quantized base is new memory at its quantized size."""
    from shards.options import DTYPE_BYTES

    fresh = getattr(pc, "from_scratch", False) or (preset.repo is None and not getattr(pc, "pretrained", None))
    quantized = pc.base_quant != "none"
    if fresh:  # a quantized fresh base is saved and loaded back (`train.quant.quantize_fresh`): fp32 twice
        fp32 = 4 * file_params * (2 if quantized else 1)
        return max(fp32, base) + adapters + buffers, 0.0, "fresh weights, built in fp32"
    found = file_dtype(getattr(pc, "pretrained", None) or preset.repo, preset.subfolder, getattr(pc, "revision", None)
                       or preset.revision)
    dtype = found or preset.released_dtype
    seen = "" if found else " (the preset's released dtype: its files are not on this machine)"
    mapped = file_params * DTYPE_BYTES.get(dtype or "", 4)
    if quantized:
        return base + adapters + buffers, mapped, f"{pc.base_quant} base quantized as it loads"
    if dtype == pc.weights_dtype:
        if pc.device != "cpu":
            return adapters, mapped, f"mapped from the {dtype} file{seen}, used as it is"
        return base + adapters + buffers, mapped, f"copied from the mapped {dtype} file{seen} into the CPU run's own memory"
    return base + adapters + buffers, mapped, f"converted from the {dtype or 'released'} file{seen} to {pc.weights_dtype}"


SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def file_dtype(source: str | None, subfolder: str, revision: str | None) -> str | None:
    """The dtype most of a transformer's safetensors bytes are stored in, read from the files' headers where they are on
    this machine (a directory, or the Hugging Face cache: nothing is downloaded); None when they are not."""
    import json
    from pathlib import Path

    if not source:
        return None
    folder = Path(source).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, revision=revision, allow_patterns=[f"{subfolder}/*"],
                                            local_files_only=True))
        except Exception:  # noqa: BLE001 (not in the cache, or not a Hub id: the preset's dtype is taken)
            return None
    files = sorted((folder / subfolder).glob("*.safetensors")) or sorted(folder.glob("*.safetensors"))
    by_dtype: dict[str, int] = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            return None
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + end - start
    if not by_dtype:
        return None
    return SAFETENSORS_DTYPES.get(max(by_dtype, key=by_dtype.get), "fp32")


def batch_sizes(batch: dict) -> list[int]:
    """Bytes of each tensor of a collated batch (an edit batch's references included)."""
    from train.data import batch_tensors

    return [t.numel() * t.element_size() for t in batch_tensors(batch)]


def loader_parts(sizes: list[int], workers: int, prefetch: int, readahead: int, pin: bool) -> list[Part]:
    """The data loader's batches alive at once (`train.data.BatchStream`, `train.prefetch.Prefetcher`): the queued
    ones (`prefetch` shared out over the `workers` queues), two per worker building one (its samples and the collated
    or pinned copy), the one the step uses and, on CUDA, the one on its way to the device; pinned on CUDA (each tensor
    at its power of two). With 0 workers the training thread builds each batch when it is due. `sizes`: one batch's
    tensors' bytes."""
    plain = sum(sizes)
    pinned_batch = sum(pinned(s) for s in sizes) if pin else plain
    queued = workers * -(-prefetch // workers) if workers else 0
    building = 2 * max(workers, 1)
    held = 1 + (1 if pin else 0)
    # a building worker holds the samples (plain) and the collated batch (plain, then pinned)
    total = queued * pinned_batch + max(workers, 1) * (plain + pinned_batch) + held * pinned_batch
    words = (f"{queued} queued, {building} being built by {max(workers, 1)} worker(s), {held} in use; "
             f"{plain / 2**20:.1f} MiB a batch" + (f", {pinned_batch / 2**20:.1f} MiB pinned" if pin else ""))
    parts = [Part("data loader batches", total, "training", "fewer --workers or --prefetch, or a smaller --batch-size",
                  words)]
    if workers and readahead:
        parts.append(Part("read-ahead buffer", READ_AHEAD_BUFFER, "training", "--readahead 0"))
    return parts


def host_plan(pc, model: HostModel, loader: list[Part], device_peak: float, device_static: float, baseline: int,
              ranks_per_node: int, limit: int, limit_from: str) -> dict:
    """The host memory of one rank, by part and phase, its peak, a node's, and the verdict against `limit`.

    `device_peak`, `device_static`: the device plan's peak and what it holds besides the step's activations and
    gradients; on a CPU run they are host memory too. `baseline`: the process before any weights (measured)."""
    cpu = pc.device == "cpu"
    parts: list[Part] = []
    if cpu:
        parts.append(Part("weights while loading", model.weights, "loading weights",
                          "--weights-dtype bf16 or a quantized base (--base-quant)", model.weights_how))
        parts.append(Part("device tensors (CPU run)", device_static, "training",
                          "a smaller model, --weights-dtype bf16 or LoRA (--lora-rank)",
                          "weights, optimizer states, EMA: the device plan's, in host memory"))
        parts.append(Part("step's tensors (CPU run)", device_peak - device_static, "training",
                          "a smaller --batch-size or --grad-checkpointing all",
                          "the larger of activations and gradients, as the device plan's peak"))
    else:
        parts.append(Part("weights while loading", model.weights, "loading weights",
                          "--weights-dtype in the released file's dtype (bf16: used from the mapped file, not converted), "
                          "a quantized base (--base-quant), or fewer ranks per node", model.weights_how))
        if model.swapped:
            parts.append(Part("pinned swap blocks", model.swapped, "training",
                              "fewer --blocks-to-swap, or a quantized base (--base-quant int8) to swap fewer bytes",
                              "block swap's frozen weights, page-locked, for the whole run"))
        if pc.ema_placement() == "cpu" or (pc.ema_decay > 0 and pc.fsdp_cpu_offload):
            # fp32 shadow weights, pinned one by one; with the weights on the GPU also a pinned fp32 staging copy
            shadow = (sum(pinned(4 * n // model.shard) for n in model.trainable_sizes) if not pc.fsdp_cpu_offload
                      else 4 * sum(model.trainable_sizes) / model.shard)
            staging = 0 if pc.fsdp_cpu_offload else shadow
            parts.append(Part("EMA in CPU memory", shadow + staging, "training", "--ema-device device, or no EMA (--ema-decay 0)",
                              "fp32 shadow weights" + (", pinned, and their pinned staging copy" if staging else
                                                       ", sharded beside FSDP's offloaded weights")))
            parts.append(Part("EMA state from the checkpoint", 4 * sum(model.trainable_sizes) / model.shard, "resuming",
                              "--ema-device device, or no EMA (--ema-decay 0)", "loaded to CPU memory first"))
        if pc.fsdp_cpu_offload:
            offload = sum(pinned(4 * n // model.shard) for n in model.trainable_sizes) + model.gradients + model.optimizer_states
            parts.append(Part("FSDP CPU offload", offload, "training", "more ranks to shard over, or no --fsdp-cpu-offload",
                              "this rank's shard of the weights (pinned), gradients and optimizer states"))
        else:
            parts.append(Part("optimizer states from the checkpoint", model.optimizer_states, "resuming",
                              "a lighter --optimizer (adafactor, came, adamw-8bit)", "loaded to CPU memory first"))
        if model.saved:
            parts.append(Part("checkpoint serialisation", min(model.saved, SAVE_SHARD_BYTES), "saving",
                              "LoRA (--lora-rank) saves the adapters alone",
                              "safetensors copies a file's tensors to CPU memory before writing"))
    return summarise(parts + loader, model.mapped, baseline, ranks_per_node, limit, limit_from)


def summarise(parts: list[Part], mapped: float, baseline: int, ranks_per_node: int, limit: int, limit_from: str) -> dict:
    """A rank's host memory from its parts: each phase's sum (the parts alive from loading to the end count in every
    later phase), the peak (the baseline and the largest phase), a node's, and the verdict against `limit`."""
    def alive(part: Part, phase: str) -> bool:
        return part.phase == phase or (phase in ("resuming", "saving") and part.name.startswith(LASTING))

    phases = {name: sum(p.bytes for p in parts if alive(p, name)) for name in PHASES}
    worst = max(phases, key=phases.get)
    per_rank = baseline + phases[worst]
    biggest = max((p for p in parts if alive(p, worst)), key=lambda p: p.bytes, default=None)
    return {
        "baseline": baseline,
        "parts": [dataclasses.asdict(p) for p in parts],
        "mapped": mapped,
        "phases": phases,
        "peak_phase": worst,
        "per_rank": per_rank,
        "ranks_per_node": ranks_per_node,
        "per_node": ranks_per_node * per_rank,
        "limit": limit,
        "limit_from": limit_from,
        "available": available_memory(),
        "fits": ranks_per_node * per_rank <= limit,
        "largest_part": dataclasses.asdict(biggest) if biggest else None,
    }


def with_loader(host: dict, loader: list[Part]) -> dict:
    """`host` with its data loader's parts replaced by `loader` (a dry run builds its one batch itself)."""
    kept = [Part(**p) for p in host["parts"] if p["name"] not in LOADER]
    return summarise(kept + loader, host["mapped"], host["baseline"], host["ranks_per_node"], host["limit"], host["limit_from"])


def refusal(host: dict) -> str:
    """Why a plan's host memory does not fit, its largest part and what to change."""
    big = host["largest_part"]
    node = (f" per node ({host['ranks_per_node']} ranks x {host['per_rank'] / GiB:.2f} GiB)" if host["ranks_per_node"] > 1
            else "")
    text = (f"host memory: the run needs {host['per_node'] / GiB:.2f} GiB{node} at its peak ({host['peak_phase']}), over "
            f"the {host['limit'] / GiB:.2f} GiB of {host['limit_from']}.")
    if big:
        text += (f" Its largest part is {big['name']}: {big['bytes'] / GiB:.2f} GiB per rank; to lower it: {big['remedy']}.")
    return (text + f" The process itself takes {host['baseline'] / GiB:.2f} GiB before any weights (python -m train plan "
            f"shows every part). If this machine has the memory after all, give a larger --host-memory.")


def format_host(host: dict) -> list[str]:
    """The plan's lines on host memory."""
    lines = ["  host memory (RAM) of a rank: its baseline, and each part in the phase of the run it is alive in",
             f"    {'process baseline':<36} {host['baseline'] / GiB:9.2f} GiB  measured: interpreter, torch, diffusers, the "
             f"plan's trace"]
    for part in host["parts"]:
        lines.append(f"    {part['name']:<36} {part['bytes'] / GiB:9.2f} GiB  {part['phase']}"
                     + (f": {part['detail']}" if part["detail"] else ""))
    if host["mapped"]:
        lines.append(f"    {'released file, mapped':<36} {host['mapped'] / GiB:9.2f} GiB  page cache while loading, shared by "
                     f"a node's ranks: not counted")
    phases = ", ".join(f"{name} {value / GiB:.2f}" for name, value in host["phases"].items())
    lines.append(f"    {'phases (GiB above the baseline)':<36} {phases}")
    verdict = "fits" if host["fits"] else "does NOT fit"
    node = (f" x {host['ranks_per_node']} ranks = {host['per_node'] / GiB:.2f} GiB per node" if host["ranks_per_node"] > 1
            else "")
    lines.append(f"    {'host peak':<36} {host['per_rank'] / GiB:9.2f} GiB  per rank ({host['peak_phase']}){node}; "
                 f"{verdict} in {host['limit'] / GiB:.2f} GiB ({host['limit_from']})")
    return lines
