"""How code outside the engine finds the `Runtime` that drives a wrapped model: `fsdp()` stores
it on the root as `_fullshard_runtime`. Apart from module.py (the mixin class) so that the
full-state functions, which module.py's methods call, can look a runtime up without importing
module.py back."""

from __future__ import annotations

from torch import nn

from fullshard.engine.hooks import Runtime


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
