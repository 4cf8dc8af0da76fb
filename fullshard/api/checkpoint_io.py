"""Minimal checkpoints for `FSDPStrategy.save_checkpoint` / `load_checkpoint`.

A stand-in until the checkpoint issue brings `torch.distributed.checkpoint` (resharding to
another world size); the on-disk contracts below are what that work keeps or converts.

- **full** (`state_dict_type='full'`): one `torch.save` file written by rank 0:
  `{model_key: {fqn: unsharded tensor}, optimizer_key: {"state": {fqn: {...}},
  "param_groups": [{..., "params": [fqn, ...]}]}, other keys: value or state_dict()}`.
  Optimizer state tensors shaped like the parameter's shard are gathered like the parameter
  (so they come out unsharded); others (Adam's `step`) are kept as they are. It loads into a
  plain `nn.Module` too (`torch.load(path)["model"]`).
- **sharded** (`state_dict_type='sharded'`): a directory with `rank{r}.pt` (this rank's
  `model.state_dict()` shards and `optimizer.state_dict()`) and `meta.pt` (world size, mesh
  shape and everything that is not a model or optimizer). Loading needs the same world size
  and mesh.

Both are written under a temporary name and renamed into place when complete. Loading detects
the format from the path. Objects with `state_dict`/`load_state_dict` (schedulers, ...) are
saved as their state dict and restored in place by both formats; plain values are copied into
the caller's `state` dict.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from fullshard.distributed import comm
from fullshard.engine.full_state import full_state_dict, load_full_state_dict
from fullshard.engine.layout import owned_rows
from fullshard.engine.module import FullyShardedModule

if TYPE_CHECKING:
    from fullshard.api.strategy import FSDPStrategy

FORMAT = "fullshard-sharded-v0"
_Filter = dict[str, Callable[[str, Any], bool]]


def _world() -> comm.Group:
    return comm.Group.from_process_group(None)


def _the_model(state: dict[str, Any], doing: str) -> tuple[str, nn.Module]:
    found = [(k, v) for k, v in state.items() if isinstance(v, FullyShardedModule)]
    if not found:
        raise ValueError(
            f"{doing}: could not find a model set up by FSDPStrategy in the state. Put it in "
            f"like so: state={{'model': model, 'optimizer': optimizer, ...}}, after "
            f"fabric.setup(...)."
        )
    if len(found) > 1:
        raise ValueError(
            f"{doing}: found {len(found)} sharded models ({', '.join(k for k, _ in found)}); "
            f"a checkpoint holds one. Save them to separate paths."
        )
    return found[0]  # type: ignore[return-value]


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _sharded_params(model: nn.Module) -> dict[int, Any]:
    runtime = model.fullshard_runtime  # type: ignore[attr-defined]
    return {id(sp.param): sp for unit in runtime.units for sp in unit.params}


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _apply_filter(key: str, value: Any, filter: _Filter | None) -> Any:
    if filter is None or key not in filter or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if filter[key](k, v)}


# -- optimizer state: shards <-> full, keyed by parameter name --------------------------------
def _gather_rows(local: torch.Tensor, layout: Any, group: comm.Group) -> torch.Tensor:
    if "nccl" in group.backend and local.device.type != "cuda":  # CPU-offloaded state
        local = local.to(torch.device("cuda", torch.cuda.current_device()))
    padded = local.new_zeros(layout.padded_shard_shape)
    padded[: layout.local_rows].copy_(local)
    full = local.new_empty((layout.padded_numel,))
    comm.all_gather(full, padded.reshape(-1), group)
    return full[: layout.numel].view(layout.shape).cpu()


def full_optimizer_state(model: nn.Module, optimizer: Optimizer, keep: bool) -> dict[str, Any]:
    """The optimizer's state with parameter names as keys and unsharded tensors.
    Collective over the model's shard axis; returns `{}` where `keep` is False."""
    by_id = _sharded_params(model)
    group = model.fullshard_runtime.mesh.shard  # type: ignore[attr-defined]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = []
    for p in params:
        if id(p) not in by_id:
            raise ValueError(
                f"The optimizer holds a parameter of shape {tuple(p.shape)} that is not a shard "
                f"of the model being saved; save each model with its own optimizer."
            )
        names.append(by_id[id(p)].fqn)
    osd = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for index, p in enumerate(params):
        sp = by_id[id(p)]
        entry = {}
        for key, value in sorted(osd["state"].get(index, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == sp.layout.local_shape:
                value = _gather_rows(value.detach(), sp.layout, group)
            elif isinstance(value, torch.Tensor):
                value = value.detach().cpu()
            entry[key] = value
        if entry:
            state[names[index]] = entry
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups} if keep else {}


def load_full_optimizer_state(model: nn.Module, optimizer: Optimizer, full: dict) -> None:
    """Load a name-keyed (ours) or index-keyed (a plain torch save) full optimizer state."""
    by_id = _sharded_params(model)
    group = model.fullshard_runtime.mesh.shard  # type: ignore[attr-defined]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [by_id[id(p)].fqn for p in params]
    keys: list[Any] = list(names)
    if full["state"] and all(isinstance(k, int) for k in full["state"]):
        keys = list(range(len(params)))
    state = {}
    for index, (p, key) in enumerate(zip(params, keys)):
        if key not in full["state"]:
            continue
        layout = by_id[id(p)].layout
        entry = {}
        for k, v in full["state"][key].items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(layout.shape):
                rows = v.reshape(layout.dim0, *layout.rest)
                start, stop = owned_rows(layout.dim0, group.size, group.rank)
                v = rows[start:stop].to(p.device).clone()
            entry[k] = v
        state[index] = entry
    saved_groups = full["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}."
        )
    groups, start = [], 0
    for saved, current in zip(saved_groups, optimizer.param_groups):
        n = len(current["params"])
        groups.append({**saved, "params": list(range(start, start + n))})
        start += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- save ---------------------------------------------------------------------------------
def save(
    strategy: FSDPStrategy,
    path: str | os.PathLike,
    state: dict[str, Any],
    state_dict_type: str,
    filter: _Filter | None,
) -> None:
    model_key, model = _the_model(state, "save_checkpoint")
    if filter is not None and state_dict_type == "sharded":
        raise NotImplementedError(
            "A filter is only supported with state_dict_type='full'; sharded checkpoints "
            "always hold the complete state."
        )
    path = Path(strategy.broadcast(os.fspath(path)))
    world = _world()
    rank0 = world.rank == 0
    if state_dict_type == "full":
        if path.is_dir() and not (path / "meta.pt").is_file():
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        out: dict[str, Any] = {}
        for key, obj in state.items():
            if obj is model:
                value: Any = full_state_dict(model, rank0_only=True, cpu_offload=True)
            elif isinstance(obj, Optimizer):
                value = full_optimizer_state(model, obj, keep=rank0)
            elif _is_stateful(obj):
                value = obj.state_dict()
            else:
                value = obj
            out[key] = _apply_filter(key, value, filter)
        if rank0:
            if path.is_dir():
                shutil.rmtree(path)  # a sharded checkpoint being replaced by a full one
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(out, path)
        strategy.barrier()
        return

    tmp = path.with_name(f".{path.name}.tmp")
    if rank0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    strategy.barrier()
    local: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, obj in state.items():
        if obj is model:
            local[key] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                          for k, v in model.state_dict().items()}
        elif isinstance(obj, Optimizer):
            local[key] = obj.state_dict()
        elif _is_stateful(obj):
            meta[key] = obj.state_dict()
        else:
            meta[key] = obj
    torch.save(local, tmp / f"rank{world.rank}.pt")
    if rank0:
        mesh = model.fullshard_runtime.mesh  # type: ignore[attr-defined]
        torch.save(
            {"format": FORMAT, "world_size": world.size, "mesh": mesh.shape,
             "model_key": model_key, "sharded_keys": sorted(local), "state": meta},
            tmp / "meta.pt",
        )
    strategy.barrier()
    if rank0:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
    strategy.barrier()


