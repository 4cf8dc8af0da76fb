"""Options users pass to fullshard: the strategy enums and their parsing.

Everything here is plain data. `ShardingPlan` is what the engine actually consumes: a strategy
name from any door (`FSDPType`, `ShardingStrategy`, torch's enum, or a string) is turned into one
by `resolve_sharding_strategy`, so the engine never sees the many spellings.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class FSDPType(enum.Enum):
    """The functional door's strategy names (as in thunder's `fsdp`)."""

    ZERO2 = "ZERO2"
    """Gather each unit once in forward and keep it until its backward (like SHARD_GRAD_OP)."""
    ZERO3 = "ZERO3"
    """Release each unit after its forward and gather it again for backward (like FULL_SHARD)."""


class ShardingStrategy(enum.Enum):
    """The strategy names of torch FSDP / Lightning Fabric."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


class FSDPBucketingStrategy(enum.Enum):
    """How many tensors one collective moves."""

    NONE = "NONE"
    """One collective per parameter."""
    LAYER = "LAYER"
    """One collective per leaf module that owns parameters (`nn.Linear`, `nn.LayerNorm`, ...)."""
    BLOCK = "BLOCK"
    """One collective per unit (e.g. per transformer block)."""


@dataclass(frozen=True)
class ShardingPlan:
    """What a strategy means to the engine.

    `reshard_after_forward` is the ZeRO-3 / ZeRO-2 switch for every unit but the root;
    `reshard_root_after_forward` releases the root after its forward too. The root's backward
    runs first, so releasing it only to gather it again at once costs one exposed exchange;
    by default it stays gathered into backward (FSDP2's `reshard_after_forward=None`, see
    `with_reshard_after_forward`). `hybrid` asks for a 2-D (replicate, shard) mesh and
    `no_shard` for the `(N, 1)` mesh. The mesh itself is chosen once the world size is known
    (`fullshard.distributed.mesh`). `post_forward_size` > 0 (FSDP2's integer
    `reshard_after_forward`, ZeRO++'s hpZ) keeps, after a unit's forward, a copy of its
    parameters sharded over that many consecutive ranks (one node), which backward gathers
    from instead of from the whole shard axis.
    """

    name: str
    reshard_after_forward: bool
    no_shard: bool = False
    hybrid: bool = False
    reshard_root_after_forward: bool = False
    post_forward_size: int = 0

    def with_reshard_after_forward(self, value: bool | int | None) -> ShardingPlan:
        """This plan with FSDP2's `reshard_after_forward` applied.

        None keeps the strategy's meaning (FULL_SHARD / HYBRID_SHARD / ZERO3: every unit but
        the root; the others: none). True releases every unit after its forward, the root
        included; False keeps every unit gathered until its backward (ZeRO-2's schedule).
        True on a strategy that keeps parameters gathered is a contradiction (ValueError).
        An int `k` (FSDP2's) reshards every unit but the root to `k` ranks after its forward:
        each keeps 1/k of the unit, a run of `k` consecutive ranks (one node when `k` is the
        ranks per node) holds it whole, and backward gathers it from them only. The root stays
        gathered into backward, as with None. `k` must divide the shard axis (checked with
        the mesh); 1 keeps a whole copy on every rank, i.e. False.
        """
        if value is not None and not isinstance(value, int):
            raise TypeError(
                f"reshard_after_forward must be True, False, None or an int (ranks to reshard "
                f"to after forward), got {type(value).__name__}: {value!r}"
            )
        if value is None:
            return self
        if not isinstance(value, bool) and value < 1:
            raise ValueError(
                f"reshard_after_forward={value} must be >= 1: the ranks a unit is resharded to "
                f"after forward, e.g. the ranks per node."
            )
        if value is not True and value is not False and value == 1:
            value = False  # one rank holds the whole unit: kept gathered
        if value and not self.reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward={value!r} asks to release parameters after forward, "
                f"but sharding_strategy {self.name!r} keeps them gathered until backward. Use "
                f"FULL_SHARD (or HYBRID_SHARD) with reshard_after_forward={value!r}, or drop it."
            )
        if isinstance(value, bool):
            return dataclasses.replace(
                self, reshard_after_forward=value, reshard_root_after_forward=value
            )
        return dataclasses.replace(self, post_forward_size=value)

    def unit_reshards(self, choice: object, *, is_root: bool, name: str) -> bool:
        """Whether one unit is released after its forward: `choice` is what a per-unit
        `reshard_after_forward` callable returned for it (None: this plan's default for the
        root or for the other units). As FSDP2's per-module argument: False keeps a unit
        gathered from its forward into its backward (the unit that runs last in forward runs
        first in backward, so resharding it only gathers it again at once), True releases it
        after its forward even under ZeRO-2's schedule."""
        if choice is None:
            return self.reshard_root_after_forward if is_root else self.reshard_after_forward
        if not isinstance(choice, bool):
            raise TypeError(
                f"reshard_after_forward(module) must return True, False or None for each unit; "
                f"for unit {name or '<root>'!r} it returned {type(choice).__name__}: {choice!r}"
            )
        return choice


