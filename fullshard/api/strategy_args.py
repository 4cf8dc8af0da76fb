"""Parsing and checking `FSDPStrategy`'s arguments: engine keywords, the deprecated
`activation_checkpointing`, the timeout, the reduce ops of the user collectives, the
gradient-clipping arguments, and the torch FSDP objects Lightning's attributes report.

Also torch FSDP's own keywords (see [Note: torch FSDP's keywords]): each is translated to
the engine's option with the same meaning, checked at setup, or warned about once when it
can have no effect here. Every rejection says what was found and what to pass instead.
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fullshard.api.frozen_gathers import check_keep_frozen_gathered
from fullshard.config import check_ignored_states, check_module_classes, resolve_bucketing_strategy
from fullshard.engine.wrap import mark_unit

ENGINE_OPTIONS = (
    "bucketing_strategy",
    "prefetch_limit",
    "max_pending_reductions",
    "broadcast_from",
    "move_state_dict_to_cpu",
    "reshard_after_forward",
    "keep_frozen_gathered",
)

# [Note: torch FSDP's keywords]
# Every keyword of torch's `FullyShardedDataParallel.__init__` (torch 2.13) is accepted:
# `sharding_strategy`, `cpu_offload`, `auto_wrap_policy`, `mixed_precision` and `device_mesh`
# are FSDPStrategy's own arguments; the rest arrive through `**kwargs` and mean:
#   sync_module_states=True   broadcast_from=0: rank 0's parameters and buffers everywhere
#                             (a meta-device model is a ValueError: nothing to broadcast)
#   forward_prefetch          prefetch in forward on/off (torch defaults to off; we prefetch
#                             unless it is passed as False)
#   backward_prefetch         None: no prefetch in backward; BACKWARD_PRE/POST: prefetch (ours
#                             is issued when the running unit is gathered, i.e. PRE's timing)
#   limit_all_gathers=True    at most one unit gathered ahead of the running one (caps
#                             prefetch_limit at 1); False lifts nothing beyond prefetch_limit
#   use_orig_params=True      our behaviour; False: warned once, no effect
#   ignored_modules/_states   left unsharded, unmoved, uncast, gradients not reduced
#   device_id                 must name the rank's device (checked at setup)
#   process_group             None or the default group (all ranks); other groups: use
#                             device_mesh
#   param_init_fn             called on each meta-device module, unit by unit, instead of
#                             its reset_parameters()
# Anything else is a TypeError naming it.
TORCH_FSDP_OPTIONS = (
    "process_group",
    "backward_prefetch",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
)
_WARNED: set[str] = set()
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}


def warn_once(key: str, message: str) -> None:
    """A `UserWarning` the first time `key` is seen in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)


@dataclass(frozen=True)
class TorchFSDPOptions:
    """The torch FSDP keywords that are checked or applied when the model is set up."""

    device_id: int | torch.device | None = None
    process_group: Any = None
    sync_module_states: bool = False
    ignored_states: tuple[Any, ...] | None = None


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"FSDPStrategy({name}=...) must be a bool, got {value!r}")
    return value


def _backward_prefetch(value: object) -> bool:
    """Whether torch's `backward_prefetch` value asks for prefetching in backward."""
    if value is None:
        return False
    name = value.name if isinstance(value, enum.Enum) else value
    if isinstance(name, str) and name.upper() in ("BACKWARD_PRE", "BACKWARD_POST"):
        return True
    raise ValueError(
        f"FSDPStrategy(backward_prefetch={value!r}) must be None or torch's "
        f"BackwardPrefetch.BACKWARD_PRE / BACKWARD_POST."
    )


