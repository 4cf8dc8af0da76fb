"""One original parameter after sharding: its layout, its local shard, where modules use it.

The user-visible `nn.Parameter` (`param`) is a view of the *real* rows this rank owns inside its
bucket's flat shard storage; the padded rows behind it stay zero because nothing but the engine
writes there. The optimizer therefore holds exactly the local rows (its state is sharded for
free) and an in-place update of `param` is an update of the bytes the next all-gather sends.

`refs` lists every `(module, attribute)` that holds the parameter -- several for tied weights:
where `Unit.install` puts the unsharded tensor while the owning unit is gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fullshard.engine.layout import ShardLayout


@dataclass(eq=False)
class ShardedParam:
    fqn: str
    """The first name under which the parameter appears in `named_parameters()`."""
    layout: ShardLayout
    requires_grad: bool
    refs: list[tuple[nn.Module, str]]
    offset: int = 0
    """Element offset of this parameter's padded shard inside its bucket's flat shard."""
    param: nn.Parameter = field(init=False, repr=False)

    def attach(self, padded_shard: torch.Tensor) -> None:
        """Make the local `nn.Parameter` a view of `padded_shard`'s real rows and register it
        in every module that held the original parameter."""
        local = padded_shard[: self.layout.local_rows]
        self.param = nn.Parameter(local, requires_grad=self.requires_grad)
        for module, name in self.refs:
            module._parameters[name] = self.param


def params_by_module(params: Iterable[ShardedParam]) -> dict[nn.Module, dict[str, ShardedParam]]:
    """Each module that holds sharded parameters, with them under its own attribute names
    (a tied weight appears under each module that holds it): where the state-dict hooks go."""
    by_module: dict[nn.Module, dict[str, ShardedParam]] = {}
    for sp in params:
        for module, name in sp.refs:
            by_module.setdefault(module, {})[name] = sp
    return by_module
