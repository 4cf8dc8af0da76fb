"""The only module that calls torch.distributed collectives; it counts every call and byte.

Every collective fullshard runs goes through a function here, so `comm_stats()` is the whole
truth about what was sent. Counters are kept per *kind* -- the collective the algorithm asks
for (`all_gather`, `reduce_scatter`, `all_reduce`, `broadcast`, `scatter`) -- with:

- `calls`: how many collectives of that kind were issued;
- `bytes`: the logical payload (the full gathered output of an all-gather, the full input of a
  reduce-scatter, the tensor of an all-reduce or broadcast, everything a scatter hands out);
- `wire_bytes`: what this rank actually sends for it with the algorithm we used.

[Note: gloo's all-gather and reduce-scatter]
On gloo (CPU) we do not call the all-gather / reduce-scatter collectives: gloo implements
reduce-scatter as an all-reduce plus a chunk (twice the traffic) and its all-gather peaks at
~8 MB per call, so both are several times slower than the network allows (measured on this
2-core machine at 32 MB, 2 ranks: all_gather 47 ms, reduce_scatter 61 ms, all_reduce 25 ms).
Instead each rank exchanges chunks directly with every peer (`isend`/`irecv`, all posted at
once, matched by a per-group tag sequence): an all-gather sends our shard to each peer and
receives theirs into place; a reduce-scatter sends peer j its chunk j and sums the N chunks of
ours in rank order (so every rank's sum has the same rounding). Each rank sends exactly
B·(N−1)/N bytes -- the ring optimum -- and the same 32 MB took ~14 ms either way. Both can
work piece by piece: `all_gather(segments=)` lands each parameter's rows in place, and
`reduce_scatter_segments` sends each peer its rows straight from every unpacked gradient (no
packed copy, no padding on the wire: wire bytes count what is really sent). With many
ranks this is N−1 messages per collective instead of a ring's pipeline; NCCL keeps its own
collectives, which already are optimal. Piece by piece means one message per piece and peer,
and each gloo message has a fixed cost (~0.1 ms here); so exchanges of at most
`COALESCE_BYTES` per rank send their pieces together, one message per peer, at the price of
one copy of what is exchanged (`_coalesce`): a small transformer block's gather went from ~12
messages per peer to one.

[Note: ranks that run different units]
Every exchange is matched by its position in the group's sequence, so all ranks must issue
the engine's collectives in the same order. When they do not (LayerDrop with a per-rank RNG, an
MoE expert skipped on one rank, a data-dependent branch), the k-th exchange of one rank meets
the k-th of another that moves different rows: a hang, a size-mismatch crash or, when sizes
coincide, a silent exchange of the wrong unit's data. So the engine labels each exchange
(`label=`: the unit and bucket) and, on gloo:
- every point-to-point tag mixes the collective's sequence number, the crc32 of kind + label
  and the piece index, so a message of one unit can never be received as another's (tags that
  collide are harmless: gloo matches equal tags in posting order, the same on every rank);
- exchanges that open a unit's gathers or reductions (`check=True`: the engine sets it on the
  first bucket of a unit, where any divergence begins, since a unit's buckets are issued
  back to back) also send every peer a 16-byte header `(sequence number, crc32 of kind +
  label)` under a tag that does not depend on the label, and `wait()` checks the headers
  before it waits for any data: a mismatch raises `RankDivergenceError` on every rank
  involved, naming each rank's unit, as soon as both reach the exchange.
Cost: one tiny message per peer for each unit's gather and reduction, no extra collective
(headers are not counted in `comm_stats()`; one header per bucket cost ~0.25 ms each on this
loaded 2-core machine, too much for NONE bucketing). What it cannot see: a rank that stops
communicating altogether (the others then wait until the process group's timeout), and the
NCCL path (no headers: collectives are matched by NCCL). Identifiers, tags and the error's
wording live in divergence.py.

[Note: the NCCL algorithm on gloo, for tests]
`use_native_collectives(True)` (or FULLSHARD_NATIVE_COLLECTIVES=1 in the environment) makes
gloo groups take NCCL's code path: the backend's own all-gather (rank-major output, reordered
by the bucket) and reduce-scatter (on packed chunks), so every line of it except CUDA streams
runs in the CPU test suite. It is for tests only: on gloo those collectives are slower.

A group of size 1 communicates nothing: those calls become local copies and are not counted.

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

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fullshard.distributed.comm_handles import _COUNTERS, _DONE, _nbytes, _settle
from fullshard.distributed.comm_handles import KINDS as KINDS
from fullshard.distributed.comm_handles import CommHandle as CommHandle
from fullshard.distributed.comm_handles import Group as Group
from fullshard.distributed.comm_handles import comm_stats as comm_stats
from fullshard.distributed.comm_handles import reset_comm_stats as reset_comm_stats
from fullshard.distributed.divergence import RankDivergenceError as RankDivergenceError
from fullshard.distributed.divergence import divergence_message, exchange_id
from fullshard.distributed.divergence import register_label as register_label
from fullshard.distributed.divergence import tag as _tag

# torch 2.13 renamed the tensor collectives; the old names still exist but warn.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor



_SEQ: dict[int, int] = {}


def _next_seq(group: Group) -> int:
    """The collective's position in the group's sequence: the same on every member as long
    as they issue the same collectives in the same order (checked by the headers)."""
    key = id(group.pg)
    _SEQ[key] = seq = _SEQ.get(key, 0) + 1
    return seq


_NATIVE_ON_GLOO = os.environ.get("FULLSHARD_NATIVE_COLLECTIVES", "") == "1"


def use_native_collectives(enabled: bool) -> bool:
    """For tests only: make gloo groups use the backend's all-gather / reduce-scatter, i.e.
    the NCCL code path (see the module docstring). Returns the previous setting."""
    global _NATIVE_ON_GLOO
    previous, _NATIVE_ON_GLOO = _NATIVE_ON_GLOO, bool(enabled)
    return previous


def _use_pairwise(group: Group) -> bool:
    return group.backend == "gloo" and not _NATIVE_ON_GLOO


class _Header:
    """The 16-byte header of one labelled exchange: sent to and received from every peer."""

    __slots__ = ("group", "mine", "theirs", "works")

    def __init__(self, group: Group, seq: int, ident: int) -> None:
        self.group = group
        self.mine = torch.tensor([seq, ident], dtype=torch.int64)
        self.theirs = torch.empty(group.size, 2, dtype=torch.int64)
        tag = _tag(seq, 0, 0)
        size, rank = group.size, group.rank
        self.works = []
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            into = self.theirs[src]
            self.works.append(dist.isend(self.mine, group.ranks[dst], group=group.pg, tag=tag))
            self.works.append(dist.irecv(into, group.ranks[src], group=group.pg, tag=tag))

    @property
    def seq(self) -> int:
        return int(self.mine[0])

    def check(self) -> None:
        for w in self.works:
            w.wait()
        self.theirs[self.group.rank] = self.mine
        if bool((self.theirs == self.mine).all()):
            return
        raise RankDivergenceError(divergence_message(self.seq, self.group.ranks, self.theirs))


def gathers_segments(group: Group) -> bool:
    """Whether `all_gather(..., segments=...)` can land data parameter-major by itself."""
    return group.size > 1 and _use_pairwise(group)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    *,
    async_op: bool = False,
    segments: Sequence[int] | None = None,
    label: str | None = None,
    check: bool = True,
) -> CommHandle:
    """Gather every rank's `input` into `output` (`group.size * input.numel()` elements).

    Without `segments` the output is rank-major: rank r's input at `[r*n, (r+1)*n)`. With
    `segments` (sizes that split `input` into consecutive pieces, e.g. one per parameter;
    only where `gathers_segments(group)`), the output is *segment-major*: piece j of every
    rank, in rank order, then piece j+1 -- each parameter's rows contiguous, straight from
    the wire with no copy-out. That costs one message per piece and peer instead of one per
    peer; on gloo that is cheaper than copying the whole output once more, except for small
    exchanges, which go as one message per peer and are placed by one copy (`_coalesce`).

    `label` (e.g. the unit and bucket) goes into the tags and, with `check`, into a header
    checked on gloo: see the note on ranks that run different units.
    """
    if group.size == 1:
        output.copy_(input.reshape(output.shape))
        return _DONE
    n = _nbytes(output)
    _COUNTERS.add("all_gather", n, n * (group.size - 1) / group.size)
    seq, ident, header = _sequence(group, "all_gather", label, check)
    if _use_pairwise(group):
        size, rank = group.size, group.rank
        flat_in, flat_out = input.reshape(-1), output.view(-1)
        pieces = list(segments) if segments is not None else [flat_in.numel()]
        if len(pieces) > 1 and _coalesce(group, _nbytes(flat_in), len(pieces)):
            return _all_gather_coalesced(output, input, pieces, group, seq, ident, header,
                                         async_op)
        works, start = [], 0
        for j, piece in enumerate(pieces):
            mine = flat_in[start : start + piece]
            slots = flat_out[size * start : size * (start + piece)].view(size, piece)
            slots[rank].copy_(mine)
            tag = _tag(seq, ident, j + 1)
            for step in range(1, size):
                dst, src = (rank + step) % size, (rank - step) % size
                works.append(dist.isend(mine, group.ranks[dst], group=group.pg, tag=tag))
                works.append(dist.irecv(slots[src], group.ranks[src], group=group.pg, tag=tag))
            start += piece
        handle = CommHandle(works, refs=(output, input), header=header)
    else:
        if segments is not None and len(segments) > 1:
            raise ValueError("segment-major all-gather needs gathers_segments(group)")
        work = _all_gather_into(output, input, group=group.pg, async_op=True)
        handle = CommHandle(work, refs=(output, input), header=header)
    return _settle(handle, async_op)


COALESCE_BYTES = 1 << 20
"""Pairwise exchanges of at most this many bytes per rank go out as one message per peer,
even when split into segments (see `_coalesce`). 0 turns coalescing off."""


def _coalesce(group: Group, nbytes: int, pieces: int) -> bool:
    """Send a segmented pairwise exchange of `nbytes` per rank as one message per peer?

    Each gloo message costs a fixed ~0.1 ms of Python, c10d and wake-up (profiled on 2 ranks:
    isend + irecv + wait), which is what small units pay: a transformer block is ~12 pieces,
    so ~24 messages per peer and collective. Coalescing costs one copy of what is exchanged
    (packing on the send side of a reduce-scatter, placing on the receive side of an
    all-gather), which is far cheaper than the messages below `COALESCE_BYTES`; above it the
    copy grows with the data while the messages' cost does not, so large buckets keep one
    message per piece (no copy). The decision depends only on sizes, so every rank of the
    group makes the same one (the messages must match)."""
    return pieces > 1 and 0 < nbytes <= COALESCE_BYTES and group.size > 1


def _all_gather_coalesced(
    output: torch.Tensor,
    input: torch.Tensor,
    pieces: list[int],
    group: Group,
    seq: int,
    ident: int,
    header: _Header | None,
    async_op: bool,
) -> CommHandle:
    """A segmented all-gather in one message per peer (see `_coalesce`): our whole input goes
    to each peer; each peer's input lands in a staging row and is split into its place in
    every segment once it is complete (`wait()`). Same output, same bytes on the wire."""
    size, rank = group.size, group.rank
    flat_in, flat_out = input.reshape(-1), output.view(-1)
    regions, start = [], 0
    for piece in pieces:  # each segment viewed (size, piece): row r is rank r's piece
        regions.append(flat_out[size * start : size * (start + piece)].view(size, piece))
        start += piece
    torch.split_with_sizes_copy(flat_in, pieces, out=[reg[rank] for reg in regions])
    staged = flat_in.new_empty((size - 1, flat_in.numel()))  # row r - (r > rank): rank r's
    tag = _tag(seq, ident, 1)
    works = []
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(flat_in, group.ranks[dst], group=group.pg, tag=tag))
        works.append(dist.irecv(staged[src - (src > rank)], group.ranks[src], group=group.pg,
                                tag=tag))

    def place() -> None:
        for r in range(size):
            if r != rank:
                torch.split_with_sizes_copy(staged[r - (r > rank)], pieces,
                                            out=[reg[r] for reg in regions])

    # The caller's objects themselves, not views: memory.track counts a tensor until the
    # object dies, and the bucket relies on the handle to keep a cast input alive.
    handle = CommHandle(works, on_done=place, refs=(output, input, staged), header=header)
    return _settle(handle, async_op)


def _sequence(
    group: Group, kind: str, label: str | None, check: bool
) -> tuple[int, int, _Header | None]:
    """The collective's sequence number, its kind + label hash (for the tags) and the header
    posted for it (gloo, labelled, `check`), if any."""
    seq = _next_seq(group)
    ident = exchange_id(kind, label or "")
    if label is None or not check or group.backend != "gloo":
        return seq, ident, None
    return seq, ident, _Header(group, seq, ident)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    *,
    async_op: bool = False,
    label: str | None = None,
    check: bool = True,
) -> CommHandle:
    """Sum `input` (rank-major, `group.size` equal chunks) over the group; this rank's chunk of
    the sum lands in `output`. (`label`, `check`: see `all_gather`.)"""
    if group.size == 1:
        output.copy_(input.reshape(output.shape))
        return _DONE
    if _use_pairwise(group):  # the packed input is one segment of `group.size` chunks
        flat = input.reshape(-1)
        return reduce_scatter_segments(
            output, [flat], [output.numel()], group, async_op=async_op, label=label, check=check
        )
    n = _nbytes(input)
    _COUNTERS.add("reduce_scatter", n, n * (group.size - 1) / group.size)
    _, _, header = _sequence(group, "reduce_scatter", label, check)
    work = _reduce_scatter_into(output, input, group=group.pg, async_op=True)
    handle = CommHandle(work, refs=(output, input), header=header)
    return _settle(handle, async_op)


def reduce_scatter_segments(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    sizes: Sequence[int],
    group: Group,
    *,
    async_op: bool = False,
    label: str | None = None,
    check: bool = True,
) -> CommHandle:
    """A reduce-scatter of tensors that were never packed (only where `gathers_segments(group)`).

    `output` (this rank's result) is split into consecutive segments of `sizes`; `inputs[j]`
    is a flat tensor of at most `group.size * sizes[j]` elements, read as `group.size` chunks
    of `sizes[j]` (the last ones short or empty: what is missing counts as zero, e.g. the
    padding rows of a parameter). Rank r's chunk of every input, summed over the group, lands
    in segment j of rank r's `output`; the padding of each segment is zeroed.

    Equal to `reduce_scatter` of the inputs packed rank-major, without the packing: each chunk
    is sent straight from its input (only the real elements), so a gradient bucket costs no
    copy before the wire. The sum is in rank order; on two ranks the peer's chunk is received
    straight into `output` and ours added to it (a + b == b + a bit for bit). The inputs must
    stay unmodified until `wait()` returns.
    """
    if not gathers_segments(group):
        raise ValueError("reduce_scatter_segments needs gathers_segments(group)")
    size, rank = group.size, group.rank
    seq, ident, header = _sequence(group, "reduce_scatter", label, check)
    flat_out = output.view(-1)
    pieces = []  # (flat input, segment size, elements of every rank's chunk)
    offset = 0
    for x, n in zip(inputs, sizes):
        x = x.view(-1)
        pieces.append((x, n, [max(0, min(n, x.numel() - r * n)) for r in range(size)]))
        offset += n
    if offset != flat_out.numel():
        raise ValueError(f"segment sizes add up to {offset}, output has {flat_out.numel()}")
    if _coalesce(group, output.element_size() * offset, len(pieces)):
        return _reduce_scatter_coalesced(
            flat_out, inputs, pieces, group, seq, ident, header, async_op
        )
    direct = size == 2
    # Received chunks of the peers in rank order (row r - (r > rank)); none on two ranks.
    received = None if direct else output.new_empty((size - 1, output.numel()))
    works, wire, offset, plan = [], 0, 0, []
    for j, (x, n, real) in enumerate(pieces):
        mine = real[rank]
        tag = _tag(seq, ident, j + 1)
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            if real[dst] > 0:
                chunk = x[dst * n : dst * n + real[dst]]
                works.append(dist.isend(chunk, group.ranks[dst], group=group.pg, tag=tag))
                wire += _nbytes(chunk)
            if mine > 0:
                into = flat_out if received is None else received[src - (src > rank)]
                into = into[offset : offset + mine]
                works.append(dist.irecv(into, group.ranks[src], group=group.pg, tag=tag))
        plan.append((x[rank * n : rank * n + mine], offset, mine, n))
        offset += n
    _COUNTERS.add("reduce_scatter", size * _nbytes(output), wire)

    def sum_in_rank_order() -> None:
        for own, start, mine, n in plan:
            out = flat_out[start : start + mine]
            if received is None:
                out.add_(own)
            elif mine > 0:
                parts = [own if r == rank else received[r - (r > rank), start : start + mine]
                         for r in range(size)]
                torch.add(parts[0], parts[1], out=out)
                for part in parts[2:]:
                    out.add_(part)
            flat_out[start + mine : start + n].zero_()

    handle = CommHandle(
        works, on_done=sum_in_rank_order, refs=(output, tuple(inputs), received), header=header
    )
    return _settle(handle, async_op)


def _reduce_scatter_coalesced(
    flat_out: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    pieces: list[tuple[torch.Tensor, int, list[int]]],
    group: Group,
    seq: int,
    ident: int,
    header: _Header | None,
    async_op: bool,
) -> CommHandle:
    """`reduce_scatter_segments` in one message per peer (see `_coalesce`): peer j's real
    elements of every piece, concatenated (one copy of what is sent), received into a compact
    staging row per peer and summed from there into the segments, in rank order as always
    (on two ranks: peer + own, the same operands and order as the per-piece path)."""
    size, rank = group.size, group.rank
    counts = [sum(real[r] for _, _, real in pieces) for r in range(size)]
    mine_total = counts[rank]
    staged = flat_out.new_empty((size - 1, mine_total))  # row r - (r > rank): rank r's chunks
    tag = _tag(seq, ident, 1)
    works, wire, sends = [], 0, []
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        if counts[dst] > 0:
            chunks = [x[dst * n : dst * n + real[dst]] for x, n, real in pieces if real[dst]]
            send = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            sends.append(send)
            works.append(dist.isend(send, group.ranks[dst], group=group.pg, tag=tag))
            wire += _nbytes(send)
        if mine_total > 0:
            into = staged[src - (src > rank)]
            works.append(dist.irecv(into, group.ranks[src], group=group.pg, tag=tag))
    _COUNTERS.add("reduce_scatter", size * _nbytes(flat_out), wire)

    def sum_in_rank_order() -> None:
        start = compact = 0
        for x, n, real in pieces:
            mine = real[rank]
            if mine > 0:
                out = flat_out[start : start + mine]
                parts = [x[rank * n : rank * n + mine] if r == rank
                         else staged[r - (r > rank), compact : compact + mine]
                         for r in range(size)]
                torch.add(parts[0], parts[1], out=out)
                for part in parts[2:]:
                    out.add_(part)
            if mine < n:
                flat_out[start + mine : start + n].zero_()
            start += n
            compact += mine

    # The caller's input objects themselves, not views of them: memory.track counts a
    # tensor until that object dies.
    refs = (flat_out, tuple(inputs), staged, tuple(sends))
    handle = CommHandle(works, on_done=sum_in_rank_order, refs=refs, header=header)
    return _settle(handle, async_op)


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    label: str | None = None,
    check: bool = True,
) -> CommHandle:
    """Reduce `tensor` in place over the group (`label`, `check`: see `all_gather`)."""
    if group.size == 1:
        return _DONE
    n = _nbytes(tensor)
    _COUNTERS.add("all_reduce", n, 2 * n * (group.size - 1) / group.size)
    header = None
    if label is not None and check and group.backend == "gloo":
        _, _, header = _sequence(group, "all_reduce", label, check)
    if header is None and not async_op:
        dist.all_reduce(tensor, op=op, group=group.pg)
        return _DONE
    work = dist.all_reduce(tensor, op=op, group=group.pg, async_op=True)
    return _settle(CommHandle(work, refs=(tensor,), header=header), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    """Broadcast `tensor` in place from global rank `src` (a member of `group`)."""
    if group.size == 1:
        return
    n = _nbytes(tensor)
    _COUNTERS.add("broadcast", n, n)
    dist.broadcast(tensor, src=src, group=group.pg)


def scatter(
    output: torch.Tensor, chunks: list[torch.Tensor] | None, src: int, group: Group
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


def broadcast_pickled(
    obj: Any, src: int, group: Group, *, device: torch.device | None = None
) -> Any:
    """Broadcast a picklable object from global rank `src`; returns it on every rank.

    Unlike `broadcast_object` it does not need numpy (torch's `broadcast_object_list` turns
    the received bytes back through `tensor.numpy()`): a length, then the pickled bytes, are
    broadcast as tensors on `device` (the current CUDA device for NCCL groups, else CPU).
    Counted as two broadcasts.
    """
    if group.size == 1:
        return obj
    import pickle

    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in group.backend
            else torch.device("cpu")
        )
    is_src = dist.get_rank() == src
    payload = pickle.dumps(obj) if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    broadcast(size, src, group)
    if is_src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(data, src, group)
    if is_src:
        return obj
    return pickle.loads(bytes(data.cpu().tolist()))


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
