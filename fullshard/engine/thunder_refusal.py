"""lightning-thunder and fullshard do not compose: either order is refused, saying what to do.

`thunder.jit(module)` traces the module's whole forward -- its hooks included -- into one
functional program whose inputs are the parameters thunder collected when it was jitted
(`ThunderModule._overrides_parameters`); later calls run that program, and the module's hooks
do not run again (a forward pre-hook on a jitted `nn.Linear` ran once in three calls). fullshard
works the other way: at every forward, hooks put each unit's gathered parameters in place of
its shards, and autograd Functions reduce the gradients unit by unit. So, as found with
lightning-thunder 0.2.6 on torch 2.9.1 (2 gloo ranks):

- `fsdp(thunder.jit(model))`: thunder keeps reading the original, unsharded parameters (the
  optimizer would get those, and they never receive a gradient), and the engine's hooks fail
  inside thunder's tracer at the first forward (`dict.fromkeys is not yet supported`).
- `thunder.jit(fsdp(model))`, or `thunder.jit` of one unit of it: thunder interprets the
  engine's hooks (collectives, storage pointers, parameter swaps) while tracing and fails
  there (`Unknown attribute untyped_storage`); had they traced, they would not run again.

Making them compose means inserting the gathers and reductions into thunder's trace, which is
what thunder's own `thunder.distributed.fsdp` does. So both are refused with a `TypeError`
before anything is sharded or traced: a `ThunderModule` anywhere in the model given to
`fsdp()` (api/functional.py), and a thunder trace reaching a unit's forward
(`refuse_thunder_trace`, called by every unit's pre-hook).

Nothing here imports thunder: a `ThunderModule` or a thunder trace exists only once thunder
has been imported, so `sys.modules` is looked up (the pre-hook looks up `THUNDER_INTERPRETER`
itself, one dict lookup per unit forward, and calls here only once thunder is imported).
"""

from __future__ import annotations

import sys

from torch import nn

_FIX = (
    "fullshard cannot shard a thunder-compiled model: thunder traces the whole forward into "
    "one program that reads the parameters it collected when it was jitted, so fullshard's "
    "per-unit gathers and reductions cannot run inside it. Either shard with thunder's own "
    "FSDP (`thunder.distributed.fsdp(model)` then `thunder.jit(...)`), or shard the plain "
    "model with `fullshard.fsdp(model)` and leave out thunder.jit (`torch.compile` composes "
    "with fullshard)."
)

THUNDER_INTERPRETER = "thunder.core.interpreter"


def refuse_thunder_module(model: nn.Module) -> None:
    """`fsdp(thunder.jit(model))` (or a model holding a `thunder.jit` submodule): a
    TypeError naming it and the fix (never while thunder is not imported)."""
    thunder_module = getattr(sys.modules.get("thunder.core.module"), "ThunderModule", None)
    if thunder_module is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, thunder_module):
            where = f"the model's submodule {name!r} is a" if name else "fsdp() was given a"
            raise TypeError(f"{where} thunder ThunderModule (from thunder.jit). {_FIX}")


def refuse_thunder_trace(unit_name: str) -> None:
    """Raise a TypeError when thunder's tracer is running this code: `thunder.jit(fsdp(m))`,
    or `thunder.jit` of one of its units, reached the forward of the unit `unit_name` (`''`:
    the root)."""
    interpreter = sys.modules.get(THUNDER_INTERPRETER)
    if interpreter is None:
        return
    # The compile context is set while thunder interprets a function, whether it interprets
    # this code or calls it opaquely, and is unset when the compiled program runs. (Checked
    # on thunder 0.2.6; a thunder without this function fails later, deep in the engine.)
    compile_context = getattr(interpreter, "get_interpretercompilectx_if_available", None)
    if compile_context is not None and compile_context() is not None:
        where = f"its unit {unit_name!r}" if unit_name else "its root"
        raise TypeError(
            f"thunder.jit() is tracing a model sharded by fullshard ({where}). {_FIX}"
        )
