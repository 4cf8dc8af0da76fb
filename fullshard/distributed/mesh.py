"""Process groups (`Group`) and the (replicate, shard) mesh: which ranks split parameters and
which hold copies.

Parameters are split along the *shard* axis (all-gather / reduce-scatter run there) and
copied along the *replicate* axis (the reduced shard is all-reduced there). Every strategy is a
mesh shape: FULL_SHARD / SHARD_GRAD_OP are `(1, N)`, NO_SHARD is `(N, 1)`, HYBRID_SHARD is
`(R, S)` with `R * S = N`. Rank `g` sits at `(g // S, g % S)`: shard groups are runs of
consecutive ranks (one node, when S is the ranks per node), as `init_device_mesh` lays them out.
"""

from __future__ import annotations

import dataclasses
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
    post_forward: Group | None = None
    """hpZ (an int `reshard_after_forward`): the run of ranks inside this rank's shard group
    that keeps a unit after its forward and gathers it again for backward; None otherwise."""
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
        return _with_post_forward(_from_device_mesh(mesh, world), plan, mesh.mesh.tolist())
    if plan.no_shard:
        shape = (n, 1)
    elif plan.hybrid:
        shape = _default_hybrid_shape(n) if mesh is None else _validate_shape(mesh, n)
    else:
        shape = (1, n)
    replicate_size, shard_size = shape
    layout = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(replicate_size)]
    if replicate_size == 1:
        built = ShardMesh(shard=world, replicate=_single(world), world=world)
    elif shard_size == 1:
        built = ShardMesh(shard=_single(world), replicate=world, world=world)
    else:
        device_type = "cuda" if "nccl" in world.backend else "cpu"
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        built = _from_device_mesh(device_mesh, world)
    return _with_post_forward(built, plan, layout)


def _with_post_forward(mesh: ShardMesh, plan: ShardingPlan, layout: list[list[int]]
                       ) -> ShardMesh:
    """`mesh` with hpZ's groups when `plan` asks for them: each shard group (a row of
    `layout`, global ranks in shard order) split into runs of `plan.post_forward_size`. Every
    rank creates every run's group, in the same order (creating a group is collective)."""
    k, size = plan.post_forward_size, mesh.shard.size
    if not k or k == size:
        return mesh  # none asked, or the run is the whole shard axis: plain resharding
    if size % k:
        raise ValueError(
            f"reshard_after_forward={k} must divide the {size} ranks that shard each parameter "
            f"(mesh {mesh.shape}): a run of {k} consecutive ranks keeps a unit after forward. "
            f"Use the ranks per node (LOCAL_WORLD_SIZE), a divisor of {size}, or True."
        )
    mine = None
    for row in layout:
        for start in range(0, size, k):
            ranks = row[start : start + k]
            pg = dist.new_group(ranks)
            if mesh.world.rank in ranks:
                mine = Group.from_process_group(pg)
    return dataclasses.replace(mesh, post_forward=mine)


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
