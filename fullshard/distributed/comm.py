"""The only module that calls torch.distributed collectives; it counts every call and byte.

Every collective fullshard runs goes through a function here, so `comm_stats()` is the whole
truth about what was sent, per *kind* (the collective the algorithm asks for, `KINDS`):
`calls`; `bytes`, the logical payload (an all-gather's full output, a reduce-scatter's full
input, the tensor of an all-reduce or broadcast, everything a scatter hands out); and
`wire_bytes`, what this rank actually sends for it with the algorithm we used.

On gloo, all-gathers, reduce-scatters and small sum all-reduces run as gloo.py's
point-to-point exchanges ([Note: gloo's all-gather and reduce-scatter] in
distributed/gloo.py); this module decides how they travel (`_exchanges`): packed into one
message per peer when small, several collectives in one exchange when the engine's seam
(unit_comm.py) issues them together (the `*_batch` functions; each counts as one call).

[Note: the NCCL algorithm on gloo, for tests]
`use_native_collectives(True)` (or FULLSHARD_NATIVE_COLLECTIVES=1 in the environment) makes
gloo groups take NCCL's code path: the backend's own all-gather (rank-major output, reordered
by unit_comm.py) and reduce-scatter (on packed chunks), so every line of it except CUDA streams
runs in the CPU test suite. It is for tests only: on gloo those collectives are slower.

A group of size 1 communicates nothing: those calls become local copies and are not counted.

Asynchronous calls return a `CommHandle`; its `wait()` blocks until the data is in place (for
the gloo reduce-scatter, our chunk summed). Until then the caller leaves the input and output
untouched; the handle keeps them alive.

[Note: CUDA streams]
With NCCL every asynchronous collective runs on the process group's own stream, which first
waits for the work queued on the current (compute) stream, so a buffer filled there (the cast
all-gather input, the packed gradients) is complete before NCCL reads it; `wait()` makes the
compute stream wait for the collective. Memory crosses streams safely without
`record_stream`: every buffer is allocated on the compute stream and the handle keeps it
referenced until `wait()` has ordered the compute stream after the collective, so the caching
allocator can only hand the block out again to work queued after the collective.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fullshard.distributed import gloo
from fullshard.distributed.gloo import HEADER_MAX, MAX_BATCH, exchange_id, header_size
from fullshard.distributed.gloo import RankDivergenceError as RankDivergenceError
from fullshard.distributed.gloo import register_label as register_label
from fullshard.distributed.mesh import Group as Group

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "scatter")


class _Counters:
    """Per kind: calls, bytes and wire bytes; and the divergence headers sent."""

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
    """`{kind: {"calls", "bytes", "wire_bytes"}}` of the collectives this process issued since
    the last reset, for every kind in `KINDS` (the module docstring says what they mean)."""
    c = _COUNTERS
    return {k: {"calls": c.calls[k], "bytes": c.bytes[k], "wire_bytes": c.wire_bytes[k]}
            for k in KINDS}


def header_stats() -> dict[str, int]:
    """The divergence headers this process sent since the last reset (see [Note: ranks that
    run different units] in distributed/gloo.py): not in `comm_stats()`, which counts the
    collectives' data; `bytes` is what they add on the wire, folded into data messages or not."""
    return {"messages": _COUNTERS.header_messages, "bytes": _COUNTERS.header_bytes}


def reset_comm_stats() -> None:
    """Set every collective counter back to zero."""
    _COUNTERS.reset()


_UNFINISHED: list[tuple[Any, tuple, Any]] = []
"""What handles dropped unwaited left in flight: (works, tensors, header), kept until done.

[Note: a dropped exchange stays alive]
A handle may be dropped unwaited: a model thrown away after a forward with grad leaves the
gathers backward would have used in flight. Gloo must not lose a posted message: freeing a
send or receive before it completes leaves the pair's queue waiting for it, and the next
exchange between those two ranks hangs until the group's timeout (measured). So a handle
dropped unfinished hands its works, buffers and header here, let go once all are complete
(checked whenever a handle is dropped unfinished or a new one starts)."""


def _let_go_of_finished() -> None:
    _UNFINISHED[:] = [u for u in _UNFINISHED if not all(w.is_completed() for w in u[0])]


