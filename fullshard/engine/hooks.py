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

The gathers ahead (`Unit.gather_ahead`) and the held reductions (`Reductions.submit`) follow
the seam's budgets: see [Note: small units travel together] in distributed/unit_comm.py.

[Note: what a training loop may do between steps]
The loop is the user's (docs/architecture.md, invariant 7); the runtime keeps no state that a
step that went wrong could leave behind:
- a backward that raised never runs its end-of-backward callback, so the state stays
  BACKWARD; the next root forward, `zero_grad` or load finds it so and calls `reset_step`:
  waits for and drops its pending reductions (all ranks issued them), drops partial and
  no_sync gradients, releases every unit. A backward of another task queues its own callback.
- a forward that raised (post-hooks run with `always_call`) calls `reset_step` from the root's
  post-hook: every unit is released, the prefetches in flight waited for, or set aside once a
  wait fails. A user who catches an exception mid-step may call `fullshard.reset_step(model)`
  to the same effect.
- `requires_grad` is read at every root forward (Unit.refresh_requires_grad).
- `zero_grad` drops a no_sync window: the model's directly (module.py), the optimizer's is
  seen through the `.grad` tensors the window marked (Bucket.accumulation_abandoned).
- any write to the shards bumps their version counter; a gathered copy older than the shards
  is dropped and gathered again before it is used (`Unit.reshard_if_stale`).
