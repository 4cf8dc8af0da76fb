"""The methods a wrapped model gains: `no_sync()`, `zero_grad()` and access to its runtime.

`fsdp()` converts the model in place and changes its class to a subclass that mixes in
`FullyShardedModule` (as torch FSDP2 does), so `isinstance(model, FullyShardedModule)` tells
whether a model is wrapped and the original class's behaviour is otherwise untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from fullshard.engine.hooks import Runtime

_CLASS_CACHE: dict[type, type] = {}


class FullyShardedModule:
    """Mixin for modules converted by `fullshard.fsdp`."""

    _fullshard_runtime: Runtime

    @property
    def fullshard_runtime(self) -> Runtime:
        return self._fullshard_runtime

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without any collective, until the next synced backward.

        Inside the context backward runs no reduction and units stay gathered after forward
        and backward (so later micro-batches need no all-gather either); the unsharded
        gradients are summed per bucket. The first backward outside the context adds its own
        gradients and reduces the sum once: k micro-batches cost one step's communication,
        and the result equals one large batch. The price is memory: while accumulating, the
        model's unsharded parameters and gradients are held, as in DDP.
        """
        runtime = self._fullshard_runtime
        previous = runtime.sync_gradients
        runtime.sync_gradients = False
        try:
            yield
        finally:
            runtime.sync_gradients = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`nn.Module.zero_grad`, which also drops gradients the engine holds outside `.grad`:
        a `no_sync` window's accumulation (releasing the units it kept gathered) and the
        reductions of a backward that raised."""
        self._fullshard_runtime.zero_grad()
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


def mark_wrapped(module: nn.Module, runtime: Runtime) -> None:
    cls = type(module)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FullySharded{cls.__name__}", (FullyShardedModule, cls), {})
        new_cls.__module__ = cls.__module__
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    module._fullshard_runtime = runtime  # a plain attribute: not a submodule or parameter


def runtime_of(module: nn.Module) -> Runtime:
    runtime = getattr(module, "_fullshard_runtime", None)
    if runtime is None:
        raise ValueError(
            f"{type(module).__name__} is not wrapped by fullshard; call fullshard.fsdp(model) "
            f"(or set it up through FSDPStrategy / Fabric) first."
        )
    return runtime


def is_wrapped(module: nn.Module) -> bool:
    return any(getattr(m, "_fullshard_runtime", None) is not None for m in module.modules())
