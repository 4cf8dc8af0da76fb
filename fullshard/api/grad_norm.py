"""The true global gradient norm of a sharded model, and clipping by it.

Each rank's gradient shards are disjoint slices of the unsharded gradients (padding rows are
not part of them), so the norm is one reduction over the shard axis: the sum of `|g|^p` (the
max for `inf`). Replicas along the replicate axis hold the same shards and are not counted
again. Every rank ends with the same norm, so a non-finite norm raises on all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fullshard.distributed import comm


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
