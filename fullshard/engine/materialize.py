"""Materializing a meta-device model one unit at a time, just before it is sharded.

A model built on the meta device (`torch.device("meta")`, `FSDPStrategy.module_init_context`)
has shapes but no storage. For each unit, in unit order (root first), the modules that belong
to it -- the unit module and its descendants outside nested units, in `named_modules()` order --
get real, uninitialized tensors on the device and then run their own `reset_parameters()`.
The unit is sharded right after, so only one unit's full parameters exist at a time.

The order is fixed, so every rank draws the same random numbers and all ranks hold slices of
one model; it equals a model built eagerly whose modules are reset in the same order. Tied
parameters stay tied (the new tensor replaces the meta one in every module holding it).

Tied across units: a parameter is initialized by the modules of its *owning* unit (the
innermost unit holding every use, materialized first); among those, the last to reset it
decides. A module of a later unit that also holds it (an LM head inside a block, tied to the
root's embedding) still runs its `reset_parameters()` -- on a scratch tensor of the full shape
put in its place for the call, so the random numbers drawn stay those of the eager model --
but cannot overwrite the owner's value, which by then is this rank's shard (re-initializing a
shard would draw different values on each rank).

Nothing may stay uninitialized: `torch.empty` memory differs per rank, so every tensor
materialized here is first filled with a sentinel (NaN; the lowest value for integers) and
must afterwards have been written by some initializer of the unit (its version counter
moved, its values changed, or the reset replaced it: assigned a new, non-meta tensor in its
place, as litgpt's `self.cos, self.sin = self.rope_cache(...)` does). Otherwise a `ValueError`
names each such parameter or buffer, its module, and the fix. (torch's FSDP leaves such memory
as is.) A module with meta tensors and no initializer (below) is an error naming it.

With torch FSDP's `param_init_fn`, that function is called instead on each module of the unit
that still has meta tensors (in the same order), and must materialize it (e.g.
`module.to_empty(device=..., recurse=False)` and initialize); a parameter it replaces is
re-registered in every module holding it when the unit is sharded.

Which initializer runs. Every module's own `reset_parameters()` runs, whatever the root is
(litgpt's `GPT` has both a `reset_parameters()`, which rebuilds its RoPE `cos`/`sin` buffers,
and an `_init_weights(module)` that knows only Linear and Embedding, for `gpt.apply()`).
The root's `_init_weights(module)` is used in two cases only:
- the root is a Hugging Face `transformers.PreTrainedModel` (recognised without importing
  transformers): after the unit's resets, `_init_weights` is applied to its modules children
  first, as the model's own `post_init` does after construction -- it covers modules without
  `reset_parameters` (rotary embeddings' `inv_freq`, BERT's `position_ids`), uses the model's
  own distributions, and a parent's override of a child's tensor (GPT-2's scaled `c_proj`) wins;
- any other root: only for a module that has meta tensors and no `reset_parameters()`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fullshard.engine.wrap import ParamOwnership

# Full shapes of the model's meta parameters, by (id(module), attribute), recorded before any
# is sharded: a later unit's module holding a foreign (already sharded) tied parameter is
# reset on a scratch tensor of this shape.
_FULL_SHAPES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, str], torch.Size]] = (
    weakref.WeakKeyDictionary()
)


def _record_full_shapes(root: nn.Module) -> dict[tuple[int, str], torch.Size]:
    shapes = _FULL_SHAPES.setdefault(root, {})
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                shapes.setdefault((id(m), name), p.shape)
    return shapes


def _sentinel(t: torch.Tensor) -> bool | float | int:
    if t.dtype == torch.bool:
        return True
    return float("nan") if t.is_floating_point() or t.is_complex() else torch.iinfo(t.dtype).min


def _still_sentinel(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == _sentinel(t)).all())


def _unit_modules(unit_module: nn.Module, unit_ids: set[int]) -> list[nn.Module]:
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        out.append(m)
        for child in m.children():
            if id(child) not in unit_ids:
                walk(child)

    walk(unit_module)
    return out


def _is_hf_pretrained(root: nn.Module) -> bool:
    """Whether `root` is a transformers `PreTrainedModel`. A model can only be one if
    transformers' modeling_utils is already imported, so nothing is imported here."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(root, base)


