"""How code outside the engine finds the `Runtime` that drives a wrapped model (`fsdp()` stores
it on the root as `_fullshard_runtime`), and the runtime functions users call on a model
(`fullshard.reset_step`). Apart from module.py (the mixin class) so that the full-state
functions, which module.py's methods call, can look a runtime up without importing module.py
back."""

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


def reset_step(model: nn.Module) -> None:
    """Return a wrapped model to between steps after a forward or backward raised and you
    caught the exception: every unit released, a failed backward's reductions and partial
    gradients dropped, so the next step's numbers are as if the failed one never ran (FSDP2's
    `reset_iter_state`). Gradients already in `.grad` and a no_sync accumulation from
    earlier, complete backwards are kept (`zero_grad` drops them).

    fullshard recovers on its own at the next forward or `zero_grad`; call this to free the
    gathered memory at once (e.g. before retrying with a smaller batch after an OOM). Every
    rank must call it when any does (a failed backward's reductions are waited for). Not
    inside backward."""
    runtime_of(model).reset_step()
