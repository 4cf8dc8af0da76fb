"""Train a small GPT with fullshard's ZeRO-3 on 2 CPU processes (what `make demo` runs).

    python examples/train_fsdp.py                 # starts 2 ranks through torchrun
    python examples/train_fsdp.py --nproc 4 --strategy SHARD_GRAD_OP --bucketing BLOCK

The model learns a repeated pseudo-random phrase (so the loss visibly falls); each rank
trains on its own rows of the global batch. At the end rank 0 prints the loss curve's ends,
the per-rank model-state bytes against one process's, and the collectives of one step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fullshard
from fullshard.testing.models import Block, TinyGPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--bucketing", default="BLOCK")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # not launched yet: start args.nproc ranks of this script
        if args.nproc < 1:
            sys.exit(f"--nproc must be >= 1, got {args.nproc}")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            __file__,
            *sys.argv[1:],
        ]
        sys.exit(subprocess.call(cmd))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=128, layers=4, heads=4, seq=32)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = fullshard.fsdp(
        model,
        sharding_strategy=args.strategy,
        bucketing_strategy=args.bucketing,
        auto_wrap_policy={Block},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Parameters of one bucket share one flat storage: count each storage once.
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
    local_bytes = sum(s.nbytes() for s in storages.values())
    # A random 50-token phrase repeated: learnable, so the loss falls well below ln(64).
    phrase = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(1))
    data = phrase.repeat(80)
    per_rank = args.batch // world
    gen = torch.Generator().manual_seed(2)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - 33, (args.batch,), generator=gen)
        rows = torch.stack([data[s : s + 33] for s in starts])[
            rank * per_rank : (rank + 1) * per_rank
        ]
        if step == args.steps - 1:
            fullshard.reset_comm_stats()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        stats = fullshard.comm_stats()
        print(
            f"\n{world} ranks, {args.strategy}, bucketing {args.bucketing}: "
            f"{args.steps} steps in {elapsed:.1f} s"
        )
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        print(f"parameter bytes per rank {local_bytes:,} vs {full_bytes:,} in one process")
        print(
            "collectives in the last step: "
            + ", ".join(
                f"{k} {v['calls']} ({v['bytes'] / 2**20:.2f} MiB)"
                for k, v in stats.items()
                if v["calls"]
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
