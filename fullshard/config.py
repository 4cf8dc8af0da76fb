"""Options users pass to fullshard: the strategy enums and their parsing.

Everything here is plain data. `ShardingPlan` is what the engine actually consumes: a strategy
name from any door (`FSDPType`, `ShardingStrategy`, torch's enum, or a string) is turned into one
by `resolve_sharding_strategy`, so the engine never sees the many spellings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FSDPType(enum.Enum):
    """The functional door's strategy names (as in thunder's `fsdp`)."""

    ZERO2 = "ZERO2"
    """Gather each unit once in forward and keep it until its backward (like SHARD_GRAD_OP)."""
    ZERO3 = "ZERO3"
    """Release each unit after its forward and gather it again for backward (like FULL_SHARD)."""


class ShardingStrategy(enum.Enum):
    """The strategy names of torch FSDP / Lightning Fabric."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


class FSDPBucketingStrategy(enum.Enum):
    """How many tensors one collective moves."""

    NONE = "NONE"
    """One collective per parameter."""
    LAYER = "LAYER"
    """One collective per leaf module that owns parameters (`nn.Linear`, `nn.LayerNorm`, ...)."""
    BLOCK = "BLOCK"
    """One collective per unit (e.g. per transformer block)."""


@dataclass(frozen=True)
class ShardingPlan:
    """What a strategy means to the engine.

    `reshard_after_forward` is the ZeRO-3 / ZeRO-2 switch; `hybrid` asks for a 2-D
    (replicate, shard) mesh and `no_shard` for the `(N, 1)` mesh. The mesh itself is chosen
    once the world size is known (`fullshard.distributed.mesh`).
    """

    name: str
    reshard_after_forward: bool
    no_shard: bool = False
    hybrid: bool = False


_PLANS = {
    "ZERO3": ShardingPlan("ZERO3", reshard_after_forward=True),
    "FULL_SHARD": ShardingPlan("FULL_SHARD", reshard_after_forward=True),
    "ZERO2": ShardingPlan("ZERO2", reshard_after_forward=False),
    "SHARD_GRAD_OP": ShardingPlan("SHARD_GRAD_OP", reshard_after_forward=False),
    "NO_SHARD": ShardingPlan("NO_SHARD", reshard_after_forward=False, no_shard=True),
    "HYBRID_SHARD": ShardingPlan("HYBRID_SHARD", reshard_after_forward=True, hybrid=True),
    "_HYBRID_SHARD_ZERO2": ShardingPlan(
        "_HYBRID_SHARD_ZERO2", reshard_after_forward=False, hybrid=True
    ),
}


def valid_strategy_names() -> list[str]:
    return list(_PLANS)


def resolve_sharding_strategy(strategy: object) -> ShardingPlan:
    """Turn any accepted spelling of a sharding strategy into a `ShardingPlan`.

    Accepts `FSDPType`, `ShardingStrategy`, torch's `torch.distributed.fsdp.ShardingStrategy`
    (matched by member name) and strings in any case.
    """
    if isinstance(strategy, ShardingPlan):
        return strategy
    if isinstance(strategy, enum.Enum):
        key = strategy.name
    elif isinstance(strategy, str):
        key = strategy.strip().upper()
    else:
        raise TypeError(
            f"sharding_strategy must be an FSDPType, a ShardingStrategy or a string, "
            f"got {type(strategy).__name__}: {strategy!r}"
        )
    if key not in _PLANS:
        raise ValueError(
            f"Unknown sharding strategy {strategy!r}. Valid strategies: "
            f"{', '.join(valid_strategy_names())}."
        )
    return _PLANS[key]


def resolve_bucketing_strategy(bucketing: object) -> FSDPBucketingStrategy:
    """Accept an `FSDPBucketingStrategy` or its name in any case."""
    if isinstance(bucketing, FSDPBucketingStrategy):
        return bucketing
    if isinstance(bucketing, str):
        key = bucketing.strip().upper()
        if key in FSDPBucketingStrategy.__members__:
            return FSDPBucketingStrategy[key]
    names = ", ".join(FSDPBucketingStrategy.__members__)
    raise ValueError(f"Unknown bucketing strategy {bucketing!r}. Valid strategies: {names}.")