_PLANS = {
    "ZERO3": ShardingPlan("ZERO3", reshard_after_forward=True),
    "FULL_SHARD": ShardingPlan("FULL_SHARD", reshard_after_forward=True),
    "ZERO2": ShardingPlan("ZERO2", reshard_after_forward=False),
    "SHARD_GRAD_OP": ShardingPlan("SHARD_GRAD_OP", reshard_after_forward=False),
    "NO_SHARD": ShardingPlan("NO_SHARD", reshard_after_forward=False, no_shard=True),
    "HYBRID_SHARD": ShardingPlan("HYBRID_SHARD", reshard_after_forward=True, hybrid=True),
    "_HYBRID_SHARD_ZERO2": ShardingPlan(
        "_HYBRID_SHARD_ZERO2", reshard_after_forward=False, hybrid=True
    ),
}


def valid_strategy_names() -> list[str]:
    return list(_PLANS)


def resolve_sharding_strategy(strategy: object) -> ShardingPlan:
    """Turn any accepted spelling of a sharding strategy into a `ShardingPlan`.

    Accepts `FSDPType`, `ShardingStrategy`, torch's `torch.distributed.fsdp.ShardingStrategy`
    (matched by member name) and strings in any case.
    """
    if isinstance(strategy, ShardingPlan):
        return strategy
    if isinstance(strategy, enum.Enum):
        key = strategy.name
    elif isinstance(strategy, str):
        key = strategy.strip().upper()
    else:
        raise TypeError(
            f"sharding_strategy must be an FSDPType, a ShardingStrategy or a string, "
            f"got {type(strategy).__name__}: {strategy!r}"
        )
    if key not in _PLANS:
        raise ValueError(
            f"Unknown sharding strategy {strategy!r}. Valid strategies: "
            f"{', '.join(valid_strategy_names())}."
        )
    return _PLANS[key]


def resolve_bucketing_strategy(bucketing: object) -> FSDPBucketingStrategy:
    """Accept an `FSDPBucketingStrategy` or its name in any case."""
    if isinstance(bucketing, FSDPBucketingStrategy):
        return bucketing
    if not isinstance(bucketing, str):
        raise TypeError(
            f"bucketing_strategy must be an FSDPBucketingStrategy or a string, got "
            f"{type(bucketing).__name__}: {bucketing!r}"
        )
    if isinstance(bucketing, str):
        key = bucketing.strip().upper()
        if key in FSDPBucketingStrategy.__members__:
            return FSDPBucketingStrategy[key]
    names = ", ".join(FSDPBucketingStrategy.__members__)
    raise ValueError(f"Unknown bucketing strategy {bucketing!r}. Valid strategies: {names}.")


# -- checks of plain arguments, shared by the doors (fsdp(), FSDPStrategy, state dicts) ---------