class CommHandle:
    """A collective in flight: its works (one, or a pairwise exchange's messages), what to do
    once they are complete (`on_done`) and what they read and write (`refs`, kept alive until
    then). `wait()` is idempotent; dropped unwaited, its messages stay alive until they
    complete (see [Note: a dropped exchange stays alive])."""

    __slots__ = ("_works", "_on_done", "_refs", "_header", "done")

    def __init__(self, works: list[Any] | tuple = (), on_done: Callable[[], None] | None = None,
                 refs: tuple = (), header: gloo.Header | None = None) -> None:
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


# torch 2.13 renamed the tensor collectives; the old names still exist but warn.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

COALESCE_BYTES = 1 << 20
"""Pairwise exchanges of at most this many bytes per rank go out as one message per peer
(`_small`); the engine batches small units within it (unit_comm.SMALL_UNITS_BYTES). 0 turns
both off. 4 MiB measured the same as 1 MiB, so the smaller copies and header buffers stay."""

_NATIVE_ON_GLOO = os.environ.get("FULLSHARD_NATIVE_COLLECTIVES", "") == "1"


def use_native_collectives(enabled: bool) -> bool:
    """For tests only: make gloo groups use the backend's all-gather / reduce-scatter, i.e.
    the NCCL code path (see the module docstring). Returns the previous setting."""
    global _NATIVE_ON_GLOO
    previous, _NATIVE_ON_GLOO = _NATIVE_ON_GLOO, bool(enabled)
    return previous


def pairwise_exchanges(group: Group) -> bool:
    """Whether this group's all-gathers, reduce-scatters and small sums run as gloo.py's
    point-to-point exchanges, which land segments in place and carry several collectives."""
    return group.size > 1 and group.backend == "gloo" and not _NATIVE_ON_GLOO


def _small(nbytes: int) -> bool:
    """Send a pairwise exchange of `nbytes` per rank packed, one message per peer? Below
    `COALESCE_BYTES` packing's copy costs less than one message per piece (see [Note: gloo's
    all-gather and reduce-scatter] in distributed/gloo.py). Only sizes decide: every rank agrees."""
    return 0 < nbytes <= COALESCE_BYTES


def _batchable(tensors: Sequence[torch.Tensor]) -> bool:
    """Send the collectives of these tensors (what each rank sends of each) as one exchange?
    Small, of one dtype, and not too many for one header."""
    return (1 < len(tensors) <= MAX_BATCH and _small(sum(_nbytes(t) for t in tensors))
            and len({t.dtype for t in tensors}) == 1)


