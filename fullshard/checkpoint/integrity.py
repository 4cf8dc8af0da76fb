"""Checkpoints that cannot lie: content checksums written with a checkpoint and verified on
load, and what a save says when the disk is full.

Every saved item has a CRC-32 (`zlib.crc32`: ~1.9 GB/s on this project's CPU machine, about
4x blake2b; it detects every burst error up to 32 bits -- a flipped byte, a torn write --
which is the failure it is for; it is not a defence against someone forging a file):

- **full format** (one `torch.save` file) and every other `torch.save` file we read
  (`meta.pt`): the zip archive `torch.save` writes already holds a CRC-32 per record (one
  record per tensor storage, plus the pickle). `torch.save` computes them by default and our
  saves force it on (`torch.utils.serialization.config.save.compute_crc32`); `torch.load`
  never checks them. `verify_torch_file` re-reads every record through `zipfile`, which
  checks each CRC and header, and names the state-dict key a bad record holds. A file
  written with CRCs switched off loads with a warning;
- **sharded format** (DCP): DCP writes no checksums. `SummingWriter` reads back each item it
  wrote on this rank (from the page cache) and sums its byte range; the sums travel to rank 0
  with DCP's own write results and go into `.fullshard-checksums.json` beside DCP's files,
  with whole-file sums of `.metadata` and `meta.pt` (`write_sums`). Loading checks each
  whole file before unpickling it and every item range as DCP reads it
  (`check_item`, called from `safe_load`'s reader), on the rank that reads it. A directory
  without the file (written by an older fullshard, by Lightning or by plain DCP) loads with
  a warning that nothing was verified.

A mismatch raises `CheckpointError` naming the file and the key. `no_space` turns a full disk
-- torch's own message is `enforce fail at inline_container.cc ... unexpected pos`, the
`ENOSPC` only in its context; DCP's is a `CheckpointException` holding every rank's `OSError`
-- into a `CheckpointError` "No space left on device" naming the path and the bytes needed.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fullshard.checkpoint.errors import CheckpointError

SUMS = ".fullshard-checksums.json"
ALGORITHM = "crc32"
_CHUNK = 1 << 22


# -- sums of bytes ---------------------------------------------------------------------------
def crc_stream(f: BinaryIO, length: int | None = None) -> int:
    """CRC-32 of the next `length` bytes of `f` (to its end when None)."""
    crc, left = 0, length
    while left is None or left > 0:
        block = f.read(_CHUNK if left is None else min(_CHUNK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        if left is not None:
            left -= len(block)
    return crc


def crc_file(path: Path) -> int:
    with open(path, "rb") as f:
        return crc_stream(f)


def crc_range(path: Path, offset: int, length: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return crc_stream(f, length)


# -- the sharded format's sums file ------------------------------------------------------------
@dataclass(frozen=True)
class Summed:
    """A DCP `_StorageInfo` with the CRC-32 of the bytes it points at, as it travels from the
    rank that wrote the item to rank 0 (which unwraps it before writing DCP's index)."""

    info: Any
    crc: int
    fqn: str


def summing_writer(path: Path) -> Any:
    """A `FileSystemWriter` for `path` whose items come back to rank 0 with their sums."""
    from dataclasses import replace

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.futures import Future

    class SummingWriter(FileSystemWriter):
        sums: list[list[Any]] = []

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = super().write_data(plan, planner).wait()
            out = []
            for wr in results:
                info = wr.storage_data
                crc = crc_range(Path(self.path) / info.relative_path, info.offset, info.length)
                out.append(replace(wr, storage_data=Summed(info, crc, wr.index.fqn)))
            fut: Future = Future()
            fut.set_result(out)
            return fut

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            plain, sums = [], []
            for wr_list in results:
                mine = []
                for wr in wr_list:
                    s = wr.storage_data
                    if isinstance(s, Summed):
                        sums.append([s.info.relative_path, s.info.offset, s.info.length,
                                     s.crc, s.fqn])
                        wr = replace(wr, storage_data=s.info)
                    mine.append(wr)
                plain.append(mine)
            self.sums = sums
            super().finish(metadata, plain)

    return SummingWriter(path, single_file_per_rank=True, sync_files=True)


def write_sums(tmp: Path, items: list[list[Any]], files: list[str]) -> None:
    """Rank 0, last file of a sharded save: the items' sums and whole-file sums of `files`."""
    record = {"format": "fullshard-checksums", "version": 1, "algorithm": ALGORITHM,
              "items": sorted(items), "files": {n: crc_file(tmp / n) for n in files}}
    file = tmp / SUMS
    with open(file, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Sums:
    """A sharded checkpoint's sums: by (file, offset) the item's (length, crc, key)."""

    path: Path
    items: dict[tuple[str, int], tuple[int, int, str]]
    files: dict[str, int]

    def check_file(self, name: str) -> None:
        """Whole-file check of `.metadata` / `meta.pt` (before unpickling them)."""
        if name not in self.files:
            return
        file = self.path / name
        if file.is_file() and crc_file(file) != self.files[name]:
            raise CheckpointError(
                f"The checkpoint file {str(file)!r} is truncated or corrupt: its checksum (CRC-32) "
                f"does not match the one written with the checkpoint, so its content changed "
                f"after it was saved. Use another checkpoint."
            )

    def check_item(self, relative_path: str, offset: int, data: bytes) -> None:
        """One DCP item's bytes, as they were read for loading."""
        found = self.items.get((relative_path, offset))
        if found is None:
            return
        length, crc, fqn = found
        if len(data) != length or zlib.crc32(data) != crc:
            raise CheckpointError(
                f"The checkpoint file {str(self.path / relative_path)!r} is corrupt: the bytes "
                f"of {fqn!r} (offset {offset}, {length} bytes) do not match the checksum "
                f"(CRC-32) written with the checkpoint. Use another checkpoint."
            )


_WARNED: set[str] = set()


def read_sums(path: Path) -> Sums | None:
    """The sums of the sharded checkpoint `path`; None (with a warning, once per path) for a
    checkpoint written without them."""
    file = path / SUMS
    if not file.is_file():
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(
                f"The sharded checkpoint {str(path)!r} has no {SUMS} (written by an older "
                f"fullshard, by Lightning or by plain torch.distributed.checkpoint): it loads "
                f"without verifying its content. Saving it again adds checksums.",
                stacklevel=4,
            )
        return None
    try:
        record = json.loads(file.read_text())
        items = {(str(r), int(o)): (int(n), int(c), str(k))
                 for r, o, n, c, k in record["items"]}
        files = {str(k): int(v) for k, v in record["files"].items()}
    except Exception as e:
        raise CheckpointError(
            f"The checkpoint's checksum file {str(file)!r} is corrupt ({type(e).__name__}: "
            f"{e}); the checkpoint cannot be verified. Use another checkpoint."
        ) from None
    return Sums(path, items, files)


# -- torch.save files --------------------------------------------------------------------------
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80"  # a pre-1.6 torch.save file starts with a pickle protocol byte


class _Ref:
    def __init__(self, key: str) -> None:
        self.key = key


class _Rec:
    """Stands for whatever a global would build: keeps its arguments, items and state so the
    tree can be walked to the storages (nothing the file names is imported or called)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Rec:
        self = object.__new__(cls)
        self.args, self.items, self.state = args, {}, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)


class _Mapper(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return type("Rec", (_Rec,), {})

    def persistent_load(self, pid: Any) -> Any:
        return _Ref(str(pid[2])) if isinstance(pid, tuple) and len(pid) > 2 else None


def _storage_keys(data: bytes) -> dict[str, str]:
    """Record name ('data/3') -> where in the checkpoint its first tensor sits."""
    out: dict[str, str] = {}

    def walk(obj: Any, where: str, depth: int) -> None:
        if depth > 60:
            return
        if isinstance(obj, _Ref):
            out.setdefault(obj.key, where)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, where if isinstance(obj, tuple) else f"{where}[{i}]", depth + 1)
        elif isinstance(obj, _Rec):
            walk(obj.args, where, depth + 1)
            walk(obj.items, where, depth + 1)
            walk(obj.state, where, depth + 1)

    try:
        walk(_Mapper(__import__("io").BytesIO(data)).load(), "ckpt", 0)
    except Exception:
        pass  # a malformed pickle: torch.load will say so; the records are still checked
    return out


def verify_torch_file(path: Path, what: str) -> None:
    """Check a `torch.save` file before `torch.load` reads it: a zip archive whose every
    record matches its CRC-32. Raises `CheckpointError` naming the file (and the key of a
    corrupt tensor); warns for a file without CRCs."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _ZIP_MAGIC:
        if head[:1] == _LEGACY_MAGIC:
            return  # the legacy (non-zip) format has no checksums; torch.load reads it
        raise CheckpointError(
            f"{what} {str(path)!r} is not a torch.save archive (its first bytes are "
            f"{head!r}, not a zip header): it is corrupt, or not a checkpoint file written by "
            f"fullshard or torch. Use another checkpoint."
        )
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            pkl = next((i for i in infos if i.filename.endswith("/data.pkl")), None)
            keys = _storage_keys(z.read(pkl)) if pkl is not None else {}
            unsummed = 0
            for info in infos:
                record = info.filename.split("/", 1)[-1]
                where = keys.get(record.rsplit("/", 1)[-1]) if "/data/" in f"/{record}" else None
                if info.CRC == 0 and info.file_size > 0:
                    unsummed += 1
                    continue
                try:
                    with z.open(info) as member:
                        while member.read(_CHUNK):
                            pass
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    held = f" (it holds {where})" if where else ""
                    raise CheckpointError(
                        f"{what} {str(path)!r} is truncated or corrupt: its record "
                        f"{info.filename!r}"
                        f"{held} fails its check ({e}). Use another checkpoint."
                    ) from None
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, StopIteration) as e:
        raise CheckpointError(
            f"{what} {str(path)!r} is truncated or corrupt: its zip structure cannot be read "
            f"({type(e).__name__}: {e}). Use another checkpoint."
        ) from None
    if unsummed and str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(
            f"{what} {str(path)!r} was written without checksums (torch.save with "
            f"compute_crc32 off): {unsummed} record(s) load without verifying their content.",
            stacklevel=4,
        )


# -- a full disk -------------------------------------------------------------------------------
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _errors(e: BaseException | None, depth: int = 0) -> list[BaseException]:
    """`e`, its causes and contexts, and the failures DCP collected from every rank."""
    if e is None or depth > 8:
        return []
    out = [e]
    for inner in (e.__cause__, e.__context__):
        out += _errors(inner, depth + 1)
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out += _errors(inner, depth + 1)
    return out


def is_no_space(e: BaseException) -> bool:
    return any(isinstance(x, OSError) and x.errno in _FULL for x in _errors(e)) or (
        "No space left on device" in str(e))


def _short_write(e: BaseException) -> bool:
    """torch's zip writer found fewer bytes on disk than it wrote (its `ENOSPC` is lost)."""
    return any("unexpected pos" in str(x) for x in _errors(e))


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def no_space(e: BaseException, target: Path, tmp: Path, needed: int | None = None
             ) -> BaseException:
    """A clear `CheckpointError` for a save that ran out of disk (`needed`: the bytes of the
    tensors it writes, when known); `e` itself otherwise. A short write of torch's zip writer
    counts as a full disk when the checkpoint cannot fit in what is free even now (its
    temporary files removed)."""
    free = _free_bytes(target.parent)
    cannot_fit = bool(needed) and free is not None and needed > free
    if not (is_no_space(e) or (cannot_fit and _short_write(e))):
        return e
    sizes = ""
    if needed:
        sizes = f" it needs about {_bytes(needed)}"
        if free is not None:
            sizes += f" and {_bytes(free)} are free there"
        sizes += ";"
    return CheckpointError(
        f"No space left on device while saving the checkpoint {str(target)!r}:{sizes} the "
        f"filesystem filled up while writing under the temporary name {str(tmp)!r}, now "
        f"removed. The previous checkpoint at that path, if any, is untouched (a save writes "
        f"beside it and replaces it only once complete, so it needs room for both). Free "
        f"space on that filesystem or save elsewhere."
    )


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2 ** 20:.1f} MiB)"


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a nested dict/list (a DTensor counts its global size:
    what a sharded save writes over all ranks)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0
