"""`register_fsdp_forward_method(model, "generate")`: a method other than `forward` that runs
as a forward of the sharded root (torch FSDP2's function of the same name and meaning).

fullshard shards the model in place, and the root unit's parameters are gathered only by the
root's forward hooks. A method such as `generate` that uses the root's own parameters
directly (a tied embedding) outside `forward` would find them sharded. Registered, a call
`model.<name>(...)` goes through `model(...)` -- the root unit's gather, the precision's casts
and context, then the release -- with `forward` redirected for that one call to the method.
Calls into submodules (`get_encoder()`, `get_input_embeddings()`) need nothing: see
`engine/entry.py`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

_REGISTERED = "_fullshard_forward_methods"


def register_fsdp_forward_method(model: nn.Module, method: str | Callable[..., Any]) -> None:
    """Make `model.<method>(...)` run through the model's forward hooks (see the docstring);
    `method` is a name or a bound method of `model`. Registering twice is a no-op."""
    if isinstance(method, types.MethodType | types.FunctionType):
        name = method.__name__
    elif isinstance(method, str):
        name = method
    else:
        raise TypeError(f"register_fsdp_forward_method takes a method or its name, got "
                        f"{type(method).__name__}")
    if name == "forward":
        raise ValueError("forward already runs as the forward; register other methods only.")
    original = getattr(type(model), name, None)
    own = model.__dict__.get(name)  # an instance-level method (generation.sync_generation)
    if isinstance(own, types.MethodType) and own.__self__ is model:
        original = own.__func__
    if not callable(original):
        raise AttributeError(
            f"register_fsdp_forward_method({name!r}): {type(model).__name__} has no method "
            f"{name!r}."
        )
    registered: set[str] = model.__dict__.setdefault(_REGISTERED, set())
    if name in registered:
        return
    registered.add(name)

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
