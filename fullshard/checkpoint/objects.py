"""What the objects in a checkpoint's `state` are, and how their tensors are laid out.

Both formats start here. A `state` dict holds modules (sharded by fullshard or plain),
optimizers, *stateful* objects (anything with `state_dict` / `load_state_dict`: LR schedulers,
gradient scalers, ...) and plain values. This module owns:

- `ParamInfo`: one parameter's name, unsharded shape and `ShardLayout` -- a trivial one-rank
  layout for a plain module, so every format treats "a plain module" as "sharded over one rank"
  and a checkpoint written by N ranks loads into M ranks or into no process group alike;
- the optimizer <-> parameter-name mapping (optimizer state is keyed by parameter *name* in
  both formats, so it does not depend on the order the optimizer was built in);
- which optimizer-state tensors are laid out like their parameter ("rows": sharded with it)
  and which are whole (Adam's `step`);
- `filter` on save, and restoring plain values and stateful objects on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from fullshard.distributed import comm
from fullshard.engine.layout import ShardLayout
from fullshard.engine.module import FullyShardedModule
from fullshard.engine.runtime_lookup import runtime_of

Filter = Mapping[str, Callable[[str, Any], bool]]

MODULE, OPTIMIZER, STATEFUL, VALUE = "module", "optimizer", "stateful", "value"


def kind_of(obj: object) -> str:
    """How a `state` entry is saved: 'module', 'optimizer', 'stateful' or 'value'."""
    if isinstance(obj, nn.Module):
        return MODULE
    if isinstance(obj, Optimizer):
        return OPTIMIZER
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return STATEFUL
    return VALUE


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FullyShardedModule)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as checkpoints see it."""

    name: str
    """Its first name in `module.named_parameters()` (the original name, no wrapper prefix)."""
    param: torch.Tensor
    """The tensor the module holds: this rank's shard (sharded) or the whole parameter."""
    layout: ShardLayout
    """Where its rows live; `shard_size == 1` for a plain module (or NO_SHARD)."""
    group: comm.Group | None
    """The shard-axis group the rows are spread over; None when `shard_size == 1`."""

    @property
    def shape(self) -> torch.Size:
        """The unsharded shape, as the user's module defines it (`()` for a 0-dim one)."""
        return self.layout.shape

    @property
    def rows_shape(self) -> torch.Size:
        """The unsharded shape as rows, `(dim0, *rest)`: how the sharded format stores it
        (a 0-dim parameter is one row, as everywhere in fullshard)."""
        return torch.Size((self.layout.dim0, *self.layout.rest))

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like `param`) viewed as this rank's rows, `layout.local_shape`."""
        return tensor.reshape(self.layout.local_shape)


def module_params(module: nn.Module) -> dict[str, ParamInfo]:
    """The module's parameters by name (first name of a tied parameter only)."""
    if is_sharded(module):
        runtime = runtime_of(module)
        group = runtime.mesh.shard if runtime.mesh.shard.size > 1 else None
        infos = [
            ParamInfo(sp.fqn, sp.param, sp.layout, group)
            for unit in runtime.units
            for sp in unit.params
        ]
    else:
        infos = [
            ParamInfo(name, p, ShardLayout(p.shape, 1, 0), None)
            for name, p in module.named_parameters()
        ]
    return {info.name: info for info in infos}


