"""What comm.py's collectives return and count: the `Group` a collective runs on, the
per-kind counters behind `comm_stats()`, and the `CommHandle` of a collective in flight.

Nothing here issues a collective (comm.py is the only module that does); it is split out of
comm.py so that file can stay about the algorithms. comm.py re-exports every name.

Asynchronous calls return a `CommHandle`; its `wait()` blocks until the data is in place (for
the gloo reduce-scatter that includes summing our chunk). Until `wait()` returns, the caller
must keep the input and output tensors alive and untouched; the handle holds references to
them until then.

[Note: CUDA streams]
With NCCL every asynchronous collective runs on the process group's own stream, which first
waits for the work already queued on the current (compute) stream -- so a buffer filled on
the compute stream (the cast/offloaded all-gather input, the packed gradients) is complete
before NCCL reads it -- and `wait()` makes the compute stream wait for the collective, so
kernels queued after it see the result. Memory crosses streams safely without
`record_stream`: every buffer is allocated on the compute stream and the handle keeps it
referenced until `wait()` has ordered the compute stream after the collective; only then can
the caching allocator hand the block out again, to work that is queued after the collective.
Gathers for the next unit and reductions of the previous one thus overlap compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "scatter")


@dataclass(frozen=True)
class Group:
    """A process group together with the facts about it that the hot path needs."""

    pg: Any
    """The `ProcessGroup`, or None for the default (world) group."""
    size: int
    rank: int
    """This process's rank inside the group."""
    ranks: tuple[int, ...]
    """Global ranks of the members, in group-rank order."""
    backend: str

    @classmethod
    def from_process_group(cls, pg: Any = None) -> Group:
        ranks = tuple(dist.get_process_group_ranks(pg or dist.group.WORLD))
        return cls(
            pg=pg,
            size=dist.get_world_size(pg),
            rank=dist.get_rank(pg),
            ranks=ranks,
            backend=str(dist.get_backend(pg)).lower(),
        )


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls = dict.fromkeys(KINDS, 0)
            self.bytes = dict.fromkeys(KINDS, 0)
            self.wire_bytes = dict.fromkeys(KINDS, 0)
            self.header_messages = self.header_bytes = 0

    def add(self, kind: str, nbytes: int, wire: float) -> None:
        with self._lock:
            self.calls[kind] += 1
            self.bytes[kind] += nbytes
            self.wire_bytes[kind] += int(wire)

    def add_headers(self, messages: int, nbytes: int) -> None:
        """`messages` headers of `nbytes` each (sent alone or folded into data messages)."""
        with self._lock:
            self.header_messages += messages
            self.header_bytes += messages * nbytes


_COUNTERS = _Counters()


def comm_stats() -> dict[str, dict[str, int]]:
    """Collectives issued by this process since the last reset, by kind.

    Returns `{kind: {"calls": int, "bytes": int, "wire_bytes": int}}` for every kind in
    `KINDS` (see the module docstring for what the numbers mean).
    """
    c = _COUNTERS
    return {
        k: {"calls": c.calls[k], "bytes": c.bytes[k], "wire_bytes": c.wire_bytes[k]} for k in KINDS
    }


def header_stats() -> dict[str, int]:
    """The divergence headers this process sent since the last reset (see [Note: ranks that
    run different units] in distributed/gloo.py): not in `comm_stats()`, which counts the
    collectives' data; `bytes` is what they add on the wire, folded into data messages or not."""
    return {"messages": _COUNTERS.header_messages, "bytes": _COUNTERS.header_bytes}


def reset_comm_stats() -> None:
    """Set every collective counter back to zero."""
    _COUNTERS.reset()


class HeaderCheck(Protocol):
    """What a handle needs of a divergence header (gloo.py's `Header`): `check()` waits for
    the peers' headers and raises if they announce another collective. A protocol, so this file
    does not import gloo.py, which builds on it."""

    def check(self) -> None: ...


_UNFINISHED: list[tuple[Any, tuple, Any]] = []
"""What handles dropped unwaited left in flight: (works, tensors, header), kept until done.

[Note: a dropped exchange stays alive]
A handle may be dropped before it is waited for: a model thrown away after a forward with
grad leaves the gathers backward would have used in flight. Gloo must not lose a posted
message: freeing a send or receive before it completes leaves the pair's queue waiting for
it, and every later exchange between those two ranks hangs until the group's timeout
(measured: one exchange dropped unwaited, the next one times out). So a handle dropped
unfinished hands its works, buffers and header here, and they are let go once all are
complete (checked whenever a handle is dropped unfinished or a new one starts)."""


def _let_go_of_finished() -> None:
    _UNFINISHED[:] = [u for u in _UNFINISHED if not all(w.is_completed() for w in u[0])]


class CommHandle:
    """A collective in flight: its works (one, or a pairwise exchange's messages), what to do
    once they are complete (`on_done`) and what they read and write (`refs`, kept alive until
    then). `wait()` is idempotent; dropped unwaited, its messages stay alive until they
    complete (see [Note: a dropped exchange stays alive])."""

    __slots__ = ("_works", "_on_done", "_refs", "_header", "done")

    def __init__(
        self,
        works: list[Any] | tuple = (),
        on_done: Callable[[], None] | None = None,
        refs: tuple = (),
        header: HeaderCheck | None = None,
    ) -> None:
        self._works, self._on_done, self._refs = works, on_done, refs
        self._header = header  # checked before any data is waited for
        self.done = not works and on_done is None and header is None
        if _UNFINISHED:
            _let_go_of_finished()

    def __del__(self) -> None:
        if self.done:
            return
        works = [*self._works, *getattr(self._header, "works", ())]
        if works:
            _UNFINISHED.append((works, self._refs, self._header))
            _let_go_of_finished()

    def wait(self) -> None:
        if self.done:
            return
        if self._header is not None:
            header, self._header = self._header, None
            header.check()
        for w in self._works:
            w.wait()
        if self._on_done is not None:
            self._on_done()
        self._works, self._on_done, self._refs = (), None, ()
        self.done = True


_DONE = CommHandle()


def _settle(handle: CommHandle, async_op: bool) -> CommHandle:
    """What a collective returns: its handle if asynchronous, else done (after waiting)."""
    if async_op:
        return handle
    handle.wait()
    return _DONE


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
