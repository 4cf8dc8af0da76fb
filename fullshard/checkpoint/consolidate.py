"""Sharded checkpoint -> one full file, in one process, without a process group.

`to_full(ckpt_dir)` reads every DCP chunk into whole CPU tensors (DCP without distributed
setup) and assembles exactly what a `state_dict_type='full'` save of the same state writes:
modules under their original names and shapes (tied names restored), optimizer state keyed by
parameter name with unsharded tensors, and the rest of `meta.pt`. `consolidate(ckpt_dir, out)`
writes it with `torch.save`, or -- for an `out` ending in `.safetensors` -- the model weights
only, in the safetensors format (needs the optional `safetensors` package), loadable with
`safetensors.torch.load_file` into the unwrapped model. The output is written under a
temporary name and renamed into place.

Memory: the whole checkpoint is held once in host memory (the output file needs all of it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fullshard.checkpoint import atomic, sharded


def to_full(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The full-format checkpoint dict of the sharded checkpoint at `ckpt_dir`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt_dir)
    if not sharded.is_checkpoint_dir(path):
        reason = sharded.describe_dir(path) if path.is_dir() else "no such directory"
        raise ValueError(
            f"{str(path)!r} is not a sharded checkpoint ({reason}). Pass the directory that "
            f"save_checkpoint(..., state_dict_type='sharded') wrote."
        )
    meta = sharded.read_meta(path)
    index = sharded.read_index(path)
    flat = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in index.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    sharded.read(path, flat, None)
    out: dict[str, Any] = {}
    for key in meta["order"]:
        if key in meta["modules"]:
            out[key] = _module(key, meta["modules"][key], flat)
        elif key in meta["optimizers"]:
            out[key] = _optimizer(key, meta["optimizers"][key], flat)
        elif key in meta["state"]:
            out[key] = meta["state"][key]
    return out


def _module(key: str, desc: dict[str, Any], flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for name in desc["keys"]:
        if name in desc["extra"]:
            sd[name] = desc["extra"][name]
        elif name in desc["aliases"]:
            sd[name] = sd[desc["aliases"][name]]  # the same tensor, as in the tied model
        else:
            sd[name] = flat[f"{key}.{name}"].view(desc["shapes"][name])
    return sd


def _optimizer(key: str, desc: dict[str, Any], flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "state" in desc:
        state: dict[str, dict[str, Any]] = {}
        for name, entry in desc["state"].items():
            state[name] = {}
            for k, kind in entry.items():
                if not isinstance(kind, str):
                    state[name][k] = kind[1]
                    continue
                tensor = flat[f"{key}.state.{name}.{k}"]
                state[name][k] = tensor.view(desc["shapes"][name]) if kind == sharded.ROWS \
                    else tensor
        out["state"] = state
    if "param_groups" in desc:
        out["param_groups"] = desc["param_groups"]
    return out


def model_weights(ckpt: dict[str, Any], meta_modules: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint's module(s): names as saved for one module, prefixed
    with `"{key}."` for several. Tied names get their own copy (safetensors stores no
    shared tensors)."""
    out: dict[str, torch.Tensor] = {}
    for key in meta_modules:
        prefix = "" if len(meta_modules) == 1 else f"{key}."
        storages: set[int] = set()
        for name, value in ckpt[key].items():
            if not isinstance(value, torch.Tensor):
                continue
            value = value.contiguous()
            if value.untyped_storage().data_ptr() in storages:
                value = value.clone()
            storages.add(value.untyped_storage().data_ptr())
            out[prefix + name] = value
    return out


def consolidate(ckpt_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the sharded checkpoint at `ckpt_dir` as one full file `out` (see module doc)."""
    ckpt = to_full(ckpt_dir)
    target = Path(out).expanduser().absolute()
    if target.is_dir():
        raise IsADirectoryError(
            f"The output {str(target)!r} is a directory; consolidate writes one file. Give a "
            f"file name (ending in .safetensors for the safetensors format)."
        )
    modules = list(sharded.read_meta(Path(ckpt_dir))["modules"])
    tmp = atomic.temp_path(target, atomic.new_token(None))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if target.suffix == ".safetensors":
            _save_safetensors(model_weights(ckpt, modules), tmp)
        else:
            atomic.save_file(ckpt, tmp)
        atomic.commit(tmp, target, "")
    finally:
        atomic.remove(tmp)
    return target


def _save_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "Writing .safetensors needs the `safetensors` package: pip install safetensors "
            "(or fullshard[export]); or give an output name without .safetensors for a "
            "torch.save file."
        ) from e
    if not weights:
        raise ValueError("The checkpoint holds no module weights to write as safetensors.")
    save_file(weights, str(path), metadata={"format": "pt"})
    atomic.fsync_file(path)
