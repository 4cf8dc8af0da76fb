"""Sharded checkpoint -> one full file, in one process, without a process group.

`to_full(ckpt_dir)` reads every DCP item into whole CPU tensors (DCP without distributed
setup) and rebuilds the nested dict the index records, which is exactly what a
`state_dict_type='full'` save of the same state writes: modules under their original names
and shapes (every name of a tied parameter), optimizer state keyed by parameter name with
unsharded tensors and its param groups, then the entries of `meta.pt`. The same layout is
Lightning's, so its sharded checkpoints consolidate too. Files are read without running code
from them unless `weights_only=False` (`fullshard consolidate --unsafe-load`).
`consolidate(ckpt_dir, out)` writes it with `torch.save`, or -- for an `out` ending in
`.safetensors` -- the model weights only, in the safetensors format (needs the optional
`safetensors` package), loadable with `safetensors.torch.load_file` into the unwrapped model.
The output is written under a temporary name and renamed into place.

Memory: the whole checkpoint is held once in host memory (the output file needs all of it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fullshard.checkpoint import atomic, objects, safe_load, sharded, sharded_files


def to_full(ckpt_dir: str | os.PathLike, *, weights_only: bool | None = None) -> dict[str, Any]:
    """The full-format checkpoint dict of the sharded checkpoint at `ckpt_dir` (ours or
    Lightning's: the same layout). `weights_only` as in `load_checkpoint` (None: True)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    weights_only = safe_load.resolve(weights_only)
    path = Path(ckpt_dir)
    if not sharded.is_checkpoint_dir(path):
        reason = sharded.describe_dir(path) if path.is_dir() else "no such directory"
        raise ValueError(
            f"{str(path)!r} is not a sharded checkpoint ({reason}). Pass the directory that "
            f"save_checkpoint(..., state_dict_type='sharded') wrote."
        )
    meta = sharded_files.read_meta(path, weights_only)
    index = sharded_files.read_index(path, weights_only)
    flat: dict[str, Any] = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if isinstance(md, TensorStorageMetadata) else None  # a byte item replaces None
        for key, md in index.state_dict_metadata.items()
    }
    sharded.read(path, flat, None, weights_only)
    out: dict[str, Any] = {}
    for key, items in sharded.entries(index).items():
        out[key] = sharded.unflatten([(p[1:], flat[fqn]) for p, fqn, _ in items])
    for key, value in meta.items():
        out.setdefault(key, value)
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


def consolidate(ckpt_dir: str | os.PathLike, out: str | os.PathLike, *,
                weights_only: bool | None = None) -> Path:
    """Write the sharded checkpoint at `ckpt_dir` as one full file `out` (see module doc).
    `weights_only=False` reads files holding arbitrary objects: only for files you trust."""
    ckpt = to_full(ckpt_dir, weights_only=weights_only)
    target = Path(out).expanduser().absolute()
    if target.is_dir():
        raise IsADirectoryError(
            f"The output {str(target)!r} is a directory; consolidate writes one file. Give a "
            f"file name (ending in .safetensors for the safetensors format)."
        )
    index = sharded_files.read_index(Path(ckpt_dir), safe_load.resolve(weights_only))
    modules = [k for k, v in sharded.entries(index).items()
               if sharded.kind_of_entry(v) == objects.MODULE]
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
