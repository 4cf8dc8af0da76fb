"""A plain `fsdp()` script (its own `init_process_group`, no Fabric) that trains a few blocks,
each a unit, and has one rank SIGKILL itself *inside* a unit's forward at a given step (from
a forward hook on a block), while its peers are mid-exchange: prefetched gathers in flight.

Each rank writes its pid to `--pids-dir/rank<R>.pid`; the dying rank writes the time of its
death (`time.time()`) to `--pids-dir/killed-at` just before it kills itself. With
`--kill-how raise` it raises instead (a failure with a cause to report)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pids-dir", required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=2)
    p.add_argument("--kill-block", type=int, default=1)
    p.add_argument("--kill-how", choices=("sigkill", "raise"), default="sigkill")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sleep", type=float, default=0.05)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    blocks = [Block(8) for _ in range(4)]
    model = fullshard.fsdp(nn.Sequential(*blocks, nn.Linear(8, 1)),
                           auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with open(os.path.join(args.pids_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    at = {"step": 0}

    def die(module: nn.Module, inputs: tuple) -> None:
        if at["step"] != args.kill_step or rank != args.kill_rank:
            return
        with open(os.path.join(args.pids_dir, "killed-at.tmp"), "w") as f:
            f.write(repr(time.time()))
        os.replace(os.path.join(args.pids_dir, "killed-at.tmp"),
                   os.path.join(args.pids_dir, "killed-at"))
        if args.kill_how == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        os.kill(os.getpid(), signal.SIGKILL)

    blocks[args.kill_block].register_forward_pre_hook(die)
    for step in range(args.steps):
        at["step"] = step
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
