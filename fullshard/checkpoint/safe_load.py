"""Reading checkpoint files without running code from them (unless the user opts in).

A checkpoint is a pickle, and unpickling can call any function the file names. Checkpoints
are downloaded and shared, so every file a load reads goes through here, safe by default:

- `torch.save` files (a full checkpoint, a sharded checkpoint's `meta.pt`): `torch.load(
  weights_only=True)`: tensors, plain containers, numbers, strings, `torch.Size`, dtypes.
  fullshard writes nothing else (metadata, optimizer and scheduler state dicts, RNG states
  are plain types and tensors), so its own checkpoints always load this way;
- `torch.distributed.checkpoint`'s `.metadata` index, which DCP itself unpickles with plain
  `pickle`: an unpickler that only knows DCP's own metadata classes (`SafeReader`);
- DCP's non-tensor items (optimizer param groups), which DCP's planner `torch.load`s with
  `weights_only=False`: `weights_only=True` here (`SafePlanner`). DCP's tensor items are
  read with `weights_only=True` by DCP already.

A file holding anything else raises `UnsafeCheckpointError` naming the type and where it sits
(found by re-reading the pickle with every global replaced by an inert stand-in, so locating
it runs nothing either) and how to opt in. `weights_only=False` restores plain `torch.load`
/ `pickle`: only for files you trust. `weights_only=None` means the safe default, as in
Lightning's `load(..., weights_only=None)`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fullshard.checkpoint.errors import CheckpointError

OPT_IN = (
    "If you trust this file, opt in to full unpickling (it can run arbitrary code): "
    "fabric.load(path, state, weights_only=False), FSDPStrategy.load_checkpoint(..., "
    "weights_only=False), load_checkpoint(..., weights_only=False), or "
    "`fullshard consolidate --unsafe-load`. Only for files you trust."
)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds an object that loading without `weights_only=False` refuses."""


def resolve(weights_only: bool | None) -> bool:
    """`None` -> the safe default (True); anything but a bool is a TypeError."""
    if weights_only is None:
        return True
    if not isinstance(weights_only, bool):
        raise TypeError(
            f"weights_only must be True, False or None (the safe default, True); got "
            f"{type(weights_only).__name__}: {weights_only!r}"
        )
    return weights_only


# -- torch.save files -------------------------------------------------------------------------
def torch_load(path: Path, *, weights_only: bool, what: str, mmap: bool = False) -> Any:
    """`torch.load` of a checkpoint file on CPU. With `weights_only`, an object it refuses
    raises `UnsafeCheckpointError`; a file that is not a `torch.save` archive or fails its
    checksums raises `CheckpointError` (`integrity`) before torch reads it; other failures
    propagate."""
    from fullshard.checkpoint.integrity import verify_torch_file

    verify_torch_file(path, what)
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as e:
        if not weights_only or "Weights only load failed" not in str(e):
            raise
        raise UnsafeCheckpointError(_refusal(path, what, _global_named(str(e)))) from None


