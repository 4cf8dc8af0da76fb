"""Pretrain a small GPT the way litgpt's `pretrain.py` does: Lightning's own Fabric with
fullshard's FSDPStrategy (`pip install "fullshard[lightning]"`).

    python examples/pretrain.py --devices 2 --out-dir out/pretrain     # the strategy launches
    fullshard run --nproc 2 examples/pretrain.py --devices 2 --out-dir out/pretrain --resume auto
    python examples/pretrain.py --devices 1 --micro-batch-size 8 --out-dir out/one

The loop is litgpt's, with only the strategy's import changed: loggers (a CSV logger in
`<out-dir>/logs/version_N/metrics.csv`), data prepared once under `rank_zero_first`, a warmup
+ cosine learning rate, gradient accumulation with `no_backward_sync`, `clip_gradients`, a
checkpoint every `--save-interval` steps (`<out-dir>/step-XXXXXXXX/lit_model.pth`), resume
from the latest one (`--resume auto`) or a given path, and throughput (Lightning's
`ThroughputMonitor` and `measure_flops`).

The global batch (`--global-batch-size` rows per optimizer step) is the same for any number
of processes: each rank takes `--micro-batch-size` rows per micro-batch and accumulates
`global / (micro * world)` micro-batches, and the data sampler gives every rank its slice of
the same shuffled order -- so 1 process and 2 processes log the same losses.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.utilities.throughput import ThroughputMonitor, measure_flops
from torch.utils.data import DataLoader, TensorDataset

from fullshard import FSDPStrategy
from fullshard.demo.data import load_corpus
from fullshard.testing.models import Block, TinyGPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--devices", type=int, default=1,
                   help="processes on this machine (under `fullshard run`: its --nproc)")
    p.add_argument("--strategy", default="FULL_SHARD",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
    p.add_argument("--state-dict-type", default="sharded", choices=("sharded", "full"))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=12, help="optimizer steps in total")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--resume", default=None, help="'auto' (latest checkpoint) or a path")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


# -- data ---------------------------------------------------------------------------------------
def prepare_data(path: Path, seq: int) -> None:
    """Cut the corpus (UTF-8 bytes) into windows of `seq + 1` tokens, once."""
    if path.exists():
        return
    tokens = load_corpus()
    n = (tokens.numel() - 1) // seq
    rows = torch.stack([tokens[i * seq:i * seq + seq + 1] for i in range(n)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    tmp.rename(path)


class CycleIterator:
    """Endless passes over a loader (each new pass reshuffles: the loader calls set_epoch)."""

    def __init__(self, loader) -> None:  # noqa: ANN001
        self.loader, self.epoch, self._it = loader, 0, None

    def __iter__(self) -> CycleIterator:
        return self

    def __next__(self):  # noqa: ANN204
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = iter(self.loader)
            return next(self._it)


# -- the loop -----------------------------------------------------------------------------------
def make_model(seq: int) -> TinyGPT:
    return TinyGPT(vocab=256, dim=32, layers=2, heads=2, seq=seq)


def get_lr(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to `min_lr` at `max_steps` (litgpt's schedule)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.min_lr + cosine * (args.lr - args.min_lr)


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = sorted(out_dir.glob("step-*/lit_model.pth"))
    return found[-1] if found else None


def main(fabric: L.Fabric, args: argparse.Namespace) -> None:
    fabric.seed_everything(args.seed)
    world = fabric.world_size
    per_step = args.micro_batch_size * world
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"micro-batch-size x processes = {per_step}")
    accumulate = args.global_batch_size // per_step

    data_file = args.out_dir / "data" / f"train-{args.seq}.pt"
    with fabric.rank_zero_first():  # rank 0 prepares the data, the others then read it
        if fabric.global_rank == 0:
            prepare_data(data_file, args.seq)
        rows = torch.load(data_file)
    loader = DataLoader(TensorDataset(rows), batch_size=args.micro_batch_size, shuffle=True,
                        drop_last=True)
    loader = fabric.setup_dataloaders(loader)

    fabric.print(f"{world} process(es); global batch {args.global_batch_size} = micro "
                 f"{args.micro_batch_size} x {world} x accumulate {accumulate}")
    with fabric.init_module(empty_init=False):
        model = make_model(args.seq)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}

    resume = latest_checkpoint(args.out_dir) if args.resume == "auto" else args.resume
    if resume:
        fabric.print(f"Resuming training from {resume}")
        fabric.load(resume, state)

    monitor = ThroughputMonitor(fabric, window_size=4)
    with torch.device("meta"):  # FLOPs of one micro-batch, counted on a meta-device copy
        meta_model = make_model(args.seq)
        x = torch.randint(0, 256, (args.micro_batch_size, args.seq))
        flops = measure_flops(meta_model, lambda: meta_model(x), lambda y: y.sum())
    fit(fabric, args, state, loader, accumulate, monitor, flops)


def fit(fabric: L.Fabric, args: argparse.Namespace, state: dict, loader, accumulate: int,  # noqa: ANN001
        monitor, flops_per_batch: int) -> None:  # noqa: ANN001
    model, optimizer = state["model"], state["optimizer"]
    train_iterator = CycleIterator(loader)
    for _ in range(state["iter_num"]):  # resume: the data position, as litgpt fast-forwards
        next(train_iterator)
    t0 = time.perf_counter()
    running = torch.zeros(())
    while state["step_count"] < args.max_steps:
        (batch,) = next(train_iterator)
        state["iter_num"] += 1
        lr = get_lr(state["step_count"], args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = batch[:, :-1], batch[:, 1:]
        is_accumulating = state["iter_num"] % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            fabric.backward(loss / accumulate)
        running += loss.detach() / accumulate
        if is_accumulating:
            continue
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step_count"] += 1
        step = state["step_count"]
        step_loss = fabric.all_reduce(running, reduce_op="mean").item()
        running = torch.zeros(())
        monitor.update(time=time.perf_counter() - t0, batches=state["iter_num"],
                       samples=state["iter_num"] * args.micro_batch_size,
                       lengths=state["iter_num"] * args.micro_batch_size * args.seq,
                       flops=flops_per_batch * accumulate)
        if step % args.log_interval == 0:
            fabric.log_dict({"loss": step_loss, "iter": state["iter_num"], "step": step,
                             "learning_rate": lr, "grad_norm": grad_norm.item()}, step=step)
            monitor.compute_and_log(step=step)
            fabric.print(f"step {step:4d}  iter {state['iter_num']:5d}  loss {step_loss:.4f}  "
                         f"lr {lr:.2e}  grad norm {grad_norm.item():.3f}")
        if step % args.save_interval == 0 or step == args.max_steps:
            path = args.out_dir / f"step-{step:08d}" / "lit_model.pth"
            fabric.save(path, state)
            fabric.print(f"Saved checkpoint to {path}")
    for logger in fabric.loggers:
        logger.finalize("success")


def setup() -> None:
    args = parse_args()
    strategy = FSDPStrategy(sharding_strategy=args.strategy, auto_wrap_policy={Block},
                            state_dict_type=args.state_dict_type)
    logger = CSVLogger(args.out_dir, name="logs")
    fabric = L.Fabric(devices=args.devices, strategy=strategy,
                      precision=args.precision, loggers=[logger])
    fabric.launch(main, args)


if __name__ == "__main__":
    setup()
