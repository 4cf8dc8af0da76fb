"""A rendezvous of every rank through the process group's key-value store (no collective),
which guards the collective checkpoint calls against being made on one rank only."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

_RENDEZVOUS_SEQ: dict[str, int] = {}


def rendezvous(
    name: str,
    *,
    timeout: float,
    warn_after: float | None = None,
    on_slow: Callable[[list[int]], None] | None = None,
) -> None:
    """Wait until every rank of the default group has called `rendezvous(name)` as often as
    this one -- through the process group's key-value store, not a collective.

    It guards calls that are collective but easy to make on one rank only (`if rank == 0:
    save(...)`): a collective would hang there until the group's timeout, or pair with the
    other ranks' next unrelated collective. Here nothing is sent on the group, so a missing
    rank only costs the wait: after `warn_after` seconds `on_slow(missing_ranks)` is called
    once (to warn), after `timeout` seconds a `TimeoutError` names the ranks that never came,
    and this call is forgotten (the next one pairs with the other ranks' first).
    Not counted in `comm_stats()`: it moves no tensor over the group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank, size = dist.get_rank(), dist.get_world_size()
    seq = _RENDEZVOUS_SEQ.get(name, 0) + 1
    prefix = f"fullshard/rendezvous/{name}/{seq}/"
    store.set(f"{prefix}{rank}", b"1")
    start = time.monotonic()
    pending = [r for r in range(size) if r != rank]
    warned, pause = False, 0.001
    while pending:
        pending = [r for r in pending if not store.check([f"{prefix}{r}"])]
        if not pending:
            break
        waited = time.monotonic() - start
        if not warned and warn_after is not None and waited >= warn_after and on_slow:
            warned = True
            on_slow(pending)
        if waited >= timeout:
            store.delete_key(f"{prefix}{rank}")
            raise TimeoutError(
                f"rank {rank} waited {waited:.0f}s in {name!r} for rank(s) "
                f"{', '.join(map(str, pending))}, which never called it. {name!r} is "
                f"collective: every rank must call it (do not wrap it in `if rank == 0:`)."
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    _RENDEZVOUS_SEQ[name] = seq