def check_engine_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], TorchFSDPOptions]:
    """Split `**kwargs` into engine options for `fullshard.fsdp` (torch FSDP keywords
    translated, see [Note: torch FSDP's keywords]) and what `setup_module` checks; anything
    else is a `TypeError` naming it."""
    unknown = [k for k in kwargs if k not in ENGINE_OPTIONS and k not in TORCH_FSDP_OPTIONS]
    if unknown:
        raise TypeError(
            f"FSDPStrategy got unexpected keyword argument(s) {', '.join(map(repr, unknown))}."
            f" Engine options accepted as keywords: {', '.join(ENGINE_OPTIONS)}; torch FSDP "
            f"options: {', '.join(TORCH_FSDP_OPTIONS)}."
        )
    engine = {k: v for k, v in kwargs.items() if k in ENGINE_OPTIONS}
    if "bucketing_strategy" in engine:
        resolve_bucketing_strategy(engine["bucketing_strategy"])
    reshard = engine.get("reshard_after_forward")
    if reshard is not None and not isinstance(reshard, int) and not callable(reshard):
        raise TypeError(
            f"FSDPStrategy(reshard_after_forward=...) must be True, False, None, an int (ranks "
            f"to reshard to after forward) or a callable of a unit's module returning True, "
            f"False or None, got "
            f"{type(reshard).__name__}: {reshard!r}"
        )
    check_keep_frozen_gathered(engine.get("keep_frozen_gathered"), "FSDPStrategy")
    for name in ("prefetch_limit", "max_pending_reductions"):
        value = engine.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"FSDPStrategy({name}=...) must be an int >= 0, got {value!r}")

    if _bool("sync_module_states", kwargs.get("sync_module_states", False)):
        if engine.get("broadcast_from") not in (None, 0):
            raise ValueError(
                f"FSDPStrategy(sync_module_states=True) broadcasts from rank 0 but "
                f"broadcast_from={engine['broadcast_from']!r} was passed too; keep one."
            )
        engine["broadcast_from"] = 0
    if "forward_prefetch" in kwargs:
        engine["forward_prefetch"] = _bool("forward_prefetch", kwargs["forward_prefetch"])
    if "backward_prefetch" in kwargs:
        engine["backward_prefetch"] = _backward_prefetch(kwargs["backward_prefetch"])
    if _bool("limit_all_gathers", kwargs.get("limit_all_gathers", False)):
        if engine.get("prefetch_limit", 1) > 1:
            raise ValueError(
                f"FSDPStrategy(limit_all_gathers=True) allows one unit gathered ahead of the "
                f"running one, but prefetch_limit={engine['prefetch_limit']} asks for more; "
                f"drop one of them."
            )
        engine["prefetch_limit"] = min(engine.get("prefetch_limit", 1), 1)
    if not _bool("use_orig_params", kwargs.get("use_orig_params", True)):
        warn_once(
            "use_orig_params",
            "FSDPStrategy(use_orig_params=False) has no effect: fullshard always exposes the "
            "original parameters (as this rank's shards) under their own names, which is "
            "torch FSDP's use_orig_params=True.",
        )
    if kwargs.get("param_init_fn") is not None:
        if not callable(kwargs["param_init_fn"]):
            raise TypeError(
                f"FSDPStrategy(param_init_fn=...) must be callable, got "
                f"{kwargs['param_init_fn']!r}"
            )
        engine["param_init_fn"] = kwargs["param_init_fn"]
    if kwargs.get("ignored_modules") is not None and kwargs.get("ignored_states") is not None:
        raise ValueError(
            "FSDPStrategy got both ignored_modules and ignored_states; pass one of them "
            "(ignored_states takes modules or parameters), as torch FSDP requires."
        )
    which = "ignored_states" if kwargs.get("ignored_states") is not None else "ignored_modules"
    ignored = check_ignored_states(f"FSDPStrategy({which}=...)", kwargs.get(which))
    if ignored is not None:
        kinds = {isinstance(x, nn.Parameter) for x in ignored}
        if len(kinds) > 1:
            raise ValueError(
                "FSDPStrategy(ignored_states=...) must hold only parameters or only modules, "
                "as torch FSDP requires."
            )
        if kwargs.get("ignored_modules") is not None and kinds == {True}:
            raise TypeError("FSDPStrategy(ignored_modules=...) must hold modules, got "
                            "parameters; pass them as ignored_states.")
    device_id = kwargs.get("device_id")
    if device_id is not None and not isinstance(device_id, int | torch.device | str):
        raise TypeError(
            f"FSDPStrategy(device_id=...) must be an int or torch.device, got {device_id!r}"
        )
    options = TorchFSDPOptions(
        sync_module_states=kwargs.get("sync_module_states", False),
        device_id=device_id,
        process_group=kwargs.get("process_group"),
        ignored_states=ignored,
    )
    return engine, options


