"""`model.state_dict()` of a wrapped model holds `DTensor`s, as torch FSDP2's does.

Each sharded parameter appears as a `DTensor` of its original shape whose local tensor is this
rank's real rows (a view of the shard: no copy, no communication, no padding):
`[Shard(0)]` on a 1-D mesh over the shard group (FULL_SHARD, SHARD_GRAD_OP),
`[Replicate(), Shard(0)]` on the 2-D `(replicate, shard)` mesh (HYBRID_SHARD) and
`[Replicate()]` on the replicate group (NO_SHARD). Our row layout is `torch.chunk`'s, which
is how `Shard(0)` splits uneven rows, so code written for FSDP2 (`.full_tensor()`,
`torch.distributed.checkpoint.state_dict.get_model_state_dict`, litgpt's savers) reads it
unchanged. A 0-dim parameter lives on shard rank 0 only (as one row); it appears as a `DTensor`
that is `Partial` over the shard axis (zero elsewhere), whose `.full_tensor()` is its value.

fullshard's own readers (full gathers, its checkpoint formats) want the local rows as the
registered parameters themselves: they read `local_state_dict(model)`, which turns the
conversion off for the duration of the call.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.distributed.mesh import ShardMesh
from fullshard.engine.layout import ShardLayout
from fullshard.engine.sharded_param import ShardedParam, params_by_module
from fullshard.engine.unit import Unit

_LOCAL_VALUES = contextvars.ContextVar("fullshard_local_state_dict", default=False)


def local_state_dict(module: nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """`module.state_dict(keep_vars=...)` with every sharded parameter as this rank's rows
    (with `keep_vars=True`: the registered `nn.Parameter`s themselves), not as `DTensor`s."""
    token = _LOCAL_VALUES.set(True)
    try:
        return module.state_dict(keep_vars=keep_vars)
    finally:
        _LOCAL_VALUES.reset(token)


class StateDictMesh:
    """The `DeviceMesh` and placements a wrapped model's state dict uses (built without
    communication from the process groups the engine already has)."""

    def __init__(self, mesh: ShardMesh) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import Partial

        device_type = "cuda" if "nccl" in mesh.world.backend else "cpu"
        self.problem: str | None = None
        self.device_mesh: Any = None
        if mesh.replicate.size == 1:
            self.device_mesh = DeviceMesh.from_group(_pg(mesh.shard), device_type)
            self.placements: tuple[Any, ...] = (Shard(0),)
            self.scalar_placements: tuple[Any, ...] = (Partial(),)
        elif mesh.shard.size == 1:
            self.device_mesh = DeviceMesh.from_group(_pg(mesh.replicate), device_type)
            self.placements = self.scalar_placements = (Replicate(),)
        else:
            self.placements = (Replicate(), Shard(0))
            self.scalar_placements = (Replicate(), Partial())
            grid = _grid(mesh)
            if grid is None:
                self.problem = (
                    f"this rank's shard group {mesh.shard.ranks} and replicate group "
                    f"{mesh.replicate.ranks} do not form the row-major (replicate, shard) grid "
                    f"of init_device_mesh"
                )
            else:
                self.device_mesh = DeviceMesh.from_group(
                    [_pg(mesh.replicate), _pg(mesh.shard)], device_type, mesh=grid,
                    mesh_dim_names=("replicate", "shard"),
                )

    def as_dtensor(self, key: str, local: torch.Tensor, layout: ShardLayout) -> Any:
        from torch.distributed.tensor import DTensor

        if self.device_mesh is None:
            raise ValueError(
                f"state_dict: cannot express {key!r} as a DTensor because {self.problem}. "
                f"Use fullshard.full_state_dict(model) for the unsharded tensors, or build "
                f"the HYBRID_SHARD mesh with init_device_mesh."
            )
        shape = torch.Size(layout.shape)
        if len(shape) == 0:  # one row on shard rank 0, nothing elsewhere
            value = local.reshape(()) if local.numel() == 1 else local.new_zeros(())
            return DTensor.from_local(value, self.device_mesh, self.scalar_placements,
                                      run_check=False, shape=shape, stride=())
        return DTensor.from_local(local, self.device_mesh, self.placements, run_check=False,
                                  shape=shape, stride=_contiguous_stride(shape))


def register_dtensor_state_dict(units: Iterable[Unit], mesh: ShardMesh) -> None:
    """One state-dict post-hook per module that holds sharded parameters: each of them
    becomes a `DTensor` in `state_dict()` (see the module docstring)."""
    sd_mesh = StateDictMesh(mesh)
    for module, params in params_by_module(sp for unit in units for sp in unit.params).items():
        module.register_state_dict_post_hook(functools.partial(_as_dtensors, params, sd_mesh))


def _as_dtensors(params: dict[str, ShardedParam], sd_mesh: StateDictMesh, module: nn.Module,
                 state_dict: dict, prefix: str, *_: object) -> None:
    if _LOCAL_VALUES.get():
        return
    for name, sp in params.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and not is_dtensor(value):
            state_dict[key] = sd_mesh.as_dtensor(key, value, sp.layout)


def is_dtensor(value: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _pg(group: Any) -> Any:
    return group.pg if group.pg is not None else dist.group.WORLD


def _grid(mesh: ShardMesh) -> torch.Tensor | None:
    """All global ranks as the `(replicate, shard)` grid, if this rank's two groups are a row
    and a column of `arange(world).view(R, S)` (what `init_device_mesh` builds)."""
    r, s = mesh.replicate.size, mesh.shard.size
    grid = torch.arange(r * s).view(r, s)
    row, col = mesh.replicate.rank, mesh.shard.rank
    if (tuple(grid[row].tolist()) != tuple(mesh.shard.ranks)
            or tuple(grid[:, col].tolist()) != tuple(mesh.replicate.ranks)):
        return None
    return grid


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
