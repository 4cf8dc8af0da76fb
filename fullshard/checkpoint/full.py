"""The full checkpoint format: one `torch.save` file, written by global rank 0.

Contents (what Lightning's FSDP full checkpoints hold, so files move between the two):

    {model_key: {name: unsharded tensor},                 # original names and shapes
     optimizer_key: {"state": {param name: {"exp_avg": unsharded tensor, "step": ..., ...}},
                     "param_groups": [{"lr": ..., "params": [param name, ...]}, ...]},
     other keys: plain value, or obj.state_dict() for a stateful object}

The model part is `fullshard.full_state_dict` itself (gathered one parameter at a time, moved
to CPU as it arrives; the other ranks keep nothing). Optimizer state laid out like its
parameter goes through the same `gather_rows` / `own_rows` as the model, so the engine's full
state dict, this format and `fullshard consolidate` share one implementation. The file loads
into an unwrapped model with plain `torch.load` (`model.load_state_dict(ckpt['model'])`).

Loading memory-maps the file (`torch.load(mmap=True)`): every rank copies only its own rows
of each tensor, so N ranks do not cost N full copies in host memory. It reads with
`weights_only=True` unless the caller opts out (`safe_load`): this format holds only tensors
and plain values, so fullshard's (and Lightning's) files always load that way. Optimizer
state keyed by index (a plain `torch.save(optimizer.state_dict())`) loads too.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from fullshard.checkpoint import objects, safe_load
from fullshard.checkpoint.errors import CheckpointError
from fullshard.checkpoint.objects import Filter
from fullshard.distributed import comm
from fullshard.engine.full_state import (
    full_state_dict,
    gather_rows,
    load_full_state_dict,
    own_rows,
)


# -- save ---------------------------------------------------------------------------------------
def local_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries that need no communication: stateful objects' state dicts, plain values.
    Computed before any collective, so a user `state_dict()` that raises on one rank fails
    the save on every rank instead of leaving the others waiting in a gather."""
    out = {}
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if kind == objects.STATEFUL:
            out[key] = obj.state_dict()
        elif kind == objects.VALUE:
            out[key] = obj
    return out


