"""Converting a model in place: shard every parameter, build units and buckets, add hooks.

Order of work (memory: each parameter is sharded and dropped before the next, so besides the
user's own model only one bucket's shards -- and, with `broadcast_from`, one bucket's full
rows on the source rank -- are ever allocated at once):

1. choose the units (wrap.py) and the owning unit of every parameter;
2. per unit, group its parameters into buckets by the bucketing strategy, dtype and
   `requires_grad` (a bucket's flat buffers need one dtype; frozen parameters are gathered
   but never reduced, so they never share a bucket with trainable ones);
3. fill each bucket's flat shard: from the local model, or scattered from `broadcast_from`;
4. register the local shards as the modules' parameters under their original names; move
   buffers to the device (and broadcast them from `broadcast_from`);
5. create the runtime, hook the units, mark the root as wrapped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fullshard.config import FSDPBucketingStrategy, ShardingPlan
from fullshard.distributed import comm
from fullshard.distributed.mesh import ShardMesh
from fullshard.engine.bucket import Bucket
from fullshard.engine.hooks import Runtime
from fullshard.engine.layout import ShardLayout
from fullshard.engine.module import mark_wrapped
from fullshard.engine.sharded_param import ShardedParam
from fullshard.engine.unit import Unit
from fullshard.engine.wrap import ParamOwnership, assign_params, select_units


def shard_module(
    model: nn.Module,
    *,
    mesh: ShardMesh,
    plan: ShardingPlan,
    device: torch.device,
    bucketing: FSDPBucketingStrategy,
    auto_wrap_policy: object,
    broadcast_from: int | None,
    prefetch_limit: int,
    max_pending_reductions: int,
) -> Runtime:
    unit_modules = select_units(model, auto_wrap_policy)
    owned = assign_params(model, unit_modules)
    names = {id(m): n for n, m in model.named_modules()}
    shard_rank_of_global: list[int] | None = None
    if broadcast_from is not None:
        shard_rank_of_global = comm.all_gather_object(mesh.shard.rank, mesh.world)

    units: list[Unit] = []
    for module in unit_modules:
        mine = [o for o in owned if o.unit is module]
        buckets = []
        for group in _bucket_groups(mine, bucketing):
            params = [_sharded_param(o, mesh) for o in group]
            bucket = Bucket(params, mesh, dtype=group[0].param.dtype, device=device)
            _fill_bucket(bucket, group, mesh, broadcast_from, shard_rank_of_global)
            for sp in params:
                sp.attach(bucket.padded_shard(sp))
            buckets.append(bucket)
        units.append(Unit(module, names[id(module)], buckets))

    _move_buffers(model, device, mesh, broadcast_from)
    runtime = Runtime(
        units,
        mesh,
        plan,
        prefetch_limit=prefetch_limit,
        max_pending_reductions=max_pending_reductions,
    )
    for unit in units:
        unit.module.register_forward_pre_hook(_bind(runtime.pre_forward, unit), prepend=True)
        unit.module.register_forward_hook(_bind(runtime.post_forward, unit), always_call=True)
    mark_wrapped(model, runtime)
    return runtime


def _bind(method, unit):  # type: ignore[no-untyped-def]
    def hook(*args):  # type: ignore[no-untyped-def]
        return method(unit, *args)

    return hook


def _sharded_param(o: ParamOwnership, mesh: ShardMesh) -> ShardedParam:
    layout = ShardLayout(o.param.shape, mesh.shard.size, mesh.shard.rank)
    return ShardedParam(o.name, layout, o.param.requires_grad, o.refs)


def _bucket_groups(
    owned: Sequence[ParamOwnership], bucketing: FSDPBucketingStrategy
) -> list[list[ParamOwnership]]:
    groups: dict[tuple, list[ParamOwnership]] = {}
    for i, o in enumerate(owned):
        kind = (o.param.dtype, o.param.requires_grad)
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
            rows = o.param.detach().reshape(sp.layout.dim0, *sp.layout.rest)
            bucket.padded_shard(sp)[: stop - start].copy_(rows[start:stop])
        return
    # Scatter: the source packs every shard rank's rows (rank-major, zero padded) and each
    # rank receives only its own shard of the bucket.
    chunks = None
    if mesh.world.rank == broadcast_from:
        s = mesh.shard.size
        packed = torch.empty(s, bucket.numel, dtype=bucket.dtype, device=bucket.device)
        rows = [
            o.param.detach().to(bucket.device).reshape(sp.layout.dim0, *sp.layout.rest)
            for sp, o in zip(bucket.params, group)
        ]
        torch._chunk_cat(rows, dim=0, num_chunks=s, out=packed)
        assert shard_rank_of_global is not None
        chunks = [packed[shard_rank_of_global[g]] for g in range(mesh.world.size)]
    comm.scatter(bucket.shard_flat, chunks, broadcast_from, mesh.world)


@torch.no_grad()
def _move_buffers(
    model: nn.Module, device: torch.device, mesh: ShardMesh, broadcast_from: int | None
) -> None:
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) not in moved:
                new = buf.to(device)
                if broadcast_from is not None:
                    new = new.contiguous()
                    comm.broadcast(new, broadcast_from, mesh.world)
                moved[id(buf)] = new
            module._buffers[name] = moved[id(buf)]
