"""peft's LoRA on a tiny Llama (from a config) under fullshard, on 2 real gloo ranks.

The base model is frozen and only the adapters train: losses, the adapters' gradient shards
and, after SGD steps, their parameter shards match one process training the same peft model
(fp32, rtol=1e-5, atol=1e-6); every frozen base parameter ends with `.grad is None` and its
initial values. Once with FULL_SHARD, once with SHARD_GRAD_OP and Hugging Face's gradient
checkpointing switched on (what LoRA fine-tuning scripts do).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.distributed import comm
from fullshard.testing import DistributedGroup, local_rows

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.distributed.hf_tiny import batches, hf_loss, llama  # noqa: E402 - importable


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    # init_lora_weights=False: B random, not zero, so A gets a gradient from the first step
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(model, cfg)


def _train_and_compare(model, ref, world: int) -> dict[str, float]:
    """SGD(+momentum) steps on both; losses, the adapters' gradient shards and their
    parameter shards after each step match the reference. Returns the worst differences."""
    rank = dist.get_rank()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
    ref_params = dict(ref.named_parameters())
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def compare(what: str) -> None:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            theirs = ref_params[name].grad if what == "grad" else ref_params[name].detach()
            mine = p.grad if what == "grad" else p.detach()
            expected = local_rows(theirs, world, rank)
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6, msg=name)
            if mine.numel():
                worst[what] = max(worst[what], (mine - expected).abs().max().item())

    for batch in batches("llama", world):
        rows = batch["input_ids"].shape[0] // world
        loss = hf_loss(model, {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()})
        loss.backward()
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, model.fullshard_runtime.mesh.world)
        ref_loss = hf_loss(ref, batch)
        ref_loss.backward()
        torch.testing.assert_close(global_loss / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        worst["loss"] = max(worst["loss"], (global_loss / world - ref_loss).abs().item())
        compare("grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        compare("param")
    return worst


def _lora_parity() -> dict:
    world = dist.get_world_size()
    out: dict[str, object] = {}
    for strategy, checkpointing in (("FULL_SHARD", False), ("SHARD_GRAD_OP", True)):
        torch.manual_seed(0)
        ref = _lora(llama())
        if checkpointing:
            ref.gradient_checkpointing_enable({"use_reentrant": False})
        model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy=strategy)
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert frozen and trainable and all("lora_" in n for n in trainable), trainable
        worst = _train_and_compare(model, ref, world)
        for name, p in model.named_parameters():
            if name in frozen:
                assert p.grad is None and torch.equal(p, frozen[name]), name
        out[strategy] = {"worst": worst, "trainable": len(trainable), "frozen": len(frozen)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with DistributedGroup(2) as group:
        yield group.run(_lora_parity, timeout=300)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_lora_matches_one_process_with_the_base_frozen(results: list[dict], strategy) -> None:
    for r in results:
        assert r[strategy]["worst"]["loss"] <= 1e-5, r[strategy]
        # 2 layers x 3 target modules x (A, B)
        assert r[strategy]["trainable"] == 12, r[strategy]
