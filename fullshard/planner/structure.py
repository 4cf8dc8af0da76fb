"""The shape of a wrapped model as the engine would build it: units, their buckets, and each
bucket's parameter shapes, dtype and trainability -- without sharding anything.

It is read off the (usually meta-device) model with the engine's own functions: `select_units`
and `assign_params` (`engine/wrap.py`) decide the units and which unit owns every parameter
(tied weights go to the innermost common unit), and `_bucket_groups` (`engine/sharding.py`)
groups each unit's parameters into buckets by the bucketing strategy, dtype and
`requires_grad`. Everything that depends on the world size is then pure arithmetic on these
shapes with `ShardLayout` (`engine/layout.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from fullshard.config import FSDPBucketingStrategy
from fullshard.engine.layout import ShardLayout
from fullshard.engine.sharding import _bucket_groups
from fullshard.engine.wrap import assign_params, select_units


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: the parameters one collective moves."""

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    """The shards' dtype as the engine would hold them (after any '-true' conversion)."""
    requires_grad: bool

    @property
    def numel(self) -> int:
        return sum(_layout(s, 1, 0).numel for s in self.shapes)

    def padded_shard_numel(self, shard_size: int) -> int:
        """L: elements of one rank's padded flat shard (the same on every rank)."""
        return sum(_layout(s, shard_size, 0).padded_shard_numel for s in self.shapes)

    def local_numels(self, shard_size: int, shard_rank: int) -> list[int]:
        """Real (unpadded) elements of each parameter's shard on `shard_rank`."""
        out = []
        for s in self.shapes:
            layout = _layout(s, shard_size, shard_rank)
            out.append(layout.local_rows * layout.row_numel)
        return out


@dataclass(frozen=True)
class UnitSpec:
    name: str
    """Module path of the unit ('' for the root)."""
    class_name: str
    buckets: tuple[BucketSpec, ...]

    @property
    def trainable(self) -> bool:
        return any(b.requires_grad for b in self.buckets)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)


@dataclass(frozen=True)
class ModelStructure:
    units: tuple[UnitSpec, ...]
    """Root first, then in module order (which is forward order for the usual models)."""

    @property
    def numel(self) -> int:
        """Psi: the number of (unique) parameter elements."""
        return sum(u.numel for u in self.units)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.shapes) for u in self.units for b in u.buckets)

    @property
    def trainable_tensors(self) -> int:
        return sum(len(b.shapes) for u in self.units for b in u.buckets if b.requires_grad)

    def describe_units(self) -> str:
        """E.g. 'root + 32 x LlamaBlock'."""
        counts: dict[str, int] = {}
        for u in self.units[1:]:
            counts[u.class_name] = counts.get(u.class_name, 0) + 1
        return " + ".join(["root", *(f"{n} x {c}" for c, n in counts.items())])


def model_structure(
    model: nn.Module,
    policy: object,
    bucketing: FSDPBucketingStrategy,
    *,
    shard_dtype: torch.dtype | None = None,
) -> ModelStructure:
    """Units and buckets of `model` under `policy` and `bucketing`.

    `shard_dtype`: the dtype floating-point parameters are converted to before wrapping
    (Lightning's '16-true' / 'bf16-true'); None keeps each parameter's own dtype. Bucket groups
    are formed with the parameters' current dtypes, which a uniform conversion cannot split
    differently.
    """
    unit_modules = select_units(model, policy)
    owned = assign_params(model, unit_modules)
    names = {id(m): n for n, m in model.named_modules()}
    units = []
    for module in unit_modules:
        mine = [o for o in owned if o.unit is module]
        buckets = []
        for group in _bucket_groups(mine, bucketing):
            first = group[0].current
            dtype = first.dtype
            if shard_dtype is not None and dtype.is_floating_point:
                dtype = shard_dtype
            shapes = tuple(o.current.shape for o in group)
            buckets.append(BucketSpec(shapes, dtype, first.requires_grad))
        units.append(UnitSpec(names[id(module)], type(module).__name__, tuple(buckets)))
    return ModelStructure(tuple(units))


@cache
def _layout(shape: torch.Size, shard_size: int, shard_rank: int) -> ShardLayout:
    return ShardLayout(shape, shard_size, shard_rank)
