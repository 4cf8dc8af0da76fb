"""The runtime of one wrapped model: forward hooks, ZeRO-3's saved-tensor hooks, backward.

One `Runtime` per `fsdp()` call drives every unit of that model through a step:

forward   unit pre-hook: start the unit's gather (unless prefetched), prefetch the next
          `prefetch_limit` units in the order recorded on the previous pass, wait, install the
          unsharded views (through `GatheredParams`). Post-hook: uninstall; ZeRO-3 releases.
backward  `GatheredParams.backward` (once per unit, when its gradients are complete) issues
          the reduction of every bucket's unsharded gradients asynchronously; the reductions
          of at most `max_pending_reductions` issues stay in flight (a unit's buckets count
          once, so LAYER/NONE bucketing does not wait on its own reductions), older ones are
          finished (waited and written to `.grad`) while earlier units compute. The unit is
          released.
end       a callback queued on the autograd engine finishes all reductions and releases every
          unit, so nothing unsharded survives the step.

The gathers ahead (`_gather_ahead`) and the held reductions (`_queue_reductions`) follow
the seam's budgets: see [Note: small units travel together] in distributed/unit_comm.py.

[Note: what a training loop may do between steps]
The loop is the user's (docs/architecture.md, invariant 7); the runtime keeps no state that a
step that went wrong could leave behind:
- a backward that raised never runs its end-of-backward callback. The callback records the
  autograd task it was queued for (`callback_task`); the next root forward or `zero_grad`
  finds it still set and discards the step (`_discard_step`): waits for and drops its
  pending reductions (all ranks issued them), drops partial and no_sync gradients, releases
  every unit. A backward of another task queues its own callback.
- a forward that raised (post-hooks run with `always_call`) releases every unit and waits
  for the prefetches in flight, or sets them aside once a wait fails (`_forward_failed`).
- `requires_grad` is read at every root forward (Unit.refresh_requires_grad).
- `zero_grad` drops a no_sync window: the model's directly (module.py), the optimizer's is
  seen through the `.grad` tensors the window marked (Bucket.accumulation_abandoned).
- any write to the shards bumps their version counter; a gathered copy older than the shards
  is dropped and gathered again before it is used (`_drop_stale`).
- `torch.autograd.grad(loss, params)`: the reductions run synchronously and their local-shard
  results are returned to autograd instead of being written to `.grad`.

[Note: the root stays gathered]
The root's forward encloses every other unit's, so the root is gathered for the whole forward
anyway, and its backward (the head, the final norm) runs first. Releasing it after forward
only to gather it again at once is an exposed exchange that nothing can hide, so by default
(FSDP2's `reshard_after_forward=None`; `plan.reshard_root_after_forward` False) the root is
not released by its post-hook: ZeRO-3 gathers every other unit twice per step and the root
once. Its lifetime: gathered from its pre-hook until its own `GatheredParams.backward` (its
gradients complete, i.e. near the end of backward, its embedding being the first layer) or
the end-of-backward callback releases it, which is no longer than with True, where backward
gathers it again first and holds it to the same point; the peak is the same. Its saved
tensors are still packed as tokens (the hooks do not tell units apart); unpacking finds it
gathered and gathers nothing. A forward with gradients that no backward follows leaves the
root gathered until the next step reuses it (as ZeRO-2 leaves every unit); `release_all`,
`zero_grad` after a failed step and a load drop it.
The same for any unit a per-unit `reshard_after_forward` keeps (`unit.reshard_after_forward`,
set at wrap), e.g. torchtitan's LM head unit: gathered once, reduced as its backward ends.

[Note: the turn from forward to backward]
Under ZeRO-3 the first unit backward needs (the last block; the order recorded last step,
else the reverse of this forward) was released by its post-hook moments ago, and its first
saved tensor is unpacked only after the loss and the root's own backward (an LM head) have
run. Gathering it only then left the link idle for that whole stretch and the gather exposed
(on 2 emulated hosts at 300 Mbit/s, config A: ~130 ms idle, then 140 ms blocked). So the
root's post-hook, when this forward pushed the saved-tensor hooks (ZeRO-3 with grad), starts
the gathers of the first `backward_prefetch_limit` units of that order
(`_prefetch_backward_start`). Counts per step are the algorithm's (the gather is one
backward would issue anyway; it is counted when it is issued, before `loss.backward()`); the
transient memory is the prefetch's, within the limit. A forward with grad that no backward
follows leaves them gathered until the next step uses or releases them, as it leaves the root.

Activation checkpointing reruns unit forwards inside backward: what the hooks do then is
[Note: recomputed forwards] in engine/unit.py.
"""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from fullshard.config import ShardingPlan
from fullshard.distributed.mesh import ShardMesh
from fullshard.distributed.unit_comm import Reductions, gather_batch_bytes
from fullshard.engine.bucket import Bucket, PendingReduction
from fullshard.engine.mixed_precision import cast_floating
from fullshard.engine.saved_params import SavedParams
from fullshard.engine.thunder_refusal import refuse_thunder_trace
from fullshard.engine.unit import BackwardDone, Unit, UnitState


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
        reshards: Sequence[bool],
        backward_prefetch_limit: int | None = None,
        input_dtypes: dict[Unit, torch.dtype] | None = None,
    ) -> None:
        self.units = units
        self.root = units[0]
        # `reshards`: each unit released after forward? (ShardingPlan.unit_reshards, at wrap)
        for i, (u, reshard) in enumerate(zip(units, reshards, strict=True)):
            u.index = i
            u.reshard_after_forward = reshard
        # ZeRO-3's saved-tensor hooks are needed when any unit is released after forward
        self._any_reshards = any(u.reshard_after_forward for u in units)
        self.mesh = mesh
        self.plan = plan
        self.prefetch_limit = prefetch_limit  # forward: units gathered ahead of the running one
        # backward: the same unless told (torch's backward_prefetch=None turns it off)
        self.backward_prefetch_limit = (
            prefetch_limit if backward_prefetch_limit is None else backward_prefetch_limit
        )
        self.max_pending_reductions = max_pending_reductions
        # mixed precision: the dtype each unit casts its floating inputs to (precision.py)
        self.input_dtypes = input_dtypes or {}
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
        # Reductions in flight, one entry per issue (a unit's buckets, or a batch of small
        # units' buckets sent together), oldest first; the seam holds small units' ones
        # until they go together (see `_queue_reductions`).
        self.pending: collections.deque[list[PendingReduction]] = collections.deque()
        self.reductions = Reductions(mesh, on_issue=self._track_pending)
        # Autograd task whose end-of-backward callback is queued and has not run yet; a
        # value that outlives its task marks a backward that raised (see [Note: what a
        # training loop may do between steps]).
        self.callback_task: int | None = None
        self._grad_mode_task = -1  # task for which `_returns_grads` was decided
        self._returns_grads = False  # this task is torch.autograd.grad: return, don't write
        # ZeRO-3: the saved-tensor hooks over gathered buffers (saved_params.py)
        self.saved = SavedParams(regather=self._regather_saved)
        # id() of the exception being handled when the root forward began (id(None) if
        # none): an id, not a reference, so an OOM-retry loop's exception is not kept alive.
        self._forward_exc = id(None)

    @property
    def callback_queued(self) -> bool:
        return self.callback_task is not None

    # -- gather / release bookkeeping -------------------------------------------------------
    def _wait(self, unit: Unit) -> None:
        unit.wait_gathered()
        if self.mesh.shard.size > 1:  # else the unsharded buffer is the shard itself
            self.saved.track(unit)

    def _release(self, unit: Unit) -> None:
        if self.mesh.shard.size > 1:
            self.saved.untrack(unit)
        unit.release()

    def _drop_stale(self, unit: Unit) -> None:
        """Release `unit` if its shards were written since it was gathered (a load, an edit
        under no_grad): its gathered copy holds the old values. One int compare per bucket."""
        if any(b.is_stale() for b in unit.buckets):
            self._release(unit)

    # -- forward ----------------------------------------------------------------------------
    def pre_forward(self, unit: Unit, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        refuse_thunder_trace(unit.name)  # thunder.jit of the model or a unit: a dict lookup
        recomputing = _in_backward()
        if unit is self.root and not recomputing:
            self._begin_forward()
        self._drop_stale(unit)
        if recomputing:
            unit.start_gather(async_op=True)
        else:
            self.forward_order.append(unit)
            pos = len(self.forward_order) - 1
            self._gather_ahead(unit, self.forward_order_prev, pos, self.prefetch_limit)
        self._wait(unit)
        with_grad = torch.is_grad_enabled()
        if recomputing:
            unit.install_recomputed(self)  # see [Note: recomputed forwards] in engine/unit.py
        else:
            unit.install(self, with_grad=with_grad, pass_id=self.pass_id)
        if unit is self.root and self._wants_saved_tensor_hooks(with_grad, recomputing):
            self.saved.push()
        dtype = self.input_dtypes.get(unit)
        if dtype is not None:
            args, kwargs = cast_floating((args, kwargs), dtype)
        if (
            with_grad
            and not recomputing
            and unit.buckets
            and not unit.trainable_params
            and self._wants_saved_tensor_hooks(with_grad, recomputing)
        ):
            return self._mark_frozen_inputs(unit, args, kwargs)
        if dtype is not None:
            return args, kwargs
        return None

    def _mark_frozen_inputs(self, unit: Unit, args: Any, kwargs: Any) -> Any:
        """ZeRO-3, a unit with nothing trainable: pass its grad-requiring inputs through
        `BackwardDone`, so the unit re-gathered for its backward is released right after."""
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return args, kwargs
        outs = BackwardDone.apply(self, unit, *(flat[i] for i in idx))
        for i, o in zip(idx, outs):
            flat[i] = o
        unit.node_created(self.pass_id)
        return tree_unflatten(flat, spec)

    def gather_for_recompute(self, unit: Unit) -> None:
        """Activation checkpointing: gather and install `unit` for a recomputation that runs
        outside its hooks -- an enclosing unit whose parameters the checkpointed region reads
        (see activation_checkpoint.py). Installed as for the unit's own recomputation: trainable
        tensors require grad, so the recomputed ops save exactly what the original forward
        saved (non-reentrant checkpoint checks), and a reentrant checkpoint's nested backward
        hands their gradients to `recomputed_backward`. Released by the unit's own last node,
        or at the end of backward."""
        self._ensure_backward_callback()
        self._drop_stale(unit)
        if not unit.is_gathered:
            unit.start_gather(async_op=False)
        self._wait(unit)
        unit.install_recomputed(self)

    def recomputed_backward(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """`RecomputedParams.backward` (reentrant checkpointing only): add the gradients the
        recomputed graph produced for `unit` to the unit's sum of the pass. They are reduced
        with the unit's last counted node, or by the end-of-backward flush when none is left
        to run (the unit ran only inside reentrant checkpoints, whose first forward records
        no node, or its node ran already)."""
        self._ensure_backward_callback()
        unit.add_partial_grads(grads)

    def post_forward(self, unit: Unit, module: torch.nn.Module, args: Any, output: Any) -> None:
        # ZeRO-3 with grad: this pass's backward gathers units again
        regathers = unit is self.root and self.saved.pop()
        unit.uninstall()
        if unit is self.root and not _in_backward() and id(sys.exc_info()[1]) != self._forward_exc:
            # `always_call`: the forward raised (an exception other than the one being
            # handled when it started, e.g. by an OOM-retry loop's `except` block).
            self._forward_failed()
            return
        if unit is self.root:
            if self._release_after_forward(unit, unit.reshard_after_forward):
                self._release(unit)
            # Units prefetched that this forward did not run, where they reshard (the ones
            # it ran were released, or kept, by their own post-hooks already). None can be
            # under ZeRO-2 with grad: skip the walk there.
            if self._any_reshards or not torch.is_grad_enabled():
                for u in self.units[1:]:
                    if (u.is_gathered or u.state is UnitState.GATHERING) and (
                        self._release_after_forward(u, u.reshard_after_forward)
                    ):
                        self._release(u)
            if regathers:
                self._prefetch_backward_start(self._expected_backward_order())
        elif self._release_after_forward(unit, unit.reshard_after_forward):
            self._release(unit)

    def _forward_failed(self) -> None:
        """Release every unit after a forward raised: no backward will come for them (the
        partial order is not kept). Prefetches in flight are waited for, but once a wait fails
        (a peer died) the rest are set aside unwaited (`Bucket.abandon_gather`): a broken group
        can only raise again or block, and that would hide the forward's own error."""
        self._forward_exc = id(None)
        broken = False
        for u in self.units:
            u.uninstall()
            if not broken:
                try:
                    self._release(u)
                    continue
                except Exception:  # noqa: BLE001 - the forward's error is the one to see
                    broken = True
            u.abandon_gathers()
            self._release(u)
        self.forward_order = []

    def _begin_forward(self) -> None:
        self._forward_exc = id(sys.exc_info()[1])
        if self.callback_task is not None:
            self._discard_step()  # the last backward raised
        abandoned = False
        for unit in self.units:  # a few pointer comparisons per parameter and step
            for bucket in unit.buckets:
                bucket.check_intact()
                if bucket.accumulated_grad is not None and bucket.accumulation_abandoned():
                    abandoned = True
            unit.refresh_requires_grad()
        if abandoned:  # zero_grad during a no_sync window: drop it all
            self._drop_gradients()
        self.pass_id += 1
        if self.forward_order:
            self.forward_order_prev = self.forward_order
        self.forward_order = []

    def _wants_saved_tensor_hooks(self, with_grad: bool, recomputing: bool) -> bool:
        return (
            with_grad
            and not recomputing
            and self._any_reshards
            and self.sync_gradients
            and self.mesh.shard.size > 1
        )

    def _release_after_forward(self, unit: Unit, reshard: bool) -> bool:
        """Release `unit` after its forward? `reshard`: the plan's choice for it (see
        [Note: the root stays gathered])."""
        if _in_backward():
            return False  # recomputation: backward is using the unit
        if not torch.is_grad_enabled() or not unit.trainable_params:
            return True  # no GatheredParams.backward will come to release it
        if not self.sync_gradients:
            return False  # no_sync keeps units gathered until the synced backward
        return reshard

    def _gather_ahead(self, unit: Unit, order: list[Unit], pos: int, limit: int) -> None:
        """Have `unit` gathered or in flight, and prefetch what follows it in `order` (the
        order recorded on the last pass, `unit` expected at `pos`).

        Ahead means the next `limit` units and, where small units' exchanges can be sent
        together (gloo), as many more as keep the bytes in flight within `SMALL_UNITS_BYTES`
        per rank: they are issued in one exchange with `unit` if it needs one. The window is
        refilled only when one of the next `limit` units is not in flight, so a run of small
        units costs one exchange per ~SMALL_UNITS_BYTES, not one per unit. Memory: the units in
        flight ahead are `limit` units or SMALL_UNITS_BYTES per rank gathered, whichever is more.
        """
        window: list[Unit] = []
        if limit > 0 and pos < len(order) and order[pos] is unit:
            budget, nbytes = gather_batch_bytes(self.mesh.shard), unit.gather_nbytes
            for nxt in order[pos + 1 :]:
                if nxt is unit or nxt in window:
                    continue  # a unit called several times per pass
                if len(window) >= limit and nbytes + nxt.gather_nbytes > budget:
                    break
                window.append(nxt)
                nbytes += nxt.gather_nbytes
        if unit.in_flight and all(u.in_flight for u in window[:limit]):
            return
        for u in window:
            self._drop_stale(u)
        unit.start_gather_with(window, async_op=True)

    # -- ZeRO-3 saved tensors ---------------------------------------------------------------
    def _regather_saved(self, unit: Unit) -> None:
        """A saved tensor of `unit` is being unpacked in backward (saved_params.py): gather
        the unit again if it is not, prefetching the ones expected next."""
        # Every unpack, not only a gathering one: the root stays gathered into backward, and
        # the outer task's callback must be queued before a reentrant recomputation nests one.
        self._ensure_backward_callback()
        if not unit.is_gathered:
            self.backward_order.append(unit)
            pos = self._backward_plan.get(unit, len(self._backward_plan_list))
            self._gather_ahead(unit, self._backward_plan_list, pos, self.backward_prefetch_limit)
            self._wait(unit)

    def _expected_backward_order(self) -> list[Unit]:
        """The order backward is expected to gather units in: last step's, else the reverse
        of this forward."""
        return self.backward_order_prev or list(reversed(self.forward_order))

    def _prefetch_backward_start(self, order: list[Unit]) -> None:
        """ZeRO-3, the root's forward is done: start gathering again the first
        `backward_prefetch_limit` units backward will need (see [Note: the turn from forward
        to backward])."""
        if self.backward_prefetch_limit <= 0:
            return
        ahead = list(dict.fromkeys(u for u in order if not u.is_gathered))
        ahead = ahead[: self.backward_prefetch_limit]
        if ahead:
            ahead[0].start_gather_with(ahead[1:], async_op=True)

    # -- backward ---------------------------------------------------------------------------
    def _ensure_backward_callback(self) -> None:
        if not _in_backward():
            return
        task = torch._C._current_graph_task_id()
        if self.callback_task == task:
            return
        # A task we have not seen: this step's backward, or one nested in it (reentrant
        # checkpointing), which gets its own callback. A callback left by a backward that
        # raised cannot be told from an outer task still running here; it is discarded
        # outside backward (next forward, zero_grad).
        Variable._execution_engine.queue_callback(functools.partial(self._finalize_backward, task))
        self.callback_task = task
        order = self._expected_backward_order()
        plan: dict[Unit, int] = {}
        for i, u in enumerate(order):
            plan.setdefault(u, i)
        self._backward_plan, self._backward_plan_list = plan, order
        self.backward_order = []

    def _task_returns_grads(self, unit: Unit) -> bool:
        """Is this backward `torch.autograd.grad` (gradients returned, `.grad` untouched)?

        Autograd exposes no flag for it; `_will_engine_execute_node` on a leaf's
        AccumulateGrad node answers during `.backward()` and raises during autograd.grad."""
        task = torch._C._current_graph_task_id()
        if self._grad_mode_task != task:
            self._grad_mode_task = task
            try:
                torch._C._will_engine_execute_node(unit._acc_node)
                self._returns_grads = False
            except RuntimeError:
                self._returns_grads = True
        return self._returns_grads

    def post_backward(
        self,
        unit: Unit,
        routing: list[tuple[Bucket, tuple[bool, ...]]],
        grads: tuple[torch.Tensor | None, ...],
    ) -> list[torch.Tensor | None] | None:
        """Called by `GatheredParams.backward` with the unit's unsharded gradients (one per
        parameter routed in `routing`). Returns the local-shard gradients to hand to autograd
        under `torch.autograd.grad`, else None (the `.grad`s are written here)."""
        self._ensure_backward_callback()
        returns = self._task_returns_grads(unit)
        if returns and not self.sync_gradients:
            raise RuntimeError(
                "torch.autograd.grad on a fullshard model inside no_sync() is not supported: "
                "the gradients are only reduced on the synced backward. Call it outside "
                "no_sync(), or use loss.backward() to accumulate."
            )
        if not unit.node_done(torch._C._current_graph_task_id()):
            unit.add_partial_grads(grads)  # called again later in this pass: reduce once
            return None
        all_grads = unit.take_grads(grads)
        result: list[torch.Tensor | None] = []
        unit_pendings: list[PendingReduction] = []
        start = 0
        for bucket, mask in routing:
            chunk, unused = [], []
            for p, routed in zip(bucket.params, mask):
                g = all_grads[start] if routed else None
                start += routed
                unused.append(g is None)
                chunk.append(g if g is not None else bucket.unused_grad(p))
            if not self.sync_gradients:
                bucket.accumulate_grads(chunk)
                continue
            pending = bucket.start_reduce(chunk, unused=unused, write=mask, defer=not returns)
            if returns:
                reduced = pending.finish(to_grad=False)
                result += [g for g, routed in zip(reduced, mask) if routed]
                continue
            unit_pendings.append(pending)
        if unit_pendings:
            self._queue_reductions(unit_pendings)
        if self.sync_gradients:
            self._release(unit)
        return result if returns else None

    def _queue_reductions(self, unit_pendings: list[PendingReduction]) -> None:
        """Hand one unit's reductions to the seam, which sends them or holds small ones to go
        with the next units' (`unit_comm.Reductions`); each issue comes back to
        `_track_pending`. The reductions of at most `max_pending_reductions` issues stay in
        flight; older ones are finished while earlier units compute."""
        self.reductions.submit(unit_pendings)

    def _flush_reductions(self) -> None:
        self.reductions.flush()

    def _track_pending(self, pendings: list[PendingReduction]) -> None:
        self.pending.append(pendings)
        while len(self.pending) > self.max_pending_reductions:
            for p in self.pending.popleft():
                p.finish()

    def frozen_backward_done(self, unit: Unit) -> None:
        """`BackwardDone.backward`: gradients have flowed through a unit with nothing
        trainable; release it once its last node of the pass has run (ZeRO-3)."""
        if unit.node_done(torch._C._current_graph_task_id()) and self.sync_gradients:
            self._release(unit)

    def _flush_partial(self) -> None:
        """Reduce the summed gradients of units called several times whose other nodes never
        ran (an output that did not reach the loss): every rank ran the same nodes."""
        for u in self.units:
            if u.partial_grads is not None:
                u.nodes = u.nodes_done + 1  # the next node_done is the last
                self.post_backward(u, u.routing, tuple([None] * len(u.trainable_params)))

    def _finalize_backward(self, task: int) -> None:
        try:
            self._flush_partial()
            self._flush_reductions()
            self._finish_pending()
            if self.sync_gradients:
                for u in self.units:
                    self._release(u)
            if self.backward_order:
                self.backward_order_prev = self.backward_order
        finally:
            if self.callback_task == task:
                self.callback_task = None

    def _finish_pending(self) -> None:
        while self.pending:
            for p in self.pending.popleft():
                p.finish()

    # -- between steps ----------------------------------------------------------------------
    def _discard_step(self, *, release: bool = True) -> None:
        """Forget a backward that raised: drop (after waiting for) its pending reductions,
        partial and no_sync gradients and, with `release`, every gathered unit."""
        self.callback_task = None
        self.reductions.drop_held()  # issued by no rank
        while self.pending:
            for p in self.pending.popleft():
                p.discard()
        self._drop_gradients(release=release)

    def _drop_gradients(self, *, release: bool = True) -> None:
        for u in self.units:
            u.partial_grads = None
            for b in u.buckets:
                b.drop_accumulated_grad()
            if release:
                self._release(u)

    def zero_grad(self) -> None:
        """`model.zero_grad()`: drop what a failed backward or an abandoned no_sync window
        left (gradients not yet in `.grad`) and release the units they kept gathered."""
        if _in_backward():
            return
        if self.callback_task is not None:
            self._discard_step()
        else:
            self._drop_gradients()

    def invalidate(self) -> None:
        """The shards were overwritten (a load): release every gathered copy now."""
        if _in_backward():
            return
        for u in self.units:
            u.uninstall()
            self._release(u)

    def release_all(self) -> None:
        """Drop every unsharded buffer and any no_sync accumulation (e.g. before a load)."""
        if self.callback_task is not None and not _in_backward():
            self._discard_step()
        self._flush_reductions()
        self._finish_pending()
        for u in self.units:
            self._release(u)
            u.partial_grads = None
            for b in u.buckets:
                b.drop_accumulated_grad()