def check_bool(name: str, value: object, *, optional: bool = False) -> bool | None:
    """`value` if it is a bool (or None, when `optional`), else a `TypeError` naming `name`:
    a string such as "no" would otherwise count as True."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    accepted = "True, False or None" if optional else "True or False"
    raise TypeError(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")


def check_ignored_states(name: str, value: object) -> tuple[object, ...] | None:
    """torch FSDP's `ignored_states` / `ignored_modules`: None, one module or parameter, or an
    iterable of them, as a tuple (the items' kinds are checked against the model later)."""
    if value is None:
        return None
    if isinstance(value, nn.Module | torch.Tensor):
        return (value,)
    if isinstance(value, str | bytes) or not _iterable(value):
        raise TypeError(
            f"{name} must be None, an nn.Module or nn.Parameter, or an iterable of them; got "
            f"{type(value).__name__} {value!r}"
        )
    return tuple(value)  # type: ignore[arg-type]


def check_module_classes(name: str, value: object) -> tuple[type[nn.Module], ...]:
    """One nn.Module subclass or an iterable of them (Lightning's `activation_checkpointing`)."""
    classes = (value,) if isinstance(value, type) else value
    if isinstance(classes, str | bytes) or not _iterable(classes):
        classes = (value,)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(
            f"{name} must be an nn.Module subclass or a list of them, got "
            f"{type(value).__name__} {value!r}"
        )
    return tuple(classes)


def _iterable(value: object) -> bool:
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(
            f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got {value!r}"
        )


def _default_full_precision_modules() -> tuple[type[nn.Module], ...]:
    return (_BatchNorm,)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for computation and communication; the shards (the optimizer's master weights)
    keep their own dtype. The fields mean what torch FSDP1's `MixedPrecision` fields mean.

    - `param_dtype`: shards are cast to it before the all-gather, so modules compute in it and
      the gathered bytes shrink accordingly;
    - `reduce_dtype`: gradients are reduced in it (default: `param_dtype`) and handed to the
      optimizer in the shards' dtype;
    - `buffer_dtype`: buffers are cast to it;
    - `keep_low_precision_grads`: hand the reduced gradients to `.grad` in `reduce_dtype`
      instead of the shards' dtype (for an optimizer that steps on low-precision gradients);
    - `cast_forward_inputs`: floating-point inputs of every unit are cast to `param_dtype`;
    - `cast_root_forward_inputs`: floating-point inputs of the root are cast to `param_dtype`
      (torch's default; it wins over `cast_forward_inputs` for the root);
    - `full_precision_modules`: module classes that stay out of mixed precision (torch's
      `_module_classes_to_ignore`, BatchNorm by default): their parameters are gathered and
      reduced in the shards' dtype, their buffers keep theirs, and their floating inputs are
      cast to fp32 and their outputs back to the input dtype (torch's hooks for the same).

    Our own default is `cast_forward_inputs=True` (every unit casts; the cast is a no-op once
    the root has cast); torch's class defaults to False and relies on the root cast. Torch
    FSDP1 keeps `full_precision_modules` in fp32 only when an `auto_wrap_policy` is given;
    fullshard does it whenever mixed precision is on (see the README).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = True
    cast_root_forward_inputs: bool = True
    full_precision_modules: tuple[type[nn.Module], ...] = field(
        default_factory=_default_full_precision_modules
    )

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            _check_dtype(name, getattr(self, name))
        for name in ("keep_low_precision_grads", "cast_forward_inputs",
                     "cast_root_forward_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"MixedPrecision.{name} must be a bool, got {getattr(self, name)!r}"
                )
        classes = self.full_precision_modules
        if isinstance(classes, type):
            classes = (classes,)
        try:
            classes = tuple(classes)
        except TypeError:
            classes = (classes,)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"MixedPrecision.full_precision_modules must hold nn.Module subclasses, got "
                f"{bad!r}"
            )
        object.__setattr__(self, "full_precision_modules", classes)

    @classmethod
    def coerce(cls, value: object) -> MixedPrecision | None:
        """Accept ours, torch's `torch.distributed.fsdp.MixedPrecision` (every field,
        `_module_classes_to_ignore` included) or FSDP2's `MixedPrecisionPolicy`, or None."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if hasattr(value, "param_dtype") and hasattr(value, "reduce_dtype"):
            return cls(
                param_dtype=value.param_dtype,
                reduce_dtype=value.reduce_dtype,
                buffer_dtype=getattr(value, "buffer_dtype", None),
                keep_low_precision_grads=bool(getattr(value, "keep_low_precision_grads", False)),
                cast_forward_inputs=bool(getattr(value, "cast_forward_inputs", True)),
                cast_root_forward_inputs=bool(getattr(value, "cast_root_forward_inputs", True)),
                full_precision_modules=tuple(getattr(value, "_module_classes_to_ignore", ())),
            )
        raise TypeError(
            f"mixed_precision must be a fullshard.MixedPrecision, torch's "
            f"torch.distributed.fsdp.MixedPrecision, or None; got {type(value).__name__}"
        )


@dataclass(frozen=True)
class CPUOffload:
    """Keep shards, their gradients and the optimizer state in (pinned) host memory."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(
                f"CPUOffload.offload_params must be a bool, got {self.offload_params!r}"
            )

    @classmethod
    def coerce(cls, value: object) -> CPUOffload:
        """Accept a bool, ours, torch's `CPUOffload`, or None (no offload)."""
        if value is None:
            return cls()
        if isinstance(value, bool):
            return cls(offload_params=value)
        if isinstance(value, CPUOffload):
            return value
        if hasattr(value, "offload_params"):  # torch's, which does not check its field
            return cls(offload_params=check_bool("cpu_offload.offload_params",
                                                 value.offload_params))
        raise TypeError(
            f"cpu_offload must be True, False, None, fullshard.CPUOffload or torch's "
            f"CPUOffload; got {type(value).__name__} {value!r}"
        )


COMPRESSED_FORMATS = ("bf16", "int8")
"""The compressed wire formats a `Compression` field may name (None: the exact bytes)."""

COMPRESSION_BLOCK_SIZES = (32, 4096)
"""Smallest and largest `Compression.block_size` (powers of two in between)."""


@dataclass(frozen=True, kw_only=True)
class Compression:
    """What travels compressed on the wire; the shards, the optimizer step and checkpoints
    stay full precision (distributed/wire_format.py holds the formats and their error).

    - `weights`: gathers of trainable parameters, dequantized into the compute dtype on
      arrival (ZeRO++'s qwZ for "int8");
    - `gradients`: reductions, each rank's chunks quantized, exchanged, dequantized and summed
      in fp32 (ZeRO++'s qgZ for "int8"; never summed in int8);
    - `frozen_weights`: gathers of buckets whose parameters all have `requires_grad=False`
      at this step (a frozen unit; a fine-tuned unit's frozen base, which wrap buckets
      apart from its trainable parameters);
    - `block_size`: elements per int8 block, each with its own fp32 scale: the error of an
      element is at most its block's absmax/254, and the scales cost 4/block_size bytes per
      element.

    None in a field means that traffic is exact. `Compression.coerce("int8")` is the shorthand
    for all three fields int8.
    """

    weights: str | None = None
    gradients: str | None = None
    frozen_weights: str | None = None
    block_size: int = 256

    def __post_init__(self) -> None:
        for name in ("weights", "gradients", "frozen_weights"):
            value = getattr(self, name)
            if value is not None and value not in COMPRESSED_FORMATS:
                allowed = ", ".join(repr(f) for f in COMPRESSED_FORMATS)
                raise ValueError(
                    f"Compression.{name}={value!r} is not a wire format; use one of {allowed}, "
                    f"or None for exact"
                )
        size = self.block_size
        low, high = COMPRESSION_BLOCK_SIZES
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(
                f"Compression.block_size must be an int, got {type(size).__name__} {size!r}; "
                f"use a power of two from {low} to {high}, e.g. 256"
            )
        if not (low <= size <= high) or size & (size - 1):
            raise ValueError(
                f"Compression.block_size={size} is not a power of two from {low} to {high}; "
                f"use e.g. 256 (smaller: less error, more scale bytes)"
            )

    @property
    def enabled(self) -> bool:
        """Whether any traffic is compressed."""
        return any(f is not None for f in (self.weights, self.gradients, self.frozen_weights))

    def wire_for(self, traffic: str) -> str:
        """The wire format of `traffic` ("weights", "gradients" or "frozen_weights") as the
        communication seam names it: "exact" where the field is None."""
        if traffic not in ("weights", "gradients", "frozen_weights"):
            raise ValueError(
                f"traffic {traffic!r} is not one of 'weights', 'gradients', 'frozen_weights'"
            )
        return getattr(self, traffic) or "exact"

    @classmethod
    def coerce(cls, value: object) -> Compression | None:
        """Accept a `Compression`, None (nothing compressed), or a format name as shorthand:
        "int8" or "bf16" compresses weights, gradients and frozen weights alike; "none" and
        "exact" mean None."""
        if value is None or isinstance(value, Compression):
            return value if value is None or value.enabled else None
        if isinstance(value, str):
            key = value.strip().lower()
            if key in ("none", "exact"):
                return None
            if key in COMPRESSED_FORMATS:
                return cls(weights=key, gradients=key, frozen_weights=key)
            raise ValueError(
                f"compression={value!r} is not a wire format; use 'int8', 'bf16', 'none', or "
                f"fullshard.config.Compression(weights=..., gradients=..., ...)"
            )
        raise TypeError(
            f"compression must be a Compression, a format name ('int8', 'bf16', 'none') or "
            f"None; got {type(value).__name__} {value!r}"
        )


# -- Lightning precision strings (validated here; the engine applies the dtypes) ----------

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def resolve_precision(precision: object) -> str:
    """Lightning's precision strings (and its short aliases `32`, `16`, `'bf16'`)."""
    if precision is None:
        return "32-true"
    key = str(precision).strip().lower() if isinstance(precision, str | int) else None
    if isinstance(precision, bool):
        key = None
    key = _PRECISION_ALIASES.get(key, key) if key is not None else None
    if key not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported. Valid values: {', '.join(PRECISIONS)} "
            f"(aliases: 32, 16, 'bf16')."
        )
    return key


def mixed_precision_for(precision: str) -> MixedPrecision | None:
    """The `MixedPrecision` a precision string stands for (Lightning's table); None for fp32."""
    if precision == "32-true":
        return None
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
