"""Activation checkpointing that composes with sharding: fullshard's own, and the model's.

A checkpointed region runs its forward twice: once in the forward pass, once again inside
backward (the recomputation). The unit hooks live in `module.__call__`, so during the
recomputation only the hooks of modules *called* inside the region fire: a unit that is the
region (or lies inside it) gathers itself as usual, but the units *enclosing* the region ran
their hooks in the forward pass only, and the region would find their shards (a LayerNorm of
a block owned by the root: "weight of shape [24]"). So whoever starts a recomputation
*gathers and installs* the enclosing units it reads (`entry.enclosing_units`: every unit, nested
units excepted, that owns a parameter used in the region's subtree) for the length of the
recomputation (`_install_for_recompute`; under ZeRO-3 a real gather, the forward's
copy was released). Two kinds of region:

- fullshard's own (`activation_checkpointing_policy`): the chosen modules' `forward` is
  replaced by an instance attribute that runs it under non-reentrant `torch.utils.checkpoint`
  and, inside backward, installs the enclosing units around it. Names, `state_dict` keys and
  hooks are unchanged (no wrapper module, no `_checkpoint_wrapped_module` prefix).
- torch's `CheckpointWrapper` (the user's `apply_activation_checkpointing` before wrapping):
  its `checkpoint_fn` is wrapped as HF's function is (below); a policy on top of such a model
  is not applied again, with a warning, as Lightning does.
- the model's own: Hugging Face's `gradient_checkpointing_enable()` gives each
  `GradientCheckpointingLayer` a `_gradient_checkpointing_func` (`checkpoint`, reentrant or
  not), through which the layer checkpoints itself; it may be switched on before or after
  wrapping. What the layer hands that function differs by version: up to transformers
  5.3 its `nn.Module.__call__` (the recomputation runs the layer's hooks), from later 5.x
  its plain `forward` (so that FSDP2's hooks stay outside the checkpoint; the recomputation
  runs no hook of the layer, a unit's own gather included). Hooks cannot serve both, so the
  function itself is wrapped (`_RecomputeGuard`): whatever it is handed runs as before, and
  inside backward the layer's enclosing units *and its own unit* are installed around it
  (where the layer's hooks run too, they install its unit a second time, which is
  harmless: a recomputation's installs are uncounted and idempotent). HF sets the function
  afresh at every enable, so it is wrapped again where found unwrapped: at wrap time and
  before each forward of the root or of an entry point (`entry.entry_points`: the ways
  into the model), i.e. before any layer is called -- not in the layer's own pre-hook,
  which 5.3 runs only after it has looked the function up. Traced as no-ops under
  torch.compile.

How the recomputed graph's gradients reach the reductions (it is never differentiated under
non-reentrant checkpointing and is the only route under reentrant checkpointing) is the
unit's business: see [Note: recomputed forwards] in engine/unit.py.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from fullshard.engine.autograd import in_eager_backward, in_eager_forward
from fullshard.engine.entry import enclosing_units, entry_points
from fullshard.engine.wrap import normalize_policy, policy_modules

if TYPE_CHECKING:
    from fullshard.engine.hooks import Runtime
    from fullshard.engine.unit import Unit


def _checkpointed_modules(
    model: nn.Module, policy: object, numel_of: dict[int, int]
) -> list[nn.Module]:
    """The modules torch's `apply_activation_checkpointing(model, auto_wrap_policy=policy)`
    would wrap on the unsharded model (`numel_of`: unsharded sizes, the registered parameters
    are shards by now)."""
    fn = normalize_policy(policy)
    return [] if fn is None else policy_modules(model, fn, numel_of=numel_of, claim=False)


def apply_activation_checkpointing(model: nn.Module, policy: object, runtime: Runtime) -> None:
    # torch's CheckpointWrapper (by name: torch's module for it is private). Checkpointing
    # the layers inside it again would recompute each of them twice per backward.
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    if wrapped and normalize_policy(policy) is not None:
        warnings.warn(
            f"activation_checkpointing_policy is configured, but the model already contains "
            f"checkpointed layers ({len(wrapped)}, e.g. {wrapped[0]!r}): the policy is not "
            f"applied, so nothing is checkpointed twice. Drop the policy or the manual "
            f"checkpointing to silence this.",
            stacklevel=3,
        )
        policy = None
    numel_of = {id(p.param): p.layout.numel for u in runtime.units for p in u.params}
    for module in _checkpointed_modules(model, policy, numel_of):
        needed = enclosing_units(module, runtime, called=False)
        module.forward = functools.partial(_checkpointed_forward, module.forward, runtime, needed)
    hook_model_checkpointing(model, runtime)


class _RecomputeGuard:
    """A layer's `_gradient_checkpointing_func`, wrapped: checkpoints what it is handed
    through `inner` (HF's function), installing `needed` around the recomputation."""

    __slots__ = ("inner", "runtime", "needed")

    def __init__(self, inner: Any, runtime: Runtime, needed: list[Unit]) -> None:
        self.inner, self.runtime, self.needed = inner, runtime, needed

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        run = functools.partial(_run, function, self.runtime, self.needed)
        return self.inner(run, *args, **kwargs)


_FUNC = "_gradient_checkpointing_func"


def _guard_layers(layers: list[tuple[nn.Module, list[Unit]]], runtime: Runtime) -> None:
    """Wrap the checkpoint function of each layer that has an unwrapped one."""
    for layer, needed in layers:
        func = layer.__dict__.get(_FUNC)
        if func is not None and not isinstance(func, _RecomputeGuard):
            layer.__dict__[_FUNC] = _RecomputeGuard(func, runtime, needed)


def _guard_before_forward(layers: list[tuple[nn.Module, list[Unit]]], runtime: Runtime,
                          *_: Any) -> None:
    if in_eager_forward():
        _guard_layers(layers, runtime)


def hook_model_checkpointing(model: nn.Module, runtime: Runtime) -> None:
    """Let the model's own checkpointed layers (Hugging Face) recompute with the units they
    read installed (see the module docstring). Layers whose recomputation needs no unit
    installed (none owns a parameter they use outside units nested in them) are left alone."""
    layers: list[tuple[nn.Module, list[Unit]]] = []
    for module in model.modules():
        # torch's CheckpointWrapper runs `checkpoint_fn(wrapped_module, ...)`, guarded as HF's
        # function is; HF's layers by class name too (transformers is not imported)
        wrapper = type(module).__name__ == "CheckpointWrapper" and callable(
            getattr(module, "checkpoint_fn", None))
        if not (wrapper or any(c.__name__ == "GradientCheckpointingLayer"
                               for c in type(module).__mro__)):
            continue
        needed = enclosing_units(module, runtime, called=False)
        if needed and wrapper:  # its checkpoint function is set once, at construction
            module.checkpoint_fn = _RecomputeGuard(module.checkpoint_fn, runtime, needed)
        elif needed:
            layers.append((module, needed))
    if not layers:
        return
    _guard_layers(layers, runtime)
    # The ways into the model: every forward that reaches a layer passes one of them first.
    for way_in in (model, *entry_points(model)):
        way_in.register_forward_pre_hook(functools.partial(_guard_before_forward, layers, runtime))


def _install_for_recompute(runtime: Runtime, needed: list[Unit]) -> None:
    """Gather and install `needed` for a recomputation that runs outside their hooks, as for
    a unit's own recomputation (`Unit.install_recomputed`): trainable tensors require grad, so
    the recomputed ops save exactly what the original forward saved (non-reentrant checkpoint
    checks), and a reentrant checkpoint's nested backward hands their gradients to
    `Runtime.recomputed_backward`. Released by each unit's own last node, or at the end of
    backward."""
    runtime.ensure_backward_callback()
    for unit in needed:
        unit.reshard_if_stale()
        if not unit.is_gathered:
            unit.start_gather(async_op=False)
        unit.wait_gathered()
        unit.install_recomputed(runtime)


def _checkpointed_forward(
    original: Any, runtime: Runtime, needed: list[Unit], *args: Any, **kwargs: Any
) -> Any:
    return checkpoint(_run, original, runtime, needed, *args, use_reentrant=False, **kwargs)


def _run(original: Any, runtime: Runtime, needed: list[Unit], *args: Any, **kwargs: Any) -> Any:
    if not in_eager_backward():
        return original(*args, **kwargs)
    # Recomputation inside backward: the hooks of the enclosing units are not running.
    _install_for_recompute(runtime, needed)
    try:
        return original(*args, **kwargs)
    finally:
        for unit in needed:
            unit.uninstall()
