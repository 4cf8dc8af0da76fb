"""Parsing and checking `FSDPStrategy`'s arguments: engine keywords, the deprecated
`activation_checkpointing`, the timeout, and the reduce ops of the user collectives.

Every rejection says what was found and what to pass instead (torch FSDP1 options that have
an equivalent here name it).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from fullshard.config import resolve_bucketing_strategy

ENGINE_OPTIONS = (
    "bucketing_strategy",
    "prefetch_limit",
    "max_pending_reductions",
    "broadcast_from",
    "move_state_dict_to_cpu",
)
_TORCH_FSDP_HINTS = {
    "use_orig_params": "fullshard always exposes the original parameters (as shards); drop it",
    "limit_all_gathers": "use prefetch_limit=N (units gathered ahead of the running one)",
    "forward_prefetch": "use prefetch_limit=N",
    "backward_prefetch": "use prefetch_limit=N",
    "sync_module_states": "use broadcast_from=0",
    "process_group": "use device_mesh=(replicate, shard) or a DeviceMesh with HYBRID_SHARD",
    "param_init_fn": "build the model under fabric.init_module(empty_init=True); modules are "
    "materialized with their reset_parameters()",
    "device_id": "the device follows the local rank (FSDPStrategy.root_device)",
}
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}


def check_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine options among `**kwargs`, checked; anything else is a `TypeError`."""
    unknown = [k for k in kwargs if k not in ENGINE_OPTIONS]
    if unknown:
        hints = "".join(
            f"\n  {k}: {_TORCH_FSDP_HINTS[k]}" for k in unknown if k in _TORCH_FSDP_HINTS
        )
        raise TypeError(
            f"FSDPStrategy got unexpected keyword argument(s) {', '.join(map(repr, unknown))}."
            f" Engine options accepted as keywords: {', '.join(ENGINE_OPTIONS)}.{hints}"
        )
    if "bucketing_strategy" in kwargs:
        resolve_bucketing_strategy(kwargs["bucketing_strategy"])
    for name in ("prefetch_limit", "max_pending_reductions"):
        value = kwargs.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"FSDPStrategy({name}=...) must be an int >= 0, got {value!r}")
    return dict(kwargs)


def merge_checkpointing_arguments(
    activation_checkpointing: type[nn.Module] | Sequence[type[nn.Module]] | None,
    activation_checkpointing_policy: object,
) -> object:
    """The policy to use; the deprecated `activation_checkpointing` (module classes) still
    works with a `DeprecationWarning`."""
    if activation_checkpointing is None:
        return activation_checkpointing_policy
    if activation_checkpointing_policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and "
            "`activation_checkpointing_policy`. Use the latter."
        )
    warnings.warn(
        "FSDPStrategy(activation_checkpointing=...) is deprecated; use "
        "activation_checkpointing_policy={...module classes...}.",
        DeprecationWarning,
        stacklevel=3,
    )
    classes = activation_checkpointing
    if isinstance(classes, type):
        classes = [classes]
    return set(classes)


def as_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """A `timedelta` (seconds accepted as a number), or None."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")


def reduce_op_of(reduce_op: object) -> tuple[Any, bool]:
    """(the `ReduceOp` to run, whether to divide by the group size afterwards)."""
    if isinstance(reduce_op, str):
        key = reduce_op.lower()
        if key in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        if key in _REDUCE_OPS:
            return _REDUCE_OPS[key], False
        raise ValueError(
            f"reduce_op={reduce_op!r} is not supported; use 'mean', 'sum', 'max', 'min', "
            f"'product' or a torch.distributed.ReduceOp."
        )
    if reduce_op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    return reduce_op, False
