"""Block swapping: the frozen weights of a transformer's last blocks live in (pinned) CPU memory and come to the
device one block ahead of their use, in the forward pass and again in the backward pass's recomputation.

For LoRA or ControlNet training beside a frozen transformer that does not fit the card (kohya's
`--blocks_to_swap`). Frozen weights never change, so a block leaves the device by dropping its device copy:
nothing is ever copied back. Every swapped block is recomputed in backward (non-reentrant checkpointing), so
after its forward only the module refers to its device weights, and dropping them frees the memory; autograd
keeps its own references to the copies a recomputation used until backward is done with them.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn


def tensor_bytes(t: Tensor) -> int:
    """Bytes `t` holds; a wrapper subclass (torchao's Int8Tensor) holds its inner tensors' bytes."""
    return sum(x.numel() * x.element_size() for x in inner_tensors(t))


def inner_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold `t`'s data: `t` itself, or a wrapper subclass's inner tensors."""
    if type(t) in (Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for name in names if (inner := getattr(t, name)) is not None for x in inner_tensors(inner)]


@contextlib.contextmanager
def exact_pinned_sizes() -> Iterator[None]:
    """PyTorch's pinned-memory allocator rounds each allocation up to a power of two, to reuse freed blocks: weights
    pinned once for the whole run would take ~1.5 times their size (a 36 MiB projection takes 64). Its setting
    `pinned_max_round_threshold_mb` turns that off above a size; it is set to 0 while the host copies are pinned and
    put back after (unset, its default is no threshold), so other pinned memory (batches) keeps the rounding."""
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None), getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if None in settings:  # an older torch: rounded
        yield
        return
    get, set_ = settings
    before = get()
    set_("pinned_max_round_threshold_mb:0")
    try:
        yield
    finally:
        # the getter gives back what was set, not the defaults: an unset threshold is restored as no threshold
        set_(before if "pinned_max_round_threshold_mb" in before else "pinned_max_round_threshold_mb:1073741824")


def checkpointed_forward(forward: Callable, context_fn: Callable | None = None) -> Callable:
    """`forward` recomputed in backward (non-reentrant checkpointing) when grad is enabled, run directly otherwise.
    Its keyword arguments go in as a positional dict: checkpoint finds the devices whose RNG state it saves (LoRA
    dropout must draw the same masks again) in positional tensors only, and diffusers calls blocks with keywords.
    `context_fn`: checkpoint's, two context managers entered around the forward and around the recomputation."""
    def run(args: tuple, kwargs: dict):
        return forward(*args, **kwargs)

    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return torch.utils.checkpoint.checkpoint(run, args, kwargs, use_reentrant=False, **extra)
    return wrapped


