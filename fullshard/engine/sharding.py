"""Converting a model in place: shard every parameter, build units and buckets, add hooks.

Order of work (memory: each unit is sharded before the next is touched, so besides the user's
own model only one unit's full parameters -- and, with `broadcast_from`, one bucket's full rows
on the source rank -- are ever allocated at once):

1. choose the units (wrap.py) and the owning unit of every parameter;
2. per unit, in order (root first):
   a. meta-device modules of the unit are materialized on the device and initialized with
      their own `reset_parameters()` (`materialize.py`), so a model built on the meta device
      never exists in full;
   b. its parameters are grouped into buckets (`unit_buckets`, which `unit_specs` also gives
      the planner for a model it does not change);
   c. each bucket's flat shard is filled from the local values, or scattered from
      `broadcast_from`, and the local shards replace the parameters under their names;
3. buffers move to the device (cast to the buffer dtype, broadcast from `broadcast_from`);
   ignored modules and parameters (`ignored.py`) are skipped throughout;
4. the runtime is created, the units hooked, activation checkpointing applied, the root
   marked as wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fullshard.config import Compression, FSDPBucketingStrategy, MixedPrecision, ShardingPlan
from fullshard.distributed import comm
from fullshard.distributed.mesh import ShardMesh
from fullshard.engine.activation_checkpoint import apply_activation_checkpointing
from fullshard.engine.bucket import Bucket
from fullshard.engine.dtensor_state import register_dtensor_state_dict
from fullshard.engine.eager import register_unit_hooks
from fullshard.engine.full_state import own_rows, register_sharded_loading
from fullshard.engine.hooks import Runtime
from fullshard.engine.ignored import Ignored
from fullshard.engine.layout import ShardLayout
from fullshard.engine.materialize import materialize_unit
from fullshard.engine.mixed_precision import (
    bucket_dtypes,
    buffer_dtype,
    full_precision_ids,
    holds_full_precision,
    install_full_precision_casts,
    keeps_low_precision_grads,
    unit_input_dtypes,
)
from fullshard.engine.module import mark_wrapped
from fullshard.engine.sharded_param import ShardedParam
from fullshard.engine.unit import Unit
from fullshard.engine.wrap import ParamOwnership, assign_params, choose_units, select_units


def shard_module(
    model: nn.Module,
    *,
    mesh: ShardMesh,
    plan: ShardingPlan,
    device: torch.device,
    bucketing: FSDPBucketingStrategy,
    auto_wrap_policy: object,
    broadcast_from: int | None,
    mixed_precision: MixedPrecision | None,
    offload: bool,
    activation_checkpointing_policy: object,
    prefetch_limit: int,
    max_pending_reductions: int,
    backward_prefetch_limit: int | None = None,
    ignored: Ignored | None = None,
    param_init_fn: Callable[[nn.Module], object] | None = None,
    reshard_unit: Callable[[nn.Module], bool | None] | None = None,
    compression: Compression | None = None,
) -> Runtime:
    ignored = ignored or Ignored()
    unit_choice = choose_units(model, auto_wrap_policy, ignored)
    unit_modules = list(unit_choice.modules)
    names = {id(m): n for n, m in model.named_modules()}
    # Each unit's resharding, checked before anything is changed in place.
    reshards = [
        plan.unit_reshards(None if reshard_unit is None else reshard_unit(m),
                           is_root=i == 0, name=names[id(m)])
        for i, m in enumerate(unit_modules)
    ]
    owned = assign_params(model, unit_modules, ignored)
    fp_ids = full_precision_ids(model, mixed_precision)
    shard_rank_of_global: list[int] | None = None
    if broadcast_from is not None:
        shard_rank_of_global = comm.all_gather_object(mesh.shard.rank, mesh.world)

    units: list[Unit] = []
    for module in unit_modules:
        mine = [o for o in owned if o.unit is module]
        materialize_unit(model, module, set(map(id, unit_modules)), mine, device, param_init_fn)
        buckets = []
        for spec in unit_buckets(mine, bucketing, mixed_precision, fp_ids):
            params = [
                ShardedParam(o.name, ShardLayout(o.current.shape, mesh.shard.size, mesh.shard.rank),
                             o.current.requires_grad, o.refs)
                for o in spec.params
            ]
            bucket = Bucket(
                params,
                mesh,
                dtype=spec.dtype,
                device=device,
                compute_dtype=spec.compute_dtype,
                reduce_dtype=spec.reduce_dtype,
                offload=offload,
                keep_low_precision_grads=spec.keep_low_precision_grads,
                compression=compression,
            )
            _fill_bucket(bucket, spec.params, mesh, broadcast_from, shard_rank_of_global)
            for sp in params:
                sp.attach(bucket.padded_shard(sp))
            buckets.append(bucket)
        for o in mine:
            o.param = None  # drop our reference to the full tensor: only shards remain
        units.append(Unit(module, names[id(module)], buckets))

    _move_buffers(model, device, mixed_precision, fp_ids, mesh, broadcast_from, ignored)
    runtime = Runtime(
        units,
        mesh,
        plan,
        prefetch_limit=prefetch_limit,
        max_pending_reductions=max_pending_reductions,
        backward_prefetch_limit=backward_prefetch_limit,
        input_dtypes=unit_input_dtypes(units, mixed_precision, fp_ids),
        reshards=reshards,
    )
    runtime.units_description = unit_choice.describe()
    # Under torch.compile the hooks run eagerly (they issue collectives and swap tensors):
    # one clean graph break at each, instead of dynamo tracing into them (eager.py).
    for unit in units:
        register_unit_hooks(
            unit.module,
            functools.partial(runtime.pre_forward, unit),
            functools.partial(runtime.post_forward, unit),
        )
    install_full_precision_casts(model, mixed_precision)
    apply_activation_checkpointing(model, activation_checkpointing_policy, runtime)
    # A load writes the shards in place: drop gathered copies now (a stale copy would also be
    # caught by its version counter at the next forward, but would hold memory until then).
    model.register_load_state_dict_post_hook(lambda module, keys: runtime.invalidate())
    register_sharded_loading(units)  # load_state_dict takes full tensors too
    register_dtensor_state_dict(units, mesh)  # state_dict() holds DTensors, as FSDP2's
    mark_wrapped(model, runtime)
    return runtime


@dataclass(frozen=True)
class BucketSpec:
    """One bucket as `shard_module` builds it: its parameters and their dtypes (precision.py)."""

    params: tuple[ParamOwnership, ...]
    dtype: torch.dtype
    """The shards' dtype: the parameters' own (one per bucket)."""
    compute_dtype: torch.dtype | None
    """Gathered in (None: `dtype`)."""
    reduce_dtype: torch.dtype | None
    """Reduced in (None: the compute dtype)."""
    full_precision: bool
    """Held by a full-precision module: gathered and reduced in `dtype` (precision.py)."""
    keep_low_precision_grads: bool

    @property
    def requires_grad(self) -> bool:
        return self.params[0].current.requires_grad


@dataclass(frozen=True)
class UnitSpec:
    """One unit as `shard_module` builds it, before anything is sharded."""

    module: nn.Module
    name: str
    """Module path ('' for the root)."""
    buckets: tuple[BucketSpec, ...]


def unit_buckets(
    owned: Sequence[ParamOwnership],
    bucketing: FSDPBucketingStrategy,
    mixed_precision: MixedPrecision | None,
    fp_ids: set[int] | frozenset[int] = frozenset(),
) -> list[BucketSpec]:
    """One unit's parameters grouped into buckets, in order: by the bucketing strategy, dtype,
    `requires_grad` and full precision (a bucket's flat buffers need one dtype; frozen
    parameters are gathered but never reduced; full-precision ones gather in their own dtype),
    with each bucket's dtypes. `shard_module` builds exactly these (the planner counts them)."""
    groups: dict[tuple, list[ParamOwnership]] = {}
    for i, o in enumerate(owned):
        full = holds_full_precision(o.refs, fp_ids)  # gathered in its own dtype (precision.py)
        kind = (o.current.dtype, o.current.requires_grad, full)
        if bucketing is FSDPBucketingStrategy.NONE:
            key: tuple = (i, kind)
        elif bucketing is FSDPBucketingStrategy.LAYER:
            key = (id(o.refs[0][0]), kind)
        else:
            key = (kind,)
        groups.setdefault(key, []).append(o)
    specs = []
    for key, group in groups.items():
        dtype, _, full = key[-1]
        compute, reduce = bucket_dtypes(mixed_precision, dtype, full)
        specs.append(BucketSpec(tuple(group), dtype, compute, reduce, full,
                                keeps_low_precision_grads(mixed_precision, full)))
    return specs


