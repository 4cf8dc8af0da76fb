"""The sharded checkpoint format: Lightning Fabric's, a `torch.distributed.checkpoint` (DCP)
directory plus `meta.pt`.

    ckpt/
      .metadata          DCP's index: every item's global shape, dtype and where it lies
      __0_0.distcp ...   one file per rank that had something to write
      meta.pt            rank 0: the rest of `state` (step counters, scheduler state, RNG
                         state, values), a plain dict {key: value}

The DCP part is the nested dict `{model_key: {name: tensor}, optimizer_key: {"state": {param
name: {"exp_avg": ..., "step": ...}}, "param_groups": [{"lr": ..., "params": [param name,
...]}]}}`, which DCP flattens to keys `"model.layers.0.weight"`,
`"optimizer.state.layers.0.weight.exp_avg"`, `"optimizer.param_groups.0.lr"` and records
each key's path in its index. That is exactly what Lightning Fabric writes (FSDPStrategy and
ModelParallelStrategy), so checkpoints move both ways; every name of a tied parameter is
stored (as Lightning does), and non-tensor items (param groups) are DCP byte items.

A parameter -- and optimizer state laid out like it -- is described to DCP as a DTensor
`Shard(0)` over the module's shard-axis mesh whose local tensor is this rank's unpadded rows
(DTensor's `Shard(0)` follows `torch.chunk`, exactly our layout; a rank may own zero rows).
These DTensors are views built only here, at save and load time: the engine never sees them.
DCP stores every chunk with its global offset, so loading reads whatever rows this rank owns
*now* -- another world size, another strategy (HYBRID, NO_SHARD), or a plain module in a
process without any process group. A 0-dim parameter (one row, owned by shard-rank 0) is
stored as a whole 0-dim tensor, as Lightning stores it. Under HYBRID every replica holds the
same shards: DCP's planner keeps one copy of each chunk (the lowest rank's), so nothing is
written twice; whole tensors (buffers, Adam's `step`) are written by global rank 0.

Reading never runs code from the files by default: `meta.pt`, DCP's index and its byte items
go through `safe_load`. What a load may read -- files inside the directory, complete, matching
their checksums -- is checked first (`sharded_files`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard.checkpoint import integrity, objects, safe_load
from fullshard.checkpoint.errors import CheckpointError
from fullshard.checkpoint.objects import Filter, ParamInfo
from fullshard.checkpoint.sharded_files import DCP_METADATA, META, read_index
from fullshard.distributed import comm
from fullshard.engine.dtensor_state import local_state_dict

__all__ = ["CheckpointError"]


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


def _whole_scalar(info: ParamInfo) -> bool:
    """A 0-dim parameter: one row (on shard-rank 0), stored as a whole 0-dim tensor."""
    return len(info.shape) == 0


def as_saved(rows: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    """How DCP sees this rank's rows of a parameter-shaped tensor: a DTensor `Shard(0)` of the
    global shape when sharded, else the (whole) tensor itself."""
    if _whole_scalar(info):  # the owner's value; DCP writes the lowest rank's (global rank 0)
        return rows.reshape(()) if rows.numel() else torch.zeros((), dtype=rows.dtype)
    if info.group is None:
        return rows
    from torch.distributed.tensor import DTensor, Shard

    shape = info.rows_shape
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        rows, _mesh(info.group), [Shard(0)], run_check=False, shape=shape, stride=stride
    )


def _load_target(view: torch.Tensor, info: ParamInfo,
                 finish: list[Callable[[], None]]) -> torch.Tensor:
    """What DCP loads into for this rank's rows `view`: the rows themselves (as `as_saved`),
    or for a 0-dim parameter a whole scalar copied into the owner's row afterwards."""
    if not _whole_scalar(info):
        return as_saved(view, info)
    whole = torch.empty((), dtype=view.dtype)
    if view.numel():
        finish.append(lambda: view.copy_(whole.reshape(view.shape)))
    return whole


