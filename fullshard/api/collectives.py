"""`fabric.all_gather` / `fabric.all_reduce`: the user's collectives over collections.

Both take a tensor, a number, or any nesting of containers (`api.batches`), convert numbers
to tensors on the device, and run one collective per tensor through
`fullshard.distributed.comm` (which counts them). Every rank must call them with the same
structure and shapes (an all-gather of different shapes fails or hangs in the backend, as in
Lightning).

`all_gather(t)` returns a tensor of shape `(group size, *t.shape)`, rank-ordered; without a
process group (a plain single-process script) `t` comes back unchanged. With `sync_grads`,
the result is differentiable: the backward of each rank's slot is summed over the ranks (an
all-reduce of the output's gradient) and handed to the rank that contributed it, as
`torch.distributed.nn.all_gather` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullshard.api.batches import map_batch
from fullshard.api.strategy_args import reduce_op_of
from fullshard.distributed import comm


def _is_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor | int | float) and not isinstance(x, bool)


def _as_tensor(x: Any, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, device=device)


def _gather(tensor: torch.Tensor, group: comm.Group) -> torch.Tensor:
    src = tensor.detach().contiguous()
    out = torch.empty((group.size, *src.shape), dtype=src.dtype, device=src.device)
    comm.all_gather(out, src, group)
    return out


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return _gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        total = grad.contiguous().clone()
        comm.all_reduce(total, group)  # every rank's gradient for every slot, summed
        return total[group.rank], None


def all_gather(data: Any, group: Any, sync_grads: bool, device: torch.device) -> Any:
    """See the module docstring. `group`: a process group or None (all ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return map_batch(data, lambda x: _as_tensor(x, device), _is_leaf)
    g = group if isinstance(group, comm.Group) else comm.Group.from_process_group(group)

    def one(x: Any) -> torch.Tensor:
        t = _as_tensor(x, device)
        return _GatherWithGrad.apply(t, g) if sync_grads else _gather(t, g)

    return map_batch(data, one, _is_leaf)


def all_reduce(data: Any, group: Any, reduce_op: Any, device: torch.device,
               reduce_tensor: Any) -> Any:
    """Reduce every tensor (and number) in `data` with `reduce_tensor(t, group, reduce_op)`
    (the strategy's in-place all-reduce); numbers come back as tensors, as in Lightning."""
    if not (dist.is_available() and dist.is_initialized()):
        return data
    return map_batch(data, lambda x: reduce_tensor(_as_tensor(x, device), group, reduce_op),
                     _is_leaf)


def all_reduce_tensor(tensor: Any, group: object = None, reduce_op: object = "mean") -> Any:
    """Reduce `tensor` in place over `group` (a process group, a `comm.Group`, or None for all
    ranks) and return it; non-tensors come back unchanged.

    `reduce_op`: 'mean' (also 'avg'), 'sum', 'max', 'min', 'product', or a `ReduceOp`.
    'mean' of an integer tensor returns a new float tensor.
    """
    if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
        return tensor
    op, mean = reduce_op_of(reduce_op)
    g = group if isinstance(group, comm.Group) else comm.Group.from_process_group(group)
    if mean and not tensor.is_floating_point():
        tensor = tensor.float()
    comm.all_reduce(tensor, g, op=op)
    if mean:
        tensor.div_(g.size)
    return tensor
