"""A unit: a module the wrap policy chose, the parameters it owns, and their buckets.

A unit is gathered just before its forward and released after it (ZeRO-3) or after its
backward (ZeRO-2). Its state is stored (`Unit.state`), set at each transition and asserted
where a transition assumes it:

    SHARDED --start_gather--> GATHERING --wait_gathered--> GATHERED --reshard--> SHARDED
                                  ^                                  |
                                  +---start_gather-- SHARDED_POST_FORWARD <--(hpZ, after forward)

(with a shard axis of size 1 nothing is exchanged: start_gather goes to GATHERED at once).
Every drop of the unsharded buffers goes through `Unit.reshard`, whose docstring is the rule.
With grad enabled its trainable parameters are installed through autograd.py's Functions
(see [Note: fullshard and autograd] in engine/autograd.py).

Trainable or frozen is read from `param.requires_grad` at every step (`refresh_requires_grad`,
one tuple comparison per unit when nothing changed), never fixed at wrap: the buckets keep
their layout (wrap time groups frozen and trainable parameters apart), and what is routed
through `GatheredParams`, reduced and written to `.grad` follows the flags of the step. A
bucket with any trainable parameter is reduced whole (zeros travel for its frozen ones, whose
`.grad` is left alone); a bucket with none is not reduced.

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

[Note: recomputed forwards]
Activation checkpointing runs a unit's forward again inside backward. There the runtime's
pre-hook (hooks.py) gathers the unit as usual but records no order, prefetches nothing, pushes
no saved-tensor hooks (checkpoint's own hooks must see the recomputed tensors), installs
through `RecomputedParams` (autograd.py) and does not release after forward: backward is
using the unit, and its `GatheredParams.backward` releases it as always. A checkpointed
region that is not itself a unit reads the parameters of the units enclosing it, whose hooks
do not run again: activation_checkpoint.py gathers and installs those
(`_install_for_recompute`).

What the recomputed graph is for depends on the checkpoint flavour, and the unit cannot tell
them apart:
- non-reentrant: the recomputed tensors only refill the saved slots of the *original* graph,
  whose `GatheredParams` node routes the gradients; the recomputed graph is never run
  backward. A `GatheredParams` created here would be counted and never run: the unit would
  wait for it until the end of backward, held gathered, its reduction deferred (ZeRO-3
  quietly turned into ZeRO-2 for the whole backward).
- reentrant: the original forward ran under no_grad, so the original graph has no edge to
  the parameters; the recomputed graph is differentiated in a nested backward and is the
  only route for the gradients of every parameter used inside the checkpointed region --
  the recomputed unit's and those of the enclosing units it reads.
So a recomputation installs through `RecomputedParams`: not counted, and its backward (run
only in the reentrant case) adds the gradients to the unit's sum of the pass
(`add_partial_grads`), reduced with the unit's last counted node or, when no counted node is
left to run, by the end-of-backward flush (`Runtime._flush_partial`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fullshard.distributed.mesh import ShardMesh
from fullshard.distributed.unit_comm import gather_batch_bytes
from fullshard.engine.autograd import GatheredParams, GradientSink, RecomputedParams, SavedParams
from fullshard.engine.bucket import Bucket, start_gathers
from fullshard.engine.sharded_param import ShardedParam


class UnitState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded post forward"  # hpZ: 1/k kept, gathered over the node
    GATHERING = "gathering"
    GATHERED = "gathered"


_SHARDED = (UnitState.SHARDED, UnitState.SHARDED_POST_FORWARD)


class Reshard(enum.Enum):
    """The moment a caller asks `Unit.reshard` whether to drop the unit's unsharded buffers."""

    AFTER_FORWARD = "after forward"  # its post-forward hook (or the root's, for prefetches)
    AFTER_BACKWARD = "after backward"  # its last autograd node ran, or backward ended
    NOW = "now"  # a stale copy, reset_step, a load: always