def _header_capacity() -> int:
    """Bytes of every receive that may meet a header: the largest folded message, rounded up
    to int64 words (see [Note: ranks that run different units] in distributed/gloo.py)."""
    return HEADER_MAX + -(-max(COALESCE_BYTES, 0) // 8) * 8


_SEQ: dict[int, int] = {}


def _exchange(kind: str, labels: Sequence[str | None], checks: Sequence[bool], group: Group
              ) -> tuple[int, list[int], bool]:
    """A new exchange on `group`: its position in the group's sequence (the same on every
    member while they issue the same collectives in the same order: the headers check it),
    the identifiers (kind + label) of the collectives it carries, and whether it carries a
    header -- on gloo, for several collectives or one labelled and checked -- counted here."""
    _SEQ[id(group.pg)] = seq = _SEQ.get(id(group.pg), 0) + 1
    idents = [exchange_id(kind, label or "") for label in labels]
    header = group.backend == "gloo" and (len(labels) > 1 or (labels[0] is not None and checks[0]))
    if header:  # one to each peer, sent alone or folded into the data messages
        _COUNTERS.add_headers(group.size - 1, header_size(len(idents)))
    return seq, idents, header


def _exchanges(kind: str, sent: Sequence[torch.Tensor], pieces: Sequence[Sequence[Any]],
               labels: Sequence[str | None], checks: Sequence[bool], group: Group
               ) -> Iterator[tuple[list[int], tuple[int, list[int], bool], bool]]:
    """How pairwise collectives travel (`sent`: what this rank sends of each, in `pieces`):
    all as one packed exchange when `_batchable`, else one by one, each packed into one
    message per peer when `_small` and split into pieces or carrying a header. Yields
    (the collectives' indices, their `_exchange`, packed), each exchange opened in turn."""
    if _batchable(sent):
        yield list(range(len(sent))), _exchange(kind, labels, checks, group), True
        return
    for i, (label, check) in enumerate(zip(labels, checks)):
        packed = _small(_nbytes(sent[i])) and (len(pieces[i]) > 1 or bool(label and check))
        yield [i], _exchange(kind, [label], [check], group), packed


def _native(kind: str, work: Any, refs: tuple, group: Group, label: str | None, check: bool,
            async_op: bool) -> CommHandle:
    """The handle of a backend collective; on gloo, labelled and checked, it gets a header, a
    message of its own."""
    seq, idents, header = _exchange(kind, [label], [check], group)
    own = gloo.Header(group, seq, idents, capacity=_header_capacity()) if header else None
    return _settle(CommHandle([work], refs=refs, header=own), async_op)


def _checks(check: bool | Sequence[bool], n: int) -> list[bool]:
    return [check] * n if isinstance(check, bool) else list(check)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False,
               segments: Sequence[int] | None = None, label: str | None = None,
               check: bool = True) -> CommHandle:
    """Gather every rank's `input` into `output` (`group.size * input.numel()` elements).

    Without `segments` the output is rank-major: rank r's input at `[r*n, (r+1)*n)`. With
    `segments` (sizes that split `input` into consecutive pieces, e.g. one per parameter;
    only where `pairwise_exchanges(group)`), the output is *segment-major*: piece j of every
    rank, in rank order, then piece j+1, each parameter's rows contiguous, straight from the
    wire (small exchanges: one message per peer, placed by one copy).

    `label` (the unit and bucket) goes into the tags and, with `check`, into a header checked
    on gloo: see [Note: ranks that run different units] in distributed/gloo.py.
    """
    items = [(output, input, segments, label)]
    return all_gather_batch(items, group, async_op=async_op, check=check)[0]


def all_gather_batch(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[int] | None, str | None]],
    group: Group, *, async_op: bool = False, check: bool | Sequence[bool] = True,
) -> list[CommHandle]:
    """Several all-gathers `(output, input, segments, label)` (see `all_gather`). On gloo,
    inputs of one dtype adding up to at most `COALESCE_BYTES` travel as one exchange sharing
    one handle, each still counted as one all-gather; else one after the other, item i with
    its header if `check` (or `check[i]`)."""
    if group.size == 1:
        for output, input, _, _ in items:
            output.copy_(input.reshape(output.shape))
        return [_DONE] * len(items)
    pairwise = pairwise_exchanges(group)
    if not pairwise and any(s is not None and len(s) > 1 for _, _, s, _ in items):
        raise ValueError("a segment-major all-gather needs pairwise_exchanges(group)")
    for output, *_ in items:
        n = _nbytes(output)
        _COUNTERS.add("all_gather", n, n * (group.size - 1) / group.size)
    checks, handles = _checks(check, len(items)), []
    if not pairwise:
        for (output, input, _, label), check in zip(items, checks):
            work = _all_gather_into(output, input, group=group.pg, async_op=True)
            handles.append(_native("all_gather", work, (output, input), group, label, check,
                                   async_op))
        return handles
    pieces = [[x[1].numel()] if x[2] is None else list(x[2]) for x in items]
    sent, labels = [x[1] for x in items], [x[3] for x in items]
    for chosen, exchange, packed in _exchanges("all_gather", sent, pieces, labels, checks, group):
        parts = [(items[i][0], items[i][1], pieces[i]) for i in chosen]
        handle = CommHandle(*gloo.all_gather(parts, group, *exchange, packed=packed,
                                             capacity=_header_capacity()))
        handles += [_settle(handle, async_op)] * len(chosen)
    return handles


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, *,
                   async_op: bool = False, label: str | None = None, check: bool = True
                   ) -> CommHandle:
    """Sum `input` (rank-major, `group.size` equal chunks) over the group; this rank's chunk of
    the sum lands in `output`. (`label`, `check`: see `all_gather`.)"""
    if group.size == 1:
        output.copy_(input.reshape(output.shape))
        return _DONE
    if pairwise_exchanges(group):  # the packed input is one segment of `group.size` chunks
        items = [(output, [input.reshape(-1)], [output.numel()], label)]
        return reduce_scatter_batch(items, group, async_op=async_op, check=check)[0]
    n = _nbytes(input)
    _COUNTERS.add("reduce_scatter", n, n * (group.size - 1) / group.size)
    work = _reduce_scatter_into(output, input, group=group.pg, async_op=True)
    return _native("reduce_scatter", work, (output, input), group, label, check, async_op)