def unit_specs(
    model: nn.Module,
    policy: object,
    bucketing: FSDPBucketingStrategy,
    mixed_precision: MixedPrecision | None,
    ignored: Ignored | None = None,
) -> list[UnitSpec]:
    """The units (root first) and buckets `shard_module` would build for `model`, read off it
    without changing it: a meta-device model works (the planner's use)."""
    unit_modules = select_units(model, policy, ignored)
    owned = assign_params(model, unit_modules, ignored)
    fp_ids = full_precision_ids(model, mixed_precision)
    names = {id(m): n for n, m in model.named_modules()}
    return [
        UnitSpec(m, names[id(m)],
                 tuple(unit_buckets([o for o in owned if o.unit is m], bucketing,
                                    mixed_precision, fp_ids)))
        for m in unit_modules
    ]


@torch.no_grad()
def _fill_bucket(
    bucket: Bucket,
    group: Sequence[ParamOwnership],
    mesh: ShardMesh,
    broadcast_from: int | None,
    shard_rank_of_global: list[int] | None,
) -> None:
    if broadcast_from is None:
        for sp, o in zip(bucket.params, group):
            own = own_rows(o.current.detach(), sp.layout)
            bucket.padded_shard(sp)[: sp.layout.local_rows].copy_(own)
        return
    # Scatter: the source packs every shard rank's rows (rank-major, zero padded) and each
    # rank receives only its own shard of the bucket.
    device = bucket.shard_flat.device
    chunks = None
    if mesh.world.rank == broadcast_from:
        s = mesh.shard.size
        packed = torch.empty(s, bucket.numel, dtype=bucket.dtype, device=device)
        rows = [
            o.current.detach().to(device).reshape(sp.layout.dim0, *sp.layout.rest)
            for sp, o in zip(bucket.params, group)
        ]
        torch._chunk_cat(rows, dim=0, num_chunks=s, out=packed)
        assert shard_rank_of_global is not None
        chunks = [packed[shard_rank_of_global[g]] for g in range(mesh.world.size)]
    comm.scatter(bucket.shard_flat, chunks, broadcast_from, mesh.world)


@torch.no_grad()
def _move_buffers(
    model: nn.Module,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
    fp_ids: set[int],
    mesh: ShardMesh,
    broadcast_from: int | None,
    ignored: Ignored,
) -> None:
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if id(module) in ignored.modules:
            continue  # the user's, untouched (ignored.py)
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) not in moved:
                cast = buffer_dtype(mixed_precision, module, buf, fp_ids)
                new = buf.to(device, dtype=cast)
                if broadcast_from is not None:
                    new = new.contiguous()
                    comm.broadcast(new, broadcast_from, mesh.world)
                moved[id(buf)] = new
            module._buffers[name] = moved[id(buf)]
