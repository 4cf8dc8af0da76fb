"""Pure arithmetic of the planner: dtypes, persistent per-rank bytes, communication per step.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fullshard.config import MixedPrecision, mixed_precision_for, resolve_precision
from fullshard.engine.sharding import _precision_dtypes
from fullshard.planner.structure import BucketSpec, ModelStructure

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

    def dtypes(self, bucket: BucketSpec) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(shard, compute, reduce) dtypes of a bucket, exactly as `engine.bucket.Bucket`."""
        master = bucket.dtype
        compute, reduce = _precision_dtypes(self.mixed, master)
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
    probe = BucketSpec((torch.Size([1]),), precision.shard_dtype or torch.float32, True)
    master, compute, reduce = precision.dtypes(probe)
    return (f"shards {_dtype_name(master)}, gather {_dtype_name(compute)}, "
            f"reduce {_dtype_name(reduce)}")


def _size(dtype: torch.dtype) -> int:
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
            master = _size(precision.dtypes(b)[0])
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
) -> dict[str, int]:
    """Wire bytes the busiest rank sends per step, by collective kind (module docstring).

    Each collective is rounded down as `fullshard.distributed.comm` counts it, so on the same
    model and mesh these are the numbers `comm_stats()` reports for one training step.
    `packed_sum_bytes`: gloo's `comm.COALESCE_BYTES` (0 for NCCL), up to which an all-reduce
    sends its whole tensor to each of the R - 1 peers in one message.
    """
    replicate, shard = mesh
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for i, unit in enumerate(structure.units):
        # ZeRO-3 gathers a unit again for backward; the root stays gathered into backward
        # (engine/hooks.py, the note on the root), so it is gathered once.
        gathers = 2 if reshard_after_forward and i > 0 else 1
        for b in unit.buckets:
            _, compute, reduce = precision.dtypes(b)
            flat = b.padded_shard_numel(shard)
            if shard > 1:
                n = shard * flat * _size(compute)
                out["all_gather"] += gathers * int(n * (shard - 1) / shard)
            if not b.requires_grad:
                continue
            if shard > 1 and backend == "gloo":
                unsent = sum(b.local_numels(shard, shard - 1))  # its own rows stay home
                out["reduce_scatter"] += (b.numel - unsent) * _size(reduce)
            elif shard > 1:
                n = shard * flat * _size(reduce)
                out["reduce_scatter"] += int(n * (shard - 1) / shard)
            if replicate > 1:
                n = flat * _size(reduce)
                if 0 < n * (replicate - 1) <= packed_sum_bytes:
                    out["all_reduce"] += n * (replicate - 1)
                else:
                    out["all_reduce"] += int(2 * n * (replicate - 1) / replicate)
    return out