- `torch.autograd.grad(loss, params)`: the reductions run synchronously and their local-shard
  results are returned to autograd instead of being written to `.grad`.

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
"""

from __future__ import annotations

import collections
import enum
import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable

from fullshard.config import ShardingPlan
from fullshard.distributed.mesh import ShardMesh
from fullshard.distributed.unit_comm import Reductions
from fullshard.engine.autograd import SavedParams, mark_frozen_inputs, writes_grad
from fullshard.engine.autograd import in_backward as _in_backward
from fullshard.engine.bucket import Bucket, PendingReduction
from fullshard.engine.kept_frozen import KeptFrozenUnits
from fullshard.engine.mixed_precision import cast_floating
from fullshard.engine.thunder_refusal import THUNDER_INTERPRETER, refuse_thunder_trace
from fullshard.engine.unit import Reshard, Unit


class TrainingState(enum.Enum):
    """Where the model is in a step (`Runtime.state`), set at each transition:

    | from                | event                                          | to          |
    |---------------------|------------------------------------------------|-------------|
    | IDLE                | the root's pre-forward (outside backward)      | FORWARD     |
    | BACKWARD, FINISHING | the root's pre-forward (the backward raised)   | FORWARD *   |
    | FORWARD             | the root's post-forward                        | IDLE        |
    | FORWARD             | the root's post-forward, the forward raised    | IDLE *      |
    | IDLE, BACKWARD      | an autograd task's first hook (callback queued)| BACKWARD    |
    | not RECOMPUTING     | a unit's pre-forward inside backward           | RECOMPUTING |
    | RECOMPUTING         | the outermost recomputed unit's post-forward   | as before   |
    | BACKWARD            | that task's end-of-backward callback begins    | FINISHING   |
    | FINISHING           | that callback ends                             | IDLE        |
    | any                 | `reset_step` (zero_grad, a load, the user)     | IDLE *      |

    (* through `reset_step`.) A forward with grad that no backward follows ends in IDLE (as
    FSDP2's); a backward that raised stays in BACKWARD until the next root forward,
    zero_grad, load or `reset_step`.
    A reentrant checkpoint's nested backward is a task of its own: its callback ends in IDLE
    and the outer task's next hook queues a callback again (BACKWARD)."""

    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTING = "recomputing"
    BACKWARD = "backward"
    FINISHING = "finishing"


_BACKWARD_UNFINISHED = (TrainingState.BACKWARD, TrainingState.FINISHING)


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
        self.kept_frozen = KeptFrozenUnits(units)  # off until api/ decides (enable)
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
        # until they go together (`Reductions.submit`).
        self.pending: collections.deque[list[PendingReduction]] = collections.deque()
        self.reductions = Reductions(mesh, on_issue=self._track_pending)
        self.state = TrainingState.IDLE
        # RECOMPUTING: how many recomputed forwards are open, and the state they interrupted
        self._recompute_depth = 0
        self._resume_state = TrainingState.IDLE
        # Autograd task whose end-of-backward callback is queued and has not run yet (state
        # BACKWARD until it runs; see [Note: what a training loop may do between steps]).
        self.callback_task: int | None = None
        self._grad_mode_task = -1  # task for which `_returns_grads` was decided
        self._returns_grads = False  # this task is torch.autograd.grad: return, don't write
        # ZeRO-3's saved-tensor hooks, told by the units when their buffers come and go (none
        # where the unsharded buffer is the shard itself)
        self.saved = SavedParams(regather=self._regather_saved)
        for u in units:
            u.saved = self.saved if mesh.shard.size > 1 else None
        # id() of the exception being handled when the root forward began (id(None) if
        # none): an id, not a reference, so an OOM-retry loop's exception is not kept alive.
        self._forward_exc = id(None)

    # -- the step's state -------------------------------------------------------------------
    def _set_phase(self, state: TrainingState) -> None:
        """Enter `state`; inside a recomputation, the state it resumes when it ends."""
        if self.state is TrainingState.RECOMPUTING:
            self._resume_state = state
        else:
            self.state = state

    def _begin_recompute(self) -> None:
        if self._recompute_depth == 0:
            self._resume_state, self.state = self.state, TrainingState.RECOMPUTING
        self._recompute_depth += 1

    def _end_recompute(self) -> None:
        self._recompute_depth -= 1
        if self._recompute_depth == 0:
            self.state = self._resume_state

    def _reshard(self, unit: Unit, at: Reshard) -> None:
        """Ask `unit` whether to drop its unsharded buffers now (Unit.reshard decides)."""
        unit.reshard(
            at,
            recomputing=self.state is TrainingState.RECOMPUTING,
            syncing=self.sync_gradients,
        )

    # -- forward ----------------------------------------------------------------------------
    def pre_forward(self, unit: Unit, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        # A forward inside backward is a recomputation (activation checkpointing): the one
        # place the state is read from autograd rather than stored.
        recomputing = _in_backward()
        if recomputing:
            self._begin_recompute()  # post_forward (always called) ends it
        if THUNDER_INTERPRETER in sys.modules:  # thunder.jit of the model or a unit?
            refuse_thunder_trace(unit.name)
        if unit is self.root and not recomputing:
            self._begin_forward()
        unit.reshard_if_stale()
        if recomputing:
            unit.start_gather(async_op=True)
        else:
            self.forward_order.append(unit)
            pos = len(self.forward_order) - 1
            unit.gather_ahead(self.forward_order_prev, pos, self.prefetch_limit, self.mesh)
        unit.wait_gathered()
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
            return mark_frozen_inputs(self, unit, self.pass_id, args, kwargs)
        return (args, kwargs) if dtype is not None else None

    def recomputed_backward(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """`RecomputedParams.backward` (reentrant checkpointing only): add the recomputed
        graph's gradients to `unit`'s sum of the pass ([Note: recomputed forwards] in
        engine/unit.py: reduced with its last counted node, else by `_flush_partial`)."""
        self.ensure_backward_callback()
        unit.add_partial_grads(grads)

    def post_forward(self, unit: Unit, module: torch.nn.Module, args: Any, output: Any) -> None:
        # ZeRO-3 with grad: this pass's backward gathers units again
        regathers = unit is self.root and self.saved.pop()
        unit.uninstall()
        if self.state is TrainingState.RECOMPUTING:
            self._reshard(unit, Reshard.AFTER_FORWARD)  # keeps it: backward is using it
            self._end_recompute()
            return
        if unit is not self.root:
            self._reshard(unit, Reshard.AFTER_FORWARD)
            return
        if id(sys.exc_info()[1]) != self._forward_exc:
            # `always_call`: the forward raised (an exception other than the one being
            # handled when it started, e.g. by an OOM-retry loop's `except` block).
            self.reset_step()
            return
        self._reshard(unit, Reshard.AFTER_FORWARD)
        # Units prefetched that this forward did not run, where they reshard (the ones it ran
        # were released, or kept, by their own post-hooks already). None can be under ZeRO-2
        # with grad: skip the walk there.
        if self._any_reshards or not torch.is_grad_enabled():
            for u in self.units[1:]:
                if u.in_flight:
                    self._reshard(u, Reshard.AFTER_FORWARD)
        if regathers:
            self._prefetch_backward_start(self._expected_backward_order())
        self.state = TrainingState.IDLE

    def _begin_forward(self) -> None:
        if self.state in _BACKWARD_UNFINISHED:
            self.reset_step()  # the last backward raised
        self.state = TrainingState.FORWARD
        self._forward_exc = id(sys.exc_info()[1])
        abandoned = False
        for unit in self.units:  # a few pointer comparisons per parameter and step
            for bucket in unit.buckets:
                bucket.check_intact()
                if bucket.accumulated_grad is not None and bucket.accumulation_abandoned():
                    abandoned = True
            unit.refresh_requires_grad()
        if self.kept_frozen.enabled:  # off: the step never enters kept_frozen.py
            self.kept_frozen.release_if_stepped()
        if abandoned:  # zero_grad during a no_sync window: drop it all
            self._drop_gradients()
        self.pass_id += 1
        if self.forward_order:
            self.forward_order_prev = self.forward_order
        self.forward_order = []

    def _wants_saved_tensor_hooks(self, with_grad: bool, recomputing: bool) -> bool:
        return (with_grad and not recomputing and self._any_reshards and self.sync_gradients
                and self.mesh.shard.size > 1)

    # -- ZeRO-3 saved tensors ---------------------------------------------------------------
    def _regather_saved(self, unit: Unit) -> None:
        """A saved tensor of `unit` is being unpacked in backward (autograd.py): gather
        the unit again if it is not, prefetching the ones expected next."""
        # Every unpack, not only a gathering one: the root stays gathered into backward, and
        # the outer task's callback must be queued before a reentrant recomputation nests one.
        self.ensure_backward_callback()
        if not unit.is_gathered:
            self.backward_order.append(unit)
            pos = self._backward_plan.get(unit, len(self._backward_plan_list))
            unit.gather_ahead(
                self._backward_plan_list, pos, self.backward_prefetch_limit, self.mesh
            )
            unit.wait_gathered()

    def _expected_backward_order(self) -> list[Unit]:
        """The order backward is expected to gather units in: last step's, else the reverse
        of this forward."""
        return self.backward_order_prev or list(reversed(self.forward_order))

    def _prefetch_backward_start(self, order: list[Unit]) -> None:
        """See [Note: the turn from forward to backward]."""
        limit = self.backward_prefetch_limit
        ahead = list(dict.fromkeys(u for u in order if not u.is_gathered))[:limit]
        if ahead:
            ahead[0].start_gather_with(ahead[1:], async_op=True)

    # -- backward ---------------------------------------------------------------------------
    def ensure_backward_callback(self) -> None:
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
        self._set_phase(TrainingState.BACKWARD)
        order = self._expected_backward_order()
        # each unit's first position in it (a unit may come several times)
        self._backward_plan = {u: i for i, u in reversed(list(enumerate(order)))}
        self._backward_plan_list = order
        self.backward_order = []

    def _task_returns_grads(self, unit: Unit) -> bool:
        """Is this backward `torch.autograd.grad` (gradients returned, `.grad` untouched)?
        Asked once per autograd task (`writes_grad`, engine/autograd.py)."""
        task = torch._C._current_graph_task_id()
        if self._grad_mode_task != task:
            self._grad_mode_task = task
            self._returns_grads = not writes_grad(unit._acc_node)
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
        self.ensure_backward_callback()
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
        result: list[torch.Tensor | None] = []
        pendings = []
        for bucket, mask, chunk, unused in unit.bucket_grads(routing, grads):
            if not self.sync_gradients:
                bucket.accumulate_grads(chunk)
                continue
            pending = bucket.start_reduce(chunk, unused=unused, write=mask, defer=not returns)
            if returns:
                reduced = pending.finish(to_grad=False)
                result += [g for g, routed in zip(reduced, mask) if routed]
            else:
                pendings.append(pending)
        if pendings:
            # The seam sends them, or holds small ones to go with the next units'
            # (unit_comm.Reductions); each issue comes back to `_track_pending`.
            self.reductions.submit(pendings)
        self._reshard(unit, Reshard.AFTER_BACKWARD)
        return result if returns else None

    def _track_pending(self, pendings: list[PendingReduction]) -> None:
        """The reductions of at most `max_pending_reductions` issues stay in flight; older
        ones are finished while earlier units compute."""
        self.pending.append(pendings)
        self._finish_pending(keep=self.max_pending_reductions)

    def frozen_backward_done(self, unit: Unit) -> None:
        """`BackwardDone.backward` of a frozen unit: may release it after its last node."""
        if unit.node_done(torch._C._current_graph_task_id()):
            self._reshard(unit, Reshard.AFTER_BACKWARD)

    def _flush_partial(self) -> None:
        """Reduce the summed gradients of units called several times whose other nodes never
        ran (an output that did not reach the loss): every rank ran the same nodes."""
        for u in self.units:
            if u.partial_grads is not None:
                u.nodes = u.nodes_done + 1  # the next node_done is the last
                self.post_backward(u, u.routing, tuple([None] * len(u.trainable_params)))

    def _finalize_backward(self, task: int) -> None:
        if self.callback_task == task:
            self._set_phase(TrainingState.FINISHING)
        try:
            self._flush_partial()
            self.reductions.flush()
            self._finish_pending()
            for u in self.units:
                self._reshard(u, Reshard.AFTER_BACKWARD)
            if self.backward_order:
                self.backward_order_prev = self.backward_order
        finally:
            if self.callback_task == task:
                self.callback_task = None
                self._set_phase(TrainingState.IDLE)

    def _finish_pending(self, keep: int = 0) -> None:
        """Wait for the oldest issues' reductions and write `.grad` until `keep` are left."""
        while len(self.pending) > keep:
            for p in self.pending.popleft():
                p.finish()

    # -- between steps ----------------------------------------------------------------------
    def reset_step(self) -> None:
        """Return every unit to idle after a forward or backward that raised ([Note: what a
        training loop may do between steps]). A failed backward's reductions in flight are
        waited for and dropped with the gradients not yet in `.grad` (partial sums, a no_sync
        accumulation it may have half updated). A failed forward's partial order is forgotten
        and, once a wait fails (a peer died), the other gathers are set aside unwaited: a
        broken group can only raise again or block, hiding the forward's own error. `.grad`
        and the no_sync accumulation of earlier complete backwards are kept."""
        if _in_backward():
            raise RuntimeError(
                "fullshard.reset_step(model) (or a load into the model, which resets the step "
                "first) was called inside backward; call it after the exception has left "
                "forward() or backward(), e.g. in your `except` block."
            )
        failed = self.state
        if failed is TrainingState.RECOMPUTING:
            failed = self._resume_state
        self.state, self._recompute_depth, self.callback_task = TrainingState.IDLE, 0, None
        self._forward_exc = id(None)
        if failed in _BACKWARD_UNFINISHED:
            self.reductions.drop_held()  # issued by no rank
            while self.pending:
                for p in self.pending.popleft():
                    p.discard()
            self._drop_gradients()
        if failed is TrainingState.FORWARD:
            self.forward_order = []
        broken = False
        for u in self.units:
            u.uninstall()
            if not broken:
                try:
                    u.reshard(Reshard.NOW)
                    continue
                except Exception:
                    if failed is not TrainingState.FORWARD:
                        raise
                    broken = True  # the forward's error is the one to see
            u.abandon_gathers()
            u.reshard(Reshard.NOW)

    def _drop_gradients(self) -> None:
        """Forget the gradients not yet in `.grad`: partial sums, no_sync accumulations."""
        for u in self.units:
            u.partial_grads = None
            for b in u.buckets:
                b.drop_accumulated_grad()

    def zero_grad(self) -> None:
        """`model.zero_grad()`: drop what a failed backward or an abandoned no_sync window
        left (gradients not yet in `.grad`) and release the units they kept gathered."""
        if _in_backward():
            return
        self.reset_step()
        self._drop_gradients()

    def invalidate(self) -> None:
        """The shards were overwritten (a load): release every gathered copy now."""
        if not _in_backward():
            self.reset_step()

    def release_all(self) -> None:
        """Drop every unsharded buffer and any no_sync accumulation (e.g. before a load)."""
        self.reset_step()
        self._drop_gradients()