# -- load ---------------------------------------------------------------------------------
def _restore(state: dict[str, Any], key: str, value: Any) -> None:
    target = state[key]
    if _is_stateful(target) and not isinstance(target, nn.Module | Optimizer):
        target.load_state_dict(value)
    else:
        state[key] = value


def _missing_key(key: str) -> KeyError:
    return KeyError(
        f"The requested state contains a key {key!r} that does not exist in the loaded "
        f"checkpoint. To disable strict loading, set `strict=False`."
    )


def load(
    strategy: FSDPStrategy,
    path: str | os.PathLike,
    state: dict[str, Any] | nn.Module | None,
    strict: bool,
) -> dict[str, Any]:
    if not state:
        raise ValueError(
            "load_checkpoint(..., state=None) needs a state with at least the model to load "
            "into: state={'model': model, 'optimizer': optimizer, ...}."
        )
    path = Path(strategy.broadcast(os.fspath(path)))
    if isinstance(state, nn.Module):
        if not path.is_file():
            raise ValueError(
                f"Loading directly into a model needs a single file with the full state dict "
                f"(state_dict_type='full'): {path}"
            )
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        sd = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else ckpt
        _load_model(state, sd, strict)
        return {}
    model_key, model = _the_model(state, "load_checkpoint")
    if path.is_dir() and (path / "meta.pt").is_file():
        return _load_sharded(strategy, path, state, model_key, model, strict)
    if path.is_file():
        return _load_full(path, state, model_key, model, strict)
    raise ValueError(
        f"The path {str(path)!r} does not point to a valid checkpoint: expected a directory "
        f"with meta.pt (sharded) or a single file (full)."
    )


