"""The autograd bridge: the engine's autograd Functions, ZeRO-3's saved-tensor hooks, and what
the engine asks autograd.

Units install their gathered parameters through the Functions below (unit.py), the runtime
(hooks.py) receives their backward calls, and `SavedParams` keeps tokens instead of gathered
parameters in autograd's saved tensors.

[Note: fullshard and autograd]
What autograd holds of a unit, and for how long:
- Aliasing. The tensors a unit installs in its modules are views of its buckets' unsharded
  buffers (bucket.py), never copies. With grad enabled, the trainable ones are the outputs
  of one `GatheredParams` per (re)gathered call: an identity whose inputs are the unit's
  local shards (the registered parameters) and whose outputs are the views, so autograd has
  one edge from the unit's computation to its shards, and calls the Function's backward
  once, with the whole unit's unsharded gradients, when the unit's backward is done. Frozen
  parameters are installed as plain views: no edge, no gradient. `ctx` keeps the unit and
  the runtime, never a tensor.
- Gradients. That backward hands the gradients to the runtime, which reduces them
  asynchronously and writes the shards' `.grad` itself; it returns None to autograd, so the
  shards' AccumulateGrad never runs -- except under `torch.autograd.grad`, where the
  reduced local-shard gradients are returned. Autograd has no flag for which of the two is
  running: `writes_grad` asks whether the engine will execute a shard's AccumulateGrad node.
- Lifetime. A buffer lives from its unit's gather to its `Unit.reshard` and no longer: the
  views in the modules' `__dict__` are removed by the post-forward hook first, autograd holds
  tokens instead of the views its backward formulas saved ([Note: ZeRO-3 and saved tensors]),
  and the Functions' outputs are those same views.
- When a unit's backward is done: every autograd node it created in the forward pass has
  run -- one `GatheredParams` per (re)gathered call or, for a unit with nothing trainable
  whose inputs require grad, one `BackwardDone` on its inputs (so a frozen unit that ZeRO-3
  re-gathers in backward is released as soon as gradients have flowed through it).
  `Unit.node_done` counts them; the gradients of a unit called several times are summed
  until the last node and reduced once.

One node per unit, not per bucket: autograd runs ready nodes latest-created first, and all of
a unit's nodes would be created together at its pre-forward, so a bucket's node could not run
before the unit's backward is done anyway. (The root's node is created first of all and so
runs last, even though its LM head is differentiated first; only a node created where the
head runs could reduce it early.)

[Note: ZeRO-3 and saved tensors]
Autograd saves the unsharded parameters its backward formulas need (a Linear saves its
weight: a view of the buffer). If those references stayed, ZeRO-3 would quietly hold every
unit until backward, i.e. behave like ZeRO-2 with identical numbers. So while the root runs
forward under ZeRO-3 the runtime (hooks.py) pushes `saved_tensors_hooks`: a saved tensor whose
storage is a gathered bucket buffer (`SavedParams.track`) is packed as a `SavedParamView`
(bucket + offset/size/stride, no data); unpacking it in backward calls the runtime back
(`regather`: the unit is gathered again, prefetching the one expected next) and returns the
same view of the new buffer. This only works because the tensors handed to modules are views
of the tracked buffer, never copies (see bucket.py). Only the root pushes the hooks: the
innermost hooks win and ours handle every unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fullshard.engine.eager import keep_eager

if TYPE_CHECKING:
    from fullshard.engine.bucket import Bucket
    from fullshard.engine.unit import Unit


class GradientSink(Protocol):
    """What a unit's autograd functions below call back into: the `Runtime` (hooks.py), which
    owns the reductions. A protocol, so this file does not import hooks.py, which builds on it."""

    def post_backward(
        self, unit: Unit, routing: list[tuple[Bucket, tuple[bool, ...]]], grads: tuple
    ) -> list | None: ...

    def recomputed_backward(self, unit: Unit, grads: tuple) -> None: ...

    def frozen_backward_done(self, unit: Unit) -> None: ...


class GatheredParams(torch.autograd.Function):
    """Identity on the gathered views; its backward hands the unit's gradients to the runtime.

    It returns no gradient to autograd (the runtime writes `.grad` itself, asynchronously),
    except under `torch.autograd.grad`, where it returns the reduced local-shard gradients."""

    @staticmethod
    def forward(ctx: Any, runtime: GradientSink, unit: Unit, *shards: torch.Tensor) -> tuple:
        ctx.runtime = runtime
        ctx.unit = unit
        ctx.routing = unit.routing  # this step's trainable flags (replaced, never mutated)
        ctx.set_materialize_grads(False)  # None, not zeros, for a parameter that got no grad
        return tuple(unit.trainable_views())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        shard_grads = ctx.runtime.post_backward(ctx.unit, ctx.routing, grads)
        if shard_grads is None:
            shard_grads = [None] * len(grads)
        return (None, None, *shard_grads)


class RecomputedParams(GatheredParams):
    """`GatheredParams` for a recomputation inside backward (activation checkpointing).

    Its node is not counted among the unit's nodes of the pass (see [Note: recomputed
    forwards] in engine/unit.py); its backward, which runs only when a reentrant
    checkpoint differentiates the recomputed graph, adds the unit's gradients to the unit's
    sum of the pass instead of reducing them."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.runtime.recomputed_backward(ctx.unit, grads)
        return (None, None, *([None] * len(grads)))


