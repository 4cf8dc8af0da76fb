"""Converting a model in place: shard every parameter, build units and buckets, add hooks.

Order of work (memory: each unit is sharded before the next is touched, so besides the user's
own model only one unit's full parameters -- and, with `broadcast_from`, one bucket's full rows
on the source rank -- are ever allocated at once):

1. choose the units (wrap.py) and the owning unit of every parameter;
2. per unit, in order (root first):
   a. meta-device modules of the unit are materialized on the device and initialized with
      their own `reset_parameters()` (`materialize.py`), so a model built on the meta device
      never exists in full;
   b. its parameters are grouped into buckets by the bucketing strategy, dtype and
      `requires_grad` (a bucket's flat buffers need one dtype; frozen parameters are gathered
      but never reduced, so they never share a bucket with trainable ones);
   c. each bucket's flat shard is filled from the local values, or scattered from
      `broadcast_from`, and the local shards replace the parameters under their names;
3. buffers move to the device (cast to the buffer dtype, broadcast from `broadcast_from`);
4. the runtime is created, the units hooked, activation checkpointing applied, the root
   marked as wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from fullshard.config import FSDPBucketingStrategy, MixedPrecision, ShardingPlan
from fullshard.distributed import comm
from fullshard.distributed.mesh import ShardMesh
from fullshard.engine.bucket import Bucket
from fullshard.engine.checkpointing import apply_activation_checkpointing
from fullshard.engine.hooks import Runtime
from fullshard.engine.layout import ShardLayout
from fullshard.engine.materialize import materialize_unit
from fullshard.engine.module import mark_wrapped
from fullshard.engine.sharded_param import ShardedParam
from fullshard.engine.unit import Unit
from fullshard.engine.wrap import ParamOwnership, assign_params, choose_units


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
) -> Runtime:
    unit_choice = choose_units(model, auto_wrap_policy)
    unit_modules = list(unit_choice.modules)
    owned = assign_params(model, unit_modules)
    names = {id(m): n for n, m in model.named_modules()}
    shard_rank_of_global: list[int] | None = None
    if broadcast_from is not None:
        shard_rank_of_global = comm.all_gather_object(mesh.shard.rank, mesh.world)

    units: list[Unit] = []
    for module in unit_modules:
        mine = [o for o in owned if o.unit is module]
        materialize_unit(model, module, set(map(id, unit_modules)), mine, device)
        buckets = []
        for group in _bucket_groups(mine, bucketing):
            params = [_sharded_param(o, mesh) for o in group]
            dtype = group[0].current.dtype
            compute, reduce = _precision_dtypes(mixed_precision, dtype)
            bucket = Bucket(
                params,
                mesh,
                dtype=dtype,
                device=device,
                compute_dtype=compute,
                reduce_dtype=reduce,
                offload=offload,
            )
            _fill_bucket(bucket, group, mesh, broadcast_from, shard_rank_of_global)
            for sp in params:
                sp.attach(bucket.padded_shard(sp))
            buckets.append(bucket)
        for o in mine:
            o.param = None  # drop our reference to the full tensor: only shards remain
        units.append(Unit(module, names[id(module)], buckets))

    buffer_dtype = mixed_precision.buffer_dtype if mixed_precision else None
    _move_buffers(model, device, buffer_dtype, mesh, broadcast_from)
    input_dtype = None
    if mixed_precision is not None and mixed_precision.cast_forward_inputs:
        input_dtype = mixed_precision.param_dtype
    runtime = Runtime(
        units,
        mesh,
        plan,
        prefetch_limit=prefetch_limit,
        max_pending_reductions=max_pending_reductions,
        input_dtype=input_dtype,
    )
    runtime.units_description = unit_choice.describe()
    # Under torch.compile the hooks run eagerly (they issue collectives and swap tensors):
    # one clean graph break at each, instead of dynamo tracing into them and breaking inside.
    eager = torch.compiler.disable
    for unit in units:
        unit.module.register_forward_pre_hook(
            eager(functools.partial(runtime.pre_forward, unit)), prepend=True, with_kwargs=True
        )
        unit.module.register_forward_hook(
            eager(functools.partial(runtime.post_forward, unit)), always_call=True
        )
    apply_activation_checkpointing(model, activation_checkpointing_policy, runtime)
    mark_wrapped(model, runtime)
    return runtime


def _precision_dtypes(
    mp: MixedPrecision | None, dtype: torch.dtype
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(compute, reduce) dtypes of a bucket whose shards are `dtype`; None keeps the default."""
    if mp is None or not dtype.is_floating_point:
        return None, None
    return mp.param_dtype, mp.reduce_dtype


def _sharded_param(o: ParamOwnership, mesh: ShardMesh) -> ShardedParam:
    layout = ShardLayout(o.current.shape, mesh.shard.size, mesh.shard.rank)
    return ShardedParam(o.name, layout, o.current.requires_grad, o.refs)


def _bucket_groups(
    owned: Sequence[ParamOwnership], bucketing: FSDPBucketingStrategy
) -> list[list[ParamOwnership]]:
    groups: dict[tuple, list[ParamOwnership]] = {}
    for i, o in enumerate(owned):
        kind = (o.current.dtype, o.current.requires_grad)
        if bucketing is FSDPBucketingStrategy.NONE:
            key: tuple = (i,)
        elif bucketing is FSDPBucketingStrategy.LAYER:
            key = (id(o.refs[0][0]), *kind)
        else:
            key = kind
        groups.setdefault(key, []).append(o)
    return list(groups.values())


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
            start, stop = sp.layout.owned
            rows = o.current.detach().reshape(sp.layout.dim0, *sp.layout.rest)
            bucket.padded_shard(sp)[: stop - start].copy_(rows[start:stop])
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
    buffer_dtype: torch.dtype | None,
    mesh: ShardMesh,
    broadcast_from: int | None,
) -> None:
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) not in moved:
                cast = buffer_dtype if buf.is_floating_point() else None
                new = buf.to(device, dtype=cast)
                if broadcast_from is not None:
                    new = new.contiguous()
                    comm.broadcast(new, broadcast_from, mesh.world)
                moved[id(buf)] = new
            module._buffers[name] = moved[id(buf)]
