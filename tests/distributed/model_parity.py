"""Parity of a wrapped (possibly compiled) model with its unwrapped twin, for models whose
loss is not `model.loss(x, y)`: Hugging Face models (`labels=`) and compiled modules (the
compiled forward only runs when the `OptimizedModule` itself is called).

`train_and_compare` runs inside every rank: the reference takes the whole global batch, the
wrapped model this rank's rows; losses (averaged over ranks), every local gradient shard and,
after each SGD step, every local parameter shard must match at the fp32 tolerances of
docs/architecture.md's invariant 3.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fullshard.api.compiled import uncompiled
from fullshard.distributed import comm
from fullshard.testing.parity import local_rows

Batch = dict[str, torch.Tensor]
RTOL, ATOL = 1e-5, 1e-6


def _compare(what: str, step: int, model: nn.Module, ref: nn.Module) -> float:
    inner = uncompiled(model)
    mesh = inner.fullshard_runtime.mesh  # type: ignore[union-attr]
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    names = 0
    for name, p in inner.named_parameters():  # type: ignore[union-attr]
        rp = ref_params[name]
        mine = p.grad if what == "grad" else p.detach()
        theirs = rp.grad if what == "grad" else rp.detach()
        assert (mine is None) == (theirs is None), f"step {step}: {what} of {name}: presence"
        if theirs is None:
            continue
        expected = local_rows(theirs, mesh.shard.size, mesh.shard.rank)
        assert mine.shape == expected.shape, f"step {step}: {what} of {name}: shape"
        if mine.numel():
            diff = (mine - expected).abs().max().item()
            worst = max(worst, diff)
            assert torch.allclose(mine, expected, rtol=RTOL, atol=ATOL), (
                f"step {step}: {what} of {name} differs from the reference by {diff:.3e}"
            )
        names += 1
    assert names == len(ref_params), f"compared {names} of {len(ref_params)} parameters"
    return worst


def train_and_compare(
    model: nn.Module,
    ref: nn.Module,
    batches: list[Batch],
    loss_of: Callable[[nn.Module, Batch], torch.Tensor],
    *,
    lr: float = 0.1,
) -> dict[str, float]:
    """Train both for `len(batches)` SGD(+momentum) steps; returns the worst differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    group = uncompiled(model).fullshard_runtime.mesh.world  # type: ignore[union-attr]
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, batch in enumerate(batches):
        rows = next(iter(batch.values())).shape[0] // world
        mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
        loss = loss_of(model, mine)
        loss.backward()
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, group)
        global_loss /= world
        ref_loss = loss_of(ref, batch)
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], (global_loss - ref_loss.detach()).abs().item())
        assert torch.allclose(global_loss, ref_loss.detach(), rtol=RTOL, atol=ATOL), (
            f"step {step}: loss {global_loss.item():.8f} != reference {ref_loss.item():.8f}"
        )
        worst["grad"] = max(worst["grad"], _compare("grad", step, model, ref))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst["param"] = max(worst["param"], _compare("param", step, model, ref))
    return worst
