"""fullshard: Fully Sharded Data Parallel (ZeRO-2 / ZeRO-3) training for PyTorch.

Every parameter is split along its first dimension across the ranks; a unit of the model is
gathered just before it runs and its gradients are reduce-scattered right after, so each rank
keeps about 1/N of the model state.
"""

from fullshard.api.forward_methods import register_fsdp_forward_method
from fullshard.api.functional import fsdp
from fullshard.api.grad_norm import clip_grad_norm_
from fullshard.api.lightning_registration import register_when_lightning_is_imported
from fullshard.config import (
    Compression,
    CPUOffload,
    FSDPBucketingStrategy,
    FSDPType,
    MixedPrecision,
    ShardingStrategy,
)
from fullshard.distributed.comm import comm_stats, reset_comm_stats
from fullshard.engine.bucket import memory_stats, reset_memory_stats
from fullshard.engine.full_state import full_state_dict, load_full_state_dict
from fullshard.engine.module import FullyShardedModule
from fullshard.engine.runtime_lookup import reset_step
from fullshard.planner import PlanTable, plan

__all__ = [
    "CPUOffload",
    "Compression",
    "FSDPBucketingStrategy",
    "FSDPType",
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
    "register_fsdp_forward_method",
    "reset_memory_stats",
    "reset_step",
]

__version__ = "0.1.0"

_LIGHTNING_MISSING = (
    "fullshard.FSDPStrategy is a Lightning Fabric strategy and needs Lightning: "
    'pip install "fullshard[lightning]". (fullshard.fsdp(model) needs torch only.)'
)


# Retired: fullshard's copy of Lightning Fabric's API. What replaces each name. An ImportError
# (not AttributeError): `from fullshard import Fabric` shows this message only then.
_RETIRED = {
    "Fabric": "fullshard.Fabric was retired: use Lightning's own Fabric with fullshard's "
              "strategy, L.Fabric(strategy=fullshard.FSDPStrategy(...)) (or "
              'strategy="fullshard" after `import fullshard`); pip install "fullshard[lightning]".',
    "seed_everything": "fullshard.seed_everything was retired with fullshard.Fabric: use "
                       "lightning.fabric.seed_everything or fabric.seed_everything(...).",
    "CSVLogger": "fullshard.CSVLogger was retired with fullshard.Fabric: use "
                 "lightning.fabric.loggers.CSVLogger (Fabric(loggers=...)).",
}


def __getattr__(name: str) -> object:
    """`fullshard.FSDPStrategy`, imported on first use: it needs Lightning, the rest does not."""
    if name in _RETIRED:
        raise ImportError(_RETIRED[name], name=f"fullshard.{name}")
    if name != "FSDPStrategy":
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    try:
        from fullshard.api.lightning_strategy import FSDPStrategy
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("lightning", "lightning_utilities"):
            raise
        raise ImportError(_LIGHTNING_MISSING) from exc
    return FSDPStrategy


register_when_lightning_is_imported()  # L.Fabric(strategy="fullshard"): see that module