def _has_meta(module: nn.Module) -> bool:
    tensors = (*module._parameters.values(), *module._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


@torch.no_grad()
def materialize_unit(
    root: nn.Module,
    unit_module: nn.Module,
    unit_ids: set[int],
    owned: Sequence[ParamOwnership],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], object] | None = None,
) -> None:
    names = {id(m): n for n, m in root.named_modules()}
    refs_by_param = {id(o.current): o.refs for o in owned}
    # Decide which modules to reset before materializing anything: materializing a tied
    # parameter for its first holder must not make a later holder look already initialized.
    to_reset = [m for m in _unit_modules(unit_module, unit_ids) if _has_meta(m)]
    model_init = getattr(root, "_init_weights", None)
    model_init = model_init if callable(model_init) else None
    hf_init = model_init if model_init is not None and _is_hf_pretrained(root) else None
    if param_init_fn is not None:
        for module in to_reset:
            if _has_meta(module):  # an earlier call may have materialized it (recurse=True)
                param_init_fn(module)
        _check_materialized(owned)
        return
    for module in to_reset:
        if model_init is None and not callable(getattr(module, "reset_parameters", None)):
            raise TypeError(
                f"Module {names.get(id(module)) or '<root>'!r} ({type(module).__name__}) has "
                f"tensors on the meta device but no reset_parameters() to initialize them. "
                f"Implement reset_parameters() (initializing only its own parameters and "
                f"buffers, not its children's), or build the model on a real device."
            )
    full_shapes = _record_full_shapes(root) if to_reset else {}
    # Every tensor materialized here: (module, kind, attribute, tensor, version after the fill).
    fresh: list[tuple[nn.Module, str, str, torch.Tensor, int]] = []
    for module in to_reset:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            new.fill_(_sentinel(new))
            fresh.append((module, "parameter", name, new, new._version))
            for holder, attr in refs_by_param.get(id(p), [(module, name)]):
                holder._parameters[attr] = new
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                new_b = torch.empty_like(b, device=device)
                new_b.fill_(_sentinel(new_b))
                fresh.append((module, "buffer", name, new_b, new_b._version))
                module._buffers[name] = new_b
    # Parameters of other units (tied, already materialized and sharded) held by modules about
    # to be reset: a scratch stand-in of the full shape takes the reset's writes.
    own = {id(o.current) for o in owned}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    scratch: dict[int, nn.Parameter] = {}
    for module in to_reset:
        for name, p in list(module._parameters.items()):
            if p is None or p.is_meta or id(p) in own:
                continue
            if id(p) not in scratch:
                shape = full_shapes.get((id(module), name), p.shape)
                scratch[id(p)] = nn.Parameter(
                    torch.empty(shape, dtype=p.dtype, device=device), requires_grad=False
                )
            swapped.append((module, name, p))
            module._parameters[name] = scratch[id(p)]
    try:
        for module in to_reset:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            elif hf_init is None:
                model_init(module)  # type: ignore[misc]  # no reset_parameters: the root's init
        if hf_init is not None:
            for module in reversed(to_reset):  # children before their parents, as post_init
                hf_init(module)
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
    _check_initialized(fresh, names)
    _check_materialized(owned)


def _check_materialized(owned: Sequence[ParamOwnership]) -> None:
    still_meta = [o.name for o in owned if o.current.is_meta]
    if still_meta:
        raise ValueError(
            f"Parameters {still_meta} are still on the meta device after materializing their "
            f"unit: they are held only by modules of other units (a weight tied across units). "
            f"Materialize the model before fsdp(), or tie within one unit."
        )


def _check_initialized(
    fresh: Sequence[tuple[nn.Module, str, str, torch.Tensor, int]], names: dict[int, str]
) -> None:
    """Raise naming every materialized tensor no reset_parameters() wrote."""
    missing = []
    for module, kind, name, t, version in fresh:
        table = module._parameters if kind == "parameter" else module._buffers
        now = table.get(name)
        if now is not t and (now is None or not now.is_meta):
            continue  # replaced by the reset (a new tensor was assigned), or removed
        if now is t and (t.numel() == 0 or t._version != version or not _still_sentinel(t)):
            continue  # written in place, or empty
        prefix = names.get(id(module)) or ""
        missing.append(
            f"{kind} {(prefix + '.' if prefix else '') + name!r} of {type(module).__name__}"
            + (" (replaced by a meta tensor)" if now is not t else "")
        )
    if missing:
        raise ValueError(
            f"After materializing from the meta device, {', '.join(missing)} "
            f"{'was' if len(missing) == 1 else 'were'} not set by any reset_parameters(): the "
            f"memory would stay uninitialized and differ on every rank. Initialize "
            f"{'it' if len(missing) == 1 else 'them'} in the module's reset_parameters() (e.g. "
            f"`self.<name>.copy_(...)` / `.fill_(...)` under torch.no_grad()), or build the "
            f"model on a real device (or load a checkpoint into it) before wrapping."
        )
