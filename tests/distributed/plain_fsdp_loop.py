"""A plain torch script: `init_process_group` itself, then `fullshard.fsdp()`, no Fabric.
Each rank writes its pid to `--pids-dir`; it then trains a tiny model for `--steps` steps,
sleeping `--sleep` seconds in each (a long run, for tests that end it from outside)."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pids-dir", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sleep", type=float, default=0.1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fullshard.fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with open(os.path.join(args.pids_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    for _ in range(args.steps):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
