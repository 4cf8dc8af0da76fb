"""A unit: a module the wrap policy chose, the parameters it owns, and their buckets.

A unit is gathered just before its forward and released after it (ZeRO-3) or after its
backward (ZeRO-2). Its state is the state of its buckets:

    SHARDED --start_gather--> GATHERING --wait--> GATHERED --release--> SHARDED

Autograd routing: when a gathered unit is installed with grad enabled, its trainable
parameters' unsharded views pass through `GatheredParams`, an autograd Function whose inputs
are the local shards and whose outputs are the views. Autograd therefore calls its backward
once, with the unsharded gradients of the whole unit, when the unit's backward is done; the
runtime (hooks.py) reduces them and writes the shards' `.grad` itself, asynchronously, so the
Function returns no gradient to autograd. Frozen parameters are installed as plain views.

One node per unit, not per bucket: autograd runs ready nodes latest-created first, and all of
a unit's nodes would be created together at its pre-forward, so a bucket's node could not run
before the unit's backward is done anyway. (The root's node is created first of all and so
runs last, even though its LM head is differentiated first; only a node created where the
head runs could reduce it early.)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fullshard.engine.bucket import Bucket
from fullshard.engine.sharded_param import ShardedParam

if TYPE_CHECKING:
    from fullshard.engine.hooks import Runtime


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GatheredParams(torch.autograd.Function):
    """Identity on the gathered views; its backward hands the unit's gradients to the runtime."""

    @staticmethod
    def forward(ctx: Any, runtime: Runtime, unit: Unit, *shards: torch.Tensor) -> tuple:
        ctx.runtime = runtime
        ctx.unit = unit
        return tuple(unit.trainable_views())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.runtime.post_backward(ctx.unit, grads)
        return (None, None, *([None] * len(grads)))


class Unit:
    def __init__(self, module: nn.Module, name: str, buckets: Sequence[Bucket]) -> None:
        self.module = module
        self.name = name
        self.buckets = list(buckets)
        self.trainable_buckets = [b for b in self.buckets if b.requires_grad]
        for i, b in enumerate(self.buckets):
            b.set_label(name, i, first_trainable=b is next(iter(self.trainable_buckets), None))
        self.trainable_params: list[ShardedParam] = [
            p for b in self.trainable_buckets for p in b.params
        ]
        self.params: list[ShardedParam] = [p for b in self.buckets for p in b.params]
        self.index = -1  # position in the runtime's unit list
        # Outputs of this forward pass's GatheredParams, reused if the unit runs again in the
        # same pass while still gathered (ZeRO-2), so autograd sees one node and we reduce once.
        self.cached_views: list[torch.Tensor] | None = None
        self.cached_pass = -1
        self._install_order: list[ShardedParam] = []

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'}, {len(self.params)} params, {self.state.value})"

    @property
    def state(self) -> UnitState:
        if any(b.is_gathering for b in self.buckets):
            return UnitState.GATHERING
        if self.buckets and all(b.is_gathered for b in self.buckets):
            return UnitState.GATHERED
        return UnitState.SHARDED

    @property
    def is_gathered(self) -> bool:
        return all(b.is_gathered for b in self.buckets)

    def start_gather(self, *, async_op: bool) -> None:
        for b in self.buckets:
            b.start_gather(async_op=async_op)

    def wait_gathered(self) -> None:
        for b in self.buckets:
            b.finish_gather()

    def release(self) -> None:
        self.cached_views = None
        for b in self.buckets:
            b.release()

    def trainable_views(self) -> list[torch.Tensor]:
        return [v for b in self.trainable_buckets for v in b.unsharded_views()]

    def install(self, runtime: Runtime, *, with_grad: bool, pass_id: int) -> None:
        """Put the unsharded tensors in place of the shards in every module that uses them."""
        if self.cached_views is not None and self.cached_pass == pass_id and self.is_gathered:
            views = self.cached_views
        else:
            frozen = [
                (p, v)
                for b in self.buckets
                if not b.requires_grad
                for p, v in zip(b.params, b.unsharded_views())
            ]
            if with_grad and self.trainable_params:
                shards = [p.param for p in self.trainable_params]
                trainable = list(GatheredParams.apply(runtime, self, *shards))
            else:
                trainable = self.trainable_views()
            views = [v for _, v in frozen]
            views += trainable
            self._install_order = [p for p, _ in frozen] + self.trainable_params
            self.cached_views = views if with_grad else None
            self.cached_pass = pass_id
        for p, v in zip(self._install_order, views):
            p.install(v)

    def uninstall(self) -> None:
        for p in self.params:
            p.uninstall()
