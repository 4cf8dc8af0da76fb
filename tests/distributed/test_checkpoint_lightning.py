"""Checkpoints move between Lightning Fabric and fullshard, both ways, both formats (issue 12,
item 4), on 2 gloo ranks. Skipped when Lightning is not installed.

Lightning really runs inside our ranks: `lightning.fabric.Fabric(accelerator='cpu', devices=2,
strategy=ModelParallelStrategy(...))` -- Lightning's FSDP2 strategy, the one that runs on CPU
(its `FSDPStrategy` writes the same layout on GPU) -- joins the process group the harness made
and shards the model with torch's `fully_shard`. The model is TinyGPT (a tied embedding and
head, rows that split over the ranks), trained 2 steps with AdamW and an LR scheduler.

- Lightning -> fullshard: what Lightning saved (sharded directory, or one full file) loads
  with Lightning's `Fabric.load` into a model sharded by fullshard's strategy; its parameters
  and every optimizer state tensor equal Lightning's, gathered (`get_model_state_dict` /
  `get_optimizer_state_dict` with `full_state_dict=True`), exactly; so do the param groups,
  the scheduler and the user's values. Lightning's sharded directory also consolidates
  (`to_full`, what `fullshard consolidate` writes) into exactly that.
- fullshard -> Lightning: the reverse, compared with fullshard's own full state.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.checkpoint import full, to_full
from fullshard.testing import DistributedGroup
from tests.distributed import ckpt_common as cc

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


# -- Lightning's side -----------------------------------------------------------------------------
def _parallelize(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _lightning(sharded: bool, seed: int = 0):
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(_parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                     save_distributed_checkpoint=sharded)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # LOCAL_RANK is set: joins the existing process group, starts nothing
    torch.manual_seed(seed)
    model = fabric.setup_module(cc.make_model("gpt"))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                    weight_decay=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return fabric, model, opt, sched


def _lightning_full(model: nn.Module, opt) -> dict:
    """Lightning's model and optimizer, gathered: what it would write to a full file."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, opt = model.module, opt.optimizer  # Lightning's wrappers: what its save unwraps
    options = StateDictOptions(full_state_dict=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, opt, options=options)}


def _fullshard(fmt: str = "sharded", seed: int = 0):
    """The same, with fullshard's strategy in Lightning's Fabric."""
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2,
                      strategy=fullshard.FSDPStrategy(state_dict_type=fmt))
    fabric.launch()
    torch.manual_seed(seed)
    model = fabric.setup_module(cc.make_model("gpt"))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                    weight_decay=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return fabric, model, opt, sched


def _fullshard_full(model: nn.Module, opt) -> dict:
    """fullshard's model and optimizer, gathered on every rank."""
    model, opt = model.module, opt.optimizer  # the sharded model and optimizer inside
    return {"model": fullshard.full_state_dict(model, rank0_only=False),
            "optimizer": full.optimizer_state(opt, {"model": model}, "optimizer")}


def _compare(a: dict, b: dict) -> list[str]:
    """Where two gathered {model, optimizer} states differ (empty: bit for bit the same)."""
    bad = []
    ma, mb = a["model"], b["model"]
    bad += [f"model keys {sorted(set(ma) ^ set(mb))}"] if set(ma) != set(mb) else []
    bad += [f"model {k}" for k in set(ma) & set(mb) if not torch.equal(ma[k], mb[k])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    # A tied parameter has one optimizer entry; each side keys it by one of its names.
    if set(sa) != set(sb):
        bad.append(f"optimizer names {sorted(set(sa) ^ set(sb))}")
    for name in set(sa) & set(sb):
        if sa[name].keys() != sb[name].keys():
            bad.append(f"optimizer {name} keys")
        bad += [f"optimizer {name}.{k}" for k, v in sa[name].items()
                if k in sb[name] and not torch.equal(v, sb[name][k])]
    ga, gb = a["optimizer"]["param_groups"], b["optimizer"]["param_groups"]
    # torch's broadcast_from_rank0 (Lightning's full load) turns tuples (Adam's betas) into
    # lists on the way; the values are the same.
    norm = [[{**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()},
              "params": sorted(g["params"])} for g in gs] for gs in (ga, gb)]
    bad += [f"param_groups {norm[0]} != {norm[1]}"] if norm[0] != norm[1] else []
    return bad


def _same_batches_train(model, opt, sched, backward) -> None:
    torch.manual_seed(11)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = cc.GLOBAL_BATCH // world
    for _ in range(2):
        x, y = model.make_batch(cc.GLOBAL_BATCH, None)
        backward(model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]))
        opt.step()
        opt.zero_grad()
        sched.step()


# -- the two directions ----------------------------------------------------------------------
def _lightning_to_fullshard(root: str, fmt: str) -> dict:
    lfabric, lmodel, lopt, lsched = _lightning(sharded=fmt == "sharded")
    _same_batches_train(lmodel, lopt, lsched, lfabric.backward)
    path = f"{root}/lightning-{fmt}"
    lfabric.save(path, {"model": lmodel, "optimizer": lopt, "scheduler": lsched, "step": 2})
    expected = _lightning_full(lmodel, lopt)

    fabric, model, opt, sched = _fullshard(seed=5)  # loading detects the format
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    rest = fabric.load(path, state)
    consolidated: list[str] = []
    if fmt == "sharded" and dist.get_rank() == 0:  # `fullshard consolidate` reads it too
        whole = to_full(path)
        consolidated = _compare(expected, whole) + (
            [] if whole["step"] == 2 and whole["scheduler"] == lsched.state_dict()
            else ["meta.pt entries"])
    return {"diff": _compare(expected, _fullshard_full(model, opt)) + consolidated,
            "rest": rest, "step": state["step"],
            "sched": sched.state_dict() == lsched.state_dict()}


def _fullshard_to_lightning(root: str, fmt: str) -> dict:
    fabric, model, opt, sched = _fullshard(fmt)
    _same_batches_train(model, opt, sched, fabric.backward)
    path = f"{root}/fullshard-{fmt}"
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 2})
    expected = _fullshard_full(model, opt)

    lfabric, lmodel, lopt, lsched = _lightning(sharded=fmt == "sharded", seed=5)
    state = {"model": lmodel, "optimizer": lopt, "scheduler": lsched, "step": 0}
    rest = lfabric.load(path, state)
    # Lightning's sharded load puts a stateful object's state dict into `state` instead of
    # restoring the object (its full load restores it): compare whichever it did.
    got = state["scheduler"]
    got = got if isinstance(got, dict) else got.state_dict()
    return {"diff": _compare(expected, _lightning_full(lmodel, lopt)), "rest": rest,
            "step": state["step"], "sched": got == sched.state_dict()}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("direction", ["lightning_to_fullshard", "fullshard_to_lightning"])
def test_checkpoints_move_between_lightning_and_fullshard(group2, tmp_path, direction,
                                                          fmt) -> None:
    fn = _lightning_to_fullshard if direction == "lightning_to_fullshard" else \
        _fullshard_to_lightning
    for out in group2.run(fn, str(tmp_path), fmt, timeout=300):
        assert out["diff"] == [], out["diff"]
        assert out["step"] == 2 and out["sched"] and out["rest"] == {}