def check_torch_options(options: TorchFSDPOptions, module: nn.Module,
                        root: torch.device) -> None:
    """What can only be checked once the rank's device and the model are known."""
    check_device_id(options.device_id, root)
    check_process_group(options.process_group)
    if options.sync_module_states and any(
        t.is_meta for t in (*module.parameters(), *module.buffers())
    ):
        raise ValueError(
            "FSDPStrategy(sync_module_states=True) broadcasts rank 0's values, but the model "
            "is on the meta device (init_module(empty_init=True)). Drop sync_module_states: "
            "every rank materializes the model unit by unit in the same order, so with the "
            "same seed (fabric.seed_everything) all ranks hold the same values -- or build "
            "the model on a real device."
        )


def check_device_id(device_id: int | torch.device | str | None, root: torch.device) -> None:
    """torch FSDP's `device_id` must name the device this rank computes on."""
    if device_id is None:
        return
    if isinstance(device_id, int):
        wanted = torch.device(root.type if root.type != "cpu" else "cuda", device_id)
    else:
        wanted = torch.device(device_id)
    if wanted.type == root.type and (wanted.index is None or wanted.index == root.index
                                     or root.type == "cpu"):
        return
    raise ValueError(
        f"FSDPStrategy(device_id={device_id!r}) names {wanted}, but this rank computes on "
        f"{root} (the accelerator and the local rank decide it). Drop device_id or make it "
        f"{root}."
    )


def check_process_group(process_group: object) -> None:
    """Only the default group (all ranks) is a valid torch FSDP `process_group` here."""
    if process_group is None or process_group is dist.group.WORLD:
        return
    raise ValueError(
        f"FSDPStrategy(process_group={process_group!r}) is not supported: fullshard shards "
        f"over all ranks. For HYBRID_SHARD's (intra-node, inter-node) groups pass "
        f"sharding_strategy='HYBRID_SHARD' with device_mesh=(replicate, shard) instead."
    )


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
    classes = check_module_classes("FSDPStrategy(activation_checkpointing=...)",
                                   activation_checkpointing)
    warnings.warn(
        "FSDPStrategy(activation_checkpointing=...) is deprecated; use "
        "activation_checkpointing_policy={...module classes...}.",
        DeprecationWarning,
        stacklevel=3,
    )
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


def mark_wrapped_unit(module: nn.Module, **overrides: Any) -> nn.Module:
    """The `wrapper_cls` of `FSDPStrategy.module_sharded_context`'s `enable_wrap`: torch's
    `wrap(m)` calls it and gets `m` back, marked as a unit."""
    if overrides:
        warn_once(
            "wrap_overrides",
            f"torch's wrap(module, **overrides) ignores {sorted(overrides)} under fullshard: "
            f"every unit uses the FSDPStrategy's options; the module still becomes a unit.",
        )
    return mark_unit(module)


# -- torch's own types for Lightning's attributes ----------------------------------------------
# Lightning's `strategy.sharding_strategy`, `.cpu_offload` and `.mixed_precision_config` are
# torch FSDP's enum and dataclasses; scripts compare them with torch's objects or read
# `.name`. The engine keeps its own types; these build the torch objects users see. A torch
# built without distributed support has no `torch.distributed.fsdp`: fullshard's own types
# stand in then (they carry the same fields and names).
_TORCH_SHARDING_NAMES = {"ZERO3": "FULL_SHARD", "ZERO2": "SHARD_GRAD_OP"}


def torch_sharding_strategy(plan_name: str) -> Any:
    """torch's `ShardingStrategy` member for a plan name (`ZERO3` is FULL_SHARD, `ZERO2`
    SHARD_GRAD_OP)."""
    name = _TORCH_SHARDING_NAMES.get(plan_name, plan_name)
    try:
        from torch.distributed.fsdp import ShardingStrategy
    except ImportError:  # pragma: no cover - torch without distributed
        from fullshard.config import ShardingStrategy  # type: ignore[assignment]
    return ShardingStrategy[name]


