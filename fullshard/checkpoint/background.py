"""Asynchronous saves: `save_checkpoint(..., async_save=True)` returns while the files are
written in the background.

The name follows `torch.distributed.checkpoint.async_save`, the torch API for the same thing
(a keyword, since `async` is reserved in Python); like it, the call returns a handle whose
`wait()` blocks until the checkpoint is in place (and returns its path) or raises why not.

What happens where:
- on the calling (training) thread, before the call returns: everything collective over the
  training process group -- the rendezvous, the agreement on what is saved, the full
  format's gather onto rank 0 -- and a copy ("staging") of every tensor to be written, so
  training may change the parameters and optimizer state at once;
- on one background thread per process: the writing, the agreement that every rank's part is
  complete, and rank 0's rename, exactly as a blocking save does them (`api`, `atomic`): so a
  crash or SIGKILL mid-write leaves the previous checkpoint. Its collectives (DCP's planning,
  the agreements) run over a process group of their own (gloo, created once, on the first
  asynchronous save), never over the training group, so they cannot interleave with the
  training's collectives.

At most one save is in flight per process: the next save (blocking or not), any load, and
`wait_pending()` first wait for it, and raise its error if it failed and the handle's `wait()`
has not raised it already -- a failure is never lost, nor raised twice: if nothing waited for
it, it is printed at process exit, which waits for the thread (a non-daemon thread). Call
`wait_pending()` (or the handle's `wait()`) before `destroy_process_group()`, which would take
the background save's process group with it.

The staged copy costs host memory: the rank's share of the checkpoint (rank 0: the whole
full checkpoint), held until the write ends. On CUDA a DTensor's shard is copied on its
device and other tensors to CPU memory (this has not run on a GPU).
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fullshard.distributed import comm


class AsyncSave:
    """The handle of a save running in the background (`save_checkpoint(async_save=True)`)."""

    def __init__(self, target: Path, work: Callable[[], None]) -> None:
        self.path = target
        self._error: BaseException | None = None
        self._surfaced = False  # its error was raised to someone
        self._thread = threading.Thread(target=self._run, args=(work,),
                                        name=f"fullshard-save {target.name}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(); printed at exit if nobody waits
            self._error = e

    def done(self) -> bool:
        """True once the write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is in place and return its path, or raise the error
        that made the save fail."""
        self._thread.join()
        if self._error is not None:
            self._surfaced = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error else "done"
        return f"AsyncSave({str(self.path)!r}, {state})"


_PENDING: AsyncSave | None = None


def wait_pending() -> Path | None:
    """Wait for the save in flight in this process, if any; raise its error if it failed and
    its handle's `wait()` has not raised it already (an error is raised once)."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    pending._thread.join()
    return None if pending._surfaced else pending.wait()


def start(target: Path, work: Callable[[], None]) -> AsyncSave:
    global _PENDING
    wait_pending()
    _PENDING = AsyncSave(target, work)
    return _PENDING


@atexit.register
def _report_at_exit() -> None:
    pending = _PENDING
    if pending is None:
        return
    try:
        pending.wait()
    except BaseException as e:
        if pending._surfaced:
            return
        print(f"fullshard: the asynchronous save of {str(pending.path)!r} failed, and nothing "
              f"waited for it: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


# -- the background save's own process group ----------------------------------------------------
_SIDE: dict[int, tuple[comm.Group, Any]] = {}


def side_group(group: comm.Group | None) -> tuple[comm.Group | None, Any]:
    """`(group, process_group)` for the background thread's collectives: a gloo group over
    the same ranks as the default group (collective on the first call: every rank saves)."""
    if group is None:
        return None, None
    import torch.distributed as dist

    key = id(dist.group.WORLD)  # a new default group (a re-initialized job): a new group
    if key not in _SIDE:
        pg = dist.new_group(ranks=list(group.ranks), backend="gloo")
        _SIDE.clear()
        _SIDE[key] = (comm.Group.from_process_group(pg), pg)
    return _SIDE[key]


# -- staging ---------------------------------------------------------------------------------
def stage(tree: Any) -> Any:
    """A copy of `tree` (nested dicts/lists of tensors, DTensors and plain values) that later
    changes to the live tensors do not reach: tensors copied to CPU memory, DTensors rebuilt
    over copies of their local shards, other values deep-copied."""
    import copy

    if isinstance(tree, dict):
        return {k: stage(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [stage(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(stage(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(tree, DTensor):
            local = tree.to_local().detach().clone()  # same device, as DCP expects
            return DTensor.from_local(local, tree.device_mesh, tree.placements,
                                      run_check=False, shape=tree.shape, stride=tree.stride())
        t = tree.detach()
        return t.clone() if t.device.type == "cpu" else t.to("cpu", copy=True)
    return copy.deepcopy(tree)
