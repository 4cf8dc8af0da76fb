"""The exact sizes: the units and buckets the engine would build, the bytes one rank holds and
sends per step, and byte sizes as people write them.

Units and buckets come from the engine itself (`engine.sharding.unit_specs`: the units, the
owning unit of every parameter, each unit's buckets by bucketing strategy, dtype,
`requires_grad` and full precision); only their shapes are kept here. Everything that depends
on the world size is then arithmetic on those shapes with `ShardLayout` (`engine/layout.py`).

Persistent bytes (exact, per rank; `L_b(S)` = a bucket's padded flat shard, i.e. the sum over
its parameters of `ceil(d0 / S) * row_numel`, the `ShardLayout` numbers):

    parameters  sum over buckets            L_b(S) * size(shard dtype)
    gradients   sum over trainable buckets  L_b(S) * size(shard dtype)
    optimizer   sum over trainable params   k * local_numel * size(shard dtype) + step

The shard storage is the engine's flat `shard_flat` per bucket and the gradients are views of
one reduce output per bucket, so both include the padding. Optimizer state is created by torch
from the user-visible local shards, which exclude the padding: `local_numel` is the rank's real
rows times the row size, so rank 0 (which always owns `ceil(d0/S)` rows) holds the most; the
planner reports rank 0. `k` = 2 for Adam/AdamW (`exp_avg`, `exp_avg_sq`), 1 for SGD with
momentum, 0 for plain SGD, and Adam(W) keeps a 4-byte fp32 `step` tensor per parameter (on the
host unless `capturable`/`fused`). With mixed precision the shards, gradients and optimizer
state stay in fp32; with '16-true' / 'bf16-true' the whole model is converted, so they are
16-bit. So AdamW fp32 at `S` ranks holds `16 * Psi / S` bytes plus padding plus `4 * tensors`.

Communication per rank per step (what `fullshard.comm_stats()` counts as `wire_bytes`; ring /
pairwise algorithms send `B * (n - 1) / n` of a `B`-byte all-gather or reduce-scatter and
`2 * B * (n - 1) / n` of an all-reduce over `n` ranks), per bucket, with `c` / `r` the
compute (gather) and reduce dtype sizes, on a `(R, S)` mesh:

    all-gather      g * L * c * (S - 1)       g = 2 under ZeRO-3 (forward, and again for
                                              backward) but 1 for the root (kept gathered
                                              into backward), 1 under ZeRO-2; 0 if S == 1
    reduce-scatter  L * r * (S - 1)           trainable buckets, S > 1, NCCL; gloo sends
                                              each peer its real rows straight from the
                                              gradients, no padding: (numel - its own
                                              rows) * r, most on the last shard rank (the
                                              fewest rows), the rank reported
    all-reduce      2 * L * r * (R - 1) / R   trainable buckets, R > 1 (NO_SHARD: L = numel);
                                              gloo sends a small one (L * r * (R - 1) within
                                              comm.COALESCE_BYTES) whole to every peer:
                                              L * r * (R - 1), the same on two ranks

i.e. about `(3 * Psi - Psi_root) * (N - 1) / N` words for ZeRO-3 and `2 * Psi * (N - 1) / N`
for ZeRO-2 and NO_SHARD; bf16 gathers halve the all-gather part.

Byte strings: `B`; binary `KiB MiB GiB TiB` (powers of 1024); decimal `KB MB GB TB` (powers of
1000); a bare `K M G T` means the binary unit, as GPU memory is usually quoted ('80G' = 80 GiB).
Case-insensitive, optional space, fractional numbers allowed ('1.5 TiB'); a plain number is bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from fullshard.config import (
    Compression,
    FSDPBucketingStrategy,
    MixedPrecision,
    mixed_precision_for,
    resolve_precision,
)
from fullshard.distributed.wire_format import wire_nbytes
from fullshard.engine.layout import ShardLayout
from fullshard.engine.mixed_precision import bucket_dtypes
from fullshard.engine.sharding import unit_specs
from fullshard.engine.wrap import describe_unit_classes


# -- the units and buckets ----------------------------------------------------------------------
@dataclass(frozen=True)
class BucketShape:
    """One bucket: the parameters one collective moves."""

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    """The shards' dtype as the engine would hold them (after any '-true' conversion)."""
    requires_grad: bool
    full_precision: bool = False
    """Held by a full-precision module (`MixedPrecision.full_precision_modules`): gathered and
    reduced in the shards' own dtype."""

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
class UnitShape:
    name: str
    """Module path of the unit ('' for the root)."""
    class_name: str
    buckets: tuple[BucketShape, ...]

    @property
    def trainable(self) -> bool:
        return any(b.requires_grad for b in self.buckets)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)


