"""Reference parity: train a wrapped model beside the unwrapped one and compare every step.

Run `check_parity` inside every rank (e.g. through `DistributedGroup.run`). Each rank builds
the same reference model from the same seed, wraps a deep copy with `fullshard.fsdp`, and
trains both on the same global batch -- the reference on all of it in this process, the
wrapped model on this rank's rows. Every step it asserts:

- the wrapped loss, averaged over ranks, equals the reference loss (with
  `reference_per_rank`, the mean of the reference's losses on each rank's rows, which is what
  data parallelism computes when batch statistics are per rank, e.g. BatchNorm);
- every local shard of every gradient equals the matching rows of the reference gradient,
  and a parameter whose reference gradient is None has `.grad` None too (never zeros);
- after the optimizer step (when `check_params`), every local shard of every parameter too.

Failures raise `AssertionError` naming the step, the parameter and the largest difference.
Per-step collective counts and peak unsharded bytes are returned for further checks.
`on_step(step, model, ref)`, if given, runs before each step's forward on both models (e.g.
to freeze or unfreeze parameters the way a fine-tuning loop does); `compare` is the
per-parameter check, for loops written by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.distributed import comm
from fullshard.engine.layout import owned_rows


def local_rows(full: torch.Tensor, shard_size: int, shard_rank: int) -> torch.Tensor:
    """The rows of `full` that `shard_rank` owns (a 0-dim tensor counts as shape (1,))."""
    rows = full.reshape(full.shape[0] if full.dim() else 1, *full.shape[1:])
    start, stop = owned_rows(rows.shape[0], shard_size, shard_rank)
    return rows[start:stop]


@dataclass
class ParityReport:
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    calls_per_step: list[dict[str, int]] = field(default_factory=list)
    peak_unsharded_bytes: list[int] = field(default_factory=list)
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0


def _optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def compare(
    what: str, step: int, model: nn.Module, ref: nn.Module, rtol: float = 1e-5, atol: float = 1e-6
) -> float:
    """Assert every local shard of `model`'s gradients (`what="grad"`) or parameters
    (`"param"`) equals the matching rows of `ref`'s; returns the largest difference."""
    runtime = model.fullshard_runtime
    s, r = runtime.mesh.shard.size, runtime.mesh.shard.rank
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        rp = ref_params[name]
        mine = p.grad if what == "grad" else p.detach()
        theirs = rp.grad if what == "grad" else rp.detach()
        if theirs is None:
            assert mine is None, f"step {step}: {name} has a {what} the reference lacks (None)"
            continue
        assert mine is not None, f"step {step}: {name} has no {what}"
        expected = local_rows(theirs, s, r)
        assert mine.shape == expected.shape, (
            f"step {step}: {what} of {name} has local shape {tuple(mine.shape)}, "
            f"expected {tuple(expected.shape)}"
        )
        if mine.numel():
            diff = (mine - expected).abs().max().item()
            worst = max(worst, diff)
            assert torch.allclose(mine, expected, rtol=rtol, atol=atol), (
                f"step {step}: {what} of {name} differs from the reference by up to {diff:.3e}"
            )
    return worst


def check_parity(
    make_model: Callable[[], nn.Module],
    *,
    steps: int = 20,
    batch_per_rank: int = 2,
    optimizer: str = "sgd",
    lr: float = 0.05,
    check_params: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    param_atol: float | None = None,
    reference_per_rank: bool = False,
    seed: int = 0,
    on_step: Callable[[int, nn.Module, nn.Module], None] | None = None,
    **fsdp_kwargs: object,
) -> ParityReport:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    ref = make_model()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", **fsdp_kwargs)
    opt = _optimizer(optimizer, model.parameters(), lr)
    ref_opt = _optimizer(optimizer, ref.parameters(), lr)
    generator = torch.Generator().manual_seed(seed + 1)
    world_group = model.fullshard_runtime.mesh.world
    report = ParityReport()
    b = batch_per_rank
    for step in range(steps):
        x, y = ref.make_batch(b * world, generator)
        if on_step is not None:
            on_step(step, model, ref)
        fullshard.reset_comm_stats()
        fullshard.reset_memory_stats()
        loss = model.loss(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b])
        loss.backward()
        report.calls_per_step.append({k: v["calls"] for k, v in fullshard.comm_stats().items()})
        report.peak_unsharded_bytes.append(fullshard.memory_stats()["peak_unsharded_bytes"])
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, world_group)
        global_loss /= world
        if reference_per_rank:
            # Batch statistics (BatchNorm) are per rank in data parallelism, as in DDP: the
            # reference averages the per-rank losses instead of one loss over the whole batch.
            chunks = zip(x.split(b), y.split(b))
            ref_loss = torch.stack([ref.loss(xi, yi) for xi, yi in chunks]).mean()
        else:
            ref_loss = ref.loss(x, y)
        ref_loss.backward()
        report.losses.append(global_loss.item())
        report.reference_losses.append(ref_loss.item())
        assert torch.allclose(global_loss, ref_loss.detach(), rtol=rtol, atol=atol), (
            f"step {step}: loss {global_loss.item():.8f} != reference {ref_loss.item():.8f}"
        )
        worst = compare("grad", step, model, ref, rtol, atol)
        report.max_grad_diff = max(report.max_grad_diff, worst)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if check_params:
            worst = compare("param", step, model, ref, rtol, param_atol or atol)
            report.max_param_diff = max(report.max_param_diff, worst)
    return report
