"""CUDA / NCCL paths of the engine (skipped without a GPU).

One rank per visible GPU (world size = `torch.cuda.device_count()`), NCCL, rank r on device
r. With two or more GPUs this runs NCCL's own collectives and the CUDA-stream overlap; with
one it still checks devices, dtypes and pinned memory (a group of one communicates nothing).

- parity: ZeRO-2, ZeRO-3 and NO_SHARD (BLOCK and NONE bucketing) train 3 SGD steps beside the
  unwrapped model on the whole global batch; every local gradient and parameter shard equals
  the reference's rows (fp32 rtol=1e-5, atol=1e-6); shards and grads live on the rank's GPU;
  the collective counts are the algorithm's (ZeRO-3 2 all-gathers + 1 reduce-scatter per
  bucket, ZeRO-2 1 + 1, NO_SHARD 1 all-reduce); nothing unsharded survives the step;
- bf16 mixed precision keeps fp32 shards and grads and computes in bf16;
- CPU offload keeps shards and grads in pinned host memory while computing on the GPU, with
  the same gradients as without offload.
"""

from __future__ import annotations

import pytest
import torch

from fullshard.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCKS = 2  # TinyGPT(layers=2): root (tok, pos, ln_f) + 2 Block units
BUCKETS = {"BLOCK": 1 + BLOCKS, "NONE": 4 + 12 * BLOCKS}  # as test_parity.BUCKETS (TinyGPT)


def _parity(strategy: str, bucketing: str) -> dict:
    import copy

    import torch.distributed as dist

    import fullshard
    from fullshard.testing import local_rows
    from fullshard.testing.models import Block, TinyGPT

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    ref = TinyGPT(layers=BLOCKS).to(device)
    model = fullshard.fsdp(copy.deepcopy(ref), device=device, sharding_strategy=strategy,
                           auto_wrap_policy={Block}, bucketing_strategy=bucketing)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    runtime = model.fullshard_runtime
    s, r = runtime.mesh.shard.size, runtime.mesh.shard.rank
    gen = torch.Generator().manual_seed(1)
    calls = []
    for _ in range(3):
        x, y = ref.make_batch(2 * world, gen)
        x, y = x.to(device), y.to(device)
        mine = slice(2 * rank, 2 * rank + 2)
        fullshard.reset_comm_stats()
        model.loss(x[mine], y[mine]).backward()
        torch.cuda.synchronize()
        calls.append({k: v["calls"] for k, v in fullshard.comm_stats().items()})
        ref.loss(x, y).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            assert p.is_cuda and p.grad.is_cuda and p.device == device, name
            torch.testing.assert_close(p.grad, local_rows(rp.grad, s, r), rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), local_rows(rp.detach(), s, r),
                                       rtol=1e-5, atol=1e-6, msg=name)
    return {"calls": calls, "unsharded": fullshard.memory_stats()["unsharded_param_bytes"]}


def _mixed_and_offload() -> dict:
    import copy

    import torch.distributed as dist

    import fullshard
    from fullshard.config import MixedPrecision
    from fullshard.testing.models import Block, TinyGPT

    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    mp = fullshard.fsdp(TinyGPT(layers=BLOCKS).to(device), device=device,
                        auto_wrap_policy={Block},
                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    x, y = mp.make_batch(2, torch.Generator().manual_seed(rank))
    x, y = x.to(device), y.to(device)
    logits = mp(x)
    assert logits.dtype == torch.bfloat16
    logits.float().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 and p.is_cuda
               for p in mp.parameters())

    torch.manual_seed(0)
    base = TinyGPT(layers=BLOCKS)
    off = fullshard.fsdp(copy.deepcopy(base), device=device, auto_wrap_policy={Block},
                         cpu_offload=True)
    on = fullshard.fsdp(base.to(device), device=device, auto_wrap_policy={Block})
    off.loss(x, y).backward()
    on.loss(x, y).backward()
    torch.cuda.synchronize()
    for (name, p), q in zip(off.named_parameters(), on.parameters()):
        assert not p.is_cuda and p.is_pinned() and not p.grad.is_cuda, name
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-5, atol=1e-6, msg=name)
    return {"ok": True}


def _world() -> int:
    return torch.cuda.device_count()


@pytest.mark.parametrize("strategy", ["ZERO2", "ZERO3", "NO_SHARD"])
@pytest.mark.parametrize("bucketing", ["BLOCK", "NONE"])
def test_cuda_nccl_parity_on_every_gpu(strategy: str, bucketing: str) -> None:
    world = _world()
    results = run_distributed(_parity, world, strategy, bucketing, backend="nccl", timeout=300)
    n = BUCKETS[bucketing] if world > 1 else 0
    want = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if world > 1 and strategy == "ZERO3":
        want.update(all_gather=2 * n, reduce_scatter=n)
    elif world > 1 and strategy == "ZERO2":
        want.update(all_gather=n, reduce_scatter=n)
    elif world > 1:
        want.update(all_reduce=n)
    for rank, r in enumerate(results):
        for step, calls in enumerate(r["calls"]):
            got = {k: calls[k] for k in want}
            assert got == want, (rank, step, got)
        assert r["unsharded"] == 0, rank


def test_cuda_mixed_precision_and_pinned_offload() -> None:
    assert all(r["ok"] for r in run_distributed(_mixed_and_offload, _world(), backend="nccl",
                                                timeout=300))
