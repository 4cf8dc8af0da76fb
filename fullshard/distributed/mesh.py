"""Process groups (`Group`) and the (replicate, shard) mesh: which ranks split parameters and
which hold copies.

Parameters are split along the *shard* axis (all-gather / reduce-scatter run there) and
copied along the *replicate* axis (the reduced shard is all-reduced there). Every strategy is a
mesh shape: FULL_SHARD / SHARD_GRAD_OP are `(1, N)`, NO_SHARD is `(N, 1)`, HYBRID_SHARD is
`(R, S)` with `R * S = N`. Rank `g` sits at `(g // S, g % S)`: shard groups are runs of
consecutive ranks (one node, when S is the ranks per node), as `init_device_mesh` lays them out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fullshard.config import ShardingPlan


@dataclass(frozen=True)
class Group:
    """A process group together with the facts about it that the hot path needs."""

    pg: Any
    """The `ProcessGroup`, or None for the default (world) group."""
    size: int
    rank: int
    """This process's rank inside the group."""
    ranks: tuple[int, ...]
    """Global ranks of the members, in group-rank order."""
    backend: str

    @classmethod
    def from_process_group(cls, pg: Any = None) -> Group:
        ranks = tuple(dist.get_process_group_ranks(pg or dist.group.WORLD))
        backend = str(dist.get_backend(pg)).lower()
        return cls(pg, dist.get_world_size(pg), dist.get_rank(pg), ranks, backend)


@dataclass(frozen=True)
class ShardMesh:
    shard: Group
    replicate: Group
    world: Group
    data_parallel_size: int = field(init=False)
    """Ranks that see different data (the world); gradients are averaged over all of them. A
    plain attribute: the step reads it for every reduction."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_parallel_size", self.world.size)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.replicate.size, self.shard.size)


def _default_hybrid_shape(world_size: int) -> tuple[int, int]:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node != 0:
        per_node = world_size
    return (world_size // per_node, per_node)


def build_mesh(plan: ShardingPlan, mesh: object = None) -> ShardMesh:
    """Create (or adopt) the process groups for `plan`.

    `mesh` may be None, a `(replicate, shard)` tuple, or a 2-D `DeviceMesh` whose dims are
    (replicate, shard). Must be called on every rank (creating subgroups is collective).
    """
    world = Group.from_process_group(None)
    n = world.size
    if mesh is not None and not plan.hybrid:
        raise ValueError(
            f"A device mesh was given with sharding strategy {plan.name}; a (replicate, shard) "
            f"mesh only applies to HYBRID_SHARD. Drop the mesh or use HYBRID_SHARD."
        )
    if is_device_mesh(mesh):
        return _from_device_mesh(mesh, world)
    if plan.no_shard:
        shape = (n, 1)
    elif plan.hybrid:
        shape = _default_hybrid_shape(n) if mesh is None else _validate_shape(mesh, n)
    else:
        shape = (1, n)
    replicate_size, shard_size = shape
    if replicate_size == 1:
        return ShardMesh(shard=world, replicate=_single(world), world=world)
    if shard_size == 1:
        return ShardMesh(shard=_single(world), replicate=world, world=world)
    device_type = "cuda" if "nccl" in world.backend else "cpu"
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    return _from_device_mesh(device_mesh, world)


def check_mesh_shape(mesh: object) -> None:
    """A `(replicate, shard)` mesh must be two positive ints (the world size is checked later)."""
    expected = "device_mesh must be a (replicate, shard) tuple of two positive ints or a 2-D "
    if not isinstance(mesh, tuple | list):
        raise TypeError(f"{expected}DeviceMesh, got {type(mesh).__name__}: {mesh!r}")
    if len(mesh) != 2 or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in mesh
    ):
        raise ValueError(f"{expected}DeviceMesh, got {mesh!r}")


def _validate_shape(mesh: object, world_size: int) -> tuple[int, int]:
    check_mesh_shape(mesh)
    r, s = mesh  # type: ignore[misc]
    if r * s != world_size:
        raise ValueError(
            f"The device mesh {tuple(mesh)} has {r * s} ranks but the world size is "
            f"{world_size}. Choose (replicate, shard) with replicate * shard == {world_size}."
        )
    return (r, s)


def is_device_mesh(mesh: object) -> bool:
    return isinstance(mesh, DeviceMesh)


def _from_device_mesh(device_mesh: object, world: Group) -> ShardMesh:
    if device_mesh.ndim != 2:  # type: ignore[attr-defined]
        raise ValueError(
            f"A DeviceMesh for HYBRID_SHARD must be 2-D (replicate, shard), got "
            f"{device_mesh.ndim}-D {device_mesh}"  # type: ignore[attr-defined]
        )
    replicate = Group.from_process_group(device_mesh.get_group(0))  # type: ignore[attr-defined]
    shard = Group.from_process_group(device_mesh.get_group(1))  # type: ignore[attr-defined]
    if replicate.size * shard.size != world.size:
        raise ValueError(
            f"The DeviceMesh covers {replicate.size * shard.size} ranks but the world size is "
            f"{world.size}."
        )
    return ShardMesh(shard=shard, replicate=replicate, world=world)


def _single(world: Group) -> Group:
    """A one-member group: collectives on it are local no-ops, never sent."""
    return Group(pg=None, size=1, rank=0, ranks=(dist.get_rank(),), backend=world.backend)