@dataclass(frozen=True)
class ModelStructure:
    units: tuple[UnitShape, ...]
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
        return describe_unit_classes(u.class_name for u in self.units[1:])


def model_structure(
    model: nn.Module,
    policy: object,
    bucketing: FSDPBucketingStrategy,
    *,
    shard_dtype: torch.dtype | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ModelStructure:
    """Units and buckets of `model` under `policy`, `bucketing` and `mixed_precision`, as
    `engine.sharding.unit_specs` reads them.

    `shard_dtype`: the dtype floating-point parameters are converted to before wrapping
    (Lightning's '16-true' / 'bf16-true'); None keeps each parameter's own dtype. Bucket groups
    are formed with the parameters' current dtypes, which a uniform conversion cannot split
    differently.
    """
    units = []
    for unit in unit_specs(model, policy, bucketing, mixed_precision):
        buckets = []
        for spec in unit.buckets:
            dtype = spec.dtype
            if shard_dtype is not None and dtype.is_floating_point:
                dtype = shard_dtype
            shapes = tuple(o.current.shape for o in spec.params)
            buckets.append(BucketShape(shapes, dtype, spec.requires_grad, spec.full_precision))
        units.append(UnitShape(unit.name, type(unit.module).__name__, tuple(buckets)))
    return ModelStructure(tuple(units))


@cache
def _layout(shape: torch.Size, shard_size: int, shard_rank: int) -> ShardLayout:
    return ShardLayout(shape, shard_size, shard_rank)


# -- dtypes, optimizer state, persistent bytes, communication -----------------------------------
STEP_BYTES = 4
"""Adam(W)'s per-parameter `step` counter: a 0-dim fp32 tensor."""


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    states: int
    """Full-size state tensors per parameter."""
    step_tensor: bool


OPTIMIZERS = {
    o.name: o
    for o in (
        OptimizerSpec("adamw", 2, True),
        OptimizerSpec("adam", 2, True),
        OptimizerSpec("sgd-momentum", 1, False),
        OptimizerSpec("sgd", 0, False),
    )
}


def resolve_optimizer(optimizer: object) -> OptimizerSpec:
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a string ({', '.join(OPTIMIZERS)}), got "
                        f"{type(optimizer).__name__}: {optimizer!r}")
    key = optimizer.strip().lower().replace("_", "-")
    if key not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {optimizer!r}. Valid: {', '.join(OPTIMIZERS)}.")
    return OPTIMIZERS[key]


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision setting means for bytes: the shard dtype and the engine's
    `MixedPrecision` (which sets the gather and reduce dtypes)."""

    name: str
    shard_dtype: torch.dtype | None
    """'16-true' / 'bf16-true': floating parameters are converted to it before wrapping."""
    mixed: MixedPrecision | None

    def dtypes(self, bucket: BucketShape) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(shard, compute, reduce) dtypes of a bucket, exactly as `engine.bucket.Bucket`."""
        master = bucket.dtype
        compute, reduce = bucket_dtypes(self.mixed, master, bucket.full_precision)
        compute = compute or master
        return master, compute, reduce or compute


def resolve_precision_spec(precision: object) -> PrecisionSpec:
    """A Lightning precision string (None: '32-true') or a `MixedPrecision`."""
    if isinstance(precision, PrecisionSpec):
        return precision
    if isinstance(precision, MixedPrecision) or hasattr(precision, "param_dtype"):
        mp = MixedPrecision.coerce(precision)
        return PrecisionSpec(f"mixed({_dtype_name(mp.param_dtype)})", None, mp)
    name = resolve_precision(precision)
    shard_dtype = None
    if name.endswith("-true") and name != "32-true":
        shard_dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16
    return PrecisionSpec(name, shard_dtype, mixed_precision_for(name))


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else {torch.float32: "fp32", torch.bfloat16: "bf16",
                                         torch.float16: "fp16"}.get(dtype, str(dtype))


def dtype_names(precision: PrecisionSpec) -> str:
    """E.g. 'shards fp32, gather bf16, reduce bf16' for an fp32 model."""
    probe = BucketShape((torch.Size([1]),), precision.shard_dtype or torch.float32, True)
    master, compute, reduce = precision.dtypes(probe)
    return (f"shards {_dtype_name(master)}, gather {_dtype_name(compute)}, "
            f"reduce {_dtype_name(reduce)}")


