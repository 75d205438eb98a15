"""Device-to-host synchronisations counted on a CPU run, as CUDA would have them.

On CUDA, `torch.cuda.set_sync_debug_mode("warn")` flags every operation that makes the host wait for the device.
A CPU run has no such mode, and no device either: every tensor is in host memory, so reading any of them costs
nothing. `SyncCounter` therefore tracks where each tensor *would* live on a GPU run and counts the reads that would
make the host wait there:

Where a tensor lives
    On the device: the tensors `mark`ed so (the model's parameters and buffers, the batch as the step receives it:
    the prefetcher's copies), a tensor created with an explicit `device=` given as a `torch.device` object (code
    writes `device=x.device` or `device=self.device` for the training device; a literal "cpu" string means the host),
    a tensor moved with `.to(<torch.device>)`, and every output of an operation with an input on the device (autograd's
    backward and the optimizer's foreach kernels included: the gradients and optimizer state of device parameters
    are on the device). Everything else is on the host: created without a device, loaded from files, built by the
    data loader's threads.

What counts as a synchronisation
    - a read of a device tensor's value on the host: `.item()`, `bool(t)` / `if t:`, `float(t)`, `int(t)`,
      `t.__index__()`, `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")`, printing or formatting it;
    - an operation whose output size depends on device data: `nonzero`, `masked_select`, `unique`, indexing or
      assigning with a boolean mask, `repeat_interleave` without `output_size`, `bincount`, `equal`;
    - a blocking copy from host memory to the device: `.to(device)` / `.cuda()` of a host tensor without
      `non_blocking=True`, `torch.tensor(data, device=...)` (the data is copied from pageable memory and the copy
      waits), `copy_` of a host tensor (more than one element) into a device tensor, a device tensor indexed by a host
      index tensor (copied implicitly).
    A 0-dim host tensor or a Python number combined with a device tensor is passed as a kernel argument: no copy,
    no sync (as on CUDA). `non_blocking=True` copies to the device are asynchronous (from pinned memory, or staged by
    the driver from pageable memory) and not counted, as the sync debug mode does not flag them.

This is what `torch.cuda.set_sync_debug_mode` reports on CUDA for the same code, within two limits: it cannot see
reads made inside C++ of operations it does not know (e.g. a custom kernel's), and a `device=` given as a string
other than "cpu" (e.g. "cuda") counts as the device.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ON_DEVICE = "_on_device"  # the attribute a device tensor carries (True); absent or False: on the host
ROOT = Path(__file__).resolve().parents[1]
aten = torch.ops.aten

# operations whose output's size is known only once the device has computed their input (CUDA synchronises)
DATA_SIZED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.bincount.default, aten.equal.default,
              aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
# Tensor methods that read a device tensor's values on the host (item and its kin are counted in dispatch, where they
# all meet as `_local_scalar_dense`)
HOST_READS = {"tolist", "numpy", "cpu", "__format__", "__repr__", "__str__"}
HOST_DATA = {"new_tensor"}  # Tensor methods that copy host data to the tensor's device
DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}  # copy their data to the device when given one
IN_PLACE_COPIES = {aten.copy_.default, aten._foreach_copy_.default}


def on_device(t) -> bool:
    return _place(t) is True


def _place(t) -> bool | None:
    """True: on the device; False: on the host; None: not known yet (a factory's output inside another operation)."""
    return getattr(t, ON_DEVICE, False) if isinstance(t, torch.Tensor) else False


def _copy_pairs(func, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of a copy_ or a _foreach_copy_."""
    if func is aten.copy_.default:
        return [(args[0], args[1])]
    return list(zip(args[0], args[1]))


def _set(t, where: bool) -> None:
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, ON_DEVICE, where)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: counted as on the host
            pass


def _explicit_device(value) -> bool | None:
    """Whether a `device=` value names the training device (a torch.device), the host (the string "cpu"), or neither."""
    if value is None:
        return None
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        return not value.startswith("cpu")
    if isinstance(value, int):
        return True
    return None


@dataclass(frozen=True)
class Sync:
    """One synchronisation: its kind and where in the code it happened (the innermost frame of this repository and
    the innermost frame overall, e.g. inside diffusers)."""

    kind: str
    where: str
    inner: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}" + (f" (in {self.inner})" if self.inner != self.where else "")


def _where() -> tuple[str, str]:
    frames = [f for f in traceback.extract_stack()[:-3] if "sync_counter.py" not in f.filename
              and "/torch/" not in f.filename]
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename]
    fmt = lambda f: f"{Path(f.filename).relative_to(ROOT) if f.filename.startswith(str(ROOT)) else Path(f.filename).name}:{f.lineno} {f.name}"  # noqa: E731
    mine = fmt(ours[-1]) if ours else "?"
    inner = fmt(frames[-1]) if frames else mine
    return mine, inner


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # an operation without tensor inputs (a factory) leaves its output's place open: at the top level the Python
        # call says where (`_Function`); inside another operation (e.g. pad_sequence's output) the first copy into it
        places = [_place(t) for t in tensors]
        device = True if True in places else None if None in places or not tensors else False
        if not self.counter.quiet:
            self._count(func, args, kwargs, bool(device))
        out = func(*args, **kwargs)
        if func in IN_PLACE_COPIES:  # a copy's destination stays where it is, unless still open
            for dst, src in _copy_pairs(func, args):
                if _place(dst) is None:
                    _set(dst, on_device(src))
                    if dst._base is not None and _place(dst._base) is None:
                        _set(dst._base, on_device(src))
        else:
            for t in tree_flatten(out)[0]:
                _set(t, device)
        return out

    def _count(self, func, args, kwargs, device: bool) -> None:
        record = self.counter.record
        if func is aten._local_scalar_dense.default and device:
            record("read (item / bool / float / int)")
        elif func in DATA_SIZED and device:
            record(f"data-sized {func.overloadpacket.__name__}")
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and device:
            indices = [i for i in args[1] if isinstance(i, torch.Tensor)]
            if any(i.dtype == torch.bool for i in indices):
                record("boolean mask indexing")
            elif on_device(args[0]) and any(not on_device(i) and i.dim() > 0 for i in indices):
                record("host index tensor copied to the device")
        elif func in IN_PLACE_COPIES:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            for dst, src in _copy_pairs(func, args):
                if on_device(dst) and _place(src) is False and src.dim() > 0 and not non_blocking:
                    record("blocking copy host -> device (copy_)")
                elif on_device(src) and _place(dst) is False and not non_blocking:
                    record("read (copy_ to host)")


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counter = self.counter
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if counter.quiet:
            return func(*args, **kwargs)
        if name in HOST_READS and on_device(this):
            counter.record(f"read ({name})")
            with counter.silent():  # what it calls to read (item, copies) is this one read
                return _host_copy(this, func(*args, **kwargs))
        if name in ("to", "cuda") and this is not None:
            target = True if name == "cuda" else _to_target(args[1:], kwargs)
            non_blocking = kwargs.get("non_blocking", False) or (name == "to" and True in [a for a in args[1:] if isinstance(a, bool)])
            with counter.silent():
                out = func(*args, **kwargs)
            if target is False and on_device(this):
                counter.record("read (to host)")
                return _host_copy(this, out)
            if target is True and not on_device(this):
                if not non_blocking:
                    counter.record(f"blocking copy host -> device ({name})")
                _set(out, True)  # on a CPU run the same tensor: it now stands for the device copy
            return out
        if name in HOST_DATA and on_device(this):
            counter.record(f"blocking copy host -> device ({name})")
        explicit = _explicit_device(kwargs.get("device"))
        if explicit and name in DATA_FACTORIES and not (args and on_device(args[0])):
            counter.record(f"blocking copy host -> device (torch.{name}(..., device=))")
        out = func(*args, **kwargs)
        if explicit is not None:
            for t in tree_flatten(out)[0]:
                _set(t, explicit)
        elif not any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]):
            for t in tree_flatten(out)[0]:  # created without a device: on the host
                if _place(t) is None:
                    _set(t, False)
        return out


def _host_copy(this: torch.Tensor, out):
    """`out`, a host copy of device tensor `this`, as a tensor of its own (a CPU run returns `this` itself)."""
    if out is this:
        out = this.view_as(this)
    _set(out, False)
    return out


def _to_target(args, kwargs) -> bool | None:
    """Where `.to(...)`'s arguments send a tensor: True the device, False the host, None nowhere new (a dtype)."""
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            return on_device(a)
        where = _explicit_device(a) if not isinstance(a, (bool, torch.dtype)) else None
        if where is not None:
            return where
    return None


class SyncCounter:
    """Counts the device-to-host synchronisations of the code run inside it on this thread (see the module's
    docstring for what counts and how a CPU run knows where a tensor would live).

    Use::

        counter = SyncCounter()
        counter.mark(model.parameters())
        with counter:
            ...
        counter.syncs  # [Sync(kind, where, inner), ...]
    """

    def __init__(self):
        self.syncs: list[Sync] = []
        self.quiet = False
        self._modes = None

    def mark(self, tensors) -> None:
        """Tensors that live on the device (parameters, buffers, a batch the prefetcher copied)."""
        for t in tensors:
            _set(t, True)

    def record(self, kind: str) -> None:
        self.syncs.append(Sync(kind, *_where()))

    def silent(self):
        counter = self

        class _Silent:
            def __enter__(self):
                self.was, counter.quiet = counter.quiet, True

            def __exit__(self, *exc):
                counter.quiet = self.was
        return _Silent()

    def __len__(self) -> int:
        return len(self.syncs)

    def by_place(self, since: int = 0) -> Counter:
        return Counter(str(s) for s in self.syncs[since:])

    def __enter__(self) -> SyncCounter:
        self._modes = (_Dispatch(self), _Function(self))
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._modes[1].__exit__(*exc)
        self._modes[0].__exit__(*exc)
        self._modes = None


def _print(*a) -> None:
    print(*a, file=sys.stderr)