def reduce_scatter_batch(
    items: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor], Sequence[int], str | None]],
    group: Group, *, async_op: bool = False, check: bool | Sequence[bool] = True,
) -> list[CommHandle]:
    """Reduce-scatters `(output, inputs, sizes, label)` of unpacked tensors (only where
    `pairwise_exchanges(group)`), batched as `all_gather_batch`'s.

    `output` is split into consecutive segments of `sizes`; `inputs[j]` is a flat tensor of
    at most `group.size * sizes[j]` elements, read as `group.size` chunks of `sizes[j]` (the
    last ones short or empty: what is missing counts as zero, e.g. a parameter's padding
    rows). Rank r's chunk of every input, summed over the group in rank order, lands in
    segment j of rank r's `output`, padding zeroed: `reduce_scatter` of the inputs packed
    rank-major, without the packing (each chunk is sent straight from its input, real
    elements only). The inputs must stay unmodified until `wait()`.
    """
    if not pairwise_exchanges(group):
        raise ValueError("a reduce-scatter of segments needs pairwise_exchanges(group)")
    plans = [gloo.segments_plan(output, inputs, sizes, group)
             for output, inputs, sizes, _ in items]
    peers = [r for r in range(group.size) if r != group.rank]
    for (output, _, _, _), plan in zip(items, plans):
        # wire bytes: the real elements of every peer's chunks (no padding is sent)
        wire = sum(real[r] * x.element_size() for x, _, real in plan for r in peers)
        _COUNTERS.add("reduce_scatter", group.size * _nbytes(output), wire)
    handles, labels = [], [x[3] for x in items]
    sent, checks = [x[0] for x in items], _checks(check, len(items))
    for chosen, exchange, packed in _exchanges("reduce_scatter", sent, plans, labels, checks,
                                               group):
        handle = CommHandle(*gloo.reduce_scatter(
            [items[i] for i in chosen], [plans[i] for i in chosen], group, *exchange,
            packed=packed, capacity=_header_capacity()))
        handles += [_settle(handle, async_op)] * len(chosen)
    return handles


def all_reduce(tensor: torch.Tensor, group: Group, *,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
               label: str | None = None, check: bool = True) -> CommHandle:
    """Reduce `tensor` in place over the group (`label`, `check`: see `all_gather`).

    On gloo a small sum travels as one message per peer (`_packed_sum`), the header folded
    in; anything else is the backend's all-reduce, with a header message of its own."""
    if group.size == 1:
        return _DONE
    if _packed_sum(group, op, [tensor]):
        return _all_reduce_packed([(tensor, label)], group, async_op, [check])[0]
    n = _nbytes(tensor)
    _COUNTERS.add("all_reduce", n, 2 * n * (group.size - 1) / group.size)
    work = dist.all_reduce(tensor, op=op, group=group.pg, async_op=True)
    if label is None or not check:  # no header: the sequence number is not needed
        return _settle(CommHandle([work], refs=(tensor,)), async_op)
    return _native("all_reduce", work, (tensor,), group, label, check, async_op)


def all_reduce_batch(items: Sequence[tuple[torch.Tensor, str | None]], group: Group, *,
                     async_op: bool = False, check: bool | Sequence[bool] = True
                     ) -> list[CommHandle]:
    """Several sum all-reduces `(tensor, label)` issued together: as one exchange sharing one
    handle when `_packed_sum` allows them all at once (the engine batches NO_SHARD's small
    units this way; each still counts as one all-reduce), else one after the other."""
    checks = _checks(check, len(items))
    tensors = [t for t, _ in items]
    if len(items) <= MAX_BATCH and _packed_sum(group, dist.ReduceOp.SUM, tensors):
        return _all_reduce_packed(items, group, async_op, checks)
    return [all_reduce(t, group, async_op=async_op, label=label, check=c)
            for (t, label), c in zip(items, checks)]