def size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- persistent bytes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    structure: ModelStructure,
    shard_size: int,
    precision: PrecisionSpec,
    optimizer: OptimizerSpec,
    shard_rank: int = 0,
) -> ModelStateBytes:
    """Bytes of shards, gradients and optimizer state one rank holds (module docstring)."""
    if not 0 <= shard_rank < shard_size:
        raise ValueError(f"shard_rank must be in [0, {shard_size}), got {shard_rank}")
    params = grads = optim = 0
    for unit in structure.units:
        for b in unit.buckets:
            master = size_of(precision.dtypes(b)[0])
            flat = b.padded_shard_numel(shard_size) * master
            params += flat
            if not b.requires_grad:
                continue
            grads += flat
            local = b.local_numels(shard_size, shard_rank)
            optim += optimizer.states * sum(local) * master
            if optimizer.step_tensor:
                optim += STEP_BYTES * len(local)
    return ModelStateBytes(params, grads, optim)


# -- communication -------------------------------------------------------------------------------
def comm_bytes(
    structure: ModelStructure,
    mesh: tuple[int, int],
    reshard_after_forward: bool,
    precision: PrecisionSpec,
    backend: str = "nccl",
    packed_sum_bytes: int = 0,
    compression: Compression | None = None,
) -> dict[str, int]:
    """Wire bytes the busiest rank sends per step, by collective kind (module docstring).

    Each collective is rounded down as `fullshard.distributed.comm` counts it, so on the same
    model and mesh these are the numbers `comm_stats()` reports for one training step.
    `packed_sum_bytes`: gloo's `comm.COALESCE_BYTES` (0 for NCCL), up to which an all-reduce
    sends its whole tensor to each of the R - 1 peers in one message. With `compression`, a
    compressed gather or shard-axis reduction sends each peer `wire_nbytes(L)` (the encoded
    padded shard; a reduction's all-to-all row); the replicate axis stays exact.
    """
    replicate, shard = mesh
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    block = 256 if compression is None else compression.block_size
    for i, unit in enumerate(structure.units):
        # ZeRO-3 gathers a unit again for backward; the root stays gathered into backward,
        # so it is gathered once. See [Note: the root stays gathered] in engine/unit.py.
        gathers = 2 if reshard_after_forward and i > 0 else 1
        for b in unit.buckets:
            _, compute, reduce = precision.dtypes(b)
            flat = b.padded_shard_numel(shard)
            weights = "weights" if b.requires_grad else "frozen_weights"
            wire = "exact" if compression is None else compression.wire_for(weights)
            if shard > 1 and wire != "exact":
                out["all_gather"] += gathers * wire_nbytes(flat, wire, block_size=block) * (
                    shard - 1)
            elif shard > 1:
                n = shard * flat * size_of(compute)
                out["all_gather"] += gathers * int(n * (shard - 1) / shard)
            if not b.requires_grad:
                continue
            wire = "exact" if compression is None else compression.wire_for("gradients")
            if shard > 1 and wire != "exact":
                out["reduce_scatter"] += wire_nbytes(flat, wire, block_size=block) * (shard - 1)
            elif shard > 1 and backend == "gloo":
                unsent = sum(b.local_numels(shard, shard - 1))  # its own rows stay home
                out["reduce_scatter"] += (b.numel - unsent) * size_of(reduce)
            elif shard > 1:
                n = shard * flat * size_of(reduce)
                out["reduce_scatter"] += int(n * (shard - 1) / shard)
            if replicate > 1:
                n = flat * size_of(reduce)
                if 0 < n * (replicate - 1) <= packed_sum_bytes:
                    out["all_reduce"] += n * (replicate - 1)
                else:
                    out["all_reduce"] += int(2 * n * (replicate - 1) / replicate)
    return out


# -- byte strings ---------------------------------------------------------------------------------
_BINARY = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """'80GiB' -> 85899345920. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise TypeError(f"A byte size must be an int or a string like '80GiB', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"A byte size must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"A byte size must be an int or a string like '80GiB', got "
                        f"{type(value).__name__}: {value!r}")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else ""
    if unit.endswith("ib"):
        unit = unit[:-2]
    scale = _DECIMAL.get(unit) or _BINARY.get(unit)
    if m is None or scale is None:
        raise ValueError(
            f"Cannot read {value!r} as a byte size: expected a number and a unit, e.g. "
            f"'80GiB', '80GB', '512MiB', '80G' (binary) or a plain number of bytes."
        )
    nbytes = int(float(m.group(1)) * scale)
    if nbytes <= 0:
        raise ValueError(f"A byte size must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: int | float | None) -> str:
    """Binary units, three significant digits: 1.23 GiB, 512 MiB, 0 B."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """Parameter counts: 6.74B, 1.85M, 7.6K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
