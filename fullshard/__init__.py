"""fullshard: Fully Sharded Data Parallel (ZeRO-2 / ZeRO-3) training for PyTorch.

Every parameter is split along its first dimension across the ranks; a unit of the model is
gathered just before it runs and its gradients are reduce-scattered right after, so each rank
keeps about 1/N of the model state.
"""

from fullshard.api.fabric import Fabric, seed_everything
from fullshard.api.functional import fsdp
from fullshard.api.grad_norm import clip_grad_norm_
from fullshard.api.loggers import CSVLogger
from fullshard.api.strategy import FSDPStrategy
from fullshard.config import (
    CPUOffload,
    FSDPBucketingStrategy,
    FSDPType,
    MixedPrecision,
    ShardingStrategy,
)
from fullshard.distributed.comm import comm_stats, reset_comm_stats
from fullshard.engine.full_state import full_state_dict, load_full_state_dict
from fullshard.engine.memory import memory_stats, reset_memory_stats
from fullshard.engine.module import FullyShardedModule
from fullshard.planner import PlanTable, plan

__all__ = [
    "CPUOffload",
    "CSVLogger",
    "FSDPBucketingStrategy",
    "FSDPStrategy",
    "FSDPType",
    "Fabric",
    "FullyShardedModule",
    "MixedPrecision",
    "PlanTable",
    "ShardingStrategy",
    "clip_grad_norm_",
    "comm_stats",
    "fsdp",
    "full_state_dict",
    "load_full_state_dict",
    "memory_stats",
    "plan",
    "reset_comm_stats",
    "reset_memory_stats",
    "seed_everything",
]

__version__ = "0.1.0"
