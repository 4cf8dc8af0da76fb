"""Train a small GPT with Lightning's own Fabric and fullshard's FSDPStrategy.

    python examples/fabric_train.py                       # 2 processes, started by Fabric.launch
    python examples/fabric_train.py --devices 4 --strategy HYBRID_SHARD --mesh 2,2
    fullshard run --nproc-per-node 2 examples/fabric_train.py --devices 2

A Lightning Fabric script ports by changing one import: `from fullshard import FSDPStrategy`
(or by `strategy="fullshard"` after `import fullshard`); needs `pip install "fullshard[lightning]"`.
The model learns a fixed pseudo-random token sequence, so the loss falls.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fullshard import FSDPStrategy
from fullshard.testing.models import Block, TinyGPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", default="2", help="processes on this machine, or 'auto'")
    p.add_argument("--strategy", default="FULL_SHARD",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
    p.add_argument("--mesh", default=None, help="replicate,shard for HYBRID_SHARD, e.g. 2,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--checkpoint", default=None, help="save a (sharded) checkpoint here at the end")
    return p.parse_args()


def train(fabric: L.Fabric, args: argparse.Namespace) -> None:
    fabric.seed_everything(0)
    with fabric.init_module():
        model = TinyGPT(vocab=64, dim=64, layers=2, heads=4, seq=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    text = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(1))
    windows = text.unfold(0, 33, 7)  # (n, 33) overlapping windows of the sequence
    micro = max(1, args.batch // (fabric.world_size * args.accumulate))
    loader = DataLoader(TensorDataset(windows), batch_size=micro, shuffle=True, drop_last=True)
    loader = fabric.setup_dataloaders(loader)

    step, batches = 0, iter(loader)
    while step < args.steps:
        for i in range(args.accumulate):
            try:
                (rows,) = next(batches)
            except StopIteration:
                batches = iter(loader)
                (rows,) = next(batches)
            is_last = i == args.accumulate - 1
            with fabric.no_backward_sync(model, enabled=not is_last):
                logits = model(rows[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        if step % 10 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {loss.item():.3f}  grad norm {norm.item():.3f}")
        step += 1
    if args.checkpoint:
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step})
        fabric.print(f"saved {args.checkpoint}")


def main() -> None:
    args = parse_args()
    mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
    strategy = FSDPStrategy(sharding_strategy=args.strategy, auto_wrap_policy={Block},
                            device_mesh=mesh)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=devices)
    fabric.launch(train, args)


if __name__ == "__main__":
    main()
