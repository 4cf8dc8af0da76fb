"""Mixed-precision dtype rules: which dtype each bucket, buffer, gradient and input gets.

`MixedPrecision` (config.py) says what the user wants; this file turns it into per-object
decisions, with torch FSDP1's meanings:

- a bucket gathers in `param_dtype` and reduces in `reduce_dtype`, unless its parameters
  belong to a *full-precision module* (`full_precision_modules`, BatchNorm by default): then
  it gathers and reduces in the shards' own dtype. Such parameters never share a bucket with
  the others (a bucket has one compute dtype);
- buffers are cast to `buffer_dtype`, except those of full-precision modules;
- full-precision modules get a forward pre-hook casting floating inputs to fp32 (to their
  parameters' dtype, if the model itself is low precision) and a forward hook casting floating
  outputs back to the dtype the inputs had (torch registers the same pair), so the modules
  around them keep running in `param_dtype`;
- the root casts its floating inputs to `param_dtype` when `cast_root_forward_inputs`, other
  units when `cast_forward_inputs`; a full-precision unit casts nothing (its hooks do);
- reduced gradients reach `.grad` in the shards' dtype, or in `reduce_dtype` with
  `keep_low_precision_grads`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fullshard.config import MixedPrecision


def full_precision_ids(model: nn.Module, mp: MixedPrecision | None) -> set[int]:
    """Ids of the modules (and their descendants) that stay out of mixed precision."""
    if mp is None or mp.param_dtype is None or not mp.full_precision_modules:
        return set()
    classes = mp.full_precision_modules
    return {
        id(sub)
        for m in model.modules()
        if isinstance(m, classes)
        for sub in m.modules()
    }


def holds_full_precision(refs: Iterable[tuple[nn.Module, str]], fp_ids: set[int]) -> bool:
    """A parameter is full precision when a full-precision module holds it."""
    return any(id(m) in fp_ids for m, _ in refs)


def bucket_dtypes(
    mp: MixedPrecision | None, dtype: torch.dtype, full_precision: bool
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(compute, reduce) dtypes of a bucket whose shards are `dtype`; None keeps the shards'."""
    if mp is None or not dtype.is_floating_point or full_precision:
        return None, None
    return mp.param_dtype, mp.reduce_dtype


def keeps_low_precision_grads(mp: MixedPrecision | None, full_precision: bool) -> bool:
    return mp is not None and mp.keep_low_precision_grads and not full_precision


def buffer_dtype(
    mp: MixedPrecision | None, module: nn.Module, buf: torch.Tensor, fp_ids: set[int]
) -> torch.dtype | None:
    if mp is None or not buf.is_floating_point() or id(module) in fp_ids:
        return None
    return mp.buffer_dtype


def unit_input_dtypes(
    units: Iterable[Any], mp: MixedPrecision | None, fp_ids: set[int]
) -> dict[Any, torch.dtype]:
    """The dtype each unit casts its floating inputs to (units absent: no cast). The first
    unit is the root."""
    out: dict[Any, torch.dtype] = {}
    if mp is None or mp.param_dtype is None:
        return out
    for i, unit in enumerate(units):
        wanted = mp.cast_root_forward_inputs if i == 0 else mp.cast_forward_inputs
        if wanted and id(unit.module) not in fp_ids:
            out[unit] = mp.param_dtype
    return out


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


class _FullPrecisionCasts:
    """The pre/post forward hook pair of one full-precision module."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.input_dtype: torch.dtype | None = None

    def pre(self, module: nn.Module, args: Any) -> Any:
        self.input_dtype = None

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
                self.input_dtype = x.dtype
                return x.to(self.dtype)
            return x

        return tree_map(cast, args)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        dtype, self.input_dtype = self.input_dtype, None
        if dtype is None:
            return None  # nothing was cast on the way in
        return cast_floating(output, dtype)


def install_full_precision_casts(model: nn.Module, mp: MixedPrecision | None) -> None:
    """Hook every outermost full-precision module of `model` (appended, so they run after
    any other hook, the unit hooks included)."""
    if mp is None or mp.param_dtype is None or not mp.full_precision_modules:
        return
    classes = mp.full_precision_modules
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, classes):
            continue
        inside.update(id(sub) for sub in m.modules())
        # fp32 as torch does -- or the shards' own dtype when the whole model was converted
        # (precision '*-true'), so the module's weights and inputs agree
        floating = [p.dtype for p in m.parameters() if p.is_floating_point()]
        casts = _FullPrecisionCasts(floating[0] if floating else torch.float32)
        m.register_forward_pre_hook(casts.pre)
        m.register_forward_hook(casts.post)