class Unit:
    def __init__(self, module: nn.Module, name: str, buckets: Sequence[Bucket]) -> None:
        self.module = module
        self.name = name
        self.buckets = list(buckets)
        self.params: list[ShardedParam] = [p for b in self.buckets for p in b.params]
        for i, b in enumerate(self.buckets):
            b.set_label(name, i, first_trainable=False)  # refresh_requires_grad picks the first
        self._flags: tuple[bool, ...] = ()
        # Set by refresh_requires_grad from the parameters' current flags:
        self.trainable_params: list[ShardedParam] = []
        self.routing: list[tuple[Bucket, tuple[bool, ...]]] = []  # buckets with a trainable
        self._acc_node: Any = None  # a trainable shard's AccumulateGrad (autograd.grad probe)
        # Kept gathered while nothing is trainable? Set by the runtime (engine/kept_frozen.py).
        self.keep_frozen_gathered = False
        self.refresh_requires_grad()
        self.index = -1  # position in the runtime's unit list
        # Released after its forward? Set by the runtime from the plan and any per-unit choice
        # (config.ShardingPlan.unit_reshards); False keeps it gathered into its backward.
        self.reshard_after_forward = False
        # Outputs of this forward pass's GatheredParams, reused if the unit runs again in the
        # same pass while still gathered (ZeRO-2), so autograd sees one node and we reduce once.
        self.cached_views: list[torch.Tensor] | None = None
        self.cached_pass = -1
        self._install_order: list[ShardedParam] = []
        # Autograd nodes created in pass `nodes_pass` (see the module docstring), how many of
        # them ran in backward task `done_task`, and the gradients summed so far.
        self.nodes = 0
        self.nodes_pass = -1
        self.nodes_done = 0
        self.done_task = -1
        self.partial_grads: list[torch.Tensor | None] | None = None
        # Set at each transition (module docstring); a unit without parameters stays SHARDED
        # and counts as gathered and in flight.
        self.state = UnitState.SHARDED
        # ZeRO-3's saved-tensor hooks over the gathered buffers, told when they come and go;
        # None where the unsharded buffer is the shard itself (shard axis of size 1).
        self.saved: SavedParams | None = None

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'}, {len(self.params)} params, {self.state.value})"

    def _expect(self, transition: str, *states: UnitState) -> None:
        assert self.state in states, (
            f"unit {self.name or '<root>'!r}: {transition} expects it "
            f"{' or '.join(s.value for s in states)}, but it is {self.state.value}"
        )

    @property
    def is_gathered(self) -> bool:
        return self.state is UnitState.GATHERED or not self.buckets

    @property
    def is_installed(self) -> bool:
        """The unsharded tensors are in place in the modules (between the unit's forward
        hooks, or for a recomputation). True for a unit without parameters."""
        if not self.params:
            return True
        module, name = self.params[0].refs[0]
        return name in module.__dict__

    @property
    def keeps_gathered(self) -> bool:
        """Held gathered across micro-batches: frozen, with `keep_frozen_gathered` on
        ([Note: frozen units stay gathered] in engine/kept_frozen.py)."""
        return self.keep_frozen_gathered and not self.trainable_params and bool(self.buckets)

    @property
    def in_flight(self) -> bool:
        """Gathered, or its gather issued (True for a unit without parameters)."""
        return self.state not in _SHARDED or not self.buckets

    @functools.cached_property
    def gather_nbytes(self) -> int:
        """Bytes this rank sends per peer to gather the unit (fixed at wrap; read for every
        unit ahead at each pre-forward)."""
        return sum(b.gather_nbytes for b in self.buckets)

    @functools.cached_property
    def unsharded_nbytes(self) -> int:
        """Bytes of the unit's unsharded buffers on this rank while it is gathered."""
        return self.gather_nbytes * (self.buckets[0].mesh.shard.size if self.buckets else 0)

    def start_gather(self, *, async_op: bool) -> None:
        self.start_gather_with((), async_op=async_op)

    def start_gather_with(self, others: Sequence[Unit], *, async_op: bool) -> None:
        """Start this unit's gather and those of `others` (prefetches) together: small ones
        go as one exchange (bucket.start_gathers). Units in flight already are left as they
        are."""
        units = [self, *others]
        start_gathers([b for u in units for b in u.buckets], async_op=async_op)
        for u in units:
            if u.buckets and u.state in _SHARDED:
                # shard axis of size 1: nothing to exchange, the shards are the data
                done = u.buckets[0].is_gathered
                u.state = UnitState.GATHERED if done else UnitState.GATHERING

    def gather_ahead(self, order: list[Unit], pos: int, limit: int, mesh: ShardMesh) -> None:
        """Have this unit gathered or in flight, and prefetch what follows it in `order` (the
        order recorded on the last pass, this unit expected at `pos`).

        Ahead means the next `limit` units and, where small units' exchanges can be sent
        together (gloo), as many more as keep the bytes in flight within the seam's budget
        (`unit_comm.gather_batch_bytes`) per rank: they are issued in one exchange with this
        unit if it needs one. The window is refilled only when one of the next `limit` units
        is not in flight, so a run of small units costs one exchange per budget, not one per
        unit. Memory: the units in flight ahead are `limit` units or the budget per rank
        gathered, whichever is more.
        """
        window: list[Unit] = []
        if limit > 0 and pos < len(order) and order[pos] is self:
            budget, nbytes = gather_batch_bytes(mesh.shard), self.gather_nbytes
            for nxt in order[pos + 1 :]:
                if nxt is self or nxt in window:
                    continue  # a unit called several times per pass
                if len(window) >= limit and nbytes + nxt.gather_nbytes > budget:
                    break
                window.append(nxt)
                nbytes += nxt.gather_nbytes
        if self.in_flight and all(u.in_flight for u in window[:limit]):
            return
        for u in window:
            u.reshard_if_stale()
        self.start_gather_with(window, async_op=True)

    def wait_gathered(self) -> None:
        """Wait for the gather started before; ZeRO-3's saved-tensor hooks now know the
        buffers (see [Note: ZeRO-3 and saved tensors] in engine/autograd.py)."""
        if not self.buckets:
            return
        self._expect("wait_gathered", UnitState.GATHERING, UnitState.GATHERED)
        for b in self.buckets:
            b.finish_gather()
        self.state = UnitState.GATHERED
        if self.saved is not None:
            self.saved.track(self)

    def reshard(self, at: Reshard, *, recomputing: bool = False, syncing: bool = True) -> None:
        """Drop the unit's unsharded buffers (waiting for a gather in flight first) if the
        rule says so at `at`. The one place that frees a gathered unit; callers say when they
        ask and what the step is doing (`recomputing`: a forward rerun inside backward;
        `syncing`: False inside no_sync()), the rule decides:

        - `NOW` (a copy older than the shards, reset_step, a load): always.
        - a unit that `keeps_gathered` (frozen, `keep_frozen_gathered` on): only at `NOW`
          ([Note: frozen units stay gathered] in engine/kept_frozen.py lists when).
        - `AFTER_BACKWARD` (the unit's last autograd node of the pass ran, or backward ended):
          always, except inside no_sync(), which keeps every unit gathered until the synced
          backward.
        - `AFTER_FORWARD`: never during a recomputation (backward is using the unit); always
          when no backward will come for it (grad disabled, nothing trainable); never inside
          no_sync(); otherwise `reshard_after_forward` decides, set at wrap from the strategy
          (config.ShardingPlan.unit_reshards): True for every unit but the root under
          FULL_SHARD / HYBRID_SHARD (ZeRO-3: released after forward, gathered again for
          backward); False under SHARD_GRAD_OP (ZeRO-2: kept from forward into backward) and
          for the root by default ([Note: the root stays gathered]); a
          per-unit `reshard_after_forward` (FSDP2's) overrides either. With hpZ (an int
          `reshard_after_forward` k: the mesh has `post_forward` runs) a unit that ran keeps
          1/k of its buffers (`Bucket.keep_post_forward`, state SHARDED_POST_FORWARD) and
          backward gathers them over the run; that copy goes at the next reshard (after
          backward, NOW) or when a new gather of the shards replaces it. NO_SHARD follows
          SHARD_GRAD_OP's schedule, but its shard axis has size 1: the "unsharded buffer" is
          the shards themselves (or their cast copy under mixed precision), so resharding
          frees nothing beyond that copy. HYBRID_SHARD frees on its shard axis exactly as
          FULL_SHARD or SHARD_GRAD_OP.
        """
        if at is not Reshard.NOW and self.keeps_gathered:
            return
        if at is Reshard.AFTER_BACKWARD and not syncing:
            return
        keep_part = False
        if at is Reshard.AFTER_FORWARD:
            if recomputing:
                return
            # no GatheredParams.backward will come to release it: drop it whole
            backward_comes = torch.is_grad_enabled() and bool(self.trainable_params)
            if backward_comes and not (syncing and self.reshard_after_forward):
                return
            keep_part = (backward_comes and self.state is UnitState.GATHERED
                         and self.buckets[0].mesh.post_forward is not None)
        if self.saved is not None:
            self.saved.untrack(self)
        self.cached_views = None
        if keep_part:
            for b in self.buckets:
                b.keep_post_forward()
            self.state = UnitState.SHARDED_POST_FORWARD
            return
        for b in self.buckets:
            b.release()
        self.state = UnitState.SHARDED

    def reshard_if_stale(self) -> None:
        """Drop the gathered copy if the shards were written since it was gathered (a load,
        an edit under no_grad): it holds the old values. One int compare per bucket."""
        if any(b.is_stale() for b in self.buckets):
            self.reshard(Reshard.NOW)

    def abandon_gathers(self) -> None:
        """Set aside the gathers in flight unwaited (a peer is gone: Bucket.abandon_gather);
        `reshard(NOW)` follows."""
        for b in self.buckets:
            b.abandon_gather()

    def refresh_requires_grad(self) -> None:
        """Follow `requires_grad` changed since the last step (cheap when nothing changed)."""
        flags = tuple(p.param.requires_grad for p in self.params)
        if flags == self._flags:
            return
        was_kept = self.keeps_gathered
        self._flags = flags
        self.routing = []
        for b in self.buckets:
            mask = tuple(p.param.requires_grad for p in b.params)
            if any(mask):
                self.routing.append((b, mask))
        for b in self.buckets:  # divergence header on the unit's first reduction only
            b.check_reduce = bool(self.routing) and b is self.routing[0][0]
        self.trainable_params = [p for b, mask in self.routing for p, m in zip(b.params, mask) if m]
        self.cached_views = None
        self._acc_node = None
        if self.trainable_params:
            with torch.enable_grad():
                shard = self.trainable_params[0].param
                self._acc_node = shard.view_as(shard).grad_fn.next_functions[0][0]
        if was_kept and not self.keeps_gathered and self.in_flight:
            self.reshard(Reshard.NOW)  # trainable again: the strategy's rule from now on

    def node_created(self, pass_id: int) -> None:
        if self.nodes_pass != pass_id:
            self.nodes_pass, self.nodes = pass_id, 0
        self.nodes += 1

    def node_done(self, task_id: int) -> bool:
        """Count one of this pass's nodes as run in backward; True for the last one."""
        if self.done_task != task_id:
            self.done_task, self.nodes_done = task_id, 0
        self.nodes_done += 1
        return self.nodes_done >= self.nodes

    def add_partial_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Sum the gradients of one call of a unit called several times (out of place:
        autograd may hand the same tensor elsewhere)."""
        if self.partial_grads is None:
            self.partial_grads = list(grads)
            return
        self.partial_grads = [
            a if b is None else b if a is None else a + b for a, b in zip(self.partial_grads, grads)
        ]

    def take_grads(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The unit's gradients for this step: `grads` plus any earlier calls' partial sum."""
        if self.partial_grads is not None:
            self.add_partial_grads(grads)
            grads, self.partial_grads = self.partial_grads, None
        return list(grads)

    def bucket_grads(
        self, routing: list[tuple[Bucket, tuple[bool, ...]]], grads: Sequence[torch.Tensor | None]
    ) -> Iterator[tuple[Bucket, tuple[bool, ...], list[torch.Tensor], list[bool]]]:
        """Per bucket of `routing` (the trainable flags `grads` were routed with): the bucket,
        its flags, one gradient per parameter (this pass's sum; `Bucket.unused_grad` where
        this rank gave none) and which ones this rank gave none."""
        routed_grads = iter(self.take_grads(grads))
        for bucket, mask in routing:
            chunk = [next(routed_grads) if routed else None for routed in mask]
            unused = [g is None for g in chunk]
            filled = [g if g is not None else bucket.unused_grad(p)
                      for p, g in zip(bucket.params, chunk)]
            yield bucket, mask, filled, unused

    def trainable_views(self) -> list[torch.Tensor]:
        return [v for b, mask in self.routing for v, m in zip(b.unsharded_views(), mask) if m]

    def frozen_pairs(self) -> list[tuple[ShardedParam, torch.Tensor]]:
        """(param, view) of every parameter not routed through GatheredParams this step."""
        if len(self.trainable_params) == len(self.params):
            return []  # the common case: everything trainable (no views to build)
        routed = {id(p) for p in self.trainable_params}
        return [
            (p, v)
            for b in self.buckets
            for p, v in zip(b.params, b.unsharded_views())
            if id(p) not in routed
        ]

    def install(self, runtime: GradientSink, *, with_grad: bool, pass_id: int) -> None:
        """Put the unsharded tensors in place of the shards in every module that uses them."""
        if self.buckets:
            self._expect("install", UnitState.GATHERED)
        if self.cached_views is not None and self.cached_pass == pass_id:
            views = self.cached_views
        else:
            frozen = self.frozen_pairs()
            if with_grad and self.trainable_params:
                shards = [p.param for p in self.trainable_params]
                trainable = list(GatheredParams.apply(runtime, self, *shards))
                self.node_created(pass_id)
            else:
                trainable = self.trainable_views()
            views = [v for _, v in frozen]
            views += trainable
            self._install_order = [p for p, _ in frozen] + self.trainable_params
            self.cached_views = views if with_grad else None
            self.cached_pass = pass_id
        _put(zip(self._install_order, views))

    def install_recomputed(self, runtime: GradientSink) -> None:
        """Install the gathered tensors for a recomputation inside backward: trainable ones
        through `RecomputedParams` (uncounted, see [Note: recomputed forwards]), frozen ones as
        plain views. Never cached: the forward pass's cached views may be stale by now."""
        if self.buckets:
            self._expect("install_recomputed", UnitState.GATHERED)
        if self.trainable_params and torch.is_grad_enabled():
            shards = [p.param for p in self.trainable_params]
            trainable = list(RecomputedParams.apply(runtime, self, *shards))
        else:
            trainable = [v.detach() for v in self.trainable_views()]
        _put(self.frozen_pairs())
        _put(zip(self.trainable_params, trainable))

    def uninstall(self) -> None:
        for p in self.params:
            for module, name in p.refs:
                module.__dict__.pop(name, None)


def _put(pairs: Iterable[tuple[ShardedParam, torch.Tensor]]) -> None:
    """Put each tensor in the instance `__dict__` of every module that holds its parameter
    (several for tied weights): instance attributes win over `nn.Module.__getattr__`, so
    `module.weight` reads the unsharded tensor while `named_parameters()` still yields the
    shard."""
    for p, v in pairs:
        for module, name in p.refs:
            module.__dict__[name] = v
