"""What the engine leaves alone: torch FSDP's `ignored_modules` / `ignored_states`.

An ignored parameter is not sharded, gathered or reduced: it stays the user's full tensor on
every rank, its gradient is whatever this rank's backward accumulated (no averaging over
ranks, exactly as torch FSDP leaves it), and checkpoints hold it as a plain tensor (rank 0's
copy). An ignored module ignores every parameter and buffer in its subtree; it never becomes a
unit, and its buffers are neither moved, cast nor broadcast.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Ignored:
    modules: frozenset[int] = frozenset()
    """Ids of the ignored modules and all their descendants."""
    params: frozenset[int] = frozenset()
    """Ids of the ignored parameters (those inside ignored modules included)."""

    def __bool__(self) -> bool:
        return bool(self.modules or self.params)


def resolve_ignored(root: nn.Module, states: Iterable[object] | None) -> Ignored:
    """`states`: modules or parameters of `root` (torch's `ignored_states`, as
    `config.check_ignored_states` returns it; all of one kind is what torch asks, mixing is
    accepted here)."""
    if states is None:
        return Ignored()
    modules: set[int] = set()
    params: set[int] = set()
    known_params = {id(p) for p in root.parameters()}
    known_modules = {id(m) for m in root.modules()}
    for item in states:
        if isinstance(item, nn.Parameter):
            if id(item) not in known_params:
                raise ValueError(
                    f"An ignored parameter of shape {tuple(item.shape)} is not a parameter "
                    f"of the model being wrapped; pass parameters of this model."
                )
            params.add(id(item))
        elif isinstance(item, nn.Module):
            if item is root:
                raise ValueError(
                    "The model itself cannot be ignored: ignore its submodules or parameters."
                )
            if id(item) not in known_modules:
                raise ValueError(
                    f"An ignored module ({type(item).__name__}) is not a submodule of the model "
                    f"being wrapped; pass submodules of this model."
                )
            for sub in item.modules():
                modules.add(id(sub))
            params.update(id(p) for p in item.parameters())
        else:
            raise TypeError(
                f"ignored_modules / ignored_states must hold nn.Module or nn.Parameter objects, "
                f"got {type(item).__name__}"
            )
    return Ignored(frozenset(modules), frozenset(params))