def torch_cpu_offload(value: object) -> Any:
    """What `strategy.cpu_offload` reports: the user's object when it is a `CPUOffload` (torch's
    or ours), else torch's `CPUOffload(offload_params=bool(value))` (Lightning's rule)."""
    if hasattr(value, "offload_params") and not isinstance(value, bool):
        return value
    try:
        from torch.distributed.fsdp import CPUOffload
    except ImportError:  # pragma: no cover - torch without distributed
        from fullshard.config import CPUOffload  # type: ignore[assignment]
    return CPUOffload(offload_params=bool(value))


def torch_mixed_precision(param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                          buffer_dtype: torch.dtype) -> Any:
    """torch's `MixedPrecision` with these dtypes and torch's defaults for the rest: what
    Lightning's `FSDPPrecision.mixed_precision_config` returns for a precision string."""
    try:
        from torch.distributed.fsdp import MixedPrecision
    except ImportError:  # pragma: no cover - torch without distributed
        from fullshard.config import MixedPrecision  # type: ignore[assignment]
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                          buffer_dtype=buffer_dtype)


def check_mesh_or_group(process_group: object, device_mesh: object) -> None:
    """torch FSDP's `process_group` and `device_mesh` both say which ranks shard: one only."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            f"The arguments `FSDPStrategy(process_group=..., device_mesh=...)` are mutually "
            f"exclusive (got process_group={process_group!r} and device_mesh="
            f"{device_mesh!r}). Pass only one of them; fullshard takes the (replicate, "
            f"shard) layout from device_mesh."
        )


# -- gradient clipping arguments ---------------------------------------------------------------
def _positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive number (int or float), got "
            f"{type(value).__name__} {value!r}"
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def check_max_norm(max_norm: object) -> float:
    """`clip_gradients(max_norm=...)`: a finite number > 0 (a negative one would flip every
    gradient, NaN would make them all NaN)."""
    return _positive_number("clip_gradients(max_norm=...)", max_norm)


def check_clip_val(clip_val: object) -> float:
    """`clip_gradients(clip_val=...)`: a finite number > 0."""
    return _positive_number("clip_gradients(clip_val=...)", clip_val)


def check_norm_type(norm_type: object) -> float:
    """`clip_gradients(norm_type=...)`: a p-norm order p >= 0 (0 counts non-zeros), or inf
    (also spelled 'inf')."""
    if isinstance(norm_type, str) and norm_type.strip().lower() in ("inf", "+inf"):
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise ValueError(
            f"clip_gradients(norm_type={norm_type!r}) is not supported: pass a number p >= 0 "
            f"(the p-norm of the gradients, 2.0 by default) or float('inf') / 'inf' (the "
            f"largest absolute value)."
        )
    value = float(norm_type)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"clip_gradients(norm_type={norm_type!r}) must be a number >= 0 or inf."
        )
    return value


def check_optimizers(optimizers: Sequence[object], what: str) -> None:
    """Each must be a `torch.optim.Optimizer` (a string or a class is a mistake to name)."""
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, Optimizer):
            hint = (" (a class: instantiate it on the model's parameters)"
                    if isinstance(opt, type) else "")
            raise TypeError(
                f"fabric.{what}(...) got {type(opt).__name__} {opt!r:.60} as optimizer "
                f"{i + 1}{hint}; optimizers must be torch.optim.Optimizer instances built on "
                f"the model's parameters, e.g. torch.optim.AdamW(model.parameters())."
            )


def check_raw_path(path: str | os.PathLike) -> None:
    """Loading into a bare module (`load_raw`): a file, or a sharded checkpoint directory."""
    from fullshard.checkpoint.sharded import is_checkpoint_dir

    p = Path(os.fspath(path))
    if p.is_dir() and not is_checkpoint_dir(p):
        raise ValueError(
            f"The given path must be a single file containing the full state dict (or a "
            f"sharded checkpoint directory with meta.pt): {str(p)!r} is a directory that is "
            f"not a checkpoint."
        )


def lightning_precision_name(value: object) -> str | None:
    """The precision string of a Lightning `FSDPPrecision` passed as `FSDPStrategy(precision=
    ...)`; None for any other object (Lightning's FSDP strategy takes no other plugin either)."""
    if type(value).__name__ != "FSDPPrecision":
        return None
    name = getattr(value, "precision", None)
    return name if isinstance(name, str) else None
