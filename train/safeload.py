"""Loading what a checkpoint holds without running anything in it.

torch files load with `weights_only=True`; the pickles torch.distributed.checkpoint writes (`sharded/.metadata`
and non-tensor values, which its own reader loads with plain `pickle`) go through an unpickler that admits only
the classes those files are made of. A file that needs anything else is refused (`DamagedCheckpoint`), naming it.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch

SHARDED = "sharded"  # torch.distributed.checkpoint directory of an FSDP run


def load_sharded(path: Path, state: dict) -> dict:
    """Fill `state` (nested state dicts, DTensors or plain tensors) from a checkpoint's `sharded/`.

    Works under any world size of the same sharding, and in one process without a process group,
    where it assembles full tensors (export). Its pickles load through `MetadataUnpickler` and
    `weights_only=True`: a file that needs anything else is refused (`DamagedCheckpoint`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    single = not dist.is_initialized()
    with warnings.catch_warnings():
        if single:  # loading in one process is what export means; torch warns about it every time
            warnings.filterwarnings("ignore", message="torch.distributed is .* uninitialized")
        try:
            dcp.load(state, storage_reader=_checked_reader(path / SHARDED), planner=_checked_planner(path / SHARDED),
                     no_dist=single)
        except CheckpointException as e:  # raised for every rank's failure, each wrapped with its traceback
            error = next(iter(e.failures.values()))[0]
            if isinstance(error, DamagedCheckpoint):
                raise error from None
            raise DamagedCheckpoint(f"{path / SHARDED} could not be loaded ({type(error).__name__}: {error}): it is damaged "
                                    f"or was not written by this trainer. {EARLIER}") from None
    return state


EARLIER = "Use an earlier checkpoint of the run (give its step-N directory to --resume, export or sample), or start a new run."


class DamagedCheckpoint(ValueError):
    """A checkpoint file is missing, damaged or not written by this trainer; nothing was loaded from it."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's `.metadata` admitting only the classes it is made of (its metadata
    dataclasses, torch.Size, dtypes, paths): any other global, which could run code, is refused."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    def __init__(self, file, name: Path):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as metadata

        found = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in self.ALLOWED or isinstance(found, torch.dtype):
            return super().find_class(module, name)
        if module == metadata.__name__ and getattr(getattr(metadata, name, None), "__module__", None) == module:
            return getattr(metadata, name)
        raise DamagedCheckpoint(f"{self.name} asks to load {module}.{name}, which a checkpoint's metadata never holds: the "
                                f"file is damaged or was not written by this trainer, and loading it could run code. Nothing "
                                f"was loaded from it. {EARLIER}")


def read_metadata(directory: Path, name: str = ".metadata"):
    """A `sharded/` directory's metadata, through `MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = directory / name
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f, file).load()
    except DamagedCheckpoint:
        raise
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing: the checkpoint is incomplete. {EARLIER}") from None
    except Exception as e:  # truncated or garbled: the unpickler's errors are of many types
        raise DamagedCheckpoint(f"{file} cannot be read ({type(e).__name__}: {e}): it is damaged. {EARLIER}") from None
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(f"{file} holds a {type(metadata).__name__}, not a checkpoint's metadata. {EARLIER}")
    return metadata


def _checked_reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = read_metadata(directory, ".metadata" if rank is None else f"__{rank}.metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(directory)


def _checked_planner(directory: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class CheckedPlanner(DefaultLoadPlanner):
        """Non-tensor values (torch.load'ed without `weights_only` by torch's planner) are first loaded with it."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as e:
                raise DamagedCheckpoint(f"{directory}: the value of {read_item.dest_index.fqn} cannot be loaded safely "
                                        f"({type(e).__name__}: {str(e).splitlines()[0]}): the checkpoint is damaged or was not "
                                        f"written by this trainer. {EARLIER}") from None
            value.seek(0)  # it holds only what weights_only admits: torch's own load now does the same
            super().load_bytes(read_item, value)

    return CheckedPlanner()


def load_tensors(path: Path, name: str):
    """NAME.pt of a checkpoint (None when absent), with `weights_only=True`: a file that needs more is refused."""
    file = path / f"{name}.pt"
    if not file.exists():
        return None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a refused global (pickle.UnpicklingError) or a damaged archive (RuntimeError, EOFError)
        raise DamagedCheckpoint(f"{file} cannot be loaded safely ({type(e).__name__}: {str(e).splitlines()[0]}): it is "
                                f"damaged or was not written by this trainer. {EARLIER}") from None