def gather(
    state: Mapping[str, Any], filter: Filter | None, keep: bool,
    local: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full checkpoint dict of `state` (collective over each module's shard axis: every
    rank calls it in the same order); an empty dict where `keep` is False. `local` holds
    `local_entries(state)` when the caller computed them already."""
    parts = objects.split_state(state)
    modules = parts[objects.MODULE]
    local = local_entries(state) if local is None else local
    out: dict[str, Any] = {}
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if kind == objects.MODULE:
            value: Any = module_state(obj, keep)
        elif kind == objects.OPTIMIZER:
            value = optimizer_state(obj, modules, key, keep)
        else:
            value = local[key]
        if keep:
            out[key] = objects.apply_filter(key, value, filter)
    return out


def module_state(module: nn.Module, keep: bool = True) -> dict[str, Any]:
    """Unsharded state dict on CPU (collective for a sharded module); `{}` unless `keep`
    (which must be true exactly on global rank 0 when the module is sharded)."""
    if objects.is_sharded(module):
        return full_state_dict(module, cpu_offload=True, rank0_only=True)
    if not keep:
        return {}
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
            for k, v in module.state_dict().items()}


def optimizer_state(
    optimizer: Optimizer, modules: Mapping[str, nn.Module], key: str, keep: bool = True
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, tensors unsharded and on CPU.
    Collective over the module's shard axis (one gather per sharded state tensor, each
    dropped at once where `keep` is False, so only rank 0 ever holds the full state)."""
    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    osd = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(names):
        info = infos[name]
        entry: dict[str, Any] = {}
        for k, v in osd["state"].get(index, {}).items():
            if objects.is_rows(v, info.param, k):
                rows = info.local_rows(v.detach())
                if info.group is not None:
                    v = gather_rows(rows, info.layout, info.group).cpu()
                else:
                    v = rows.view(info.shape).cpu()
            elif isinstance(v, torch.Tensor):
                v = v.detach().cpu()
            entry[k] = v
        if entry and keep:
            state[name] = entry
    if not keep:
        return {}
    return {"state": state, "param_groups": objects.optimizer_groups(osd["param_groups"], names)}


# -- load -----------------------------------------------------------------------------------------
def read(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint file, memory-mapped (tensors are read only where they are used), read
    without running code from it unless `weights_only=False` (see `safe_load`)."""
    try:
        ckpt = safe_load.torch_load(path, weights_only=weights_only, mmap=True,
                                    what="The full checkpoint file")
    except CheckpointError:  # unsafe, corrupt, failed checksums: the message says which
        raise
    except Exception as e:  # a truncated zip, a pickle error, ...
        text = str(e).split("Weights only load failed")[0].strip() or type(e).__name__
        raise CheckpointError(
            f"The full checkpoint file {str(path)!r} cannot be read ({type(e).__name__}: "
            f"{text[:300]}); it is truncated or corrupt. Use another checkpoint."
        ) from None
    if not isinstance(ckpt, dict):
        raise TypeError(
            f"The checkpoint file {str(path)!r} holds a {type(ckpt).__name__}, not the dict of "
            f"a checkpoint; a bare state dict loads with load_checkpoint(path, model)."
        )
    return ckpt


def load(
    ckpt: dict[str, Any], state: dict[str, Any], strict: bool, path: Path
) -> dict[str, Any]:
    """Restore every object of `state` from the full checkpoint dict `ckpt` (consumed);
    return the entries `state` did not ask for. No communication."""
    missing = [k for k in state if k not in ckpt]
    if missing and strict:
        raise objects.missing_key(missing[0], path)
    modules = objects.split_state(state)[objects.MODULE]
    for key, obj in state.items():
        if key not in ckpt:
            continue
        value = ckpt.pop(key)
        kind = objects.kind_of(obj)
        if kind == objects.MODULE:
            load_module(obj, value, strict, key)
        elif kind == objects.OPTIMIZER:
            load_optimizer(obj, value, modules, key, strict)
        else:
            objects.restore(state, key, value)
    return ckpt


def load_module(module: nn.Module, sd: Mapping[str, Any], strict: bool, key: str) -> None:
    """Load an unsharded state dict: a sharded module copies only its own rows of each tensor."""
    if not isinstance(sd, Mapping):
        raise TypeError(
            f"The checkpoint's {key!r} is a {type(sd).__name__}, not a module state dict."
        )
    if objects.is_sharded(module):
        missing, unexpected = load_full_state_dict(module, sd, strict=strict)
    else:
        result = module.load_state_dict(sd, strict=strict)
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    report_mismatch(key, missing, unexpected)


def report_mismatch(key: str, missing: list[str], unexpected: list[str]) -> None:
    """strict=False: say which keys did not match (only rank 0 says it)."""
    if (missing or unexpected) and comm_rank() == 0:
        warnings.warn(
            f"load_checkpoint(strict=False): {key!r} loaded without the keys missing from the "
            f"checkpoint ({missing or 'none'}) and ignored the checkpoint's unexpected keys "
            f"({unexpected or 'none'}).",
            stacklevel=3,
        )


def comm_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def load_optimizer(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    modules: Mapping[str, nn.Module],
    key: str,
    strict: bool,
) -> None:
    """Load a full optimizer state (keyed by name, or by index from a plain torch save):
    each rank takes its own rows of every tensor laid out like its parameter."""
    if not isinstance(saved, Mapping) or "param_groups" not in saved:
        raise TypeError(
            f"The checkpoint's {key!r} is not an optimizer state dict (a dict with 'state' and "
            f"'param_groups'); found {type(saved).__name__}."
        )
    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    saved_state = saved.get("state", {})
    by_index = bool(saved_state) and all(isinstance(k, int) for k in saved_state)
    keys: list[Any] = list(range(len(names))) if by_index else list(names)
    unknown = sorted(set(saved_state) - set(keys), key=str)
    if unknown:
        if strict:
            raise ValueError(
                f"The checkpoint's optimizer {key!r} has state for parameters the optimizer "
                f"being loaded does not hold: {unknown[:5]}. Pass strict=False to ignore them."
            )
        report_mismatch(key, [], [str(k) for k in unknown])
    state: dict[int, dict[str, Any]] = {}
    for index, (name, skey) in enumerate(zip(names, keys)):
        if skey not in saved_state:
            continue  # a parameter without state (e.g. no gradient yet)
        info = infos[name]
        entry = {}
        for k, v in saved_state[skey].items():
            if (isinstance(v, torch.Tensor) and v.shape == info.shape
                    and not (v.dim() == 0 and k == "step")):
                # Only this rank's rows are read from the memory-mapped file; clone so the
                # optimizer does not keep the mapping alive.
                v = own_rows(v, info.layout).reshape(info.param.shape).clone()
            elif isinstance(v, torch.Tensor):
                v = v.clone()
            entry[k] = v
        state[index] = entry
    groups = objects.groups_to_load(list(saved["param_groups"]), optimizer, names, key, strict)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def keep_here(group: comm.Group | None) -> bool:
    """Rank 0 keeps (and writes) the full checkpoint."""
    return group is None or group.rank == 0
