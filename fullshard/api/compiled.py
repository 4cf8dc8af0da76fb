"""`torch.compile` around a model handed to fullshard: unwrap, shard, compile again.

`torch.compile(model)` returns an `OptimizedModule` whose `_orig_mod` is the user's model and
whose `dynamo_ctx` holds every compile option (backend, mode/options, fullgraph, dynamic).
Sharding happens in place on `_orig_mod`; `recompile` then calls that same context on the
sharded module, which is exactly `torch.compile(sharded, <the same options>)` -- without
patching `torch.compile` to record its arguments as Lightning does. (An `OptimizedModule`
carrying Lightning's `_compile_kwargs` keeps them, so Lightning can unwrap it later.)

Compiling after wrapping (`torch.compile(fsdp(model))`) and compiling units
(`torch.compile(block)` per block, or `block.compile()`) need nothing from here: fullshard's
hooks run as module hooks, which dynamo traces through where it can and around (a graph
break) where they issue collectives.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


def is_compiled(module: object) -> bool:
    # An OptimizedModule exists only once torch._dynamo is imported; importing it costs ~3 s,
    # so a process that never compiles never does (see engine/eager.py).
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch built without dynamo
        return False
    return isinstance(module, OptimizedModule)


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """`(the model torch.compile wrapped, a function compiling a module the same way)`.

    For a module that is not compiled: `(module, identity)`. Nested compiles (a compiled
    module compiled again) are unwrapped and re-applied innermost first.
    """
    if not is_compiled(module):
        return module, _identity
    inner, inner_recompile = unwrap_compiled(module._orig_mod)
    ctx = module.dynamo_ctx
    extra: dict[str, Any] = {}
    if "_compile_kwargs" in module.__dict__:  # lightning's record of the arguments
        extra["_compile_kwargs"] = module.__dict__["_compile_kwargs"]

    def recompile(sharded: nn.Module) -> nn.Module:
        compiled = ctx(inner_recompile(sharded))
        for name, value in extra.items():
            compiled.__dict__[name] = value
        return compiled

    return inner, recompile


def uncompiled(module: object) -> object:
    """The module under any `torch.compile` wrappers (anything else is returned as is)."""
    while is_compiled(module):
        module = module._orig_mod  # type: ignore[union-attr]
    return module


@contextlib.contextmanager
def uncompiled_entries(state: Any) -> Iterator[Any]:
    """For checkpoint code, which inspects modules: `state` with every compiled module
    replaced by the module it wraps (so keys carry no `_orig_mod.` and sharded models are
    recognised). A dict is changed in place and restored on exit, so plain values that a
    load writes into it stay there."""
    if not isinstance(state, dict):
        yield uncompiled(state)
        return
    swapped = {k: v for k, v in state.items() if is_compiled(v)}
    for k, v in swapped.items():
        state[k] = uncompiled(v)
    try:
        yield state
    finally:
        for k, v in swapped.items():
            state[k] = v


def _identity(module: nn.Module) -> nn.Module:
    return module
