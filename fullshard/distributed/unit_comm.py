"""The engine's communication seam: gather units' parameters, reduce units' gradients.

The engine (engine/bucket.py) says what it wants per bucket -- its shards, or its unsharded
gradients, and the size of each parameter's padded shard (`pieces`) -- and gets back a
handle whose `wait()` returns the result with each parameter's rows contiguous. How the bytes
move is decided here and below, never in the engine: gloo's pairwise exchanges (gloo.py),
packing, several small units in one exchange, NCCL's native collectives and the copy-out
their rank-major output needs (comm.py).

The contract of every call:
- dtypes. A gather sends `send` (the shards in the compute dtype) and its result has that
  dtype. A reduction casts the gradients to `ReduceRequest.dtype` (the reduce dtype), sums
  in it, and its result -- the mean over the data-parallel ranks of this rank's shard -- has
  it too. Converting to the master dtype and device is the caller's.
- `wire`: the format on the wire, per call (`wire_format.WIRE_FORMATS`; None means
  "exact"), with `block_size` for "int8". "exact" sends the tensors' own bytes, so results
  equal the definition bit for bit (sums in rank order, see [Note: gloo's all-gather and
  reduce-scatter] in distributed/gloo.py). A compressed format ("bf16", "int8") encodes
  before the wire and decodes on arrival into the same result dtype: see [Note: compressed
  collectives]. `comm_stats()` counts the encoded bytes, what is really sent.
- `track`: called on every transient buffer allocated for the call (the engine's memory
  accounting, engine/bucket.py); the handle keeps them referenced until it is done.

[Note: small units travel together]
Each exchange has a fixed cost (on gloo a message round, ~0.1-1 ms in a busy step) that a
small unit cannot hide behind its compute. Where the backend can send several collectives as
one exchange (gloo's pairwise path, comm.all_gather_batch), the runtime gathers ahead, beyond
`prefetch_limit` units, as many more as keep `gather_batch_bytes` per rank in flight, in one
exchange, and refills the window only when one of the next `prefetch_limit` units is not in
flight (`Runtime._gather_ahead`; the same in ZeRO-3's backward). Reductions of small units
wait in a batch (`Reductions`) until another unit of the same size would not fit, or
backward ends; NO_SHARD's all-reduces too (each sends its whole gradients to N-1 peers, so
their budget is SMALL_UNITS_BYTES / (N-1); the gradients are `.grad`'s storage, so waiting
costs no memory). The collectives counted stay the algorithm's (one per bucket); only the
messages are fewer. Memory: ZeRO-3 holds the running unit plus at most
max(`prefetch_limit` units, SMALL_UNITS_BYTES per rank gathered) ahead, and up to
SMALL_UNITS_BYTES per rank of unsharded gradients waiting; large units are exactly as
without batching. NCCL issues one collective per bucket as before.

[Note: compressed collectives]
ZeRO++'s qwZ and qgZ, over the same backend collectives on uint8 buffers (wire_format.py holds
the encodings and their error).
- A gather encodes this rank's (L,) shards into one buffer, all-gathers the buffers
  (rank-major) and decodes every rank's chunk -- its own too, so every rank computes with the
  same weights -- into the compute dtype, then reorders it parameter-major as an exact gather.
  Encoding is deterministic, so ZeRO-3's backward re-gather yields the forward's weights.
- A reduction on the shard axis packs the gradients rank-major (S, L) in the reduce dtype,
  encodes each destination's row, exchanges row r with rank r (`comm.all_to_all`), decodes the
  S rows received and sums them in fp32 in rank order, divided by the data-parallel size
  (`wire_format.reduce_encoded`; never summed in int8). The replicate axis's all-reduce
  (HYBRID_SHARD) and no_sync accumulation stay exact: a no_sync sum is compressed once, at the
  synced reduction. A compressed reduction is issued at once, never held to travel with others.
- NO_SHARD (shard axis of size 1) has no compressed path: the engine refuses it at wrap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fullshard.distributed import comm
from fullshard.distributed.comm import CommHandle, Group
from fullshard.distributed.comm import register_label as register_label
from fullshard.distributed.mesh import ShardMesh
from fullshard.distributed.wire_format import WIRE_FORMATS, decode, encode, reduce_encoded

SMALL_UNITS_BYTES = 1 << 20
"""Bytes per rank of small units gathered ahead (and of their gradients held) to travel in one
exchange, where the backend allows (see [Note: small units travel together]). A memory
decision: it bounds what ZeRO-3 holds beyond `prefetch_limit` units (at 4 MiB the 8-layer demo
model would be gathered whole), kept apart from comm.COALESCE_BYTES, the size up to which one
exchange is packed into one message, and capped by it."""


def small_units_bytes() -> int:
    """`SMALL_UNITS_BYTES`, within what comm sends as one message (0 when that is off)."""
    return min(SMALL_UNITS_BYTES, max(comm.COALESCE_BYTES, 0))


def gather_batch_bytes(group: Group) -> int:
    """Bytes per rank up to which several units' gathers on `group` go as one exchange (0:
    never): what the runtime may gather ahead beyond its prefetch limit."""
    return small_units_bytes() if comm.pairwise_exchanges(group) else 0


def _reduce_batch_bytes(mesh: ShardMesh) -> int:
    """The same for reductions: the shard axis's reduce-scatters or, without one (NO_SHARD),
    the all-reduces, which send their whole tensors to each of N-1 peers."""
    if mesh.shard.size > 1:
        return gather_batch_bytes(mesh.shard)
    if not comm.pairwise_exchanges(mesh.replicate):
        return 0
    return small_units_bytes() // (mesh.replicate.size - 1)


def _check_wire(wire: str | None) -> str:
    """`wire` as a format name ("exact" for None), or a ValueError."""
    if wire is not None and wire not in WIRE_FORMATS:
        raise ValueError(f"wire format {wire!r} is not one of {WIRE_FORMATS} (or None: exact)")
    return wire or "exact"


def _untracked(t: torch.Tensor) -> torch.Tensor:
    return t


# -- gathers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherRequest:
    """One bucket's all-gather over the shard axis."""

    send: torch.Tensor
    """(L,) this rank's padded shards, parameter after parameter, in the compute dtype."""
    pieces: Sequence[int]
    """Each parameter's padded shard size (elements); they add up to L."""
    label: str
    """Names the unit and bucket in divergence errors (comm's `label`)."""
    check: bool
    """Send the divergence header (the unit's first bucket)."""


