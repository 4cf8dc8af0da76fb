"""CPU offload on 2 real gloo ranks, through both doors (`fsdp()` and `FSDPStrategy`).

On a CPU-only machine host and device coincide, so what can be checked here is that the
offload code path (shards in host buffers, a copy to the compute device before each gather,
gradients copied back after each reduction) gives exactly the numbers of the unsharded
reference for ZeRO-2 and ZeRO-3, also under mixed precision (where the pre-gather copy is a
real cast), and that shards, gradients and optimizer state are host tensors. The CUDA side
(pinned memory, non-blocking copies) is tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard import FSDPStrategy
from fullshard.testing import DistributedGroup, check_parity, local_rows
from fullshard.testing.models import Block, TinyGPT


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


def _host_resident(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    runtime = model.fullshard_runtime
    flats = [b.shard_flat for u in runtime.units for b in u.buckets]
    return {
        "flat": {t.device.type for t in flats},
        "shards": {p.device.type for p in model.parameters()},
        "grads": {p.grad.device.type for p in model.parameters()},
        "opt": {v.device.type for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim()},
        # The registered parameters are views of the host-resident flat shards.
        "views": all(any(p.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                         for f in flats) for p in model.parameters() if p.numel()),
        "offload": {b.offload for u in runtime.units for b in u.buckets},
    }


# -- the functional door --------------------------------------------------------------------
def _functional(strategy: str) -> dict:
    report = check_parity(
        lambda: TinyGPT(layers=2),
        steps=6,
        optimizer="sgd",  # momentum: parameters checked to round-off every step
        sharding_strategy=strategy,
        auto_wrap_policy={Block},
        bucketing_strategy="LAYER",
        cpu_offload=True,
    )
    torch.manual_seed(0)
    model = fullshard.fsdp(TinyGPT(layers=2), device="cpu", sharding_strategy=strategy,
                           auto_wrap_policy={Block}, cpu_offload=fullshard.CPUOffload(True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.loss(*model.make_batch(2, torch.Generator().manual_seed(0))).backward()
    opt.step()
    return {"max_grad_diff": report.max_grad_diff, "calls": report.calls_per_step[-1],
            **_host_resident(model, opt)}


@pytest.mark.parametrize("strategy", ["ZERO2", "ZERO3"])
def test_fsdp_cpu_offload_matches_the_unsharded_reference(group2, strategy) -> None:
    for r in group2.run(_functional, strategy):
        assert r["flat"] == r["shards"] == r["grads"] == r["opt"] == {"cpu"}
        assert r["views"] and r["offload"] == {True}
        # Collectives unchanged by offload: LAYER buckets = 6 per block + tok, pos, ln_f.
        gathers = 2 * 15 if strategy == "ZERO3" else 15
        assert (r["calls"]["all_gather"], r["calls"]["reduce_scatter"]) == (gathers, 15)


# -- the strategy door ----------------------------------------------------------------------
def _strategy_door(sharding: str, precision: str | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyGPT(layers=2)
    runs = {}
    for offload in (True, False):
        s = FSDPStrategy(accelerator="cpu", cpu_offload=offload, sharding_strategy=sharding,
                         auto_wrap_policy={Block}, precision=precision)
        s.setup_environment()
        model = s.setup_module(copy.deepcopy(ref))
        opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        runs[offload] = (s, model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(4):
        x, y = ref.make_batch(2 * world, gen)
        mine = slice(2 * rank, 2 * rank + 2)
        for s, model, _ in runs.values():
            s.backward(model.loss(x[mine], y[mine]))
        ref.loss(x, y).backward()
        (_, off, off_opt), (_, on_dev, _) = runs[True], runs[False]
        for (name, p), q, rp in zip(off.named_parameters(), on_dev.parameters(),
                                    ref.parameters()):
            # Offloaded == not offloaded, bit for bit; both == the reference to round-off
            # (fp32), or to bf16 round-off under bf16-mixed.
            assert torch.equal(p.grad, q.grad), name
            if precision is None:
                want = local_rows(rp.grad, world, rank)
                worst = max(worst, (p.grad - want).abs().max().item() if p.numel() else 0.0)
                torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
        for _, _, opt in runs.values():
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(off.named_parameters(), on_dev.parameters()):
            assert torch.equal(p, q), name
    s_off = runs[True][0]
    s_off.backward(off.loss(x[mine], y[mine]))  # gradients present for the residency check
    return {"worst": worst, **_host_resident(off, off_opt)}


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_strategy_cpu_offload_parity(group2, sharding, precision) -> None:
    for r in group2.run(_strategy_door, sharding, precision):
        assert r["flat"] == r["shards"] == r["grads"] == r["opt"] == {"cpu"}
        assert r["views"] and r["offload"] == {True}
        assert r["worst"] < 1e-6
