"""The true global gradient norm of a sharded model, and clipping by it.

Each rank's gradient shards are disjoint slices of the unsharded gradients (padding rows are
not part of them), so the norm is one reduction over the shard axis: the sum of `|g|^p` (the
max for `inf`). Replicas along the replicate axis hold the same shards and are not counted
again. Every rank ends with the same norm, so a non-finite norm raises on all of them.

`clip_grad_norm_(model, ...)` is the functional API's door (`fullshard.clip_grad_norm_`):
`torch.nn.utils.clip_grad_norm_` on the shards would clip by each rank's local norm.
`FSDPStrategy.clip_gradients_norm` uses the same `clip_grad_norm` below.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fullshard.config import check_bool
from fullshard.distributed import comm
from fullshard.engine.runtime_lookup import runtime_of


def global_grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    group: comm.Group,
    device: torch.device,
    unreduced: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The `norm_type`-norm of the gradients whose disjoint slices `grads` are, over `group`,
    together with this rank's `unreduced` gradients (ignored parameters: added after the
    reduction, not counted once per rank)."""
    if unreduced:
        total = global_grad_norm(grads, norm_type, group, device)
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type).to(device)
                             for g in unreduced])
        if norm_type == 0:  # counts of non-zeros add up
            return total + norms.sum()
        return torch.linalg.vector_norm(torch.cat([total.reshape(1), norms]), norm_type)
    if "nccl" in group.backend and device.type != "cuda":  # e.g. CPU-offloaded gradients
        device = torch.device("cuda", torch.cuda.current_device())
    if norm_type == float("inf"):
        local = torch.zeros((), dtype=torch.float32, device=device)
        nonfinite = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float().to(device))
                nonfinite += torch.isnan(g).any().float().to(device)
        comm.all_reduce(local, group, op=dist.ReduceOp.MAX)
        comm.all_reduce(nonfinite, group)
        return torch.where(nonfinite > 0, torch.full_like(local, float("nan")), local)
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel():
            n = torch.linalg.vector_norm(g.detach().float(), norm_type).to(device)
            local += n if norm_type == 0 else n**norm_type
    comm.all_reduce(local, group)
    return local if norm_type == 0 else local ** (1.0 / norm_type)


def check_clip_arguments(max_norm: object, norm_type: object) -> tuple[float, float]:
    """`max_norm` and `norm_type` as floats, or the error naming what is wrong: torch takes a
    negative `max_norm` (it flips every gradient's sign) and a NaN one or a NaN `norm_type`
    (every gradient becomes NaN) without a word. `max_norm=inf` (measure without clipping)
    is fine."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(
                f"{name} must be a real number, got {type(value).__name__} {value!r}"
            )
    if math.isnan(max_norm) or max_norm < 0:  # type: ignore[arg-type]
        raise ValueError(
            f"max_norm must be >= 0 (inf: measure the norm without clipping), got {max_norm!r}"
        )
    if math.isnan(norm_type) or norm_type < 0:  # type: ignore[arg-type]
        raise ValueError(
            f"norm_type must be a number >= 0 or inf (2.0: the Euclidean norm), got "
            f"{norm_type!r}"
        )
    return float(max_norm), float(norm_type)  # type: ignore[arg-type]


@torch.no_grad()
def clip_grad_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: comm.Group,
    device: torch.device,
    *,
    error_if_nonfinite: bool,
    unreduced: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale `grads` (and `unreduced`) in place so their global norm is at most `max_norm`;
    return the norm."""
    max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    total = global_grad_norm(grads, norm_type, group, device, unreduced)
    grads = [*grads, *unreduced]
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite "
            f"({total.item()}), so it cannot be clipped. To scale the gradients by the "
            f"non-finite norm anyway, pass error_if_nonfinite=False."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model wrapped by `fullshard.fsdp`.

    Scales every gradient shard in place so that the norm of the *unsharded* gradients is at
    most `max_norm`, and returns that total norm (before clipping; a 0-dim float32 tensor on
    the gradients' device, the same on every rank) -- the numbers one process gets from
    `torch.nn.utils.clip_grad_norm_` on the unwrapped model. `norm_type` may be any p > 0 or
    `inf`; `0` counts the non-zero gradient elements (torch counts the parameters whose
    gradient is not all zero, which a shard cannot tell). With `error_if_nonfinite`, a NaN/inf
    norm raises a `RuntimeError` on every rank; otherwise the gradients are scaled by it, as
    torch does. `foreach` is accepted for
    signature compatibility: the scaling is one multiply per shard either way.

    Collective: every rank of the model's process group must call it (one all-reduce; two
    for `inf`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fullshard.clip_grad_norm_ takes the wrapped model (the module fullshard.fsdp "
            f"returned), got {type(model).__name__}. Pass the model itself, not its parameters."
        )
    max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    check_bool("foreach", foreach, optional=True)
    runtime = runtime_of(model)  # a ValueError naming the fix when the model is not wrapped
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        device = grads[0].device
    else:
        bucket = next((b for u in runtime.units for b in u.buckets), None)
        device = bucket.device if bucket is not None else torch.device("cpu")
    return clip_grad_norm(
        grads,
        max_norm,
        norm_type,
        runtime.mesh.shard,
        device,
        error_if_nonfinite=error_if_nonfinite,
    )
