"""The methods a wrapped model gains: `no_sync()`, `zero_grad()`, the thunder state-dict names
and access to its runtime.

`fsdp()` converts the model in place and changes its class to a subclass that mixes in
`FullyShardedModule` (as torch FSDP2 does), so `isinstance(model, FullyShardedModule)` tells
whether a model is wrapped and the original class's behaviour is otherwise untouched.

[Note: foreign classes]
The subclass is created with `type(...)`, which runs the original class's metaclass and
`__init_subclass__` (transformers' `PreTrainedModel.__init_subclass__` evaluates the type hints
of the whole MRO). So nothing here may carry an annotation that cannot be evaluated at run
time (no `TYPE_CHECKING`-only names; docs/architecture.md, invariant 8), and the subclass keeps the
original `__name__`, `__qualname__` and `__module__`: libraries read the class name (HF writes
it into `config.architectures` on `save_pretrained`, derives `loss_type` from it), and it must
be the model's own. The mixin adds no class attributes a library could look up by accident
beyond the `fullshard_*` names and the thunder methods below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from fullshard.engine.full_state import full_state_dict, load_full_state_dict
from fullshard.engine.hooks import Runtime
from fullshard.engine.runtime_lookup import runtime_of

_CLASS_CACHE: dict[type, type] = {}


class FullyShardedModule:
    """Mixin for modules converted by `fullshard.fsdp`."""

    @property
    def fullshard_runtime(self) -> Runtime:
        return runtime_of(self)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        runtime = runtime_of(self)  # type: ignore[arg-type]
        mesh = runtime.mesh
        line = (
            f"fullshard: {runtime.plan.name} over {mesh.world.size} rank(s) "
            f"(mesh {mesh.replicate.size}x{mesh.shard.size}), units: {runtime.units_description}"
        )
        own = super().extra_repr()  # type: ignore[misc]
        return f"{line}\n{own}" if own else line

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
        runtime = runtime_of(self)  # type: ignore[arg-type]
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

    def original_state_dict(self) -> dict[str, torch.Tensor]:
        """thunder's name for `fullshard.full_state_dict(model)`: every rank gets the unsharded
        state dict (original names and shapes), on CPU when `fsdp(move_state_dict_to_cpu=True)`.
        Collective: call it on every rank."""
        return full_state_dict(self)  # type: ignore[arg-type]

    def load_original_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """thunder's name for `fullshard.load_full_state_dict(model, sd)`: each rank copies its
        own rows of the unsharded tensors into its shards (in place: optimizers built on the
        shards keep working). Returns `(missing_keys, unexpected_keys)`."""
        return load_full_state_dict(self, state_dict, strict=strict)  # type: ignore[arg-type]


def mark_wrapped(module: nn.Module, runtime: Runtime) -> None:
    cls = type(module)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        # Same name, qualname and module as the original (see [Note: foreign classes]).
        new_cls = type(cls)(cls.__name__, (FullyShardedModule, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        })
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    module._fullshard_runtime = runtime  # a plain attribute: not a submodule or parameter
