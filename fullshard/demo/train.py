"""What every rank of `fullshard demo` runs: train, checkpoint, sample, measure.

The model is a byte-level GPT (`fullshard.testing.models.TinyGPT`, vocabulary 256) trained with
AdamW through Lightning's `Fabric` + fullshard's `FSDPStrategy`, one unit per transformer
block. Rank 0 shows a progress bar (tqdm when installed) and returns the measurements that
`report.py` prints and plots; the other ranks return None.

Resuming (`--resume`) loads the sharded checkpoint of the previous run (model, optimizer, step,
loss history) and continues with the batches that run would have drawn next (`data.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

import fullshard
from fullshard.demo.config import DemoConfig, build_model
from fullshard.demo.data import decode, encode, global_batch, load_corpus, rank_rows
from fullshard.distributed import comm
from fullshard.planner.hardware import measure_link
from fullshard.testing.models import TinyGPT


@dataclass
class DemoResult:
    config: DemoConfig
    world_size: int
    device: str
    first_step: int
    losses: list[float]
    seconds: float
    params: int
    state_bytes_per_rank: list[int]
    comm_per_step: dict[str, dict[str, int]]
    peak_unsharded_bytes: int
    checkpoint: str
    sample: str
    link: dict[str, float] | None = None
    """The ranks' loopback link and engine overhead (`planner.hardware.measure_link`), for the
    predicted step time on this machine."""
    exact_losses: list[float] | None = None
    """With `--compression`: the same steps trained exact, beside (None when resumed)."""
    exact_comm_per_step: dict[str, dict[str, int]] | None = None


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of unique storages behind parameters, gradients and optimizer state."""
    storages: dict[int, int] = {}
    tensors = [p for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@torch.no_grad()
def sample(model: TinyGPT, cfg: DemoConfig, device: torch.device) -> str:
    """Every rank runs the same forwards (they gather parameters) and draws the same bytes."""
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.tensor([encode(cfg.sample_prompt)], device=device)
    model.eval()
    for _ in range(cfg.sample_length):
        logits = model(ids[:, -cfg.seq :])[0, -1].float().cpu() / 0.8
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt.to(device).view(1, 1)], dim=1)
    model.train()
    return decode(ids[0].tolist())


def _progress(total: int, initial: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


@dataclass
class _Run:
    """What one training run measured."""

    losses: list[float]
    comm_step: dict[str, dict[str, int]]
    peak: int
    state_bytes: int
    seconds: float


def _setup(fabric: L.Fabric, cfg: DemoConfig) -> tuple[Any, Any, int]:
    """The seeded model and its optimizer, set up by the strategy; and the parameter count."""
    torch.manual_seed(cfg.seed)
    with fabric.init_module():
        model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    return model, optimizer, params


def _train_steps(fabric: L.Fabric, cfg: DemoConfig, model: Any, optimizer: Any, first: int,
                 losses: list[float], desc: str) -> _Run:
    """Steps `first` .. `first + cfg.steps` on the demo's batches, appending to `losses`."""
    rank, world = fabric.global_rank, fabric.world_size
    corpus = load_corpus()
    last = first + cfg.steps
    bar = _progress(last, first, fabric.is_global_zero, desc)
    comm_step: dict[str, dict[str, int]] = {}
    state_bytes = peak = 0
    start = time.perf_counter()
    for step in range(first, last):
        t0 = time.perf_counter()
        rows = rank_rows(global_batch(corpus, step, cfg.batch, cfg.seq, cfg.seed), rank, world)
        rows = rows.to(fabric.device)
        measure = step == first + min(1, cfg.steps - 1)  # a warm step
        if measure:
            fullshard.reset_comm_stats()
            fullshard.reset_memory_stats()
        loss = model.loss(rows[:, :-1], rows[:, 1:])
        fabric.backward(loss)
        if measure:
            comm_step = fullshard.comm_stats()
            peak = fullshard.memory_stats()["peak_unsharded_bytes"]
        optimizer.step()
        if step == last - 1:
            state_bytes = _state_bytes(model, optimizer)
        optimizer.zero_grad()
        mean = fabric.all_reduce(loss.detach().float(), reduce_op="mean")
        losses.append(float(mean))
        if bar is not None:
            dt = time.perf_counter() - t0
            tokens = cfg.batch * cfg.seq / dt
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens:,.0f}", ms=f"{dt * 1e3:.0f}")
            bar.update(1)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return _Run(losses, comm_step, peak, state_bytes, seconds)


def _exact_beside(fabric: L.Fabric, cfg: DemoConfig) -> _Run:
    """The same steps from the same seed with nothing compressed: the run a compressed one is
    judged against (the strategy's `compression` is read by each `setup_module`)."""
    strategy = fabric.strategy
    compression, strategy.compression = strategy.compression, None
    try:
        model, optimizer, _ = _setup(fabric, cfg)
        return _train_steps(fabric, cfg, model, optimizer, 0, [], "exact run")
    finally:
        strategy.compression = compression


def train(fabric: L.Fabric, cfg: DemoConfig) -> DemoResult | None:
    world = fabric.world_size
    if fabric.device.type == "cpu":  # share the cores between the local ranks
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    model, optimizer, params = _setup(fabric, cfg)
    ckpt = Path(cfg.out) / "checkpoint"
    first, losses = 0, []
    if cfg.resume:
        rest = fabric.load(ckpt, {"model": model, "optimizer": optimizer})
        first, losses = int(rest["step"]), list(rest["losses"])
    desc = f"training ({cfg.compression} on the wire)" if cfg.compression else "training"
    run = _train_steps(fabric, cfg, model, optimizer, first, losses, desc)
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": first + cfg.steps,
                       "losses": losses})
    text = sample(model, cfg, fabric.device)
    per_rank = comm.all_gather_object(run.state_bytes, model.fullshard_runtime.mesh.world)
    link = measure_link() if fabric.device.type == "cpu" and world > 1 else None
    exact = _exact_beside(fabric, cfg) if cfg.compression and not first else None
    if not fabric.is_global_zero:
        return None
    return DemoResult(
        config=cfg,
        world_size=world,
        device=str(fabric.device),
        first_step=first,
        losses=losses,
        seconds=run.seconds,
        params=params,
        state_bytes_per_rank=per_rank,
        comm_per_step=run.comm_step,
        peak_unsharded_bytes=run.peak,
        checkpoint=str(ckpt),
        sample=text,
        link=link,
        exact_losses=exact.losses if exact else None,
        exact_comm_per_step=exact.comm_step if exact else None,
    )