# -- save -----------------------------------------------------------------------------------
def plan(state: Mapping[str, Any], filter: Filter | None
         ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """`(tensors, meta, signature)`: the nested DCP state dict of this rank's tensors (views,
    no copies), the plain dict that goes into `meta.pt`, and what every rank must agree on
    (names, shapes, kinds -- not values). No communication."""
    modules = objects.split_state(state)[objects.MODULE]
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    sig: list[Any] = []
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if kind == objects.MODULE:
            tensors[key] = _plan_module(key, obj, filter)
            sig.append((key, kind, _shapes(tensors[key])))
        elif kind == objects.OPTIMIZER:
            tensors[key] = _plan_optimizer(key, obj, modules, filter)
            sig.append((key, kind, _shapes(tensors[key].get("state", {}))))
        else:
            value = obj.state_dict() if kind == objects.STATEFUL else obj
            meta[key] = objects.apply_filter(key, value, filter)
            sig.append((key, kind, None))
    return tensors, meta, tuple(sig)


def _shapes(tree: Mapping[str, Any]) -> Any:
    out = []
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.append((k, _shapes(v)))
        else:
            out.append((k, tuple(v.shape) if isinstance(v, torch.Tensor) else "value"))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _plan_module(key: str, module: nn.Module, filter: Filter | None) -> dict[str, Any]:
    by_id = {id(info.param): info for info in objects.module_params(module).values()}
    sd = objects.apply_filter(key, local_state_dict(module, keep_vars=True), filter)
    out: dict[str, Any] = {}
    for name, value in sd.items():
        info = by_id.get(id(value)) if isinstance(value, torch.Tensor) else None
        if info is not None:  # every name of a tied parameter, as Lightning stores it
            out[name] = as_saved(info.local_rows(value.detach()), info)
        elif isinstance(value, torch.Tensor):  # a buffer: whole on every rank
            out[name] = value.detach()
        else:  # extra state: a DCP byte item
            out[name] = value
    return out


def _plan_optimizer(key: str, optimizer: Any, modules: Mapping[str, nn.Module],
                    filter: Filter | None) -> dict[str, Any]:
    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    osd = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(names):
        info = infos[name]
        entry: dict[str, Any] = {}
        for k, v in osd["state"].get(index, {}).items():
            if objects.is_rows(v, info.param, k):
                entry[k] = as_saved(info.local_rows(v.detach()), info)
            else:
                entry[k] = v.detach() if isinstance(v, torch.Tensor) else v
        if entry:
            state[name] = entry
    groups = objects.optimizer_groups(osd["param_groups"], names)
    return objects.apply_filter(key, {"state": state, "param_groups": groups}, filter)


def write(tmp: Path, tensors: dict[str, Any], group: comm.Group | None,
          process_group: Any = None) -> list[list[Any]]:
    """DCP-save `tensors` into the directory `tmp` (collective: every rank of the default
    group, or of `process_group`; each rank writes and fsyncs its own file, rank 0 the
    `.metadata` index). Returns the items' checksums on rank 0 (`integrity`), [] elsewhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = integrity.summing_writer(tmp)
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    _dcp_call(lambda: dcp.save(tensors, storage_writer=writer, planner=planner,
                               process_group=process_group, no_dist=group is None),
              f"writing {str(tmp)!r}")
    return writer.sums


def finish_meta(tmp: Path, meta: dict[str, Any], sums: list[list[Any]]) -> None:
    """Write `meta.pt` and the checksums (rank 0, after DCP); make sure DCP's index is on
    disk."""
    from fullshard.checkpoint.atomic import fsync_file, save_file

    fsync_file(tmp / DCP_METADATA)  # DCP fsyncs the shard files, not necessarily its index
    save_file(meta, tmp / META)
    integrity.write_sums(tmp, sums, [DCP_METADATA, META])


def entries(index: Any) -> dict[str, list[tuple[tuple[Any, ...], str, Any]]]:
    """The index's items by top-level key: `{key: [(path, flat key, metadata), ...]}` where
    `path` is the item's place in the saved nested dict (`('optimizer', 'state', name, 'step')`)."""
    paths = index.planner_data if isinstance(index.planner_data, Mapping) else {}
    out: dict[str, list[tuple[tuple[Any, ...], str, Any]]] = {}
    for fqn, md in index.state_dict_metadata.items():
        path = tuple(paths.get(fqn, ())) or tuple(fqn.split(".", 1))
        out.setdefault(str(path[0]), []).append((path, fqn, md))
    return out


def kind_of_entry(items: list[tuple[tuple[Any, ...], str, Any]]) -> str:
    """A top-level key holds an optimizer ('state'/'param_groups' below it) or a module."""
    if any(len(p) >= 3 and p[1] in ("state", "param_groups") for p, _, _ in items):
        return objects.OPTIMIZER
    return objects.MODULE


def unflatten(items: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Rebuild nested dicts and lists from `(path, value)` pairs (int path parts are list
    positions, as DCP writes them)."""
    root: dict[Any, Any] = {}
    for path, value in items:
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out):
        return [out[i] for i in sorted(out)]
    return out


def read(path: Path, flat: dict[str, Any], group: comm.Group | None,
         weights_only: bool = True) -> None:
    """DCP-load into `flat` (flat key -> tensor to fill in place, or a placeholder a byte item
    replaces). Collective over the default group."""
    import torch.distributed.checkpoint as dcp

    if not flat and group is None:
        return
    reader = safe_load.reader(path, weights_only, integrity.read_sums(path))
    planner = safe_load.planner(path, weights_only)
    _dcp_call(lambda: dcp.load(flat, storage_reader=reader, planner=planner,
                               no_dist=group is None), f"reading {str(path)!r}")


def _dcp_call(fn: Callable[[], Any], what: str) -> Any:
    """`fn()`, a DCP save or load, whose `CheckpointException` (a `BaseException`, which a
    user's `except Exception` would miss) becomes a `CheckpointError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to save in a single
        # process": exactly our intent without a process group.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            return fn()
        except CheckpointException as e:  # a BaseException: `except Exception` misses it
            for failure in e.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, CheckpointError):  # ours (unsafe, corrupt): as it is
                    raise type(inner)(str(inner)) from None
            if integrity.is_no_space(e):  # the caller (`api`) names the checkpoint and sizes
                raise CheckpointError(f"No space left on device {what}: {e}") from None
            raise CheckpointError(f"torch.distributed.checkpoint failed {what}: {e}") from None
        finally:
            # A cached DeviceMesh keeps its process group alive past destroy_process_group();
            # gloo then tears the group down during interpreter exit, where its threads abort
            # the process ("terminate called without an active exception"). Keep meshes only
            # for the duration of one save or load.
            _MESHES.clear()


# -- load: into objects ---------------------------------------------------------------------
def load(path: Path, meta: dict[str, Any], state: dict[str, Any], strict: bool,
         group: comm.Group | None, weights_only: bool = True, *,
         allow_symlinks: bool = False) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint at `path` (collective when `group`);
    return the entries of `meta.pt` that `state` did not ask for."""
    index = read_index(path, weights_only, allow_symlinks=allow_symlinks)
    saved = entries(index)
    held = {k: kind_of_entry(v) for k, v in saved.items()}
    parts = objects.split_state(state)
    for key, obj in state.items():
        kind = objects.kind_of(obj)
        if key not in held and key not in meta:
            if strict:
                raise objects.missing_key(key, path)
        elif kind in (objects.MODULE, objects.OPTIMIZER) and held.get(key) != kind:
            raise TypeError(
                f"state[{key!r}] is {'a module' if kind == objects.MODULE else 'an optimizer'} "
                f"but the checkpoint {str(path)!r} saved {key!r} as "
                f"{'an optimizer' if held.get(key) == objects.OPTIMIZER else 'a module' if held.get(key) else 'a value'}; "  # noqa: E501
                f"use the key it was saved under."
            )
    modules = parts[objects.MODULE]
    finish: list[Callable[[], None]] = []
    flat: dict[str, Any] = {}
    for key, module in modules.items():
        if key in held:
            _request_module(key, module, saved[key], strict, flat, finish)
    for key, opt in parts[objects.OPTIMIZER].items():
        if key in held:
            _request_optimizer(key, opt, saved[key], modules, strict, flat, finish)
    read(path, flat, group, weights_only)
    for step in finish:
        step()
    rest = dict(meta)
    for key in list(parts[objects.STATEFUL]) + list(parts[objects.VALUE]):
        if key in rest:
            objects.restore(state, key, rest.pop(key))
    return rest


def _request_module(key: str, module: nn.Module, items: list[tuple[tuple[Any, ...], str, Any]],
                    strict: bool, flat: dict[str, Any], finish: list[Callable[[], None]]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fullshard.checkpoint.full import report_mismatch

    if objects.is_sharded(module):
        module.fullshard_runtime.release_all()  # type: ignore[attr-defined]
    by_id = {id(info.param): info for info in objects.module_params(module).values()}
    own = local_state_dict(module, keep_vars=True)
    tensors = {p[1]: md for p, _, md in items if len(p) == 2
               and isinstance(md, TensorStorageMetadata)}
    others: dict[str, list[tuple[tuple[Any, ...], str]]] = {}
    for p, fqn, md in items:
        if not (len(p) == 2 and isinstance(md, TensorStorageMetadata)):
            others.setdefault(str(p[1]), []).append((p[2:], fqn))
    saved = set(tensors) | set(others)
    missing = [k for k in own if k not in saved]
    unexpected = sorted(k for k in saved if k not in own)
    if strict and (missing or unexpected):
        raise ValueError(
            f"The checkpoint's {key!r} does not match the module being loaded. Missing keys: "
            f"{missing or 'none'}; unexpected keys: {unexpected or 'none'}. Pass strict=False "
            f"to load the matching keys only."
        )
    report_mismatch(key, missing, unexpected)
    taken: set[int] = set()
    for name, target in own.items():
        if name in others and name.endswith("_extra_state"):
            _request_extra(module, name, others[name], flat, finish)
        if name not in tensors or not isinstance(target, torch.Tensor):
            continue
        if id(target) in taken:  # tied: loaded once, under its first name
            continue
        taken.add(id(target))
        info = by_id.get(id(target))
        shape = tuple(info.shape) if info is not None else tuple(target.shape)
        found = tuple(tensors[name].size)
        if found != shape:
            raise ValueError(
                f"{key}.{name} has shape {found} in the checkpoint but {shape} in the module "
                f"being loaded (unsharded). Build the same model as when saving."
            )
        if info is not None:  # load in place into the shard
            flat[f"{key}.{name}"] = _load_target(info.local_rows(target.detach()), info, finish)
        else:
            flat[f"{key}.{name}"] = target.detach()


def _request_extra(module: nn.Module, name: str, items: list[tuple[tuple[Any, ...], str]],
                   flat: dict[str, Any], finish: list[Callable[[], None]]) -> None:
    """A submodule's `get_extra_state()` value, saved as DCP byte item(s)."""
    for _, fqn in items:
        flat[fqn] = None
    owner = module.get_submodule(name.rpartition(".")[0] if "." in name else "")

    def restore() -> None:
        value = unflatten([(p or ("value",), flat[fqn]) for p, fqn in items])
        owner.set_extra_state(value["value"] if list(value) == ["value"] else value)

    finish.append(restore)


def _request_optimizer(key: str, optimizer: Any, items: list[tuple[tuple[Any, ...], str, Any]],
                       modules: Mapping[str, nn.Module], strict: bool, flat: dict[str, Any],
                       finish: list[Callable[[], None]]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fullshard.checkpoint.full import report_mismatch

    mkey, names = objects.optimizer_param_names(optimizer, modules, key)
    infos = objects.module_params(modules[mkey]) if names else {}
    saved: dict[str, dict[str, tuple[str, Any]]] = {}
    group_items: list[tuple[tuple[Any, ...], str]] = []
    for p, fqn, md in items:
        if p[1] == "state" and len(p) == 4:
            saved.setdefault(str(p[2]), {})[str(p[3])] = (fqn, md)
        elif p[1] == "param_groups":
            group_items.append((p[2:], fqn))
    unknown = sorted(set(saved) - set(names))
    if unknown:
        if strict:
            raise ValueError(
                f"The checkpoint's optimizer {key!r} has state for parameters the optimizer "
                f"being loaded does not hold: {unknown[:5]}. Pass strict=False to ignore them."
            )
        report_mismatch(key, [], unknown)
    state: dict[int, dict[str, Any]] = {}
    values: list[tuple[int, str, str]] = []  # non-tensor state, filled in after the load
    for i, name in enumerate(names):
        info = infos[name]
        entry: dict[str, Any] = {}
        for k, (fqn, md) in saved.get(name, {}).items():
            if not isinstance(md, TensorStorageMetadata):
                flat[fqn] = None
                values.append((i, k, fqn))
                continue
            dtype = md.properties.dtype
            size = tuple(md.size)
            if size == tuple(info.shape) and not (k == "step" and not info.shape):
                # laid out like its parameter: this rank's rows
                local = torch.empty(info.layout.local_shape, dtype=dtype,
                                    device=info.param.device)
                flat[fqn] = _load_target(local, info, finish)
                entry[k] = local.view(info.param.shape)
            elif len(size) == len(info.shape) >= 1:
                raise ValueError(
                    f"The optimizer state {fqn!r} has shape {size} in the checkpoint but its "
                    f"parameter is {tuple(info.shape)}; build the same model as when saving."
                )
            else:
                local = torch.empty(tuple(md.size), dtype=dtype)
                flat[fqn] = local
                entry[k] = local
        state[i] = entry
    for _, fqn in group_items:
        flat[fqn] = None

    def load() -> None:
        for i, k, fqn in values:
            state[i][k] = flat[fqn]
        kept = {i: e for i, e in state.items() if e}
        current = optimizer.state_dict()["param_groups"]
        if not group_items:  # filtered out when saving: keep the optimizer's own groups
            groups = current
        else:
            saved_groups = unflatten([(p, flat[fqn]) for p, fqn in group_items])
            groups = objects.groups_to_load(list(saved_groups), optimizer, names, key, strict)
        optimizer.load_state_dict({"state": kept, "param_groups": groups})

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
