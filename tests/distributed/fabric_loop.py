"""A training script on Lightning's own Fabric; only the strategy's import differs:

    from lightning.fabric.strategies import FSDPStrategy     ->  from fullshard import FSDPStrategy

The tests run it with `python fabric_loop.py --devices N` (Fabric.launch starts the ranks
through the strategy's launcher) and under `fullshard run`. It uses launch, setup (optimizer
built before setup), setup_dataloaders, no_backward_sync (2 micro-batches), backward,
clip_gradients, save/load (mid-run, into a fresh model and optimizer, checked equal in place),
all_reduce, print.
Rank 0 writes the per-step global losses and gradient norms, the collectives of the last
synced backward and the mesh to `--out` (JSON). `--fail-*` injects a rank death mid-step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fullshard
from fullshard import FSDPStrategy
from fullshard.testing.models import Block, TinyGPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", default="auto")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--mesh", default=None, help="replicate,shard for HYBRID_SHARD")
    p.add_argument("--state-dict-type", default="sharded")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    p.add_argument("--out", default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=1)
    p.add_argument("--fail-how", choices=("raise", "exit", "sigkill"), default="raise")
    p.add_argument("--pids-dir", default=None)
    return p.parse_args()


def make_model() -> TinyGPT:
    return TinyGPT(vocab=23, dim=16, layers=2, heads=2, seq=6)


def snapshot(model, optimizer) -> tuple[dict, list]:
    full = fullshard.full_state_dict(model.module)  # the sharded model in _FabricModule
    opt = [
        {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
        for g in optimizer.param_groups for p in g["params"]
    ]
    return full, opt


def train(fabric: L.Fabric, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.pids_dir:
        with open(os.path.join(args.pids_dir, f"rank{fabric.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    fabric.seed_everything(0)
    with fabric.init_module():
        model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

    accum = 2
    data = torch.randint(0, 23, (64, 7), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data), batch_size=args.batch, shuffle=False)
    loader = fabric.setup_dataloaders(loader)

    losses, norms, counts = [], [], {}
    batches = iter(loader)
    for step in range(args.steps):
        step_loss = torch.zeros(())
        for micro in range(accum):
            (rows,) = next(batches)
            last = micro == accum - 1
            if last:
                fullshard.reset_comm_stats()
            with fabric.no_backward_sync(model, enabled=not last):
                logits = model(rows[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / accum
                if step == args.fail_step and fabric.global_rank == args.fail_rank:
                    if args.pids_dir:  # when it died: the tests time the launch from here
                        with open(os.path.join(args.pids_dir, "failed-at"), "w") as f:
                            f.write(repr(time.time()))
                    if args.fail_how == "raise":
                        raise RuntimeError(f"injected failure on rank {fabric.global_rank}")
                    if args.fail_how == "exit":
                        os._exit(3)
                    os.kill(os.getpid(), signal.SIGKILL)
                fabric.backward(loss)
            if last:
                counts = {k: v for k, v in fullshard.comm_stats().items() if v["calls"]}
            step_loss += loss.detach()
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(fabric.all_reduce(step_loss, reduce_op="mean").item())
        norms.append(norm.item())

        if args.ckpt and step == args.steps // 2 - 1:
            before = snapshot(model, optimizer)
            fabric.save(args.ckpt, {"model": model, "optimizer": optimizer,
                                    "scheduler": scheduler, "step": step})
            # Resume into fresh objects, as a restarted job would.
            with fabric.init_module():
                model = make_model()
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            )
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
            fabric.load(args.ckpt, state)
            after = snapshot(model, optimizer)
            assert state["step"] == step and scheduler.last_epoch == step + 1, state
            for key, value in before[0].items():
                assert torch.equal(value, after[0][key]), f"model {key} changed by save/load"
            for a, b in zip(before[1], after[1]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        fabric.print(f"step {step} loss {losses[-1]:.6f} norm {norms[-1]:.6f}")

    mesh = model.module.fullshard_runtime.mesh
    if fabric.is_global_zero and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "counts": counts,
                       "world_size": fabric.world_size, "mesh": list(mesh.shape),
                       "shard_ranks": list(mesh.shard.ranks),
                       "replicate_ranks": list(mesh.replicate.ranks)}, f)


def main() -> None:
    args = parse_args()
    mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
    strategy = FSDPStrategy(
        sharding_strategy=args.strategy,
        auto_wrap_policy={Block},
        state_dict_type=args.state_dict_type,
        device_mesh=mesh,
    )
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=devices,
                    num_nodes=args.num_nodes)
    fabric.launch(train, args)
    if args.out:  # the run is over: no watch thread of the launcher may outlive teardown
        watch = [t for t in threading.enumerate() if t.name.startswith("fullshard-")]
        before = [[t.name, t.daemon, callable(getattr(t, "stop", None))] for t in watch]
        fabric.barrier()
        fabric.strategy.teardown()
        after = [t.name for t in threading.enumerate() if t.name.startswith("fullshard-")]
        with open(f"{args.out}.threads.{fabric.global_rank}", "w") as f:
            json.dump({"before": before, "after": after}, f)


if __name__ == "__main__":
    main()
