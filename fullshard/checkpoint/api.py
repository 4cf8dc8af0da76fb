"""`save_checkpoint` / `load_checkpoint`: the collective entry points over both formats.

Saving and loading are **collective**: every rank of the default process group must call them,
with the same keys in `state` (a common mistake is `if rank == 0: save(...)`). Both start with
a rendezvous through the process group's key-value store (no collective), so a call made on
some ranks only does not hang in a collective: after `timeout / 2` seconds (at most 60) the
waiting rank warns, naming the ranks that have not called, and after `timeout` seconds it
raises a `TimeoutError` saying that saving is collective. In a process without a process group
both work alone (a plain module, or loading a sharded checkpoint into one process).

The save sequence (see `atomic` for the crash-safety argument):
  1. rank 0's absolute path and a fresh temporary name are broadcast;
  2. every rank builds its part without communicating (user `state_dict()` calls, filters) and
     all ranks agree -- on success and on what they are about to save, so a rank with other
     keys or other optimizer state fails loudly here instead of hanging in a collective later;
  3. the data is written under the temporary name (sharded: every rank through DCP, then
     rank 0 `meta.pt`; full: rank 0 one file, gathered first);
  4. all ranks agree that it is complete, then rank 0 renames it into place.
A failure anywhere raises on every rank and leaves the target as it was. With
`async_save=True`, steps 1-2 (and a copy of every tensor) run in the call and 3-4 on a
background thread over a process group of its own (`background`). DCP items are summed as
they are written and the sums saved beside them (`integrity`); a full disk says so.

Loading detects the format from what is on disk: a directory with `meta.pt` is sharded, a
file is full (either format loads into either kind of model). It restores in place every
module, optimizer and stateful object in `state`, puts plain values into `state`, and returns
the checkpoint's entries `state` did not ask for. For a sharded checkpoint those are the
entries of `meta.pt`; sharded modules or optimizers that `state` does not name are not read.
Both formats are Lightning Fabric's, so its checkpoints load here and ours load there. Every
file is read without running code from it unless the caller passes `weights_only=False`
(`safe_load`), is checked against the checksums written with it (`integrity`), and lies
inside the checkpoint directory (`sharded_files.inside`; symlinks only with `allow_symlinks=True`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from fullshard.checkpoint import (
    atomic,
    background,
    full,
    integrity,
    objects,
    safe_load,
    sharded,
    sharded_files,
)
from fullshard.checkpoint.objects import Filter
from fullshard.checkpoint.rendezvous import rendezvous
from fullshard.config import check_bool
from fullshard.distributed import comm

STATE_DICT_TYPES = ("sharded", "full")
DEFAULT_TIMEOUT = 1800.0


def save_checkpoint(
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    state_dict_type: str = "sharded",
    filter: Filter | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    async_save: bool = False,
) -> Path | background.AsyncSave:
    """Save `state` ({'model': model, 'optimizer': optimizer, 'step': 3, ...}) to `path`.

    Collective: every rank calls it. `state_dict_type='sharded'` writes a directory (DCP
    shards + `meta.pt`), `'full'` one file written by rank 0. `filter` maps a state key to
    `callable(name, value) -> bool` selecting the items to keep. Returns the absolute path.

    `async_save=True` returns once the state is copied, with an `AsyncSave` handle whose
    `wait()` returns the path when the checkpoint is in place; the files are written in the
    background, crash-safe as a blocking save (`background`). Every save and load first waits
    for the one in flight and raises its error.
    """
    if not isinstance(async_save, bool):
        raise TypeError(
            f"async_save must be True (write in the background, return a handle) or False "
            f"(the default: return when the checkpoint is in place); got "
            f"{type(async_save).__name__}: {async_save!r}"
        )
    background.wait_pending()
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(
            f"Unknown state_dict_type {state_dict_type!r}; use 'sharded' (a directory, one "
            f"file per rank, reloadable on any world size) or 'full' (one file)."
        )
    if not isinstance(state, Mapping) or not state:
        raise TypeError(
            f"save_checkpoint needs a non-empty dict of what to save, e.g. state={{'model': "
            f"model, 'optimizer': optimizer}}; got {type(state).__name__}: {state!r:.80}"
        )
    objects.check_filter(filter, state)
    group = atomic.world()
    _guard(group, "save_checkpoint", timeout)
    target = _shared_path(path, group)
    token = atomic.new_token(group)
    tmp = atomic.temp_path(target, token)
    rank0 = full.keep_here(group)
    prepare = _save_full if state_dict_type == "full" else _save_sharded
    write = prepare(target, tmp, token, state, filter, group, rank0, async_save)
    if not async_save:
        write(group, None)
        return target
    tail, pg = background.side_group(group)
    return background.start(target, lambda: write(tail, pg))


# A save is prepared on the calling thread (`_save_full` / `_save_sharded`: every collective
# over the training group) and returns `write(group, process_group)`, which writes, agrees
# over `group` (DCP over `process_group`) and renames: at once, or on the background thread.
Write = Callable[[comm.Group | None, Any], None]


def _save_full(target: Path, tmp: Path, token: str, state: Mapping[str, Any],
               filter: Filter | None, group: comm.Group | None, rank0: bool,
               staged: bool) -> Write:
    error: BaseException | None = None
    try:
        if target.is_dir() and not sharded.is_checkpoint_dir(target):
            raise IsADirectoryError(
                f"The checkpoint path {str(target)!r} is a directory that is not a checkpoint; "
                f"a full checkpoint is one file. Choose another path."
            )
        atomic.refuse_foreign(target, directory=False)
        shape = _structure(state)
        local = full.local_entries(state)
    except Exception as e:
        error, shape, local = e, None, {}
    _agree_on(group, error, shape, "save_checkpoint (preparing)")
    ckpt = full.gather(state, filter, keep=rank0, local=local)  # collective
    if staged and rank0:
        ckpt = background.stage(ckpt)  # gathered tensors are fresh; whole ones are live

    def write(tail: comm.Group | None, _: Any) -> None:
        nonlocal ckpt
        error: BaseException | None = None
        try:
            if rank0:
                atomic.remove_stale(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                open(tmp, "xb").close()
                atomic.claim(tmp)
                atomic.save_file(ckpt, tmp)
        except Exception as e:
            if rank0:
                atomic.remove(tmp)  # first: what is free now is what the message reports
            error = integrity.no_space(e, target, tmp, integrity.tensor_bytes(ckpt))
        ckpt = {}
        _finish(target, tmp, token, tail, error, rank0)

    return write


def _save_sharded(target: Path, tmp: Path, token: str, state: Mapping[str, Any],
                  filter: Filter | None, group: comm.Group | None, rank0: bool,
                  staged: bool) -> Write:
    error: BaseException | None = None
    flat: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    shape = None
    try:
        if (target.is_dir() and not sharded.is_checkpoint_dir(target)
                and any(target.iterdir())):
            raise IsADirectoryError(
                f"The checkpoint path {str(target)!r} is a non-empty directory that is not a "
                f"checkpoint; saving would replace it. Choose another path."
            )
        atomic.refuse_foreign(target, directory=True)
        flat, meta, shape = sharded.plan(state, filter)
        if rank0:
            atomic.remove_stale(target)
            tmp.mkdir(parents=True)
            atomic.claim(tmp)
    except Exception as e:
        error = integrity.no_space(e, target, tmp)
    try:
        _agree_on(group, error, shape, "save_checkpoint (preparing)")
    except BaseException:
        if rank0:
            atomic.remove(tmp)
        raise
    if staged:
        flat, meta = background.stage(flat), background.stage(meta)

    def needed() -> int:  # the DCP items' global bytes and meta.pt's
        return integrity.tensor_bytes(flat) + integrity.tensor_bytes(meta)

    def write(tail: comm.Group | None, pg: Any) -> None:
        error: BaseException | None = None
        try:  # collective; a failure raises on every rank
            sums = sharded.write(tmp, flat, tail, process_group=pg)
        except BaseException as e:
            if rank0:
                atomic.remove(tmp)
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: as they are
                raise
            clear = integrity.no_space(e, target, tmp, needed())
            if clear is e:
                raise
            raise clear from None
        try:
            if rank0:  # rank 0 only: the other ranks learn of a failure in `_finish`
                sharded.finish_meta(tmp, meta, sums)
        except Exception as e:
            error = integrity.no_space(e, target, tmp, needed())
        _finish(target, tmp, token, tail, error, rank0)

    return write


def _finish(target: Path, tmp: Path, token: str, group: comm.Group | None,
            error: BaseException | None, rank0: bool) -> None:
    """Agree that every part is written, then rename into place (rank 0) and agree on that."""
    try:
        atomic.agree(group, error, f"save_checkpoint({str(target)!r}) while writing")
        if rank0:
            try:
                if tmp.is_dir():
                    atomic.fsync_dir(tmp)
                atomic.commit(tmp, target, token)
            except Exception as e:
                error = e
        atomic.agree(group, error, f"save_checkpoint({str(target)!r}) while renaming")
    except BaseException:
        if rank0:
            atomic.remove(tmp)
        raise


def _structure(state: Mapping[str, Any]) -> Any:
    """What the ranks must agree on before the full format's collectives: the keys, their
    kinds, and which optimizer state exists (each sharded tensor is one gather)."""
    out = []
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        extra: Any = None
        if kind == objects.OPTIMIZER:
            sd = obj.state_dict()["state"]
            extra = sorted((i, tuple(sorted(e))) for i, e in sd.items())
        elif kind == objects.MODULE:
            extra = objects.is_sharded(obj)
        out.append((key, kind, extra))
    return out


def _agree_on(group: comm.Group | None, error: BaseException | None, shape: Any,
              what: str) -> None:
    """`atomic.agree`, and every rank's `shape` must equal rank 0's."""
    if group is None:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = comm.all_gather_object((mine, shape), group)
    if error is not None:
        raise error
    failed = {r: t for r, (t, _) in zip(group.ranks, reports) if t is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {t}" for r, t in failed.items())
        raise RuntimeError(f"{what} failed on rank(s) {', '.join(map(str, failed))}: {detail}")
    differ = [r for r, (_, s) in zip(group.ranks, reports) if s != reports[0][1]]
    if differ:
        raise ValueError(
            f"{what}: rank(s) {', '.join(map(str, differ))} are saving a different state than "
            f"rank {group.ranks[0]} (other keys, or optimizer state for other parameters): "
            f"{_first_difference(reports[0][1], reports[group.ranks.index(differ[0])][1])}. "
            f"Every rank must save the same keys and objects."
        )


def _first_difference(a: Any, b: Any) -> str:
    text_a, text_b = repr(a), repr(b)
    i = next((i for i, (x, y) in enumerate(zip(text_a, text_b)) if x != y),
             min(len(text_a), len(text_b)))
    return f"...{text_a[max(0, i - 40):i + 40]}... vs ...{text_b[max(0, i - 40):i + 40]}..."


def load_checkpoint(
    path: str | os.PathLike,
    state: dict[str, Any] | nn.Module | None = None,
    *,
    strict: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    weights_only: bool | None = None,
    allow_symlinks: bool = False,
) -> dict[str, Any]:
    """Load the checkpoint at `path` (format detected from disk) into `state` in place and
    return its entries that `state` did not ask for. Collective.

    `weights_only` (None means True): read every file without running code from it --
    tensors and plain Python values only, which is all fullshard (and Lightning) write. A file
    holding other objects raises `UnsafeCheckpointError`; `weights_only=False` unpickles it
    fully, which can run arbitrary code: only for files you trust.

    `state` may be a dict (modules, optimizers, stateful objects, values), a single module
    (its weights only), or None (returns the whole checkpoint as a full-format dict; for a
    sharded checkpoint every rank then reads all of it). `strict=False` tolerates keys missing
    on either side and warns about them.

    Every file is checked against the checksums saved with it (`integrity`; a checkpoint
    without them loads with a warning) and a sharded checkpoint reads only files inside its
    directory: a symlink there is refused unless `allow_symlinks=True`.
    """
    check_bool("strict", strict)  # "no" would otherwise mean True
    weights_only = safe_load.resolve(weights_only)
    background.wait_pending()  # the save in flight may be the checkpoint being loaded
    if not isinstance(allow_symlinks, bool):
        raise TypeError(
            f"allow_symlinks must be True or False (the default: refuse symlinks inside a "
            f"sharded checkpoint); got {type(allow_symlinks).__name__}: {allow_symlinks!r}"
        )
    group = atomic.world()
    _guard(group, "load_checkpoint", timeout)
    path = _shared_path(path, group)
    if sharded.is_checkpoint_dir(path):
        fmt = "sharded"
    elif path.is_file():
        fmt = "full"
    elif path.is_dir():
        raise ValueError(
            f"The path {str(path)!r} does not point to a valid checkpoint: "
            f"{sharded.describe_dir(path)}. Expected a directory with meta.pt (sharded) or "
            f"a single file (full)."
        )
    else:
        raise FileNotFoundError(
            f"No checkpoint at {str(path)!r}.{atomic.describe_missing(path)}"
        )
    if state is None:
        if fmt == "full":
            return full.read(path, weights_only)
        from fullshard.checkpoint.consolidate import to_full

        return to_full(path, weights_only=weights_only)
    if isinstance(state, nn.Module):
        return _load_module_only(path, fmt, state, strict, group, weights_only, allow_symlinks)
    if not isinstance(state, dict):
        raise TypeError(
            f"load_checkpoint(state=...) takes a dict of the objects to restore, a module, or "
            f"None; got {type(state).__name__}."
        )
    if fmt == "full":
        return full.load(full.read(path, weights_only), state, strict, path)
    meta = sharded_files.read_meta(path, weights_only, allow_symlinks=allow_symlinks)
    return sharded.load(path, meta, state, strict, group, weights_only,
                        allow_symlinks=allow_symlinks)


def _load_module_only(path: Path, fmt: str, module: nn.Module, strict: bool,
                      group: comm.Group | None, weights_only: bool,
                      allow_symlinks: bool) -> dict[str, Any]:
    """`state` is one module (Lightning's `load_raw(path, module)`): its weights only."""
    if fmt == "sharded":
        meta = sharded_files.read_meta(path, weights_only, allow_symlinks=allow_symlinks)
        index = sharded_files.read_index(path, weights_only, allow_symlinks=allow_symlinks)
        saved = sharded.entries(index)
        keys = [k for k, v in saved.items() if sharded.kind_of_entry(v) == objects.MODULE]
        if len(keys) != 1:
            raise ValueError(
                f"The checkpoint {str(path)!r} holds {len(keys)} modules ({keys}); pass "
                f"state={{key: module}} to say which to load."
            )
        sharded.load(path, meta, {keys[0]: module}, strict, group, weights_only,
                     allow_symlinks=allow_symlinks)
        return {}
    ckpt = full.read(path, weights_only)
    candidates = [k for k, v in ckpt.items() if isinstance(v, Mapping)]
    if all(not isinstance(v, Mapping) for v in ckpt.values()):
        sd: Any = ckpt  # a bare state dict: torch.save(model.state_dict(), path)
    elif "model" in ckpt and isinstance(ckpt["model"], Mapping):
        sd = ckpt["model"]
    elif len(candidates) == 1:
        sd = ckpt[candidates[0]]
    else:
        raise ValueError(
            f"The checkpoint {str(path)!r} holds several dicts ({candidates}); pass "
            f"state={{key: module}} to say which is the module's state dict."
        )
    full.load_module(module, sd, strict, "model")
    return {}


def _shared_path(path: str | os.PathLike, group: comm.Group | None) -> Path:
    """Rank 0's path, made absolute, on every rank."""
    mine = str(Path(os.fspath(path)).expanduser().absolute())
    if group is None:
        return Path(mine)
    return Path(comm.broadcast_pickled(mine, group.ranks[0], group))


def _guard(group: comm.Group | None, name: str, timeout: float) -> None:
    """Fail clearly, not hang, when only some ranks call `name` (see the module docstring)."""
    if group is None:
        return

    def slow(missing: list[int]) -> None:
        warnings.warn(
            f"{name}: rank {group.rank} has waited {warn_after:.0f}s for rank(s) "
            f"{', '.join(map(str, missing))} to call it too. {name} is collective: every rank "
            f"must call it (not only `if rank == 0:`). Giving up after {timeout:.0f}s.",
            stacklevel=4,
        )

    warn_after = min(60.0, timeout / 2)
    rendezvous(name, timeout=timeout, warn_after=warn_after, on_slow=slow)
