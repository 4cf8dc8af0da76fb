"""Measure one implementation on one config inside its ranks, and emit one JSON line.

`step_time.py` launches this; to run one measurement by hand:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/bench_worker.py --impl fsdp2-reshard --config A --steps 20 --warmup 3
    python benchmarks/bench_worker.py --impl single-t2 --config A     # single-process impls

Every rank seeds and builds the same `GPT`, wraps it the implementation's way (`impls.py`) and
trains `--steps` steps on its rows of the cycled data pool. Per step each rank times
zero_grad + forward + loss (`fwd`), backward (`bwd`) and the optimizer step (`opt`) with
`time.perf_counter`; no barrier is added, the implementation's own collectives keep the ranks
in step. Around the last step the collective counters are reset and read: the c10d wrapper
(`comm_count.py`) for every distributed implementation and, for fullshard, also
`fullshard.comm_stats()`. After the last optimizer step, with gradients still present, each rank
adds up its model state (params + grads + optimizer state, distinct storages, DTensors by their
local shard). fullshard's peak unsharded bytes (`fullshard.memory_stats()`) cover the steps
after warmup; peak RSS is `ru_maxrss`.

Rank 0 then writes one JSON record: per-step times as the max over ranks, per-step losses as
the mean over ranks, and the per-rank memory and communication figures. It is printed as the
last line of stdout and appended to `--out` when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from pathlib import Path
from typing import Any

import comm_count
import torch
import torch.distributed as dist
from gpt import CONFIGS, GPTConfig, build_model, data_pool, lm_loss, param_count, rank_rows
from impls import IMPLS_BY_NAME, Impl, Trainer, build_trainer, unique_storage_bytes

PHASES = ("step", "fwd", "bwd", "opt")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", required=True, choices=sorted(IMPLS_BY_NAME))
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="default: the config's default_steps")
    p.add_argument("--warmup", type=int, default=3, help="leading steps left out of the timing")
    p.add_argument("--out", default=None, help="append the JSON record to this file")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="cProfile the timed steps (after warmup) of each rank into "
                   "DIR/rank<r>.prof (profiling slows the steps: their times mean little)")
    args = p.parse_args()
    if args.steps is None:
        args.steps = CONFIGS[args.config].default_steps
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        p.error(f"need steps >= 1 and 0 <= warmup < steps, got {args.steps} / {args.warmup}")
    return args


def train(trainer: Trainer, batches: list[torch.Tensor], steps: int, warmup: int,
          engine: Any, count_comm: bool, profiler: Any = None) -> dict[str, Any]:
    """Run the steps on this rank; return its timings, losses and measurements.

    `engine` is the fullshard module for fullshard implementations (its counters are read),
    else None; `count_comm` says whether the c10d counters are installed.
    """
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    losses: list[float] = []
    comm_c10d = comm_engine = comm_headers = None
    for step in range(steps):
        batch = batches[step % len(batches)]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        last = step == steps - 1
        if step == warmup and engine is not None:
            engine.reset_memory_stats()
        if step == warmup and profiler is not None:
            profiler.enable()
        if last:
            comm_count.start()
            if engine is not None:
                engine.reset_comm_stats()
        t0 = time.perf_counter()
        trainer.zero_grad()
        loss = lm_loss(trainer.forward(inputs), targets)
        t1 = time.perf_counter()
        trainer.backward(loss)
        t2 = time.perf_counter()
        trainer.step()
        t3 = time.perf_counter()
        if last:
            comm_c10d = comm_count.stop() if count_comm else None
            comm_engine = engine.comm_stats() if engine is not None else None
            if engine is not None:  # divergence headers: on the wire, not in comm_stats()
                from fullshard.distributed.comm import header_stats

                comm_headers = header_stats()
        losses.append(loss.item())
        for phase, seconds in zip(PHASES, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
            times[phase].append(seconds)
    if profiler is not None:
        profiler.disable()
    return {
        "times": times,
        "losses": losses,
        "state_bytes": unique_storage_bytes(trainer.state_tensors()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "comm_c10d": comm_c10d,
        "comm_fullshard": comm_engine,
        "comm_headers": comm_headers,
        "engine_memory": engine.memory_stats() if engine is not None else None,
    }


def assemble(impl: Impl, cfg: GPTConfig, args: argparse.Namespace, psi: int,
             ranks: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One record from every rank's results: times max over ranks, losses mean over ranks."""
    def per_step(values: list[list[float]], reduce: Any) -> list[float]:
        return [reduce(column) for column in zip(*values)]

    record: dict[str, Any] = {
        "impl": impl.name,
        "config": cfg.name,
        "world": len(ranks),
        "threads": impl.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "psi": psi,
        "losses": per_step([r["losses"] for r in ranks], lambda c: sum(c) / len(c)),
    }
    for phase in PHASES:
        record[f"{phase}_s"] = per_step([r["times"][phase] for r in ranks], max)
    for key in ("state_bytes", "peak_rss_bytes", "comm_c10d", "comm_fullshard",
                "comm_headers", "engine_memory"):
        values = [r[key] for r in ranks]
        record[key] = None if all(v is None for v in values) else values
    record["wall_s"] = wall_s
    return record


def main() -> None:
    args = parse_args()
    impl, cfg = IMPLS_BY_NAME[args.impl], CONFIGS[args.config]
    start = time.perf_counter()
    torch.set_num_threads(impl.threads)
    distributed = impl.nproc > 1
    if distributed:
        comm_count.install()  # before fullshard is imported (see comm_count's docstring)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
        if impl.family == "fullshard":  # fsdp() wants a group, even of one process
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build_model(cfg)
    psi = sum(p.numel() for p in model.parameters())
    assert psi == param_count(cfg), (psi, param_count(cfg))
    trainer = build_trainer(impl, model, world, cfg.global_batch // world)
    engine = None
    if impl.family == "fullshard":
        import fullshard as engine
    batches = [rank_rows(b, rank, world) for b in data_pool(cfg)]
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    result = train(trainer, batches, args.steps, args.warmup, engine, distributed, profiler)
    if profiler is not None:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(args.profile) / f"rank{rank}.prof"))
    ranks = [result]
    if distributed:
        ranks = [None] * world
        dist.all_gather_object(ranks, result)
    if rank == 0:
        record = assemble(impl, cfg, args, psi, ranks, time.perf_counter() - start)
        line = json.dumps(record)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(line, flush=True)
    if distributed:
        # Drop the wrapped model (FSDP2's mesh, DDP's reducer hold process groups) while the
        # interpreter is fully alive: torn down at exit, gloo's threads sometimes abort.
        del trainer, model
        gc.collect()
        dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