class BackwardDone(torch.autograd.Function):
    """Identity on a frozen unit's inputs: its backward runs once gradients have flowed
    through the unit, which is then done with its (re-gathered) parameters."""

    @staticmethod
    def forward(ctx: Any, runtime: GradientSink, unit: Unit, *inputs: torch.Tensor) -> tuple:
        ctx.runtime = runtime
        ctx.unit = unit
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.runtime.frozen_backward_done(ctx.unit)
        return (None, None, *grads)


def in_backward() -> bool:
    """Autograd is running a backward task on this thread (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def in_eager_backward() -> bool:
    """`in_backward()`, traced as False under torch.compile (no graph break in a compiled
    forward that calls a hooked module; a compiled region's recomputation is compiled code
    that reads its saved inputs, not the module's attributes)."""
    return not torch.compiler.is_compiling() and in_backward()


def in_eager_forward() -> bool:
    """Outside any backward, and not traced by torch.compile."""
    return not torch.compiler.is_compiling() and not in_backward()


def writes_grad(acc_node: Any) -> bool:
    """Is the running backward `.backward()` (gradients written to `.grad`), not
    `torch.autograd.grad` (gradients returned)? Autograd exposes no flag for it;
    `_will_engine_execute_node` on a leaf's AccumulateGrad node answers during `.backward()`
    and raises during autograd.grad."""
    try:
        torch._C._will_engine_execute_node(acc_node)
    except RuntimeError:
        return False
    return True


def mark_frozen_inputs(runtime: GradientSink, unit: Unit, pass_id: int, args: Any,
                       kwargs: Any) -> Any:
    """ZeRO-3, a unit with nothing trainable: pass its grad-requiring inputs through
    `BackwardDone`, so the unit re-gathered for its backward is released right after."""
    flat, spec = tree_flatten((args, kwargs))
    idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return args, kwargs
    outs = BackwardDone.apply(runtime, unit, *(flat[i] for i in idx))
    for i, o in zip(idx, outs):
        flat[i] = o
    unit.node_created(pass_id)
    return tree_unflatten(flat, spec)


# -- ZeRO-3 saved tensors ---------------------------------------------------------------------
class SavedParamView(NamedTuple):
    """What autograd keeps for a saved tensor that is a view of a gathered bucket buffer."""

    unit: Unit
    bucket: Bucket
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SavedParams:
    """The gathered buffers of one runtime, by storage, and the saved-tensor hooks over them."""

    def __init__(self, *, regather: Callable[[Unit], None]) -> None:
        self._regather = regather
        # data_ptr of a gathered bucket buffer -> (unit, bucket); only for buckets whose
        # unsharded buffer is not the shard itself (the runtime tracks none on one rank).
        self._owner: dict[int, tuple[Unit, Bucket]] = {}
        self._hooks: Any = None
        # Under torch.compile the hooks run eagerly (eager.py): dynamo cannot trace storage
        # pointers and would otherwise try (and recompile) on every tensor autograd saves.
        # They call `_pack` and `_unpack` through the instance, so a benchmark or test can
        # wrap those.
        self.hook_fns = {"pack": lambda t: self._pack(t), "unpack": lambda s: self._unpack(s)}
        keep_eager(self, "hook_fns", "pack")
        keep_eager(self, "hook_fns", "unpack")

    def track(self, unit: Unit) -> None:
        """`unit` is gathered: saved views of its buffers become tokens."""
        for b in unit.buckets:
            assert b.unsharded is not None
            self._owner[b.unsharded.untyped_storage().data_ptr()] = (unit, b)

    def untrack(self, unit: Unit) -> None:
        for b in unit.buckets:
            if b.unsharded is not None:
                self._owner.pop(b.unsharded.untyped_storage().data_ptr(), None)

    def push(self) -> None:
        """Enter the hooks (the root's forward begins)."""
        fns = self.hook_fns
        self._hooks = torch.autograd.graph.saved_tensors_hooks(fns["pack"], fns["unpack"])
        self._hooks.__enter__()

    def pop(self) -> bool:
        """Leave the hooks if they were pushed (the root's forward ends); whether they were."""
        if self._hooks is None:
            return False
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        return True

    def _pack(self, t: torch.Tensor) -> Any:
        owner = self._owner.get(t.untyped_storage().data_ptr())
        if owner is None or t.dtype != owner[1].compute_dtype:
            return t
        unit, bucket = owner
        return SavedParamView(unit, bucket, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedParamView):
            return saved
        self._regather(saved.unit)
        buf = saved.bucket.unsharded
        assert buf is not None
        return buf.as_strided(saved.size, saved.stride, saved.offset)
