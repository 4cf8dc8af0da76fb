"""Full (unsharded) state dicts of a wrapped model, gathered or loaded one parameter at a time.

`full_state_dict` gathers each parameter over the shard axis in turn (moving it to CPU as it
arrives when asked), so at most one full parameter is in flight besides what the caller
keeps -- with `rank0_only` the other ranks keep nothing.
`load_full_state_dict` does the reverse without communication: every rank copies its own
rows out of the full tensors (which may be memory-mapped, so only those rows are read).

`gather_rows` and `own_rows` are the two halves of that, for any tensor laid out like a
parameter's local shard; `fullshard.checkpoint` uses them for optimizer state too, so the
engine's full state dict and the full checkpoint format share one implementation.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from fullshard.config import check_bool
from fullshard.distributed import comm
from fullshard.engine.dtensor_state import is_dtensor, local_state_dict
from fullshard.engine.layout import ShardLayout
from fullshard.engine.runtime_lookup import runtime_of
from fullshard.engine.sharded_param import ShardedParam, params_by_module
from fullshard.engine.unit import Unit


def _params_by_id(model: nn.Module) -> dict[int, ShardedParam]:
    runtime = runtime_of(model)
    return {id(p.param): p for u in runtime.units for p in u.params}


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, cpu_offload: bool | None = None, rank0_only: bool = False
) -> dict[str, torch.Tensor]:
    """The model's state dict with unsharded parameters under their original names and shapes.

    Collective: every rank must call it. `cpu_offload` (default: the model's
    `move_state_dict_to_cpu`) moves each tensor to CPU as soon as it is gathered;
    `rank0_only` returns an empty dict on every rank but global rank 0.
    """
    check_bool("cpu_offload", cpu_offload, optional=True)  # a string would count as True
    check_bool("rank0_only", rank0_only)
    runtime = runtime_of(model)
    if cpu_offload is None:
        cpu_offload = runtime.move_state_dict_to_cpu
    by_id = _params_by_id(model)
    keep = not rank0_only or runtime.mesh.world.rank == 0
    out: dict[str, torch.Tensor] = {}
    # Full tensors by parameter, for a tied parameter's second name. Ranks that keep nothing
    # store nothing here either (but still join every gather exactly once per parameter).
    gathered: dict[int, torch.Tensor | None] = {}
    for key, value in local_state_dict(model, keep_vars=True).items():
        sp = by_id.get(id(value))
        if sp is None:
            tensor = value.detach() if isinstance(value, torch.Tensor) else value
        elif id(value) in gathered:  # a tied parameter under a second name
            tensor = gathered[id(value)]
        else:
            tensor = gather_rows(sp.param.detach(), sp.layout, runtime.mesh.shard)
            gathered[id(value)] = tensor if keep else None
        if not keep:
            continue
        if isinstance(tensor, torch.Tensor) and cpu_offload:
            tensor = tensor.cpu()
            if sp is not None:
                gathered[id(value)] = tensor  # the tie's second name reuses the CPU copy
        out[key] = tensor
    return out


@torch.no_grad()
def gather_rows(local: torch.Tensor, layout: ShardLayout, group: comm.Group) -> torch.Tensor:
    """The unsharded tensor (shape `layout.shape`) whose rows `layout` spreads over `group`,
    given this rank's real rows `local` (shape `layout.local_shape`: a parameter's shard, or
    optimizer state shaped like it). Collective over `group`; a new tensor on every rank.

    On NCCL a host-resident `local` (CPU offload) is gathered on the current CUDA device.
    """
    if "nccl" in group.backend and local.device.type != "cuda":
        local = local.to(torch.device("cuda", torch.cuda.current_device()))
    padded = local.new_zeros(layout.padded_shard_shape)
    padded[: layout.local_rows].copy_(local)
    full = local.new_empty((layout.padded_numel,))
    comm.all_gather(full, padded.reshape(-1), group)
    return full[: layout.numel].view(layout.shape).clone()


def own_rows(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The rows of the unsharded `full` that this rank owns (a view, shape
    `layout.local_shape`); on a memory-mapped tensor only those rows are ever read."""
    start, stop = layout.owned
    return full.reshape(layout.dim0, *layout.rest)[start:stop]


def _check_state_dict(state_dict: object) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_full_state_dict(model, state_dict): state_dict must be a dict of parameter "
            f"and buffer names to tensors (e.g. torch.load(path)['model']); got "
            f"{type(state_dict).__name__}: {state_dict!r:.80}"
        )
    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise TypeError(
                f"load_full_state_dict(model, state_dict): state_dict's keys must be names "
                f"(str); got the key {k!r:.60} ({type(k).__name__})."
            )
        if not isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
            raise TypeError(
                f"load_full_state_dict(model, state_dict): state_dict[{k!r}] must be a tensor; "
                f"got {type(v).__name__}: {v!r:.60}"
            )


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load an unsharded state dict into a wrapped model: each rank copies its own rows.

    It is `model.load_state_dict(state_dict, strict=False)` (which accepts full tensors on a
    wrapped model, see `register_sharded_loading`), so the modules' own
    `_load_from_state_dict` overrides and load pre-/post-hooks run and may remap keys, as they
    would on the unwrapped model. Returns `(missing_keys, unexpected_keys)` after that
    remapping; with `strict=True` either being non-empty is a `ValueError` naming them, raised
    once the matching keys are loaded (as torch's `load_state_dict` does). A shape mismatch is
    always a `ValueError` naming the key. Anything but a mapping of names to tensors is a
    `TypeError` naming the argument.
    """
    check_bool("strict", strict)
    _check_state_dict(state_dict)
    runtime = runtime_of(model)
    runtime.release_all()
    sharded = set(_params_by_id(model))  # ids of the sharded parameters
    # Parameters the engine does not shard (ignored ones) and buffers: torch would report a
    # wrong shape only after loading everything else, as a RuntimeError; name it first.
    for key, target in local_state_dict(model, keep_vars=True).items():
        value = state_dict.get(key)
        if (
            isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor)
            and id(target) not in sharded and tuple(value.shape) != tuple(target.shape)
        ):
            raise ValueError(
                f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the "
                f"state dict but {tuple(target.shape)} in the model."
            )
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(
            f"load_full_state_dict: the state dict does not match the model. Missing keys: "
            f"{missing or 'none'}; unexpected keys: {unexpected or 'none'}. Pass strict=False "
            f"to load the matching keys only."
        )
    return list(missing), list(unexpected)


def register_sharded_loading(units: Iterable[Unit]) -> None:
    """Let `load_state_dict` on the wrapped model take full (unsharded) tensors, as torch
    FSDP's full state dicts and Lightning do, and `DTensor`s (what `state_dict()` gives, what
    `torch.distributed.checkpoint` loads into), besides this rank's rows as plain tensors.

    One load pre-hook per module that holds sharded parameters turns a full tensor into this
    rank's rows (a view: torch's copy into the shard reads only those rows, also from a
    memory-mapped file). It is a pre-hook of the module that owns the parameter, so it runs
    after that module's own `_load_from_state_dict` override has remapped the keys (litgpt's
    LoRA and adapter models map `attn.qkv.weight` to `attn.qkv.linear.weight` this way), and
    after any pre-hook the module registered before it was wrapped.
    """
    for module, params in params_by_module(sp for unit in units for sp in unit.params).items():
        module.register_load_state_dict_pre_hook(functools.partial(_load_own_rows, params))


def _load_own_rows(params: dict[str, ShardedParam], module: nn.Module, state_dict: dict,
                   prefix: str, *_: object) -> None:
    # `state_dict` is torch's copy for this module: rewriting it leaves the caller's alone.
    for name, sp in params.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor):
            state_dict[key] = _as_own_rows(key, value, sp.layout)


def _as_own_rows(key: str, value: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    if is_dtensor(value):
        if tuple(value.shape) != tuple(layout.shape):
            _raise_shape(key, value, layout)
        local = _local_rows_of(value, layout)
        if local is not None:
            return local
        # Another placement or mesh: the full tensor (collective: every rank loads the same
        # keys in the same order), then this rank's rows of it.
        return own_rows(value.full_tensor(), layout)
    if tuple(value.shape) == tuple(layout.shape):
        return own_rows(value, layout)
    if tuple(value.shape) == tuple(layout.local_shape):
        return value  # this rank's rows as a plain tensor (`local_state_dict(model)`)
    _raise_shape(key, value, layout)


def _local_rows_of(value: Any, layout: ShardLayout) -> torch.Tensor | None:
    """The DTensor's local tensor when it is exactly this rank's rows (the placements
    `state_dict()` gives, on a mesh whose sharded axis is our shard group's size and
    position); None otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    if len(layout.shape) == 0:
        return None  # 0-dim: Partial on the shard axis (dtensor_state.py)
    mesh, placements = value.device_mesh, value.placements
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if any(p != Replicate() for i, p in enumerate(placements) if i not in sharded):
        return None
    if not sharded:
        return value.to_local() if layout.shard_size == 1 else None
    coordinate = mesh.get_coordinate()
    if (len(sharded) == 1 and coordinate is not None
            and mesh.size(sharded[0]) == layout.shard_size
            and coordinate[sharded[0]] == layout.shard_rank):
        return value.to_local()
    return None


def _raise_shape(key: str, value: torch.Tensor, layout: ShardLayout) -> NoReturn:
    start, stop = layout.owned
    raise ValueError(
        f"load_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict but the "
        f"model's parameter is {tuple(layout.shape)} (unsharded; this rank holds rows "
        f"{start}:{stop}, shape {tuple(layout.local_shape)}). Pass the full tensor or this "
        f"rank's rows of it."
    )
