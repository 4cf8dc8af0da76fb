"""CUDA / NCCL paths of the engine (skipped without a GPU).

One process with NCCL on device 0: parity with the unwrapped model for ZeRO-2 and ZeRO-3,
shards and gradients on the GPU; bf16 mixed precision keeps fp32 shards and grads; CPU
offload keeps shards and grads in pinned host memory while computing on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from fullshard.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_checks() -> dict:
    import copy

    import fullshard
    from fullshard.config import MixedPrecision
    from fullshard.testing.models import Block, TinyGPT

    torch.cuda.set_device(0)
    out = {}
    for strategy in ("ZERO2", "ZERO3"):
        torch.manual_seed(0)
        ref = TinyGPT().cuda()
        model = fullshard.fsdp(copy.deepcopy(ref), sharding_strategy=strategy,
                               auto_wrap_policy={Block}, bucketing_strategy="BLOCK")
        x, y = ref.make_batch(4, torch.Generator().manual_seed(1))
        x, y = x.cuda(), y.cuda()
        model.loss(x, y).backward()
        ref.loss(x, y).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            assert p.is_cuda and p.grad.is_cuda, name
            torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-6)
        out[strategy] = fullshard.memory_stats()["unsharded_param_bytes"]

    torch.manual_seed(0)
    mp = fullshard.fsdp(TinyGPT().cuda(), auto_wrap_policy={Block},
                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    logits = mp(x)
    assert logits.dtype == torch.bfloat16
    logits.float().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in mp.parameters())

    torch.manual_seed(0)
    off = fullshard.fsdp(TinyGPT(), device="cuda", auto_wrap_policy={Block}, cpu_offload=True)
    off.loss(x, y).backward()
    for p in off.parameters():
        assert not p.is_cuda and p.is_pinned() and not p.grad.is_cuda
    return out


def test_cuda_nccl_single_rank():
    result = run_distributed(_cuda_checks, 1, backend="nccl")[0]
    assert result == {"ZERO2": 0, "ZERO3": 0}