def _global_named(message: str) -> str | None:
    """The global torch's weights-only unpickler refused (from its message)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", message)
    if found:
        return found.group(1)
    found = re.search(r"WeightsUnpickler error: ([^\n]+)", message)
    return found.group(1).strip() if found else None


def _refusal(path: Path, what: str, name: str | None) -> str:
    where = locate(path, name) if name else None
    found = f"an object of type (or built by) `{name}`" if name else \
        "an object that is not plain data"
    at = f" at {where}" if where else ""
    return (
        f"{what} {str(path)!r} holds {found}{at}, which loading with weights_only=True (the "
        f"default) refuses: unpickling it could run code from the file. fullshard's own "
        f"checkpoints hold only tensors and plain Python values; a checkpoint from elsewhere "
        f"may hold other objects. {OPT_IN}"
    )


class _Inert:
    """Stands for whatever a global would have built; it records its name and nothing else."""

    _name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Locator(pickle.Unpickler):
    """Unpickles with every global replaced by an `_Inert` class of the same name: the
    structure comes out, nothing the file names is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        return type("Inert", (_Inert,), {"_name": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:  # tensor storages of a torch.save file
        return None


def locate(path: Path, name: str) -> str | None:
    """Where (`ckpt['key'][...]`) the first object built by global `name` sits in the
    `torch.save` file `path`; None when it cannot tell."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
            data = z.read(pkl)
        tree = _Locator(io.BytesIO(data)).load()
    except Exception:  # an old non-zip file, a malformed pickle: the type alone must do
        return None
    short = name.rsplit(".", 1)[-1]
    return _find(tree, lambda o: isinstance(o, _Inert)
                 and (o._name == name or o._name.rsplit(".", 1)[-1] == short), "ckpt", 0)


def _find(obj: Any, hit: Any, where: str, depth: int) -> str | None:
    if hit(obj) or isinstance(obj, type) and issubclass(obj, _Inert) and hit(obj()):
        return where
    if depth > 50:
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = repr(k) if not isinstance(k, _Inert) else "<object>"
            found = _find(k, hit, f"{where} (a key)", depth + 1) or _find(
                v, hit, f"{where}[{key}]", depth + 1)
            if found:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _find(v, hit, f"{where}[{i}]", depth + 1)
            if found:
                return found
    return None


# -- torch.distributed.checkpoint -------------------------------------------------------------
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class _IndexUnpickler(pickle.Unpickler):
    """DCP's `.metadata`: DCP's own metadata dataclasses, `torch.Size`, dtypes, layouts."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if module == _DCP_METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as dcp_metadata

            allowed = isinstance(getattr(dcp_metadata, name, None), type)
        if not allowed:
            raise UnsafeCheckpointError(
                f"The torch.distributed.checkpoint index {str(self._path)!r} names "
                f"{module}.{name}, which is not one of DCP's metadata types; reading it with "
                f"the default weights_only=True refuses to unpickle it, since that could run "
                f"code from the file. {OPT_IN}"
            )
        return super().find_class(module, name)


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, whose `.metadata` index is read by `_IndexUnpickler`."""

        def __init__(self, path: str | os.PathLike, weights_only: bool, sums: Any) -> None:
            super().__init__(path)
            self._weights_only = weights_only
            self._sums = sums

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            """The item's bytes, checked against the checksum written with them."""
            if self._sums is None:
                return super()._slice_file(file, sinfo)
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            self._sums.check_item(sinfo.relative_path, sinfo.offset, data)
            return io.BytesIO(data)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if not self._weights_only or kwargs.get("rank") is not None:
                return super().read_metadata(*args, **kwargs)
            file = Path(os.fspath(self.path)) / ".metadata"
            with open(file, "rb") as f:
                metadata = _IndexUnpickler(f, file).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def reader(path: Path, weights_only: bool, sums: Any = None) -> Any:
    """A DCP `FileSystemReader` for `path` that reads its index safely with `weights_only`
    and checks every item it reads against `sums` (`integrity.Sums`) when given."""
    return _safe_reader_class()(path, weights_only, sums)


def _safe_planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's load planner, whose non-tensor items load with `weights_only=True`.

        fullshard requests DCP items by their flat key (`'optimizer.param_groups.0.lr'`), so a
        loaded value goes straight into the request dict under that key."""

        def __init__(self, weights_only: bool, path: Path) -> None:
            super().__init__()
            self._weights_only = weights_only
            self._path = path

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if not self._weights_only:
                return super().load_bytes(read_item, value)
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                name = _global_named(str(e)) or "an object that is not plain data"
                raise UnsafeCheckpointError(
                    f"The checkpoint {str(self._path)!r} holds, under {fqn!r}, an object of "
                    f"type {name}, which loading with weights_only=True (the default) refuses: "
                    f"unpickling it could run code from the file. {OPT_IN}"
                ) from None
            path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
            if len(path) != 1:
                raise AssertionError(f"fullshard requests DCP items by flat key, got {path}")
            target = self.original_state_dict if self.flatten_state_dict else self.state_dict
            target[path[0]] = obj

    return SafePlanner


def planner(path: Path, weights_only: bool) -> Any:
    """A DCP load planner that reads non-tensor items with `weights_only`."""
    return _safe_planner_class()(weights_only, path)