class GatherHandle:
    """A bucket's gather in flight; `wait()` returns the (S*L,) parameter-major result."""

    __slots__ = ("_comm", "_out", "_pieces", "_size", "_track", "_rank_major", "_decode")

    def __init__(self, handle: CommHandle, out: torch.Tensor, request: GatherRequest,
                 size: int, track: Callable[[torch.Tensor], torch.Tensor], rank_major: bool,
                 decode: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._comm, self._out, self._pieces = handle, out, request.pieces
        self._size, self._track, self._rank_major = size, track, rank_major
        self._decode = decode  # a compressed gather: received bytes -> (S, L) rank-major

    def wait(self) -> torch.Tensor:
        """The gathered parameters, *parameter-major*: parameter i's S padded shards, rank
        after rank, contiguous (its original-shape tensor is a view). Call once."""
        self._comm.wait()
        out, self._out = self._out, None
        assert out is not None, "GatherHandle.wait() called twice"
        if self._decode is not None:
            out = self._decode(out)
        elif not self._rank_major:
            return out
        # The backend's all-gather is rank-major ([rank0: p1 p2 | rank1: p1 p2]): one copy
        # reorders it (views of a tracked buffer, never copies, go to the modules: see
        # [Note: ZeRO-3 and saved tensors] in engine/autograd.py).
        s, numel = self._size, out.numel() // self._size
        param_major = self._track(torch.empty(out.numel(), dtype=out.dtype, device=out.device))
        slices, start = [], 0
        for piece in self._pieces:
            slices.append(param_major[s * start : s * (start + piece)].view(s, -1))
            start += piece
        torch.split_with_sizes_copy(out.reshape(s, numel), list(self._pieces), dim=1,
                                    out=slices)
        return param_major

    def discard(self) -> None:
        """Wait for the exchange (every rank issued it) and drop its result."""
        self._comm.wait()
        self._out = None

    def abandon(self) -> None:
        """Set this gather aside unwaited (a peer is gone): it and its output stay referenced
        for the rest of the process (`_ABANDONED`), so the comm thread never writes into
        freed memory; the process group is broken and the process on its way out."""
        _ABANDONED.append(self)


_ABANDONED: list[GatherHandle] = []


def gather_params(
    requests: Sequence[GatherRequest],
    group: Group,
    *,
    async_op: bool,
    track: Callable[[torch.Tensor], torch.Tensor] = _untracked,
    wire: str | None = None,
    block_size: int = 256,
) -> list[GatherHandle]:
    """All-gather these buckets over `group` (size > 1), issued together: small ones travel
    as one exchange where the backend allows. One handle per request, in order. A compressed
    `wire` sends each request's shards encoded and decodes every rank's chunk on arrival, its
    own too (qwZ; see [Note: compressed collectives])."""
    fmt = _check_wire(wire)
    segmented = fmt == "exact" and comm.pairwise_exchanges(group)
    items, layouts = [], []
    for r in requests:
        sent = r.send if fmt == "exact" else track(encode(r.send, fmt, block_size=block_size))
        out = track(torch.empty(group.size * sent.numel(), dtype=sent.dtype,
                                device=r.send.device))
        # Where the collective can place each parameter's rows itself, ask for that layout.
        split = len(r.pieces) > 1
        items.append((out, sent, list(r.pieces) if split and segmented else None, r.label))
        decoder = None if fmt == "exact" else functools.partial(
            _decode_chunks, size=group.size, numel=r.send.numel(), dtype=r.send.dtype, fmt=fmt,
            block_size=block_size)
        layouts.append((decoder is not None or (split and not segmented), decoder))
    handles = comm.all_gather_batch(
        items, group, async_op=async_op, check=[r.check for r in requests]
    )
    return [
        GatherHandle(h, item[0], r, group.size, track, major, decode=d)
        for h, item, r, (major, d) in zip(handles, items, requests, layouts)
    ]


def _decode_chunks(received: torch.Tensor, *, size: int, numel: int, dtype: torch.dtype,
                   fmt: str, block_size: int) -> torch.Tensor:
    """A compressed gather's received bytes -> (size, numel) rank-major, in `dtype`."""
    return decode(received.view(size, -1), numel, dtype, fmt, block_size=block_size)


# -- reductions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReduceRequest:
    """One bucket's gradient reduction over the data-parallel ranks."""

    grads: Sequence[torch.Tensor]
    """Each parameter's unsharded gradient in its layout's shape `(dim0, *rest)`. Never
    modified (autograd may share them); cast to `dtype` here."""
    pieces: Sequence[int]
    """Each parameter's padded shard size (elements); they add up to L."""
    dtype: torch.dtype
    """The reduce dtype: of the sums and of the result."""
    device: torch.device
    label: str
    check: bool
    accumulated: torch.Tensor | None = None
    """A no_sync sum (`accumulate_grads`) to add to `grads`; it is consumed."""


def _pack(request: ReduceRequest, size: int, track: Callable[[torch.Tensor], torch.Tensor]
          ) -> torch.Tensor:
    """The gradients rank-major with zero padding, (size * L,), cast to the reduce dtype."""
    numel = sum(request.pieces)
    out = torch.empty(size * numel, dtype=request.dtype, device=request.device)
    if size > 1:  # with one shard rank the packed gradients become the result itself
        track(out)
    torch._chunk_cat(list(request.grads), dim=0, num_chunks=size, out=out.view(size, numel))
    return out


def accumulate_grads(
    request: ReduceRequest,
    mesh: ShardMesh,
    *,
    track: Callable[[torch.Tensor], torch.Tensor] = _untracked,
) -> torch.Tensor:
    """no_sync: `request.grads` added to `request.accumulated` (None on the first
    micro-batch). Returns the new sum, to pass back as `accumulated`; the caller treats it
    as opaque (its layout is the reduction's: rank-major, (S * L,))."""
    packed = _pack(request, mesh.shard.size, track)
    if request.accumulated is None:
        return packed
    return request.accumulated.add_(packed)


class ReduceHandle:
    """One bucket's reduction: reduce-scatter on the shard axis (or, with one shard rank, the
    all-reduce), then all-reduce on the replicate axis, then the mean. Built by
    `start_reduction`; `wait()` returns the result.

    Averaging: the sum is divided by the data-parallel size after the reduction, on the
    (1/S-sized) result. fp16 cannot hold large sums, so an fp16 reduction divides by
    sqrt(N) before and after instead. A compressed reduction sums in fp32 and divides there,
    before its result is cast to the reduce dtype (see [Note: compressed collectives])."""

    __slots__ = ("mesh", "output", "label", "check", "nbytes", "_pre", "_item", "_handle",
                 "_replicate_pending", "_done", "_decode")

    def __init__(self, request: ReduceRequest, mesh: ShardMesh,
                 track: Callable[[torch.Tensor], torch.Tensor], wire: str = "exact",
                 block_size: int = 256) -> None:
        self.mesh, self.label, self.check = mesh, request.label, request.check
        world = mesh.data_parallel_size
        self._pre = math.sqrt(world) if request.dtype == torch.float16 and world > 1 else 1.0
        self._item: tuple | None = None  # set while held: what `issue_reductions` sends
        self._handle: CommHandle | None = None
        self._done = False
        self._decode: Callable[[], torch.Tensor] | None = None
        numel, shard = sum(request.pieces), mesh.shard
        # Bytes of this rank's reduced shard (what a held reduction adds to a batch).
        self.nbytes = numel * request.dtype.itemsize
        self._replicate_pending = shard.size > 1 and mesh.replicate.size > 1
        if wire != "exact" and mesh.world.size > 1:  # on one rank nothing travels
            self._start_encoded(request, track, wire, block_size)
            return
        if request.accumulated is None and comm.pairwise_exchanges(shard):
            # Each rank's rows go straight from the gradients (comm.reduce_scatter_segments):
            # no packed copy. Usually views of autograd's tensors (copies only if strided or
            # cast), divided out of place: autograd may hand one tensor to several params.
            flats = [track(g.reshape(-1).to(request.dtype)) for g in request.grads]
            if self._pre != 1.0:
                flats = [track(g / self._pre) for g in flats]
            self.output = torch.empty(numel, dtype=request.dtype, device=request.device)
            self._item = (self.output, flats, list(request.pieces), self.label)
            return
        packed = _pack(request, shard.size, track)
        if request.accumulated is not None:
            packed.add_(request.accumulated)
        if self._pre != 1.0:
            packed.div_(self._pre)
        if shard.size > 1:
            self.output = torch.empty(numel, dtype=request.dtype, device=request.device)
            self._handle = comm.reduce_scatter(
                self.output, packed, shard, async_op=True, label=self.label, check=self.check
            )
        elif comm.pairwise_exchanges(mesh.replicate):
            self.output = packed  # already this rank's (only) chunk: all-reduced, held
            self._item = (packed, self.label)
        else:
            self.output = packed
            self._handle = comm.all_reduce(
                packed, mesh.replicate, async_op=True, label=self.label, check=self.check
            )

    def _start_encoded(self, request: ReduceRequest,
                       track: Callable[[torch.Tensor], torch.Tensor], wire: str,
                       block_size: int) -> None:
        """qgZ: each destination's row of the packed gradients encoded and sent to it; the
        rows received are decoded and summed in fp32 at `wait()`."""
        shard, numel = self.mesh.shard, sum(request.pieces)
        if shard.size == 1:
            raise ValueError(
                f"{self.label}: compressed gradients (wire {wire!r}) need a shard axis; under "
                f"NO_SHARD the gradients are all-reduced whole. Use FULL_SHARD, SHARD_GRAD_OP "
                f"or HYBRID_SHARD, or Compression(gradients=None)."
            )
        self._pre = 1.0  # the sum is fp32: no fp16 overflow to avoid
        packed = _pack(request, shard.size, track)
        if request.accumulated is not None:
            packed.add_(request.accumulated)
        rows = track(encode(packed.view(shard.size, numel), wire, block_size=block_size))
        del packed  # only its encoding travels
        received = track(torch.empty_like(rows))
        self._handle = comm.all_to_all(
            received, rows, shard, async_op=True, label=self.label, check=self.check
        )
        self.output = torch.empty(0, dtype=request.dtype, device=request.device)
        world = self.mesh.data_parallel_size

        def decode_and_sum() -> torch.Tensor:
            return reduce_encoded(received, numel, request.dtype, wire, block_size=block_size,
                                  divisor=world)

        self._decode = decode_and_sum

    @property
    def issued(self) -> bool:
        """False while the reduction waits to go with others (`issue_reductions`)."""
        return self._item is None

    def wait(self) -> torch.Tensor:
        """The mean over the data-parallel ranks of this rank's padded shard of the
        gradients, (L,) in the reduce dtype (issues the replicate stage when it is due)."""
        assert self._item is None, "a held reduction was never issued"
        if self._done:
            return self.output
        assert self._handle is not None
        self._handle.wait()  # the handle held the reduce input until now
        divided = self._decode is not None
        if self._decode is not None:
            self.output, self._decode = self._decode(), None
        if self._replicate_pending:
            self._replicate_pending = False
            self._handle = comm.all_reduce(
                self.output, self.mesh.replicate, async_op=True, label=self.label,
                check=self.check,
            )
            self._handle.wait()
        post = 1.0 if divided else self.mesh.data_parallel_size / self._pre
        if post != 1.0:
            self.output.div_(post)
        self._done = True
        return self.output

    def discard(self) -> None:
        """Wait for the stage in flight (every rank issued it) and drop the result: the
        reduction of a backward that raised. One never issued (held) is just dropped."""
        if self._item is None and self._handle is not None:
            self._handle.wait()


def start_reduction(
    request: ReduceRequest,
    mesh: ShardMesh,
    *,
    hold: bool,
    track: Callable[[torch.Tensor], torch.Tensor] = _untracked,
    wire: str | None = None,
    block_size: int = 256,
) -> ReduceHandle:
    """Start reducing one bucket's gradients. With `hold`, a reduction that can travel with
    others (our own exchanges: gloo) is only prepared -- `Reductions.submit` or
    `issue_reductions` sends it; every other one (a compressed one too) is issued now."""
    handle = ReduceHandle(request, mesh, track, _check_wire(wire), block_size)
    if not hold and not handle.issued:
        issue_reductions([handle])
    return handle


def issue_reductions(handles: Sequence[ReduceHandle]) -> None:
    """Issue held reductions together (one mesh): small ones go as one exchange."""
    if not handles:
        return
    mesh = handles[0].mesh
    if mesh.shard.size == 1:  # NO_SHARD's all-reduces
        batch: Callable[..., list[CommHandle]] = comm.all_reduce_batch
        group = mesh.replicate
    else:
        batch, group = comm.reduce_scatter_batch, mesh.shard
    sent = batch([h._item for h in handles], group, async_op=True,
                 check=[h.check for h in handles])
    for h, comm_handle in zip(handles, sent):
        h._item, h._handle = None, comm_handle


class HoldsReduction(Protocol):
    """What `Reductions` queues: the caller's record of one bucket's reduction."""

    @property
    def handle(self) -> ReduceHandle: ...


class Reductions:
    """The reductions of one model's backward, small ones held to travel together (see
    [Note: small units travel together]). `submit` takes one unit's reductions (started with
    `hold=True`); `on_issue` is called with each group that goes in flight, in issue order:
    the ones that could not wait at once, a batch once another unit of the same size would
    not fit, and what is left at `flush()`."""

    def __init__(self, mesh: ShardMesh, on_issue: Callable[[list], None]) -> None:
        self.mesh = mesh
        self._on_issue = on_issue
        self._held: list[HoldsReduction] = []

    def submit(self, pendings: Sequence[HoldsReduction]) -> None:
        issued = [p for p in pendings if p.handle.issued]
        if issued:
            self._on_issue(issued)
        held = self._held
        held += [p for p in pendings if not p.handle.issued]
        size = sum(p.handle.nbytes for p in held)
        if held and size + sum(p.handle.nbytes for p in pendings) > _reduce_batch_bytes(
            self.mesh
        ):
            self.flush()

    def flush(self) -> None:
        held, self._held = self._held, []
        if held:
            issue_reductions([p.handle for p in held])
            self._on_issue(held)

    def drop_held(self) -> None:
        """Forget the held reductions (a backward that raised: no rank issued them)."""
        self._held = []