def _packed_sum(group: Group, op: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Sum these tensors as one packed exchange (`gloo.all_reduce`)? On gloo, for a sum of
    contiguous tensors of one dtype whose copies to all peers, N-1 times their bytes, stay
    within `COALESCE_BYTES`: there one message round beats the ring's 2(N-1) steps."""
    return (pairwise_exchanges(group) and op == dist.ReduceOp.SUM
            and len({t.dtype for t in tensors}) == 1 and tensors[0].dtype != torch.bool
            and all(t.is_contiguous() for t in tensors)
            and _small(sum(_nbytes(t) for t in tensors) * (group.size - 1)))


def _all_reduce_packed(items: Sequence[tuple[torch.Tensor, str | None]], group: Group,
                       async_op: bool, checks: Sequence[bool]) -> list[CommHandle]:
    for t, _ in items:  # each tensor goes whole to every peer
        _COUNTERS.add("all_reduce", _nbytes(t), _nbytes(t) * (group.size - 1))
    exchange = _exchange("all_reduce", [label for _, label in items], checks, group)
    tensors = [t for t, _ in items]
    handle = CommHandle(*gloo.all_reduce(tensors, group, *exchange, capacity=_header_capacity()))
    return [_settle(handle, async_op)] * len(items)


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    """Broadcast `tensor` in place from global rank `src` (a member of `group`)."""
    if group.size == 1:
        return
    n = _nbytes(tensor)
    _COUNTERS.add("broadcast", n, n)
    dist.broadcast(tensor, src=src, group=group.pg)


def scatter(output: torch.Tensor, chunks: list[torch.Tensor] | None, src: int, group: Group
            ) -> None:
    """Global rank `src` sends `chunks[i]` to the group's rank `i`; others pass `chunks=None`."""
    if group.size == 1:
        output.copy_(chunks[0])  # type: ignore[index]
        return
    n = _nbytes(output) * group.size
    _COUNTERS.add("scatter", n, n * (group.size - 1) / group.size)
    dist.scatter(output, chunks if dist.get_rank() == src else None, src=src, group=group.pg)


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every rank's picklable `obj`, in group-rank order."""
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    _COUNTERS.add("all_gather", 0, 0)
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)


def broadcast_pickled(obj: Any, src: int, group: Group) -> Any:
    """Broadcast a picklable object from global rank `src`; returns it on every rank. Unlike
    torch's `broadcast_object_list` it needs no numpy: a length, then the pickled bytes, go as
    two (counted) broadcasts, on the current CUDA device for NCCL groups."""
    if group.size == 1:
        return obj
    cuda = "nccl" in group.backend
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    is_src = dist.get_rank() == src
    payload = pickle.dumps(obj) if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    broadcast(size, src, group)
    if is_src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(data, src, group)
    return obj if is_src else pickle.loads(bytes(data.cpu().tolist()))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, *,
               async_op: bool = False, label: str | None = None, check: bool = True,
               kind: str = "reduce_scatter") -> CommHandle:
    """Row r of `input` (`[group.size, n]`, contiguous) goes to group rank r; rank r's row for
    us lands in row r of `output` (ours is copied). Counted as `kind`, the collective it
    carries out (a compressed reduce-scatter: see [Note: compressed collectives] in
    distributed/unit_comm.py): `bytes` the whole input, `wire_bytes` the rows sent to peers.
    (`label`, `check`: see `all_gather`.)"""
    if group.size == 1:
        output.copy_(input)
        return _DONE
    n = _nbytes(input)
    _COUNTERS.add(kind, n, n * (group.size - 1) / group.size)
    if pairwise_exchanges(group):
        handle = CommHandle(*gloo.all_to_all(output, input, group,
                                             *_exchange(kind, [label], [check], group),
                                             capacity=_header_capacity()))
        return _settle(handle, async_op)
    work = dist.all_to_all_single(output, input, group=group.pg, async_op=True)
    return _native(kind, work, (output, input), group, label, check, async_op)
