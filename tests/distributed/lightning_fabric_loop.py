"""A training script on Lightning's own `Fabric` with fullshard's strategy in it.

    python lightning_fabric_loop.py --strategy instance --devices 2   # fullshard.FSDPStrategy(...)
    python lightning_fabric_loop.py --strategy fullshard --devices 2  # strategy="fullshard"
    python lightning_fabric_loop.py --strategy single --devices 1     # Lightning's own, one process

Each step: 2 micro-batches under `fabric.no_backward_sync` (all but the last), `fabric.backward`,
`fabric.clip_gradients` (by norm; by value on step 2), `optimizer.step()`. After step 1:
`fabric.save`, then fresh objects set up by `setup_module` / `setup_optimizers`, `fabric.load`,
checked equal, and training goes on with them. Rank 0 writes the global losses and norms (and
what the strategy is, and the environment variables the run left set) to `--out` as JSON.
`--fail-rank` makes that rank raise at step 1.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import FSDPStrategy as LightningFSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import fullshard
from fullshard.testing.models import Block, TinyGPT

VALUE_CLIP_STEP = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=("instance", "fullshard", "single"), default="instance")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--state-dict-type", default="sharded")
    p.add_argument("--out", default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--fail-rank", type=int, default=-1)
    return p.parse_args()


def make_model() -> TinyGPT:
    return TinyGPT(vocab=23, dim=16, layers=2, heads=2, seq=6)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if hasattr(model, "module") else model
    if isinstance(inner, fullshard.FullyShardedModule):
        return fullshard.full_state_dict(inner)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
            for g in optimizer.param_groups for p in g["params"]]


def save_and_resume(fabric: L.Fabric, args: argparse.Namespace, model, optimizer, step: int):
    before = full_state(model), optimizer_state(optimizer)
    fabric.save(args.ckpt, {"model": model, "optimizer": optimizer, "step": step})
    with fabric.init_module():
        fresh = make_model()
    fresh = fabric.setup_module(fresh)
    fresh_opt = fabric.setup_optimizers(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    state = {"model": fresh, "optimizer": fresh_opt, "step": -1}
    fabric.load(args.ckpt, state)
    assert state["step"] == step, state
    after = full_state(fresh), optimizer_state(fresh_opt)
    assert before[0].keys() == after[0].keys()
    for key, value in before[0].items():
        assert torch.equal(value, after[0][key]), f"model {key} changed by save/load"
    for a, b in zip(before[1], after[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return fresh, fresh_opt


def train(fabric: L.Fabric, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    fabric.seed_everything(0)
    with fabric.init_module():
        model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)

    accum = 2
    data = torch.randint(0, 23, (64, 7), generator=torch.Generator().manual_seed(1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(data), batch_size=args.batch))
    batches = iter(loader)
    losses, norms = [], []
    for step in range(args.steps):
        step_loss = torch.zeros(())
        for micro in range(accum):
            (rows,) = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                logits = model(rows[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / accum
                if step == 1 and fabric.global_rank == args.fail_rank:
                    raise RuntimeError(f"injected failure on rank {fabric.global_rank}")
                fabric.backward(loss)
            step_loss += loss.detach()
        if step == VALUE_CLIP_STEP:
            fabric.clip_gradients(model, optimizer, clip_val=0.01)
            norms.append(None)
        else:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(step_loss, reduce_op="mean").item())
        if args.ckpt and step == 1:
            model, optimizer = save_and_resume(fabric, args, model, optimizer, step)

    if fabric.is_global_zero and args.out:
        strategy = fabric.strategy
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "world_size": fabric.world_size,
                       "strategy": type(strategy).__module__ + "." + type(strategy).__name__,
                       "is_lightning_fsdp": isinstance(strategy, LightningFSDPStrategy),
                       "launcher": type(strategy.launcher).__module__ if strategy.launcher
                       else None}, f)


def main() -> None:
    args = parse_args()
    if args.strategy == "instance":
        strategy = fullshard.FSDPStrategy(auto_wrap_policy={Block},
                                          state_dict_type=args.state_dict_type)
    elif args.strategy == "fullshard":
        strategy = "fullshard"  # registered by `import fullshard` (Lightning is imported first)
    else:
        strategy = "auto"  # Lightning's SingleDeviceStrategy: the one-process reference
    env_before = set(os.environ)
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=args.devices)
    fabric.launch(train, args)
    if fabric.is_global_zero and args.out:  # what the run left set in rank 0's process
        with open(args.out) as f:
            result = json.load(f)
        result["env_left_set"] = sorted(set(os.environ) - env_before)
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
