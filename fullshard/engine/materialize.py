"""Materializing a meta-device model one unit at a time, just before it is sharded.

A model built on the meta device (`torch.device("meta")`, `FSDPStrategy.module_init_context`)
has shapes but no storage. For each unit, in unit order (root first), the modules that belong
to it -- the unit module and its descendants outside nested units, in `named_modules()` order --
get real, uninitialized tensors on the device and then run their own `reset_parameters()`.
The unit is sharded right after, so only one unit's full parameters exist at a time.

The order is fixed, so every rank draws the same random numbers and all ranks hold slices of
one model; it equals a model built eagerly whose modules are reset in the same order. Tied
parameters stay tied (the new tensor replaces the meta one in every module holding it; the
last module to reset it decides its value). A module with meta tensors and no
`reset_parameters` is an error naming it.

A root with an `_init_weights(module)` method (every Hugging Face `PreTrainedModel`) initializes
the modules instead, as its own `post_init` does: it covers modules without
`reset_parameters` (rotary embeddings' `inv_freq`, BERT's `position_ids`) and uses the model's
own distributions. It is called children first, as transformers applies it, so a parent's
override of a child's tensor (GPT-2's scaled `c_proj`) wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fullshard.engine.wrap import ParamOwnership


def _unit_modules(unit_module: nn.Module, unit_ids: set[int]) -> list[nn.Module]:
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        out.append(m)
        for child in m.children():
            if id(child) not in unit_ids:
                walk(child)

    walk(unit_module)
    return out


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
) -> None:
    names = {id(m): n for n, m in root.named_modules()}
    refs_by_param: dict[int, list[tuple[nn.Module, str]]] = {}
    for o in owned:
        refs_by_param[id(o.current)] = o.refs
    # Decide which modules to reset before materializing anything: materializing a tied
    # parameter for its first holder must not make a later holder look already initialized.
    to_reset = [m for m in _unit_modules(unit_module, unit_ids) if _has_meta(m)]
    model_init = getattr(root, "_init_weights", None)
    for module in to_reset:
        if not callable(model_init) and not callable(getattr(module, "reset_parameters", None)):
            raise TypeError(
                f"Module {names.get(id(module)) or '<root>'!r} ({type(module).__name__}) has "
                f"tensors on the meta device but no reset_parameters() to initialize them. "
                f"Implement reset_parameters() (initializing only its own parameters and "
                f"buffers, not its children's), or build the model on a real device."
            )
    for module in to_reset:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            for holder, attr in refs_by_param.get(id(p), [(module, name)]):
                holder._parameters[attr] = new
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
    if callable(model_init):
        for module in reversed(to_reset):  # children before their parents
            model_init(module)
    else:
        for module in to_reset:
            module.reset_parameters()
    still_meta = [o.name for o in owned if o.current.is_meta]
    if still_meta:
        raise ValueError(
            f"Parameters {still_meta} are still on the meta device after materializing their "
            f"unit: they are held only by modules of other units (a weight tied across units). "
            f"Materialize the model before fsdp(), or tie within one unit."
        )