def optimizer_param_names(
    optimizer: Optimizer, modules: Mapping[str, nn.Module], key: str
) -> tuple[str, list[str]]:
    """`(module_key, [name of each parameter in the optimizer's order])`.

    The optimizer's parameters must all belong to one module of `state`: its state is keyed by
    that module's parameter names.
    """
    owners: dict[int, tuple[str, str]] = {}
    for mkey, module in modules.items():
        for name, info in module_params(module).items():
            owners.setdefault(id(info.param), (mkey, name))
    found: list[tuple[str, str]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owners:
                raise ValueError(
                    f"The optimizer {key!r} holds a parameter of shape {tuple(p.shape)} (param "
                    f"group {group_index}) that belongs to none of the modules in the state "
                    f"({', '.join(map(repr, modules)) or 'none'}). Put the model the "
                    f"optimizer trains into the state, e.g. state={{'model': model, "
                    f"{key!r}: optimizer}}, and build the optimizer on the set-up model's "
                    f"parameters."
                )
            found.append(owners[id(p)])
    mkeys = sorted({m for m, _ in found})
    if len(mkeys) > 1:
        raise ValueError(
            f"The optimizer {key!r} trains parameters of several modules in the state "
            f"({', '.join(map(repr, mkeys))}); its state is keyed by parameter name, so it must "
            f"train one module. Use one optimizer per module, or one module holding them all."
        )
    if not mkeys:  # an optimizer without parameters: nothing to key
        return (next(iter(modules), ""), [])
    return mkeys[0], [name for _, name in found]


def is_rows(value: object, param: torch.Tensor, state_key: str) -> bool:
    """Is this optimizer-state value laid out like its parameter (sharded with it)?

    Shaped exactly like the parameter, except a 0-dim `step` next to a 0-dim parameter
    (a plain module's scalar parameter: Adam's step count is whole, not a row).
    """
    return (
        isinstance(value, torch.Tensor)
        and value.shape == param.shape
        and not (value.dim() == 0 and state_key == "step")
    )


def optimizer_groups(
    param_groups: list[dict[str, Any]], names: list[str]
) -> list[dict[str, Any]]:
    """`optimizer.state_dict()['param_groups']` with parameter names instead of indices."""
    return [{**g, "params": [names[i] for i in g["params"]]} for g in param_groups]


def groups_to_load(
    saved: list[dict[str, Any]], optimizer: Optimizer, names: list[str], key: str, strict: bool
) -> list[dict[str, Any]]:
    """The saved groups' hyperparameters with this optimizer's parameter indices, for
    `optimizer.load_state_dict`. The groups are matched by position; with `strict` each must
    hold the same parameter names as the saved one."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer {key!r} has {len(saved)} parameter group(s), the "
            f"optimizer being loaded has {len(optimizer.param_groups)}. Build the optimizer "
            f"with the same param groups as when the checkpoint was saved."
        )
    out, start = [], 0
    for i, (group, current) in enumerate(zip(saved, optimizer.param_groups)):
        check_same_kind(group, current, optimizer, key)
        n = len(current["params"])
        mine = names[start : start + n]
        theirs = list(group["params"])
        if strict and mine != theirs and not all(isinstance(x, int) for x in theirs):
            raise ValueError(
                f"Parameter group {i} of optimizer {key!r} holds different parameters in the "
                f"checkpoint ({_short(theirs)}) than in the optimizer being loaded "
                f"({_short(mine)}). Build the param groups as when saving, or pass strict=False "
                f"to take the group hyperparameters by position."
            )
        out.append({**group, "params": list(range(start, start + n))})
        start += n
    return out


# Keys LR schedulers add to param groups: not the optimizer's own hyperparameters.
_SCHEDULER_KEYS = frozenset({"initial_lr", "base_lr", "max_lr", "min_lr", "base_momentum",
                             "max_momentum", "params"})


def check_same_kind(saved: Mapping[str, Any], current: Mapping[str, Any], optimizer: Optimizer,
                    key: str) -> None:
    """Refuse the state of another optimizer type (AdamW's into SGD): torch would take the
    saved hyperparameters as they are and the next `step()` would fail with a `KeyError`.

    Another type both lacks some of this optimizer's hyperparameters and holds others. A
    newer torch adding a hyperparameter only makes keys missing (torch fills them in), and a
    scheduler's keys are ignored, so neither is mistaken for another type."""
    have, need = set(saved) - _SCHEDULER_KEYS, set(current) - _SCHEDULER_KEYS
    missing, extra = sorted(need - have), sorted(have - need)
    if not (missing and extra):
        return
    raise ValueError(
        f"The checkpoint's optimizer {key!r} was saved by another optimizer type "
        f"({_guess_type(have)}: its param groups hold {extra}) than the one being loaded "
        f"({type(optimizer).__name__}, which needs {missing}). Build the optimizer as when "
        f"saving, or leave {key!r} out of the state to load."
    )


def _guess_type(keys: set[str]) -> str:
    """The torch.optim classes whose hyperparameters best match a param group's keys."""
    import inspect

    import torch.optim as optim

    scores = []
    for name in dir(optim):
        cls = getattr(optim, name)
        if isinstance(cls, type) and issubclass(cls, Optimizer) and cls is not Optimizer:
            try:
                sig = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
            except (TypeError, ValueError):
                continue
            scores.append((len(sig ^ keys), name))
    if not scores:
        return "another optimizer"
    best = min(s for s, _ in scores)
    names = sorted(n for s, n in scores if s <= best + 1)[:3]
    return " or ".join(names) if best <= 2 else "an optimizer other than torch.optim's"


def _short(names: list[Any]) -> str:
    return repr(names) if len(names) <= 4 else f"{names[:4]!r}... ({len(names)} in all)"


def apply_filter(key: str, value: Any, filter: Filter | None) -> Any:
    """Lightning's `filter`: keep the items `(name, value)` of a dict value for which
    `filter[key](name, value)` is true (a module's parameter names; an optimizer's 'state' and
    'param_groups'; a stateful object's state-dict keys); other values pass unchanged."""
    if filter is None or key not in filter or not isinstance(value, Mapping):
        return value
    return {k: v for k, v in value.items() if filter[key](k, v)}


def check_filter(filter: Filter | None, state: Mapping[str, Any]) -> None:
    if filter is None:
        return
    if not isinstance(filter, Mapping):
        raise TypeError(
            f"filter must be a dict of state key -> callable(name, value) -> bool, got "
            f"{type(filter).__name__}: {filter!r}"
        )
    unknown = sorted(set(filter) - set(state))
    if unknown:
        raise ValueError(
            f"The filter keys {unknown} are not keys of the state ({sorted(state)}); a filter "
            f"selects entries of the state object with the same key."
        )
    for k, fn in filter.items():
        if not callable(fn):
            raise TypeError(f"filter[{k!r}] must be a callable(name, value) -> bool, got {fn!r}")


def restore(state: dict[str, Any], key: str, value: Any) -> None:
    """Put a loaded value back: stateful objects in place, plain values into `state`."""
    if kind_of(state[key]) == STATEFUL:
        state[key].load_state_dict(value)
    else:
        state[key] = value


def missing_key(key: str, path: object) -> KeyError:
    return KeyError(
        f"The requested state contains a key {key!r} that does not exist in the loaded "
        f"checkpoint {str(path)!r}. To disable strict loading, set `strict=False`."
    )


def split_state(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`state` by kind: {'module': {...}, 'optimizer': {...}, 'stateful': {...}, ...}."""
    out: dict[str, dict[str, Any]] = {MODULE: {}, OPTIMIZER: {}, STATEFUL: {}, VALUE: {}}
    for key, obj in state.items():
        if not isinstance(key, str):
            raise TypeError(
                f"Checkpoint state keys must be strings, got {type(key).__name__} {key!r}."
            )
        out[kind_of(obj)][key] = obj
    return out
