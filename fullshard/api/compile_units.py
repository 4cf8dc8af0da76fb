"""A model `torch.compile`d before sharding is compiled again unit by unit, its root's frame eager.

Why: fullshard's unit hooks run eagerly (`torch.compiler.disable`, engine/eager.py). When only
the root is compiled again (`torch.compile(sharded_root)`), dynamo meets those hooks inside
the root's loop over its blocks -- a graph break in a loop -- and skips the root's whole frame:
the blocks then compile only as the frames dynamo happens to catch, and the step gains less
from compile than DDP's does on the same model (benchmarks/results/
2026-12-03-compile_step_time-2.md: 1.10x DDP's gain, where compiling each block meets 1.00x).
So the order that gains, torchtitan's -- compile each block, shard around it -- is what a
user who brings a compiled model gets:

- `fsdp(torch.compile(model, **kw))`, `FSDPStrategy.setup_module(...)` and hence
  `Fabric.setup(...)`: the `OptimizedModule` is unwrapped, its original sharded in place, then
  every unit but the root gets its `forward` compiled in place with the same options (the
  same `dynamo_ctx`, i.e. `torch.compile(unit.forward, **kw)`), and the sharded root comes back
  under an `OptimizedModule` with the same options (Lightning's `_to_compiled`), whose own
  `forward` runs eagerly (see [Note: the root's frame runs eagerly]).
- The unit's hooks stay outside its compiled `forward` (they run in `nn.Module.__call__`),
  as FSDP2 with a compiled block: nothing of the engine is traced, and a unit's forward
  compiles as one graph (with `fullgraph=True` too) shared by blocks of the same class.
- Only an instance attribute `forward` is added: names, `state_dict` keys, hooks and the
  unit's class are unchanged. A unit whose `forward` is already an instance attribute
  (fullshard's activation checkpointing, a user's patch) is left eager: its forward calls
  into the engine during recomputation, which must not be traced. So is a unit the user
  compiled already (an `OptimizedModule` block, torchtitan's order).

[Note: the root's frame runs eagerly]
The root's forward calls the units, in a loop in every model we know (HF, litgpt, the
benchmark GPT), so dynamo cannot compile it whole: it skips the frame and compiles instead
each frame of the model's own code that it calls -- HF's mask and position helpers, its
output-capturing wrappers, the loss function (torch's modules it leaves alone) -- as a
graph of its own. Each such fragment costs a guard check and the compiled-function wrappers
forward and backward, more than the few eager ops it replaces: on HF GPT-2 (gpt2-tiny, 2
ranks) the root compiled again ran 8 graphs with 4 breaks, and compile saved nothing
(compiled / eager 1.01) where with the root's frame eager it saves 2.6 ms of 28 (0.91;
benchmarks/results/2026-12-04-compile_step_time.md; -3: config A 0.75x against 0.68x DDP's
gain; one process, no collectives: 1.7 ms per step). So `finish` gives the root an instance
`forward` run under `torch._dynamo.disable` (recursive): every frame it calls runs eagerly,
except the units' compiled forwards, whose own compile context turns dynamo back on for
them. A root whose `forward` is already an instance attribute (a user's patch) is left as
it is.

Compiling *after* wrapping (`torch.compile(fsdp(model))`) is left as torch does it: the root
alone (what dynamo can of it; see above). `compile_units(model, **kw)` gives such a model the
per-unit compile explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fullshard.api.compiled import is_compiled, unwrap_compiled

_MARK = "_fullshard_compiled_forward"
_EAGER_ROOT = "_fullshard_eager_root_forward"

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


def compile_units(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile, in place, the `forward` of every unit of the sharded `model` but the root's
    with `torch.compile(..., **compile_kwargs)`; returns `model` (still not compiled itself:
    wrap it in `torch.compile` too if its own code should be)."""
    import torch

    if is_compiled(model):
        raise TypeError(
            "compile_units() takes the sharded model itself, not a torch.compile'd one: call "
            "it on the model fsdp() returned, before compiling the root."
        )
    _check_sharded(model)

    def compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, **compile_kwargs)

    compile_unit_forwards(model, compiler)
    return model


def unwrap_for_units(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """`(the model torch.compile wrapped, finish)`: `finish(sharded)` compiles each non-root
    unit's forward with the model's compile options and returns the sharded root under an
    `OptimizedModule` with them (`api.compiled.unwrap_compiled`'s), its own frame eager (see
    [Note: the root's frame runs eagerly]). A module that is not compiled: `(module, identity)`."""
    contexts = []  # outermost first
    current = module
    while is_compiled(current):
        contexts.append(current.dynamo_ctx)
        current = current._orig_mod
    inner, recompile_root = unwrap_compiled(module)
    if not contexts:
        return inner, recompile_root

    def compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
        for ctx in reversed(contexts):  # innermost first, as the user nested them
            fn = ctx(fn)
        return fn

    def finish(sharded: nn.Module) -> nn.Module:
        compile_unit_forwards(sharded, compiler)
        run_root_eagerly(sharded)
        return recompile_root(sharded)

    return inner, finish


def compile_unit_forwards(model: nn.Module, compiler: Compiler) -> list[nn.Module]:
    """Give every non-root unit of `model` a compiled instance `forward` (see the module
    docstring for which units are skipped); returns the modules compiled."""
    done = []
    for unit in _check_sharded(model).units[1:]:
        module = unit.module
        if _MARK in module.__dict__ or "forward" in module.__dict__ or is_compiled(module):
            continue  # done, an instance forward (see above), or compiled by the user
        # Bound to this module: dynamo guards on its class, not its identity
        # (inline_inbuilt_nn_modules), so blocks of one class share one graph.
        module.__dict__["forward"] = compiler(module.forward)
        module.__dict__[_MARK] = True
        done.append(module)
    return done


def run_root_eagerly(model: nn.Module) -> None:
    """Give the sharded root an instance `forward` that dynamo does not trace, nor any frame
    it calls but the units' compiled forwards (see [Note: the root's frame runs eagerly])."""
    import torch

    _check_sharded(model)
    if _EAGER_ROOT in model.__dict__ or "forward" in model.__dict__:
        return  # done, or the user's own instance forward
    model.__dict__["forward"] = torch._dynamo.disable(model.forward, recursive=True)
    model.__dict__[_EAGER_ROOT] = True


def _check_sharded(model: nn.Module) -> Any:
    runtime = getattr(model, "fullshard_runtime", None) if isinstance(model, nn.Module) else None
    if runtime is None:
        raise TypeError(
            f"compile_units() takes a model sharded by fullshard.fsdp() / FSDPStrategy, got "
            f"{type(model).__name__}."
        )
    return runtime
