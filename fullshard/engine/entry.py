"""Calls into a unit's submodules from outside the unit's forward.

A unit's parameters are in place only between its forward hooks. Code that calls one of its
submodules directly reads the shards instead: Hugging Face's `generate()` runs
`model.get_encoder()(...)` before its first `model(...)`, and users call
`model.get_input_embeddings()(ids)` or `model.base_model(...)`. For an encoder-decoder the
encoder's embedding and final norm belong to the root unit, so the call sees one rank's rows
(`IndexError: index out of range in self`, or wrong numbers).

So every module such code reaches -- the model's entry points (`entry_points`) -- that is not
a unit itself gets a forward pre-hook and post-hook. Called while one of its enclosing units
(`enclosing_units`: the units owning a parameter used in its subtree, units inside it
excepted) is not installed, the call runs those units' own forward hooks around it,
outermost first: gathered, installed (through `GatheredParams` when grad is enabled, so the
gradients are reduced as for any forward), released after as their policy says. That is
what `mark_forward_method` does for a method of the root, here for any call that enters the
model below its root. Inside the root's forward the units are installed and the hooks
return at once.

Inside backward (a recomputation) the hooks do nothing: activation_checkpoint.py owns that case.
Under torch.compile the hooks are traced as no-ops: within a compiled forward the enclosing
units' own (eager) hooks have installed them already. (A compiled entry point called on its
own is not covered.)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torch import nn

from fullshard.engine.autograd import in_eager_forward

if TYPE_CHECKING:
    from fullshard.engine.hooks import Runtime
    from fullshard.engine.unit import Unit

_ACCESSORS = ("get_encoder", "get_decoder", "get_input_embeddings", "get_output_embeddings")


def enclosing_units(module: nn.Module, runtime: Runtime, *, called: bool) -> list[Unit]:
    """The units a call of `module` from outside their forward must install: those owning a
    parameter used in its subtree, except units strictly inside it (their hooks fire during
    the call), root first. `called`: the call goes through `module.__call__`, so if `module`
    is a unit its own hooks fire too; with `called=False` (fullshard's checkpoint wrapper
    calls the original `forward`) `module`'s own unit is included."""
    inside = {id(m) for m in module.modules()}
    nested = {id(u.module) for u in runtime.units if called or u.module is not module} & inside
    return [
        unit
        for unit in runtime.units
        if id(unit.module) not in nested
        and any(id(holder) in inside for p in unit.params for holder, _ in p.refs)
    ]


def entry_points(model: nn.Module) -> list[nn.Module]:
    """The submodules that code outside the model's forward calls: Hugging Face's accessors
    (`get_encoder()`, `get_decoder()`, `get_input_embeddings()`, `get_output_embeddings()`)
    and `base_model`. Empty for a model without them."""
    found: dict[int, nn.Module] = {}
    for name in ("base_model", *_ACCESSORS):
        try:
            attr = getattr(model, name, None)
            module = attr() if callable(attr) and not isinstance(attr, nn.Module) else attr
        except (NotImplementedError, AttributeError, TypeError, ValueError):
            continue  # an accessor this model does not implement
        if isinstance(module, nn.Module) and module is not model:
            found.setdefault(id(module), module)
    return list(found.values())


def hook_entry_points(model: nn.Module, runtime: Runtime) -> None:
    units = {id(u.module) for u in runtime.units}
    for module in entry_points(model):
        if id(module) in units:
            continue  # a unit: its own hooks gather it
        enclosing = enclosing_units(module, runtime, called=True)
        if not enclosing:
            continue
        opened: list[list[Unit]] = []  # per call in progress (a module may be re-entered)
        module.register_forward_pre_hook(
            functools.partial(_enter, runtime, enclosing, opened), with_kwargs=True
        )
        module.register_forward_hook(
            functools.partial(_leave, runtime, opened), always_call=True
        )


def _enter(
    runtime: Runtime, enclosing: list[Unit], opened: list[list[Unit]],
    module: nn.Module, args: Any, kwargs: Any,
) -> Any:
    if not in_eager_forward():
        return None
    todo = [u for u in enclosing if not u.is_installed]
    if not todo:
        return None
    opened.append(todo)
    for unit in todo:
        args, kwargs = runtime.pre_forward(unit, module, args, kwargs) or (args, kwargs)
    return args, kwargs


def _leave(runtime: Runtime, opened: list[list[Unit]], module: nn.Module, args: Any,
           output: Any) -> None:
    if not opened or not in_eager_forward():
        return
    for unit in reversed(opened.pop()):
        runtime.post_forward(unit, module, args, output)
