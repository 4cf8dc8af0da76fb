"""A script that survives a killed rank: run under `fullshard run --max-restarts K`, it saves
a sharded checkpoint every `--every` steps and, on every (re)start, resumes from the latest
complete one (`fullshard.api.resume`). `--kill-rank R --kill-step S` SIGKILLs rank R at step S
of the first attempt only. `--attempts-dir D` has every rank note each attempt it starts
(`D/attempt<A>-rank<R>`, holding the step it resumes from). Rank 0 writes the final full
parameters to `--out` (torch.save), and `reference()` trains the same thing in one process,
unsharded, for comparison.

The global batch of a step is a function of the step alone (rows `step * 4 ...`), split evenly
over the ranks, so any world size sees the same numbers and a resumed run repeats exactly the
steps it lost.
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning as L
import torch
import torch.nn as nn

from fullshard import FSDPStrategy, full_state_dict
from fullshard.api.resume import checkpoint_path, latest_checkpoint

GLOBAL_BATCH = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, unsharded, uninterrupted."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--attempts-dir", default=None)
    p.add_argument("--devices", type=int, default=2, help="ranks per node (`fullshard run`'s)")
    p.add_argument("--num-nodes", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)

    fabric = L.Fabric(accelerator="cpu", strategy=FSDPStrategy(), devices=args.devices,
                      num_nodes=args.num_nodes)
    fabric.launch()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    last = latest_checkpoint(args.ckpt_dir)
    if last is not None:
        fabric.load(last, state)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fabric.print(f"attempt {attempt}: world size {fabric.world_size}, from step {state['step']}")
    if args.attempts_dir:
        os.makedirs(args.attempts_dir, exist_ok=True)
        with open(os.path.join(args.attempts_dir, f"attempt{attempt}-rank{fabric.global_rank}"),
                  "w") as f:
            f.write(str(state["step"]))

    rank, world = fabric.global_rank, fabric.world_size
    rows = GLOBAL_BATCH // world
    for step in range(state["step"], args.steps):
        if attempt == 0 and step == args.kill_step and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.every == 0:
            state["step"] = step + 1
            fabric.save(checkpoint_path(args.ckpt_dir, step + 1), state)

    full = full_state_dict(model.module)
    if fabric.is_global_zero:
        torch.save(full, args.out)


if __name__ == "__main__":
    main()
