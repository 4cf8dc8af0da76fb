"""A bucket: the parameters one collective moves, and their flat buffers.

Memory layout (S = shard-axis size, L = sum of the params' padded shard sizes):

    shard_flat   (L,)     this rank's padded shards, param after param. The user-visible
                          parameters are views of it, so it is also the all-gather input:
                          gathering needs no copy-in.
    unsharded    (S*L,)   *parameter-major*: each parameter's S*c padded rows contiguous, so the
                          tensors handed to modules are plain views of one buffer we track
                          (see [Note: ZeRO-3 and saved tensors] in engine/autograd.py).
                          What `unit_comm.gather_params` returns; how it gets there (in place
                          on the wire, or rank-major and copied out once) is the seam's. With
                          S == 1 nothing is gathered: the shards themselves are the data.
    reduce output (L,)    this rank's padded gradient shards, averaged over the data-parallel
                          ranks (`unit_comm.start_reduction`, from the unsharded gradients);
                          the parameters' `.grad` are views of it (or are accumulated from it).
    accumulated  (S*L,)   no_sync: the gradients summed over micro-batches, in the layout the
                          seam reduces from (`unit_comm.accumulate_grads`).
    post_forward (S*L/k,) hpZ (an int `reshard_after_forward` k): this rank's 1/k of
                          `unsharded`, kept from forward to backward: run j of a node's k
                          ranks keeps each parameter's rows [j, j+1) * S/k shards -- so its
                          (S/k)-shard pieces gathered over the node come back parameter-major,
                          the same buffer as a gather over the whole shard axis.

Dtypes and devices: `shard_flat` holds the master dtype (fp32), in host memory under CPU
offload. The all-gather sends the shards cast to the compute dtype and moved to the compute
device (one `.to`, a no-op without mixed precision or offload), so the gathered bytes shrink
with `param_dtype`. Gradients are packed and reduced in `reduce_dtype` and converted back to
the master dtype and device on the way into `.grad`.

Every buffer above except `shard_flat` and the reduce output is counted by `track` (the
figures behind `fullshard.memory_stats()`) from allocation until it is actually freed: a
weakref finalizer, so a buffer that autograd (or anyone) still references stays counted after
the engine lets go of it. RSS and allocator statistics cannot tell whether sharding works (the
allocator keeps freed buffers); this count makes a silent ZeRO-2 (autograd keeping gathered
parameters alive until backward) visible. Between steps both current figures are zero; the
peaks show ZeRO-3 against ZeRO-2 and check the planner. Autograd's own tensors (activations,
the gradients it computes before handing them to the engine) are the model's, not counted.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Literal

import torch

from fullshard.config import Compression
from fullshard.distributed import unit_comm
from fullshard.distributed.mesh import Group, ShardMesh
from fullshard.distributed.unit_comm import GatherHandle, GatherRequest, ReduceHandle
from fullshard.engine.sharded_param import ShardedParam


class Bucket:
    def __init__(
        self,
        params: Sequence[ShardedParam],
        mesh: ShardMesh,
        *,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload: bool = False,
        keep_low_precision_grads: bool = False,
        compression: Compression | None = None,
    ) -> None:
        self.params = list(params)
        self.compression = compression  # the wire formats (None: everything exact)
        self.mesh = mesh
        self.dtype = dtype  # the shards' (master) dtype, also the gradients handed to .grad
        self.compute_dtype = compute_dtype or dtype  # gathered parameters
        self.reduce_dtype = reduce_dtype or self.compute_dtype  # gradient reductions
        # the dtype of `.grad`: the shards' (for the optimizer), or MixedPrecision's
        # keep_low_precision_grads: the reduce dtype
        self.grad_dtype = self.reduce_dtype if keep_low_precision_grads else dtype
        self.device = device  # where gathering, compute and reductions happen
        self.offload = offload
        self.requires_grad = self.params[0].requires_grad
        offset = 0
        for p in self.params:
            p.offset = offset
            offset += p.layout.padded_shard_numel
        self.numel = offset
        # The layout arithmetic the hot path needs, computed once (layouts and offsets are
        # fixed at wrap): each parameter's padded shard size, its slice of the unsharded
        # buffer (start, stop, shape), its rows' shape and its local rows' slice of a flat shard.
        s = mesh.shard.size
        self.piece_sizes = [p.layout.padded_shard_numel for p in self.params]
        self._view_spans = [
            (s * p.offset, s * p.offset + p.layout.numel, p.layout.shape) for p in self.params
        ]
        self._row_shapes = [(p.layout.dim0, *p.layout.rest) for p in self.params]
        self._local_spans = [
            (p.offset, p.offset + p.layout.local_rows * p.layout.row_numel, p.layout.local_shape)
            for p in self.params
        ]
        # With CPU offload the shards (and so .grad and the optimizer state) live in host
        # memory, pinned when a CUDA device will copy from it asynchronously.
        host = torch.device("cpu") if offload else device
        pin = offload and torch.cuda.is_available()
        self.shard_flat = torch.zeros(offset, dtype=dtype, device=host, pin_memory=pin)
        self._gather_handle: GatherHandle | None = None
        self.unsharded: torch.Tensor | None = None
        self.post_forward: torch.Tensor | None = None  # hpZ's copy (see the module docstring)
        if mesh.post_forward is not None:
            k = mesh.post_forward.size
            # Parameter i's kept span of the parameter-major buffer, and its piece to gather.
            self._post_forward_pieces = [s // k * n for n in self.piece_sizes]
            j = mesh.post_forward.rank
            self._post_forward_spans = [
                (s * p.offset + j * n, s * p.offset + (j + 1) * n)
                for p, n in zip(self.params, self._post_forward_pieces)
            ]
        # `shard_flat._version` when the current gather started: any in-place write to the
        # shards since (load_state_dict, an edit under no_grad, optimizer.step) bumps it, and
        # the gathered copy is then stale (`is_stale`).
        self._gathered_version = -1
        self.accumulated_grad: torch.Tensor | None = None  # no_sync (unit_comm's layout)
        # no_sync: the `.grad` tensors we saw (or put in place, `_placeholder`) after the last
        # accumulation, with their version counters. `zero_grad` -- the optimizer's or the
        # model's, set_to_none either way -- replaces or zeroes them, which tells us the
        # window was abandoned (see `accumulation_abandoned`).
        self._grad_marks: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []
        self._placeholder: torch.Tensor | None = None
        self.label = ""  # names the unit and bucket in divergence errors (see set_label)
        self.check_gather = self.check_reduce = True  # send comm's divergence header

    def set_label(self, unit_name: str, index: int, *, first_trainable: bool) -> None:
        """Name this bucket in its collectives, so ranks that run different units get an
        error naming them (see [Note: ranks that run different units] in
        distributed/gloo.py). Only a unit's
        first bucket (first trainable one for reductions) sends the header: divergence starts
        at a unit's first collective."""
        self.check_gather, self.check_reduce = index == 0, first_trainable
        more = f" and {len(self.params) - 1} more" if len(self.params) > 1 else ""
        self.label = (
            f"unit {unit_name or '<root>'!r} (bucket {index}: {self.params[0].fqn}{more})"
        )
        unit_comm.register_label(self.label)

    # -- layout -----------------------------------------------------------------------------
    def padded_shard(self, p: ShardedParam) -> torch.Tensor:
        n = p.layout.padded_shard_numel
        return self.shard_flat[p.offset : p.offset + n].view(p.layout.padded_shard_shape)

    def check_intact(self) -> None:
        """Raise if a parameter no longer views this bucket's shards: replaced by
        `param.data = ...`, `model.half()`, `load_state_dict(assign=True)` or a new Parameter
        assigned to the module -- the engine would gather stale values and drop gradients."""
        storage = self.shard_flat.untyped_storage().data_ptr()
        for p in self.params:
            replaced = p.param.untyped_storage().data_ptr() != storage or any(
                module._parameters.get(name) is not p.param for module, name in p.refs
            )
            if replaced:
                raise RuntimeError(
                    f"Parameter {p.fqn!r} was replaced after fullshard.fsdp() wrapped the model "
                    f"(e.g. by model.to(dtype)/.half(), `param.data = ...`, "
                    f"load_state_dict(assign=True) or assigning a new nn.Parameter), so it no "
                    f"longer holds this rank's shard. Change dtype, device or values before "
                    f"wrapping, or copy into the parameter in place (param.data.copy_(...), "
                    f"load_state_dict without assign)."
                )

    # -- gather -----------------------------------------------------------------------------
    @property
    def is_gathered(self) -> bool:
        return self.unsharded is not None

    def _gather_input(self) -> torch.Tensor:
        """The shards as the all-gather sends them: on the compute device, in compute dtype.
        Without offload or mixed precision this is `shard_flat` itself (no copy)."""
        return self.shard_flat.to(self.device, self.compute_dtype, non_blocking=True)

    def is_stale(self) -> bool:
        """True if the shards were written since this bucket's gather started (the gather
        the hpZ copy came from, for that copy)."""
        return (
            self.in_flight or self.post_forward is not None
        ) and self._gathered_version != self.shard_flat._version

    @property
    def in_flight(self) -> bool:
        """Gathered, or its gather issued."""
        return self.unsharded is not None or self._gather_handle is not None

    @property
    def gather_nbytes(self) -> int:
        """Bytes this rank sends per peer to gather the bucket exactly (its shards, compute
        dtype), which its gathered copy holds per rank; a compressed gather sends less."""
        return self.numel * self.compute_dtype.itemsize

    @property
    def gather_wire(self) -> str:
        """The wire format of this bucket's gathers: `Compression.frozen_weights`' when none
        of its parameters requires grad now (a frozen unit, or a fine-tuned unit's frozen
        base, which wrap buckets apart), else `Compression.weights`'."""
        if self.compression is None:
            return "exact"
        frozen = not any(p.param.requires_grad for p in self.params)
        return self.compression.wire_for("frozen_weights" if frozen else "weights")

    @property
    def reduce_wire(self) -> str:
        """The wire format of this bucket's gradient reductions."""
        return "exact" if self.compression is None else self.compression.wire_for("gradients")

    @property
    def block_size(self) -> int:
        return 256 if self.compression is None else self.compression.block_size

    def keep_post_forward(self) -> None:
        """hpZ: keep this rank's 1/k of the gathered buffer (`post_forward`) and drop the
        rest; the next gather runs over the node from it (`mesh.post_forward`)."""
        assert self.unsharded is not None and self.mesh.post_forward is not None
        full, self.unsharded = self.unsharded, None
        kept = track(torch.empty(sum(self._post_forward_pieces), dtype=full.dtype,
                                 device=full.device), "param")
        torch.cat([full[a:b] for a, b in self._post_forward_spans], out=kept)
        self.post_forward = kept

    def _prepare_gather(self) -> tuple[GatherRequest, Group, str] | None:
        """The request for the seam, the group and wire format it goes over, or None when
        there is nothing to exchange (shard-axis size 1: the shards are the data). The handle
        keeps `send` alive until it is done."""
        if self.post_forward is not None:  # hpZ: over the node, exact (decoded already)
            send, self.post_forward = self.post_forward, None
            request = GatherRequest(send, self._post_forward_pieces, self.label,
                                    self.check_gather)
            return request, self.mesh.post_forward, "exact"
        self._gathered_version = self.shard_flat._version
        send = self._gather_input()
        if send is not self.shard_flat:
            track(send, "param")
        if self.mesh.shard.size == 1:
            self.unsharded = send
            return None
        request = GatherRequest(send, self.piece_sizes, self.label, self.check_gather)
        return request, self.mesh.shard, self.gather_wire

    def finish_gather(self) -> torch.Tensor:
        if self.unsharded is not None:
            return self.unsharded
        if self._gather_handle is None:
            start_gathers([self], async_op=False)
            if self.unsharded is not None:
                return self.unsharded
        assert self._gather_handle is not None
        self.unsharded = self._gather_handle.wait()
        self._gather_handle = None
        return self.unsharded

    def unsharded_views(self) -> list[torch.Tensor]:
        """The original-shape tensors of this bucket's parameters: views of `unsharded`."""
        buf = self.unsharded
        assert buf is not None, "bucket is not gathered"
        return [buf[start:stop].view(shape) for start, stop, shape in self._view_spans]

    def abandon_gather(self) -> None:
        """Set aside a gather in flight that cannot complete (a peer is gone), unwaited
        (`GatherHandle.abandon`). A later `release` then has nothing to wait for."""
        if self._gather_handle is not None:
            self._gather_handle.abandon()
            self._gather_handle = None

    def release(self) -> None:
        """Drop the unsharded buffer and any hpZ copy (waiting for a gather still in flight
        first)."""
        if self._gather_handle is not None:
            self._gather_handle.discard()
            self._gather_handle = None
        self.unsharded = self.post_forward = None

    # -- reduce -----------------------------------------------------------------------------
    def _reduce_request(
        self, grads: Sequence[torch.Tensor], accumulated: torch.Tensor | None = None
    ) -> unit_comm.ReduceRequest:
        """The seam's request for these unsharded gradients (one per parameter)."""
        rows = [g.reshape(shape) for g, shape in zip(grads, self._row_shapes)]
        return unit_comm.ReduceRequest(
            rows, self.piece_sizes, self.reduce_dtype, self.device, self.label,
            self.check_reduce, accumulated,
        )

    def unused_grad(self, p: ShardedParam) -> torch.Tensor:
        """What a rank that did not use `p` contributes to the reduction: negative zeros.

        IEEE sums keep a negative zero only when every term is one (-0 + -0 = -0, x + -0 = x
        for every other x, +0 included), so after the reduction a parameter whose local rows
        are all -0 received no gradient on any rank -- no extra collective needed to agree on
        which parameters were unused (`PendingReduction.finish` leaves their `.grad` None).
        """
        return torch.full(p.layout.shape, -0.0, dtype=self.reduce_dtype, device=self.device)

    def accumulate_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """no_sync: add this backward's unsharded gradients to the local accumulator."""
        if self.accumulated_grad is not None and self.accumulation_abandoned():
            self.drop_accumulated_grad()
        self.accumulated_grad = unit_comm.accumulate_grads(
            self._reduce_request(grads, self.accumulated_grad), self.mesh, track=_grad_track
        )
        self._mark_grads()

    def _mark_grads(self) -> None:
        """Remember the `.grad` of every trainable parameter (a zero placeholder where there
        is none), so that a `zero_grad` during the window can be seen (`accumulation_abandoned`).
        The placeholders are removed when the window's reduction writes the real gradients."""
        marks = []
        for i, p in enumerate(self.params):
            param = p.param
            if not param.requires_grad:
                continue
            if param.grad is None:
                if self._placeholder is None:
                    self._placeholder = torch.zeros_like(self.shard_flat)
                param.grad = self._local_at(self._placeholder, i)
            marks.append((param, param.grad, param.grad._version))
        self._grad_marks = marks

    def accumulation_abandoned(self) -> bool:
        """True if a `.grad` we marked was replaced or zeroed since: `zero_grad` ran."""
        return any(param.grad is not g or g._version != v for param, g, v in self._grad_marks)

    def _clear_placeholders(self) -> None:
        ph = self._placeholder
        if ph is not None:
            base = ph.untyped_storage().data_ptr()
            for p in self.params:
                g = p.param.grad
                if g is not None and g.untyped_storage().data_ptr() == base:
                    p.param.grad = None
        self._placeholder = None
        self._grad_marks = []

    def start_reduce(
        self,
        grads: Sequence[torch.Tensor],
        *,
        unused: Sequence[bool],
        write: Sequence[bool],
        defer: bool = False,
    ) -> PendingReduction:
        """Issue the reduction of these unsharded gradients (plus any no_sync accumulation).

        `unused[i]`: this rank's backward gave parameter i no gradient (its entry in `grads`
        is `unused_grad`); `write[i]`: parameter i requires grad now, so its `.grad` is set.
        `defer`: the seam may hold the reduction to send it with others' (the runtime's
        `Reductions.submit` then sends it); else it is issued now."""
        if self.accumulated_grad is not None and self.accumulation_abandoned():
            self.drop_accumulated_grad()
        # With a no_sync accumulation, `unused` (this micro-batch) only selects which
        # parameters get the all -0 check: an earlier micro-batch's use makes it fail.
        self._clear_placeholders()
        request = self._reduce_request(grads, self.accumulated_grad)
        self.accumulated_grad = None  # consumed by the reduction
        handle = unit_comm.start_reduction(request, self.mesh, hold=defer, track=_grad_track,
                                           wire=self.reduce_wire, block_size=self.block_size)
        return PendingReduction(self, unused, write, handle)

    def drop_accumulated_grad(self) -> None:
        """Forget the no_sync accumulation (zero_grad, a failed backward) and its placeholders."""
        self.accumulated_grad = None
        self._clear_placeholders()

    def _local_at(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's real local rows inside `flat` (a flat shard-sized tensor)."""
        start, stop, shape = self._local_spans[i]
        return flat[start:stop].view(shape)


def _grad_track(t: torch.Tensor) -> torch.Tensor:
    return track(t, "grad")


def start_gathers(buckets: Sequence[Bucket], *, async_op: bool) -> None:
    """Issue the gathers of those `buckets` not gathered or in flight, in order, together:
    the seam sends small ones (several small units' buckets) as one exchange, one call per
    group and wire format (hpZ copies go over the node, exact)."""
    todo = [b for b in dict.fromkeys(buckets) if not b.in_flight]  # a unit may come twice
    calls: dict[tuple[int, str, int], list[tuple[Bucket, GatherRequest]]] = {}
    groups: dict[int, Group] = {}
    for b in todo:
        if (prepared := b._prepare_gather()) is not None:
            req, group, wire = prepared
            groups[id(group)] = group
            calls.setdefault((id(group), wire, b.block_size), []).append((b, req))
    for (group_id, wire, block_size), members in calls.items():
        group = groups[group_id]
        handles = unit_comm.gather_params(
            [req for _, req in members], group, async_op=async_op,
            track=lambda t: track(t, "param"), wire=wire, block_size=block_size,
        )
        for (b, _), handle in zip(members, handles):
            b._gather_handle = handle


class PendingReduction:
    """One bucket's gradient reduction in flight (the seam's `handle`) and where its result
    goes: each parameter's `.grad`, or back to autograd."""

    __slots__ = ("bucket", "unused", "write", "handle")

    def __init__(
        self, bucket: Bucket, unused: Sequence[bool], write: Sequence[bool], handle: ReduceHandle
    ) -> None:
        self.bucket, self.unused, self.write, self.handle = bucket, unused, write, handle

    def discard(self) -> None:
        """Drop the reduction of a backward that raised (`ReduceHandle.discard`)."""
        self.handle.discard()

    def finish(self, *, to_grad: bool = True) -> list[torch.Tensor | None]:
        """Wait until done and average over the data-parallel ranks. Returns each parameter's
        reduced local rows (in the shards' dtype, on the shards' device: host memory under
        CPU offload), None for a parameter that does not require grad or that no rank used;
        with `to_grad` they are also written (or added) to the parameters' `.grad`."""
        bucket = self.bucket
        out = self.handle.wait().to(bucket.shard_flat.device, bucket.grad_dtype)
        result: list[torch.Tensor | None] = []
        with torch.no_grad():
            for i, (p, write, unused) in enumerate(zip(bucket.params, self.write, self.unused)):
                grad = bucket._local_at(out, i) if write else None
                if grad is not None and unused and _all_negative_zero(grad):
                    grad = None  # no rank used it (see Bucket.unused_grad)
                result.append(grad)
                if grad is None or not to_grad:
                    continue
                param = p.param
                if param.grad is None and grad.dtype != param.dtype:
                    # keep_low_precision_grads: `.grad = ` refuses another dtype; torch
                    # FSDP sets `.grad.data` the same way.
                    param.grad = torch.empty_like(param)
                    param.grad.data = grad
                elif param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        return result


def _all_negative_zero(t: torch.Tensor) -> bool:
    """Every element is -0.0 (True for an empty tensor: a rank that owns no rows)."""
    return bool((t == 0).logical_and_(t.signbit()).all())


# -- the count of unsharded bytes ------------------------------------------------------------
class _MemoryTracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = {"param": 0, "grad": 0}
        self.reset_peaks()

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak = {**self.current, "total": sum(self.current.values())}

    def add(self, kind: Literal["param", "grad"], nbytes: int) -> None:
        with self._lock:
            self.current[kind] += nbytes
            self.peak[kind] = max(self.peak[kind], self.current[kind])
            self.peak["total"] = max(self.peak["total"], sum(self.current.values()))


TRACKER = _MemoryTracker()


def track(tensor: torch.Tensor, kind: Literal["param", "grad"]) -> torch.Tensor:
    """Count `tensor`'s bytes as unsharded `kind` bytes until the tensor object is freed.

    Views keep their base tensor alive, so the count lasts as long as any view of it does.
    """
    nbytes = tensor.numel() * tensor.element_size()
    TRACKER.add(kind, nbytes)
    weakref.finalize(tensor, TRACKER.add, kind, -nbytes)
    return tensor


def memory_stats() -> dict[str, int]:
    """Unsharded bytes the engine holds now and at its peak since the last reset.

    Keys: `unsharded_param_bytes`, `unsharded_grad_bytes` (now), `peak_unsharded_param_bytes`,
    `peak_unsharded_grad_bytes`, `peak_unsharded_bytes` (peak of their sum).
    """
    current, peak = TRACKER.current, TRACKER.peak
    return {
        "unsharded_param_bytes": current["param"],
        "unsharded_grad_bytes": current["grad"],
        "peak_unsharded_param_bytes": peak["param"],
        "peak_unsharded_grad_bytes": peak["grad"],
        "peak_unsharded_bytes": peak["total"],
    }


def reset_memory_stats() -> None:
    """Set the peaks back to the current figures."""
    TRACKER.reset_peaks()
