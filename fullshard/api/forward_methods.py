"""What a model set up by `fabric.setup` answers to beyond its own class: `model.module` and
`mark_forward_method`.

Lightning's `fabric.setup` returns a `_FabricModule` wrapper; scripts then reach the user's
model as `model.module` and make methods other than `forward` (e.g. `generate`) run through
the strategy with `model.mark_forward_method("generate")`. fullshard returns the user's model
itself (sharded in place), so:

- `model.module` is the model seen as an instance of the user's own class, sharing all its
  state (see `_module_view`; added only when the class has no `module` of its own, so a
  real submodule or attribute of that name is never shadowed);
- `model.mark_forward_method(name)` / `fabric.mark_forward_method(model, name)` make
  `model.<name>(...)` run as a forward of the root: the call goes through `model(...)` --
  the root unit's gather, the precision's casts and context, then the release -- with
  `forward` redirected for that one call to the method. Without it, a method that uses the
  root's own parameters directly (a tied embedding in `generate`) would find them sharded.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from fullshard.engine.module import FullyShardedModule

_MARKED = "_fullshard_forward_methods"
_ALIASED: dict[type, type] = {}  # class -> its subclass with the `module` property


def attach(model: nn.Module) -> None:
    """Give `model` the `module` alias and `mark_forward_method` (see the module docstring)."""
    if not _has_attribute(model, "module"):
        cls = type(model)
        with_alias = _ALIASED.get(cls)
        if with_alias is None:
            with_alias = type(cls.__name__, (cls,), {"module": property(_module_view),
                                                     "__module__": cls.__module__,
                                                     "__qualname__": cls.__qualname__})
            _ALIASED[cls] = with_alias
        model.__class__ = with_alias
    if not _has_attribute(model, "mark_forward_method"):
        object.__setattr__(model, "mark_forward_method",
                           types.MethodType(mark_forward_method, model))


def _module_view(model: nn.Module) -> nn.Module:
    """`model.module`: the model seen as an instance of the user's own class.

    It shares the model's `__dict__` (the same dict object: parameters, submodules, hooks and
    every attribute, read or written through either), so it *is* the model in all but its
    class -- which lacks this property, so `view.module` does not exist. A self-reference
    (`model.module is model`) would send the unwrap loops of other libraries
    (`while hasattr(m, "module"): m = m.module` in transformers' `unwrap_model`, timm) into
    endless recursion; with the view they stop after one step, as for a DDP wrapper.
    """
    submodule = model.__dict__["_modules"].get("module")
    if submodule is not None:  # a real child named `module` (assigned after setup) wins
        return submodule
    own = next(c for c in type(model).__mro__
               if c not in _ALIASED.values() and not issubclass(c, FullyShardedModule))
    view = object.__new__(own)
    object.__setattr__(view, "__dict__", model.__dict__)
    return view


def _has_attribute(model: nn.Module, name: str) -> bool:
    try:
        getattr(model, name)
    except AttributeError:
        return False
    return True


def mark_forward_method(model: nn.Module, method: str | Callable[..., Any]) -> None:
    """Make `model.<method>(...)` run through the model's forward hooks (see the docstring)."""
    if isinstance(method, types.MethodType | types.FunctionType):
        name = method.__name__
    elif isinstance(method, str):
        name = method
    else:
        raise TypeError(f"mark_forward_method takes a method or its name, got "
                        f"{type(method).__name__}")
    if name == "forward":
        raise ValueError("forward already runs as the forward; mark other methods only.")
    original = getattr(type(model), name, None)
    own = model.__dict__.get(name)  # an instance-level method (generation.sync_generation)
    if isinstance(own, types.MethodType) and own.__self__ is model:
        original = own.__func__
    if not callable(original):
        raise AttributeError(
            f"mark_forward_method({name!r}): {type(model).__name__} has no method {name!r}."
        )
    marked: set[str] = model.__dict__.setdefault(_MARKED, set())
    if name in marked:
        return
    marked.add(name)

    @functools.wraps(original)
    def call_through_forward(*args: Any, **kwargs: Any) -> Any:
        # an instance forward of the model's own (a compiled root's eager frame,
        # api/compile_units.py) is put back, not dropped
        own_forward = model.__dict__.get("forward")

        def restore() -> None:
            if own_forward is None:
                model.__dict__.pop("forward", None)
            else:
                model.__dict__["forward"] = own_forward

        def redirected(*a: Any, **kw: Any) -> Any:
            # The method may call self.forward itself: restore it before running the method.
            restore()
            return original(model, *a, **kw)

        model.__dict__["forward"] = redirected
        try:
            return model(*args, **kwargs)
        finally:
            restore()

    object.__setattr__(model, name, call_through_forward)
