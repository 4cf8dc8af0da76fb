"""Crash-safe placement of a checkpoint: temporary name, agreement, then one rename.

A save writes everything under a temporary sibling of the target,
`.{name}.fullshard-tmp-{token}` (`token` chosen by rank 0 and broadcast, so every rank writes
into the same place), and only then -- after every rank has said its part is complete and
on disk (`agree`) -- rank 0 moves it to the target (`commit`). So a crash, SIGKILL or full disk
at any earlier point leaves the target as it was (absent, or the previous checkpoint), and a
reader never sees a half-written checkpoint under the target name. Nothing outside the names
derived from the target's is touched, so other checkpoints are never damaged.

Replacing an existing checkpoint: on Linux `renameat2(RENAME_EXCHANGE)` swaps the new and the
old atomically (the old then sits under the temporary name and is deleted); where that is not
available the old is first renamed aside to `.{name}.fullshard-old-{token}`, then the new one
renamed into place: a crash between the two renames leaves the target absent and the previous
checkpoint intact under that name (`load_checkpoint` says so). Leftover temporary names of a
crashed save are removed by the next save to the same target -- only those whose save is
over: rank 0 holds an exclusive `flock` on its temporary file or directory from the moment it
creates it until the rename (`claim` / `release`), and `remove_stale` removes only what it can
lock, so two jobs saving to one path never delete each other's work (the last rename wins,
atomically). The token is random per save (48 bits), so two saves never share a temporary name.

A save never replaces what is not a checkpoint (`refuse_foreign`): a sharded save (a
directory) onto an existing file, or a full save (one file) onto a file that is not a
`torch.save` archive, is refused before anything is written.

Every file is fsync'ed before the agreement and the parent directory after the rename, so "in
place" also means "on disk". Saving assumes the target's filesystem is shared by all ranks
(as `torch.distributed.checkpoint` does).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from fullshard.distributed import comm

TMP_TAG = ".fullshard-tmp-"
OLD_TAG = ".fullshard-old-"


def world() -> comm.Group | None:
    """The default group, or None in a process without (or with a one-rank) process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return comm.Group.from_process_group(None)


def new_token(group: comm.Group | None) -> str:
    """A fresh name suffix, the same on every rank."""
    token = secrets.token_hex(6)
    return token if group is None else comm.broadcast_pickled(token, group.ranks[0], group)


def temp_path(target: Path, token: str) -> Path:
    return target.with_name(f".{target.name}{TMP_TAG}{token}")


def _siblings(target: Path, tag: str) -> list[Path]:
    prefix = f".{target.name}{tag}"
    if not target.parent.is_dir():
        return []
    return [p for p in target.parent.iterdir() if p.name.startswith(prefix)]


def aside_copies(target: Path) -> list[Path]:
    """Previous checkpoints moved aside by a save that was interrupted mid-replace."""
    return _siblings(target, OLD_TAG)


_HELD: dict[str, int] = {}  # temporary path -> the descriptor holding its lock


def _lock(path: Path) -> int | None:
    """An open descriptor of `path` holding an exclusive non-blocking flock, or None when
    another save holds it (or locks are unavailable: then nothing is ever removed as stale
    while it may be in use)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def claim(tmp: Path) -> None:
    """Hold the lock of the just-created temporary file or directory `tmp` until `release`
    (rank 0): `remove_stale` of a concurrent save leaves it alone."""
    fd = _lock(tmp)
    if fd is not None:
        _HELD[str(tmp)] = fd


def release(tmp: Path) -> None:
    fd = _HELD.pop(str(tmp), None)
    if fd is not None:
        os.close(fd)  # closing drops the flock


def remove_stale(target: Path) -> None:
    """Delete temporary names that crashed saves to `target` left behind (rank 0 only): the
    ones no live save holds the lock of."""
    for p in _siblings(target, TMP_TAG):
        if str(p) in _HELD:
            continue
        fd = _lock(p)
        if fd is None and os.path.lexists(p) and _lockable():
            continue  # a save in progress (another job, or another thread of this one)
        try:
            remove(p)
        finally:
            if fd is not None:
                os.close(fd)


def _lockable() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


_TORCH_ZIP = b"PK\x03\x04"


def refuse_foreign(target: Path, directory: bool) -> None:
    """Refuse to replace something at `target` that is not a checkpoint (see the module
    docstring): a save deletes what it replaces."""
    if not os.path.lexists(target) or target.is_dir():
        return  # a directory is checked by the caller (a checkpoint, or empty)
    if directory:
        raise FileExistsError(
            f"The checkpoint path {str(target)!r} is an existing file; a sharded checkpoint "
            f"is a directory, and saving would delete the file. Choose another path, or "
            f"remove the file first."
        )
    with open(target, "rb") as f:
        head = f.read(4)
    if head != _TORCH_ZIP:
        raise FileExistsError(
            f"The checkpoint path {str(target)!r} is an existing file that is not a "
            f"checkpoint (not a torch.save archive); saving would replace it. Choose another "
            f"path, or remove the file first."
        )


def remove(path: Path) -> None:
    release(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def agree(group: comm.Group | None, error: BaseException | None, what: str) -> None:
    """Every rank reports whether its part of `what` succeeded; raise on every rank if any
    failed (this rank's own exception where it failed, a `RuntimeError` naming the failed
    ranks elsewhere). A rank that cannot even get here (killed) makes the others fail in the
    collective instead -- either way nothing gets committed."""
    if group is None:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = comm.all_gather_object(mine, group)
    if error is not None:
        raise error
    failed = {rank: text for rank, text in zip(group.ranks, reports) if text is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {t}" for r, t in failed.items())
        raise RuntimeError(f"{what} failed on rank(s) {', '.join(map(str, failed))}: {detail}")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def commit(tmp: Path, target: Path, token: str) -> None:
    """Move the complete checkpoint `tmp` to `target`, replacing what is there (rank 0)."""
    refuse_foreign(target, tmp.is_dir())  # again: it may have appeared since the save began
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif tmp.is_file() and target.is_file():
        os.replace(tmp, target)  # atomic over an existing file
    elif _exchange(tmp, target):
        remove(tmp)  # now the previous checkpoint
    else:
        old = target.with_name(f".{target.name}{OLD_TAG}{token}")
        os.rename(target, old)
        # A crash here leaves no target and the previous checkpoint intact at `old`.
        os.rename(tmp, target)
        remove(old)
    release(tmp)
    fsync_dir(target.parent)
    for p in aside_copies(target):  # a previous interrupted replace's leftover
        remove(p)


def describe_missing(target: Path) -> str:
    """Why `target` may be missing, for error messages."""
    old = aside_copies(target)
    if old:
        return (
            f" A save to this path was interrupted while replacing the previous checkpoint, "
            f"which is intact at {str(old[0])!r}: rename it to {str(target)!r} to use it."
        )
    return ""


def save_file(obj: Any, path: Path) -> None:
    """`torch.save` to `path` and fsync it, with the zip archive's per-record CRC-32 on
    (`integrity` verifies them on load)."""
    import torch

    try:
        from torch.utils.serialization import config
    except ImportError:  # an older torch: always computes them
        config = None
    before = config.save.compute_crc32 if config is not None else None
    if config is not None:
        config.save.compute_crc32 = True
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if config is not None:
            config.save.compute_crc32 = before

