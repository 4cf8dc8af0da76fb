"""The files of a sharded checkpoint (`sharded`) that a load may read, checked before anything
is read from them: each lies inside the checkpoint directory (no absolute name, no `..`, no
symlink unless the caller allows them), is present and as long as DCP's index says, and
matches the checksums written with it (`integrity`).

DCP's `.metadata` index names the data files. An index that names a file outside the
directory is refused as that, before its checksum is compared: the edit that made it escape
changed its sum too, and "lies outside its directory" says what happened. The index is read
for that without running code from it (`safe_load`); one that the safe reader refuses is
checked against its sum first, and unpickled in full only with `weights_only=False`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fullshard.checkpoint import integrity, safe_load
from fullshard.checkpoint.errors import CheckpointError

META = "meta.pt"
DCP_METADATA = ".metadata"
OLD_FORMAT = "fullshard-sharded-v1"  # meta.pt of fullshard before it used Lightning's layout


# -- what a load may read ---------------------------------------------------------------------
def inside(path: Path, name: str, allow_symlinks: bool) -> Path:
    """`path / name` for a file the checkpoint's own index names, refused when it lies outside
    the checkpoint directory (an absolute name, `..`, or -- unless `allow_symlinks` -- a
    symlink anywhere below `path`). DCP itself only writes plain names, so a name that leaves
    the directory means the index was edited."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} names the file {name!r}, which lies outside "
            f"its directory; a checkpoint only reads its own files (its index was edited or "
            f"is corrupt). Use another checkpoint."
        )
    file = path / rel
    if not allow_symlinks:
        node = path
        for part in rel.parts:
            node = node / part
            if node.is_symlink():
                raise CheckpointError(
                    f"The checkpoint file {str(node)!r} is a symlink (to "
                    f"{os.readlink(node)!r}); loading refuses to follow symlinks inside a "
                    f"checkpoint directory, so nothing outside it is read. If you made it, "
                    f"pass allow_symlinks=True (load_checkpoint, FSDPStrategy.load_checkpoint, "
                    f"fabric.load)."
                )
    return file


def _verified(path: Path, name: str, allow_symlinks: bool) -> Path:
    """One of the checkpoint's own files, contained and matching its whole-file checksum."""
    file = inside(path, name, allow_symlinks)
    sums = integrity.read_sums(path)
    if sums is not None:
        sums.check_file(name)
    return file


# -- the files ----------------------------------------------------------------------------------
def read_meta(path: Path, weights_only: bool = True, *,
              allow_symlinks: bool = False) -> dict[str, Any]:
    """`meta.pt`: the user's entries (a plain dict), read without running code by default."""
    file = _verified(path, META, allow_symlinks)
    try:
        meta = safe_load.torch_load(file, weights_only=weights_only,
                                    what="The sharded checkpoint's metadata file")
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} cannot be read ({type(e).__name__}: {e}); it is truncated or "
            f"corrupt, so the checkpoint {str(path)!r} cannot be loaded."
        ) from e
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{str(file)!r} holds a {type(meta).__name__}, not the dict of a sharded "
            f"checkpoint's metadata."
        )
    if meta.get("format") == OLD_FORMAT:
        raise CheckpointError(
            f"{str(path)!r} was written by an older fullshard ({OLD_FORMAT}); fullshard now "
            f"writes Lightning's layout. Load it with the fullshard version that wrote it and "
            f"save it again."
        )
    return meta


def read_index(path: Path, weights_only: bool = True, *, allow_symlinks: bool = False) -> Any:
    """DCP's `.metadata` (global shapes and dtypes of everything saved), checked against the
    files on disk: every data file it points into lies inside the checkpoint directory
    (`inside`), is present and long enough. An index that points outside is named as such
    before its checksum is compared: an edit that makes it escape also changes its sum."""
    file = path / DCP_METADATA
    if not file.is_file() and not file.is_symlink():
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} is missing its file {str(file)!r} (DCP's "
            f"index); it is incomplete and cannot be loaded."
        )
    inside(path, DCP_METADATA, allow_symlinks)
    index = _index_contained(path, weights_only, allow_symlinks)
    sums = integrity.read_sums(path)
    if sums is not None:
        sums.check_file(DCP_METADATA)
    for name, size in sorted(_data_files(index).items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(
                f"The sharded checkpoint {str(path)!r} is missing its file {str(f)!r} (its "
                f"index points {size} bytes into it); it cannot be loaded."
            )
        found = f.stat().st_size
        if found < size:
            raise CheckpointError(
                f"The checkpoint file {str(f)!r} has {found} bytes but its index points {size} "
                f"bytes into it; it is truncated, so {str(path)!r} cannot be loaded."
            )
    return index


def _index_contained(path: Path, weights_only: bool, allow_symlinks: bool) -> Any:
    """The index, read without running code from it (`safe_load`), every data file it names
    checked by `inside`. Only an index the safe reader refuses is checksummed first, and
    unpickled in full (`weights_only=False`) only when its sum matches."""
    try:
        index = safe_load.reader(path, True).read_metadata()
    except Exception as e:
        sums = integrity.read_sums(path)
        if sums is not None:
            sums.check_file(DCP_METADATA)  # corrupt or edited: that is what to say first
        unsafe = isinstance(e, safe_load.UnsafeCheckpointError)
        if unsafe and weights_only:
            raise
        if not unsafe:
            raise _unreadable(path, e) from e
        try:
            index = safe_load.reader(path, False).read_metadata()  # the opt-in
        except Exception as full_error:
            raise _unreadable(path, full_error) from full_error
    for name in _data_files(index):
        inside(path, name, allow_symlinks)
    return index


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"{str(path / DCP_METADATA)!r} cannot be read ({type(e).__name__}: {e}); it is "
        f"truncated or corrupt, so the checkpoint {str(path)!r} cannot be loaded."
    )


def _data_files(index: Any) -> dict[str, int]:
    """Every data file the index points into, and how long it must be."""
    needed: dict[str, int] = {}
    for info in (getattr(index, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed
