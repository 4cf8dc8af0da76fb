"""The sharded checkpoint format: a `torch.distributed.checkpoint` (DCP) directory + `meta.pt`.

    ckpt/
      .metadata          DCP's index: every tensor's global shape and where its chunks are
      __0_0.distcp ...   one file per rank that had something to write
      meta.pt            rank 0: format, file sizes, module/optimizer descriptions, and the
                         rest of `state` (step counters, scheduler state, RNG state, values)

DCP keys are `"{model_key}.{name}"` and `"{optimizer_key}.state.{param name}.{state key}"`
(Lightning's layout). A parameter -- and optimizer state laid out like it -- is described to
DCP as a DTensor `Shard(0)` over the module's shard-axis mesh whose local tensor is this
rank's unpadded rows (DTensor's `Shard(0)` follows `torch.chunk`, exactly our layout, a rank
may own zero rows). These DTensors are views built only here, at save and load time: the
engine never sees them. DCP stores every chunk with its global offset, so loading reads
whatever rows this rank owns *now* -- another world size, another strategy (HYBRID, NO_SHARD),
or a plain module in a process without any process group (the trivial one-rank layout).

Saved with rows shape `(dim0, *rest)`: a 0-dim parameter is stored as one row (`meta.pt` keeps
the real shapes). Under HYBRID every replica holds the same shards: DCP's planner keeps one
copy of each chunk (the lowest rank's), so nothing is written twice; whole tensors (buffers,
Adam's `step`) are written once, by the lowest rank holding them (global rank 0's values).

A tied parameter is stored once, under its first name; `meta.pt` lists the other names.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard.checkpoint import objects
from fullshard.checkpoint.objects import Filter, ParamInfo
from fullshard.distributed import comm

FORMAT = "fullshard-sharded-v1"
META = "meta.pt"
DCP_METADATA = ".metadata"

ROWS, TENSOR = "rows", "tensor"


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, truncated or corrupt (the message names the file)."""


# -- DTensor views ---------------------------------------------------------------------------
_MESHES: dict[tuple[Any, ...], Any] = {}


def _mesh(group: comm.Group) -> Any:
    """A 1-D DeviceMesh over the shard-axis group (cached within one save or load)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    pg = group.pg if group.pg is not None else dist.group.WORLD
    key = (group.ranks, id(pg), id(dist.group.WORLD))  # a new default group: new meshes
    if key not in _MESHES:
        device_type = "cuda" if "nccl" in group.backend else "cpu"
        _MESHES[key] = DeviceMesh.from_group(pg, device_type)
    return _MESHES[key]


def as_saved(rows: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    """How DCP sees this rank's rows of a parameter-shaped tensor: a DTensor `Shard(0)` of the
    global rows shape when sharded, else the (whole) tensor itself."""
    if info.group is None:
        return rows
    from torch.distributed.tensor import DTensor, Shard

    shape = info.rows_shape
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        rows, _mesh(info.group), [Shard(0)], run_check=False, shape=shape, stride=stride
    )


# -- save -----------------------------------------------------------------------------------
def plan(state: Mapping[str, Any], filter: Filter | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(flat, meta)`: the DCP state dict of this rank's tensors (views, no copies) and the
    description that goes into `meta.pt` (everything but the tensors). No communication."""
    modules = objects.split_state(state)[objects.MODULE]
    flat: dict[str, Any] = {}
    meta: dict[str, Any] = {
        "format": FORMAT, "torch": torch.__version__, "order": list(state),
        "modules": {}, "optimizers": {}, "state": {},
    }
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if kind == objects.MODULE:
            meta["modules"][key] = _plan_module(key, obj, filter, flat)
        elif kind == objects.OPTIMIZER:
            meta["optimizers"][key] = _plan_optimizer(key, obj, modules, filter, flat)
        elif kind == objects.STATEFUL:
            meta["state"][key] = objects.apply_filter(key, obj.state_dict(), filter)
        else:
            meta["state"][key] = objects.apply_filter(key, obj, filter)
    return flat, meta


def _plan_module(key: str, module: nn.Module, filter: Filter | None,
                 flat: dict[str, Any]) -> dict[str, Any]:
    by_id = {id(info.param): info for info in objects.module_params(module).values()}
    sd = objects.apply_filter(key, module.state_dict(keep_vars=True), filter)
    first: dict[int, str] = {}
    desc: dict[str, Any] = {"keys": list(sd), "aliases": {}, "shapes": {}, "extra": {}}
    for name, value in sd.items():
        if not isinstance(value, torch.Tensor):
            desc["extra"][name] = value
            continue
        if id(value) in first:  # a tied parameter's second name
            desc["aliases"][name] = first[id(value)]
            continue
        first[id(value)] = name
        info = by_id.get(id(value))
        if info is not None:
            flat[f"{key}.{name}"] = as_saved(info.local_rows(value.detach()), info)
            desc["shapes"][name] = tuple(info.shape)
        else:  # a buffer: whole on every rank
            flat[f"{key}.{name}"] = value.detach()
            desc["shapes"][name] = tuple(value.shape)
    return desc


def _plan_optimizer(key: str, optimizer: Any, modules: Mapping[str, nn.Module],
                    filter: Filter | None, flat: dict[str, Any]) -> dict[str, Any]:
    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    osd = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for index, name in enumerate(names):
        info = infos[name]
        shapes[name] = tuple(info.shape)  # what `rows` entries are, unsharded
        entry: dict[str, Any] = {}
        for k, v in osd["state"].get(index, {}).items():
            dkey = f"{key}.state.{name}.{k}"
            if objects.is_rows(v, info.param, k):
                tensors[dkey] = as_saved(info.local_rows(v.detach()), info)
                entry[k] = ROWS
            elif isinstance(v, torch.Tensor):
                tensors[dkey] = v.detach()
                entry[k] = TENSOR
            else:
                entry[k] = ("value", v)
        if entry:
            state[name] = entry
    kept = objects.apply_filter(
        key, {"state": state, "param_groups": objects.optimizer_groups(osd["param_groups"],
                                                                       names)}, filter)
    if "state" in kept:
        flat.update(tensors)
    return {"module": mkey, "shapes": shapes, **kept}


def signature(meta: Mapping[str, Any]) -> Any:
    """What every rank's `plan` must agree on (names, shapes, kinds -- not values)."""
    mods = {k: (tuple(d["keys"]), tuple(sorted(d["shapes"].items())))
            for k, d in meta["modules"].items()}
    opts = {k: tuple(sorted((n, tuple(sorted((s, v if isinstance(v, str) else "value")
                                              for s, v in e.items())))
                            for n, e in d.get("state", {}).items()))
            for k, d in meta["optimizers"].items()}
    return (tuple(meta["order"]), mods, opts)


def write(tmp: Path, flat: dict[str, Any], group: comm.Group | None) -> None:
    """DCP-save `flat` into the directory `tmp` (collective: every rank of the default group;
    each rank writes and fsyncs its own file, rank 0 the `.metadata` index)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    _dcp_call(lambda: dcp.save(flat, storage_writer=writer, planner=planner,
                               no_dist=group is None), f"writing {str(tmp)!r}")


def finish_meta(tmp: Path, meta: dict[str, Any]) -> None:
    """Record the size of every file DCP wrote and write `meta.pt` (rank 0, after DCP)."""
    from fullshard.checkpoint.atomic import fsync_file, save_file

    fsync_file(tmp / DCP_METADATA)  # DCP fsyncs the shard files, not necessarily its index
    meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    save_file(meta, tmp / META)


# -- load -----------------------------------------------------------------------------------
def read_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """`meta.pt`, checked: readable, ours, and every file it lists present with its size."""
    file = path / META
    try:
        meta = torch.load(file, map_location="cpu", weights_only=bool(weights_only))
    except FileNotFoundError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} cannot be read ({type(e).__name__}: {e}); it is truncated or "
            f"corrupt, so the checkpoint {str(path)!r} cannot be loaded."
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{str(file)!r} is not the meta.pt of a fullshard sharded checkpoint (format "
            f"{found!r}, expected {FORMAT!r})."
        )
    for name, size in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(
                f"The sharded checkpoint {str(path)!r} is missing its file {str(f)!r} "
                f"({size} bytes when saved); it cannot be loaded."
            )
        found_size = f.stat().st_size
        if found_size != size:
            raise CheckpointError(
                f"The checkpoint file {str(f)!r} has {found_size} bytes but {size} were "
                f"written; it is truncated or was replaced, so {str(path)!r} cannot be loaded."
            )
    return meta


def read_index(path: Path) -> Any:
    """DCP's `.metadata` (global shapes and dtypes of everything saved)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"{str(path / DCP_METADATA)!r} cannot be read ({type(e).__name__}: {e}); the "
            f"checkpoint {str(path)!r} is incomplete or corrupt."
        ) from e


def read(path: Path, flat: dict[str, Any], group: comm.Group | None) -> None:
    """DCP-load into the tensors of `flat` in place (collective over the default group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not flat and group is None:
        return
    reader = FileSystemReader(path)
    _dcp_call(lambda: dcp.load(flat, storage_reader=reader, planner=DefaultLoadPlanner(),
                               no_dist=group is None), f"reading {str(path)!r}")


def _dcp_call(fn: Callable[[], Any], what: str) -> Any:
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to save in a single
        # process": exactly our intent without a process group.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            return fn()
        except CheckpointException as e:  # a BaseException: `except Exception` misses it
            raise CheckpointError(f"torch.distributed.checkpoint failed {what}: {e}") from None
        finally:
            # A cached DeviceMesh keeps its process group alive past destroy_process_group();
            # gloo then tears the group down during interpreter exit, where its threads abort
            # the process ("terminate called without an active exception"). Keep meshes only
            # for the duration of one save or load.
            _MESHES.clear()


def load(path: Path, meta: dict[str, Any], state: dict[str, Any], strict: bool,
         group: comm.Group | None) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint at `path` (collective when `group`);
    return the entries of `meta.pt`'s state that `state` did not ask for."""
    index = read_index(path)
    parts = objects.split_state(state)
    held = {**{k: objects.MODULE for k in meta["modules"]},
            **{k: objects.OPTIMIZER for k in meta["optimizers"]}}
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if key not in held and key not in meta["state"]:
            if strict:
                raise objects.missing_key(key, path)
        elif kind in (objects.MODULE, objects.OPTIMIZER) and held.get(key) != kind:
            raise TypeError(
                f"state[{key!r}] is {'a module' if kind == objects.MODULE else 'an optimizer'} "
                f"but the checkpoint {str(path)!r} saved {key!r} as "
                f"{'an optimizer' if held.get(key) == objects.OPTIMIZER else 'a value'}; "
                f"use the key it was saved under."
            )
    modules = parts[objects.MODULE]
    finish: list[Callable[[], None]] = []
    flat: dict[str, Any] = {}
    for key, module in modules.items():
        if key in meta["modules"]:
            _request_module(key, module, meta["modules"][key], index, strict, flat, finish)
    for key, opt in parts[objects.OPTIMIZER].items():
        if key in meta["optimizers"]:
            _request_optimizer(key, opt, meta["optimizers"][key], modules, index, strict, flat,
                               finish)
    read(path, flat, group)
    for step in finish:
        step()
    rest = dict(meta["state"])
    for key in list(parts[objects.STATEFUL]) + list(parts[objects.VALUE]):
        if key in rest:
            objects.restore(state, key, rest.pop(key))
    return rest


def _request_module(key: str, module: nn.Module, desc: dict[str, Any], index: Any,
                    strict: bool, flat: dict[str, Any], finish: list[Callable[[], None]]) -> None:
    from fullshard.checkpoint.full import report_mismatch

    if objects.is_sharded(module):
        module.fullshard_runtime.release_all()  # type: ignore[attr-defined]
    by_id = {id(info.param): info for info in objects.module_params(module).values()}
    own = module.state_dict(keep_vars=True)
    saved = set(desc["keys"])
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in desc["keys"] if k not in own]
    if strict and (missing or unexpected):
        raise ValueError(
            f"The checkpoint's {key!r} does not match the module being loaded. Missing keys: "
            f"{missing or 'none'}; unexpected keys: {unexpected or 'none'}. Pass strict=False "
            f"to load the matching keys only."
        )
    report_mismatch(key, missing, unexpected)
    taken: dict[int, str] = {}
    for name, target in own.items():
        if name not in saved or not isinstance(target, torch.Tensor):
            continue
        if id(target) in taken:  # tied here too: loaded under its first name
            continue
        taken[id(target)] = name
        source = desc["aliases"].get(name, name)
        dkey = f"{key}.{source}"
        info = by_id.get(id(target))
        shape = tuple(info.shape) if info is not None else tuple(target.shape)
        if tuple(desc["shapes"][source]) != shape:
            raise ValueError(
                f"{key}.{name} has shape {tuple(desc['shapes'][source])} in the checkpoint but "
                f"{shape} in the module being loaded (unsharded). Build the same model as when "
                f"saving."
            )
        if info is not None:
            view = info.local_rows(target.detach())  # load in place into the shard
            tensor = as_saved(view, info)
        else:
            view = tensor = target.detach()
        if dkey in flat:  # tied in the checkpoint, two tensors here: copy after the load
            first = flat[dkey]
            finish.append(lambda v=view, f=first: v.copy_(_local(f).reshape(v.shape)))
            continue
        flat[dkey] = tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _request_optimizer(key: str, optimizer: Any, desc: dict[str, Any],
                       modules: Mapping[str, nn.Module], index: Any, strict: bool,
                       flat: dict[str, Any], finish: list[Callable[[], None]]) -> None:
    from fullshard.checkpoint.full import report_mismatch

    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    saved_state = desc.get("state", {})
    unknown = sorted(set(saved_state) - set(names))
    if unknown:
        if strict:
            raise ValueError(
                f"The checkpoint's optimizer {key!r} has state for parameters the optimizer "
                f"being loaded does not hold: {unknown[:5]}. Pass strict=False to ignore them."
            )
        report_mismatch(key, [], unknown)
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        info = infos[name]
        entry: dict[str, Any] = {}
        for k, kind in saved_state.get(name, {}).items():
            dkey = f"{key}.state.{name}.{k}"
            if not isinstance(kind, str):
                entry[k] = kind[1]
                continue
            md = index.state_dict_metadata[dkey]
            dtype = md.properties.dtype
            if kind == ROWS:
                if tuple(md.size) != tuple(info.rows_shape):
                    raise ValueError(
                        f"The optimizer state {dkey!r} has shape {tuple(md.size)} in the "
                        f"checkpoint but its parameter is {tuple(info.rows_shape)}; build the "
                        f"same model as when saving."
                    )
                local = torch.empty(info.layout.local_shape, dtype=dtype,
                                    device=info.param.device)
                flat[dkey] = as_saved(local, info)
                entry[k] = local.view(info.param.shape)
            else:
                local = torch.empty(tuple(md.size), dtype=dtype)
                flat[dkey] = local
                entry[k] = local
        if entry:
            state[i] = entry
    groups = objects.groups_to_load(list(desc.get("param_groups", [])), optimizer, names, key,
                                    strict) if "param_groups" in desc else None

    def load() -> None:
        if groups is None:  # filtered out when saving: keep the optimizer's own groups
            current = optimizer.state_dict()["param_groups"]
            optimizer.load_state_dict({"state": state, "param_groups": current})
        else:
            optimizer.load_state_dict({"state": state, "param_groups": groups})

    finish.append(load)


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file()


def describe_dir(path: Path) -> str:
    """Why a directory is not a loadable sharded checkpoint."""
    names = sorted(os.listdir(path))
    if DCP_METADATA in names or any(n.endswith(".distcp") for n in names):
        return (f"it holds DCP files but no {META} (an incomplete save or a plain "
                f"torch.distributed.checkpoint directory)")
    return f"it has no {META} (files: {names[:6] or 'none'})"
