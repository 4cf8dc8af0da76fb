"""The runtime of one wrapped model: forward hooks, ZeRO-3's saved-tensor hooks, backward.

One `Runtime` per `fsdp()` call drives every unit of that model through a step:

forward   unit pre-hook: start the unit's gather (unless prefetched), prefetch the next
          `prefetch_limit` units in the order recorded on the previous pass, wait, install the
          unsharded views (through `GatheredParams`). Post-hook: uninstall; ZeRO-3 releases.
backward  `GatheredParams.backward` (once per unit, when its gradients are complete) issues
          the reduction of every bucket's unsharded gradients asynchronously; the reductions
          of at most `max_pending_reductions` units stay in flight (a unit's buckets count
          once, so LAYER/NONE bucketing does not wait on its own reductions), older ones are
          finished (waited and written to `.grad`) while earlier units compute. The unit is
          released.
end       a callback queued on the autograd engine finishes all reductions and releases every
          unit, so nothing unsharded survives the step.

[Note: ZeRO-3 and saved tensors]
Autograd saves the unsharded parameters its backward formulas need (a Linear saves its
weight). If those references stayed, ZeRO-3 would quietly hold every unit until backward, i.e.
behave like ZeRO-2 with identical numbers. So while the root runs forward under ZeRO-3 we push
`saved_tensors_hooks`: a saved tensor whose storage is a gathered bucket buffer is packed as a
`_SavedParamView` (bucket + offset/size/stride, no data); unpacking it in backward gathers the
unit again (prefetching the one expected next) and returns the same view of the new buffer.
This only works because the tensors handed to modules are views of the tracked buffer, never
copies (see bucket.py). Only the root pushes the hooks: the innermost hooks win and ours
handle every unit.

[Note: recomputation]
Activation checkpointing reruns unit forwards *inside* backward. There the pre-hook gathers as
usual but records no order, prefetches nothing, pushes no saved-tensor hooks (checkpoint's own
hooks must see the recomputed tensors) and does not release after forward: the unit is being
used by backward and is released by its `GatheredParams.backward` as always.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from fullshard.config import ShardingPlan
from fullshard.distributed.mesh import ShardMesh
from fullshard.engine.bucket import Bucket, PendingReduction
from fullshard.engine.unit import Unit


class _SavedParamView(NamedTuple):
    unit: Unit
    bucket: Bucket
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Runtime:
    def __init__(
        self,
        units: list[Unit],
        mesh: ShardMesh,
        plan: ShardingPlan,
        *,
        prefetch_limit: int,
        max_pending_reductions: int,
        input_dtype: torch.dtype | None = None,
    ) -> None:
        self.units = units
        self.root = units[0]
        for i, u in enumerate(units):
            u.index = i
        self.mesh = mesh
        self.plan = plan
        self.prefetch_limit = prefetch_limit
        self.max_pending_reductions = max_pending_reductions
        self.input_dtype = input_dtype  # mixed precision: floating inputs of units cast to it
        self.sync_gradients = True
        self.move_state_dict_to_cpu = False  # default of full_state_dict(cpu_offload=None)
        self.units_description = ""  # e.g. 'root + 2 x Block (default: repeated blocks)'
        self.pass_id = 0
        self.forward_order: list[Unit] = []
        self.forward_order_prev: list[Unit] = []
        self.backward_order: list[Unit] = []
        self.backward_order_prev: list[Unit] = []
        self._backward_plan: dict[Unit, int] = {}
        self._backward_plan_list: list[Unit] = []
        self.pending: collections.deque[tuple[Unit, PendingReduction]] = collections.deque()
        self.callback_queued = False
        self._saved_hooks: Any = None
        # data_ptr of a gathered bucket buffer -> (unit, bucket); only for buckets whose
        # unsharded buffer is not the shard itself (shard-axis size > 1).
        self._storage_owner: dict[int, tuple[Unit, Bucket]] = {}

    # -- gather / release bookkeeping -------------------------------------------------------
    def _wait(self, unit: Unit) -> None:
        unit.wait_gathered()
        if self.mesh.shard.size > 1:
            for b in unit.buckets:
                assert b.unsharded is not None
                self._storage_owner[b.unsharded.untyped_storage().data_ptr()] = (unit, b)

    def _release(self, unit: Unit) -> None:
        if self.mesh.shard.size > 1:
            for b in unit.buckets:
                if b.unsharded is not None:
                    self._storage_owner.pop(b.unsharded.untyped_storage().data_ptr(), None)
        unit.release()

    # -- forward ----------------------------------------------------------------------------
    def pre_forward(self, unit: Unit, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        recomputing = _in_backward()
        if unit is self.root and not recomputing:
            self._begin_forward()
        if not unit.is_gathered:
            unit.start_gather(async_op=True)
        if not recomputing:
            self.forward_order.append(unit)
            self._prefetch_forward(len(self.forward_order) - 1, unit)
        self._wait(unit)
        with_grad = torch.is_grad_enabled()
        unit.install(self, with_grad=with_grad, pass_id=self.pass_id)
        if unit is self.root and self._wants_saved_tensor_hooks(with_grad, recomputing):
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(
                self._pack_hook, self._unpack_hook
            )
            self._saved_hooks.__enter__()
        if self.input_dtype is not None:
            return _cast_floating((args, kwargs), self.input_dtype)
        return None

    def gather_for_recompute(self, unit: Unit) -> None:
        """Activation checkpointing: gather and install `unit` for a recomputation that runs
        outside its hooks (see checkpointing.py)."""
        if not unit.is_gathered:
            self._ensure_backward_callback()
            unit.start_gather(async_op=False)
            self._wait(unit)
        # Leaves that require grad, so the recomputed ops save exactly what the original
        # forward saved (checkpoint checks); the recomputed graph itself is never run backward.
        for bucket in unit.buckets:
            for p, view in zip(bucket.params, bucket.unsharded_views()):
                p.install(view.detach().requires_grad_(bucket.requires_grad))

    def post_forward(self, unit: Unit, module: torch.nn.Module, args: Any, output: Any) -> None:
        if unit is self.root and self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        unit.uninstall()
        if self._release_after_forward(unit):
            self._release(unit)

    def _begin_forward(self) -> None:
        for unit in self.units:  # a few pointer comparisons per parameter and step
            for bucket in unit.buckets:
                bucket.check_intact()
        self.pass_id += 1
        if self.forward_order:
            self.forward_order_prev = self.forward_order
        self.forward_order = []

    def _wants_saved_tensor_hooks(self, with_grad: bool, recomputing: bool) -> bool:
        return (
            with_grad
            and not recomputing
            and self.plan.reshard_after_forward
            and self.sync_gradients
            and self.mesh.shard.size > 1
        )

    def _release_after_forward(self, unit: Unit) -> bool:
        if _in_backward():
            return False  # recomputation: backward is using the unit
        if not torch.is_grad_enabled() or not unit.trainable_params:
            return True  # no GatheredParams.backward will come to release it
        if not self.sync_gradients:
            return False  # no_sync keeps units gathered until the synced backward
        return self.plan.reshard_after_forward

    def _prefetch_forward(self, pos: int, unit: Unit) -> None:
        prev = self.forward_order_prev
        if self.prefetch_limit <= 0 or pos >= len(prev) or prev[pos] is not unit:
            return
        for nxt in prev[pos + 1 : pos + 1 + self.prefetch_limit]:
            if not nxt.is_gathered:
                nxt.start_gather(async_op=True)

    # -- ZeRO-3 saved tensors ---------------------------------------------------------------
    # Under torch.compile the hooks run eagerly: dynamo cannot trace storage pointers and
    # would otherwise try (and recompile) on every tensor autograd saves.
    @torch.compiler.disable
    def _pack_hook(self, t: torch.Tensor) -> Any:
        return self._pack(t)

    @torch.compiler.disable
    def _unpack_hook(self, saved: Any) -> torch.Tensor:
        return self._unpack(saved)

    def _pack(self, t: torch.Tensor) -> Any:
        owner = self._storage_owner.get(t.untyped_storage().data_ptr())
        if owner is None or t.dtype != owner[1].compute_dtype:
            return t
        unit, bucket = owner
        return _SavedParamView(unit, bucket, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedParamView):
            return saved
        unit = saved.unit
        if not unit.is_gathered:
            self._ensure_backward_callback()
            unit.start_gather(async_op=True)
            self.backward_order.append(unit)
            self._prefetch_backward(unit)
            self._wait(unit)
        buf = saved.bucket.unsharded
        assert buf is not None
        return buf.as_strided(saved.size, saved.stride, saved.offset)

    def _prefetch_backward(self, unit: Unit) -> None:
        i = self._backward_plan.get(unit)
        if self.prefetch_limit <= 0 or i is None:
            return
        for nxt in self._backward_plan_list[i + 1 : i + 1 + self.prefetch_limit]:
            if not nxt.is_gathered:
                nxt.start_gather(async_op=True)

    # -- backward ---------------------------------------------------------------------------
    def _ensure_backward_callback(self) -> None:
        if self.callback_queued or not _in_backward():
            return
        Variable._execution_engine.queue_callback(self._finalize_backward)
        self.callback_queued = True
        # Expected order of backward gathers: last step's, else the reverse of this forward.
        order = self.backward_order_prev or list(reversed(self.forward_order))
        plan: dict[Unit, int] = {}
        for i, u in enumerate(order):
            plan.setdefault(u, i)
        self._backward_plan, self._backward_plan_list = plan, order
        self.backward_order = []

    def post_backward(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Called by `GatheredParams.backward` with the unit's unsharded gradients."""
        self._ensure_backward_callback()
        start = 0
        for bucket in unit.trainable_buckets:
            n = len(bucket.params)
            chunk = [
                g
                if g is not None
                else torch.zeros(p.layout.shape, dtype=bucket.dtype, device=bucket.device)
                for g, p in zip(grads[start : start + n], bucket.params)
            ]
            start += n
            if not self.sync_gradients:
                bucket.accumulate_grads(chunk)
                continue
            self.pending.append((unit, bucket.start_reduce(chunk)))
            while len({u for u, _ in self.pending}) > self.max_pending_reductions:
                self.pending.popleft()[1].finish()
        if self.sync_gradients:
            self._release(unit)

    def _finalize_backward(self) -> None:
        try:
            while self.pending:
                self.pending.popleft()[1].finish()
            if self.sync_gradients:
                for u in self.units:
                    self._release(u)
            if self.backward_order:
                self.backward_order_prev = self.backward_order
        finally:
            self.callback_queued = False

    def release_all(self) -> None:
        """Drop every unsharded buffer and any no_sync accumulation (e.g. before a load)."""
        while self.pending:
            self.pending.popleft()[1].finish()
        for u in self.units:
            self._release(u)
            for b in u.buckets:
                b.drop_accumulated_grad()