def _as_parameter(t: Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


class Transfer:
    """Copies a block's host tensors to the device: synchronously, `start` copies and `wait` hands the copies over.

    Args:
        device: where the copies go.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def start(self, tensors: list[Tensor]) -> Any:
        """Begin copying `tensors` to the device; returns a handle for `wait`."""
        return [t.to(self.device) for t in tensors]

    def wait(self, handle: Any) -> list[Tensor]:
        """The device copies, in the order `start` was given, ready for the current stream to use."""
        return handle

    def mark(self) -> Any:
        """A mark of the work queued on the device so far, for `wait_for` (synchronous copies need none)."""
        return None

    def wait_for(self, mark: Any) -> None:
        """Return once the device has done the work queued before `mark`."""


class CudaTransfer(Transfer):
    """Copies on a side CUDA stream, so a block's weights arrive while the compute stream runs the block before.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device | str):
        super().__init__(device)
        self.stream = torch.cuda.Stream(self.device)

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], torch.cuda.Event]:
        # No wait on the compute stream first: the sources (pinned host copies) are never written, and memory the
        # allocator hands this stream is only reused after the streams recorded on it are done with it.
        with torch.cuda.stream(self.stream):
            copies = [t.to(self.device, non_blocking=True) for t in tensors]
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        return copies, arrived

    def wait(self, handle: tuple[list[Tensor], torch.cuda.Event]) -> list[Tensor]:
        copies, arrived = handle
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(arrived)
        # The copies were allocated on the side stream: without this, freeing them (when the block is dropped)
        # would let the allocator reuse their memory while the compute stream still reads it.
        for copy in copies:
            for inner in inner_tensors(copy):
                inner.record_stream(compute)
        return copies

    def mark(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def wait_for(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()


class BlockSwap:
    """Keeps the frozen weights of the last `count` of `blocks` off the device between their uses.

    Each swapped block's frozen parameters (trainable ones such as LoRA adapters stay where `place` puts
    them) are replaced by host copies: pinned CPU memory for CUDA, the CPU tensors themselves otherwise.
    The block's `forward` becomes `checkpointed(swapped(forward))`: inside the checkpointed function the
    block's weights are brought to the device (the recomputation in backward brings them again) and the
    next block's transfer is started; after it, the device copies are dropped. With swapped blocks
    s_0..s_{n-1} in execution order, the forward uses s_0 first (its transfer starts in a pre-hook on
    the block before it) and keeps s_{n-1}, which backward recomputes first; backward goes from s_{n-1}
    to s_0 and keeps s_0, which the next forward needs first. The swapper holds at most two blocks' device
    copies: the one in use and the one arriving. Without grad (validation sampling) blocks run directly,
    without checkpointing, and none is kept.

    The swapped blocks are always checkpointed here: diffusers' `enable_gradient_checkpointing()` must not
    be on as well (it would checkpoint them a second time, and its recomputation would run them as a
    forward); checkpoint the other blocks per block instead. Call `place(model, device)` instead of
    `model.to(device)`, which would move the host copies to the device.

    Args:
        blocks: the transformer's blocks in execution order (`train.presets.transformer_blocks`).
        count: how many blocks to swap, the last ones: 1 to len(blocks).
        device: the device the blocks compute on.
        transfer: how weights are copied (default: a side stream on CUDA, synchronous copies otherwise).
    """

    def __init__(self, blocks: Sequence[nn.Module], count: int, device: torch.device | str, transfer: Transfer | None = None):
        blocks = list(blocks)
        if not 1 <= count <= len(blocks):
            raise ValueError(f"--blocks-to-swap {count}: this transformer has {len(blocks)} blocks; swap 1 to {len(blocks)}")
        self.device = torch.device(device)
        self.total = len(blocks)
        self.swapped = blocks[len(blocks) - count:]
        self.transfer = transfer or (CudaTransfer(self.device) if self.device.type == "cuda" else Transfer(self.device))
        self.pinned = self.device.type == "cuda"
        self._host: list[list[nn.Parameter]] = []  # per swapped block, its frozen parameters' host copies (unique)
        self._slots: list[list[tuple[nn.Module, str, int]]] = []  # per block: (module, name, index into its host copies)
        copies: dict[int, nn.Parameter] = {}  # by id of the original: a tied parameter gets one host copy
        for block in self.swapped:
            host, slots, index = [], [], {}
            for module in block.modules():
                for name, p in module._parameters.items():
                    if p is None or p.requires_grad:
                        continue
                    if id(p) not in copies:
                        copies[id(p)] = self._host_copy(p)
                    h = copies[id(p)]
                    if id(h) not in index:
                        index[id(h)] = len(host)
                        host.append(h)
                    module._parameters[name] = h
                    slots.append((module, name, index[id(h)]))
            self._host.append(host)
            self._slots.append(slots)
        self._pending: dict[int, Any] = {}  # transfers started, not yet placed
        # marks of the device's work at the start of the last two block uses: the CPU runs ahead of the GPU, and a
        # dropped block's memory is only free once the GPU is done with it, so a transfer waits for the GPU to have
        # finished the block two uses back (at most three blocks' copies on the device: finishing, in use, arriving)
        self._marks: collections.deque = collections.deque(maxlen=2)
        self._placed: set[int] = set()  # blocks whose modules hold device copies
        self._phase = "forward"
        self._forwards = [block.__dict__.get("forward") for block in self.swapped]
        for k, block in enumerate(self.swapped):
            block.forward = checkpointed_forward(self._swapped(k, block.forward), self._phases)
        first = len(blocks) - count
        self._hooks = [blocks[first - 1].register_forward_pre_hook(self._prefetch_first)] if first > 0 else []

    def _host_copy(self, p: nn.Parameter) -> nn.Parameter:
        if not self.pinned and p.device.type == "cpu":
            return p
        host = p.detach().cpu()
        if self.pinned:
            with exact_pinned_sizes():
                host = host.pin_memory()
        return nn.Parameter(host, requires_grad=False)

    def place(self, model: nn.Module, device: torch.device | str | None = None) -> None:
        """Move every parameter and buffer of `model` to `device` (default: the swapper's), except the swapped
        frozen parameters, which stay host copies: the whole model never lands on the device at once.

        Parameters already on the device are kept as they are (an optimizer may refer to them); build the
        optimizer after placing.
        """
        if getattr(model, "gradient_checkpointing", False):
            raise ValueError("block swapping checkpoints the swapped blocks itself: turn off diffusers' gradient "
                             "checkpointing (enable_gradient_checkpointing) and checkpoint the other blocks per block")
        device = torch.device(device) if device is not None else self.device
        for k in self.resident():
            self._drop(k)
        keep = {id(h) for host in self._host for h in host}
        moved: dict[int, nn.Parameter] = {}  # tied parameters stay tied
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or id(p) in keep or _on(p, device):
                    continue
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
                module._parameters[name] = moved[id(p)]
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)

    def parameter_names(self, model: nn.Module) -> list[str]:
        """Names (as `model.named_parameters()` gives them) of the parameters kept off the device. DDP checks that
        all parameters share a device and broadcasts them at construction; give it these to ignore
        (`DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`): they are frozen and equal on all ranks."""
        hosts = {id(h) for host in self._host for h in host}
        return [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in hosts]

    def resident(self) -> list[int]:
        """Indices (within the swapped blocks) of blocks whose weights are on the device or on their way."""
        return sorted(self._placed.union(self._pending))

    def host_bytes(self) -> int:
        """Bytes of frozen weights kept off the device."""
        return sum(self._block_bytes(k) for k in range(len(self.swapped)))

    def window_bytes(self) -> int:
        """The most swapped weights on the device at once: three consecutive swapped blocks (the one the GPU is
        finishing, the one in use, the one arriving; two hold references here)."""
        sizes = [self._block_bytes(k) for k in range(len(self.swapped))]
        return max(sum(sizes[i:i + 3]) for i in range(max(1, len(sizes) - 2)))

    def describe(self) -> str:
        """One line for the start-up log."""
        gib = 2**30
        where = "pinned CPU memory" if self.pinned else "CPU memory"
        how = "on a side stream" if isinstance(self.transfer, CudaTransfer) else "synchronously"
        return (f"block swapping: {len(self.swapped)} of {self.total} blocks' frozen weights ({self.host_bytes() / gib:.1f} GiB) "
                f"in {where}, at most {min(3, len(self.swapped))} on the device at a time ({self.window_bytes() / gib:.1f} GiB), "
                f"prefetched one block ahead {how}")

    def remove(self) -> None:
        """Restore the blocks' own forwards and remove the hook; the swapped weights stay host copies."""
        for k in self.resident():
            self._drop(k)
        for block, forward in zip(self.swapped, self._forwards):
            if forward is None:
                del block.forward
            else:
                block.forward = forward
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _block_bytes(self, k: int) -> int:
        return sum(tensor_bytes(h) for h in self._host[k])

    def _phases(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return self._phase_is("forward"), self._phase_is("backward")

    @contextlib.contextmanager
    def _phase_is(self, phase: str) -> Iterator[None]:
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    def _swapped(self, k: int, forward: Callable) -> Callable:
        last = len(self.swapped) - 1

        def run(*args, **kwargs):
            backward = self._phase == "backward"
            self._arrive(k, k - 1 if backward else k + 1)
            try:
                return forward(*args, **kwargs)
            finally:
                # backward recomputes the last block first; the next forward uses the first block first
                keep = (k == 0) if backward else (k == last and torch.is_grad_enabled())
                if not keep:
                    self._drop(k)
        return run

    def _arrive(self, k: int, following: int) -> None:
        """Block k on the device for its use now; block `following` on its way."""
        # Anything else is left from a pass that did not reach every swapped block (a forward without backward,
        # a backward that stopped early): release it, so that at most two blocks are held.
        for j in self.resident():
            if j != k:
                self._drop(j)
        self._ensure(k)
        self._marks.append(self.transfer.mark())
        if 0 <= following < len(self.swapped):
            if len(self._marks) == 2 and following not in self._placed and following not in self._pending:
                self.transfer.wait_for(self._marks[0])
            self._start(following)
        assert len(self.resident()) <= 2, f"block swapping holds blocks {self.resident()} on the device"

    def _prefetch_first(self, module: nn.Module, args: tuple) -> None:
        if 0 not in self.resident():
            for j in self.resident():
                self._drop(j)
            self._start(0)

    def _start(self, k: int) -> None:
        if k not in self._placed and k not in self._pending:
            self._pending[k] = self.transfer.start(self._host[k])

    def _ensure(self, k: int) -> None:
        if k in self._placed:
            return
        handle = self._pending.pop(k) if k in self._pending else self.transfer.start(self._host[k])
        copies = [_as_parameter(c) for c in self.transfer.wait(handle)]
        for module, name, i in self._slots[k]:
            module._parameters[name] = copies[i]
        self._placed.add(k)

    def _drop(self, k: int) -> None:
        self._pending.pop(k, None)
        if k in self._placed:
            for module, name, i in self._slots[k]:
                module._parameters[name] = self._host[k][i]
            self._placed.discard(k)


def _on(t: Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
