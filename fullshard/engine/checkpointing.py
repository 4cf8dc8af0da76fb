"""Activation checkpointing that composes with sharding.

The chosen modules run their forward under non-reentrant `torch.utils.checkpoint`: autograd
keeps only their inputs and recomputes the forward inside backward. Two things make that
compose with the engine:

- the unit hooks live in `module.__call__`, outside the checkpointed `forward`, so the
  recomputation (which calls `forward` directly) would find the shards, not the unsharded
  tensors. The checkpointed function therefore *gathers and installs* itself when it runs
  inside backward: every unit that owns a parameter used in the module's subtree (units
  nested inside it have their own hooks, which fire during recomputation as usual). It
  installs plain views, without `GatheredParams`: recomputed tensors only feed the saved
  slots of the original graph, whose gradients already route through the original node.
- ZeRO-3 must gather again for the recomputation rather than reuse freed memory: the gather
  above is a real gather into a new buffer whenever the unit was released.

The wrapper replaces `module.forward` with an instance attribute, so names, `state_dict` keys
and hooks are unchanged (no wrapper module, no `_checkpoint_wrapped_module` prefix).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fullshard.engine.wrap import normalize_policy

if TYPE_CHECKING:
    from fullshard.engine.hooks import Runtime
    from fullshard.engine.unit import Unit


def _checkpointed_modules(
    model: nn.Module, policy: object, numel_of: dict[int, int]
) -> list[nn.Module]:
    """The modules torch's `apply_activation_checkpointing(model, auto_wrap_policy=policy)`
    would wrap on the unsharded model: its recursive rule (ask with `recurse=True` and the
    subtree's parameter count whether to look inside, then bottom-up with `recurse=False` and
    the count not yet claimed below), never the root. `numel_of` gives each parameter's
    unsharded size (the registered ones are shards by now)."""
    fn = normalize_policy(policy)
    if fn is None:
        return []
    chosen: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(numel_of.get(id(p), p.numel()) for p in module.parameters())
        if not fn(module, True, numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children())
        if not is_root and fn(module, False, numel - wrapped):
            chosen.append(module)
            return numel
        return wrapped

    visit(model, True)
    picked = {id(m) for m in chosen}  # a module reused at two places is checkpointed once
    return [m for m in model.modules() if id(m) in picked]


def apply_activation_checkpointing(model: nn.Module, policy: object, runtime: Runtime) -> None:
    numel_of = {id(p.param): p.layout.numel for u in runtime.units for p in u.params}
    for module in _checkpointed_modules(model, policy, numel_of):
        inside = {id(m) for m in module.modules()}
        nested_units = {id(u.module) for u in runtime.units if u.module is not module} & inside
        needed: list[Unit] = []
        for unit in runtime.units:
            if id(unit.module) in nested_units:
                continue
            if any(id(holder) in inside for p in unit.params for holder, _ in p.refs):
                needed.append(unit)
        original = module.forward
        module.forward = functools.partial(_checkpointed_forward, original, runtime, needed)


def _checkpointed_forward(
    original: Any, runtime: Runtime, needed: list[Unit], *args: Any, **kwargs: Any
) -> Any:
    return checkpoint(_run, original, runtime, needed, *args, use_reentrant=False, **kwargs)


def _run(original: Any, runtime: Runtime, needed: list[Unit], *args: Any, **kwargs: Any) -> Any:
    if torch._C._current_graph_task_id() == -1:
        return original(*args, **kwargs)
    # Recomputation inside backward: the hooks of the enclosing units are not running.
    for unit in needed:
        runtime.gather_for_recompute(unit)
    try:
        return original(*args, **kwargs)
    finally:
        for unit in needed:
            unit.uninstall()