def _load_model(model: nn.Module, sd: dict[str, Any], strict: bool) -> None:
    if isinstance(model, FullyShardedModule):
        load_full_state_dict(model, sd, strict=strict)
    else:
        model.load_state_dict(sd, strict=strict)


def _load_full(
    path: Path, state: dict[str, Any], model_key: str, model: nn.Module, strict: bool
) -> dict[str, Any]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if model_key not in ckpt:
        raise _missing_key(model_key)
    _load_model(model, ckpt.pop(model_key), strict)
    for key, obj in state.items():
        if obj is model:
            continue
        if key not in ckpt:
            if strict:
                raise _missing_key(key)
            continue
        value = ckpt.pop(key)
        if isinstance(obj, Optimizer):
            load_full_optimizer_state(model, obj, value)
        else:
            _restore(state, key, value)
    return ckpt


def _load_sharded(
    strategy: FSDPStrategy,
    path: Path,
    state: dict[str, Any],
    model_key: str,
    model: nn.Module,
    strict: bool,
) -> dict[str, Any]:
    meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
    world = _world()
    mesh = model.fullshard_runtime.mesh  # type: ignore[attr-defined]
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fullshard sharded checkpoint (meta.pt format "
                         f"{meta.get('format')!r}).")
    if meta["world_size"] != world.size or tuple(meta["mesh"]) != tuple(mesh.shape):
        raise ValueError(
            f"The sharded checkpoint {path} was saved by {meta['world_size']} ranks with mesh "
            f"{tuple(meta['mesh'])}; this job has {world.size} ranks with mesh "
            f"{tuple(mesh.shape)}. Sharded checkpoints load into the same world size and "
            f"mesh; save with state_dict_type='full' to change them."
        )
    local = torch.load(path / f"rank{world.rank}.pt", map_location="cpu", weights_only=False)
    if model_key not in local:
        raise _missing_key(model_key)
    model.load_state_dict(local.pop(model_key), strict=strict)
    rest = dict(meta["state"])
    for key, obj in state.items():
        if obj is model:
            continue
        if isinstance(obj, Optimizer):
            if key not in local:
                if strict:
                    raise _missing_key(key)
                continue
            obj.load_state_dict(local.pop(key))
            continue
        if key not in rest:
            if strict:
                raise _missing_key(key)
            continue
        _restore(state, key, rest.pop(key))
    return rest
