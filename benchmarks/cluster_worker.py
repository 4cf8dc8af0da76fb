"""One rank of a cluster benchmark run: train, time, count what went over the link.

`cluster.py` starts this with `fullshard run --nnodes N --node-rank i ...` inside each emulated
host's network namespace (`cluster_net.py`); by hand, on a real cluster, it is the same:

    GLOO_SOCKET_IFNAME=eth0 fullshard run --nnodes 2 --node-rank 0 --master-addr 10.77.0.1 \\
        --master-port 29500 benchmarks/cluster_worker.py --impl fsdp2-reshard --config A
    python benchmarks/cluster_worker.py --impl single-t1 --config A --world 2   # the reference

Every rank builds the benchmark GPT (`gpt.py`, seeded), wraps it the implementation's way
(`impls.py`; plus `fullshard-hybrid_shard-block` here) and trains on its `--micro-batch` rows
of a global batch of micro-batch x world rows (the single-process reference takes the whole
global batch of `--world` ranks). Per step: the step time of `bench_worker.py` (zero_grad +
forward + loss + backward + optimizer step, `time.perf_counter`, no barrier added).

The measured window is the steps after `--warmup`: at its start and end every rank passes a
barrier and reads its host link's counters (`/sys/class/net/$CLUSTER_IFACE/statistics`, the
veth as seen inside the host's namespace), and the collective counters (`fullshard.comm_stats()`
for fullshard, the c10d wrapper of `comm_count.py` for everyone) cover the same steps.

`--ready-dir D` (for the kill check): after step `--ready-after` each rank writes
`D/rank<r>.pid` with its pid and keeps training.

Rank 0 writes one JSON record (per-step max-over-ranks times, mean-over-ranks losses, per-rank
counters) to `--out` and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import comm_count
import torch
import torch.distributed as dist
from gpt import CONFIGS, build_model, data_pool, lm_loss, param_count, rank_rows
from impls import IMPLS_BY_NAME, Impl, build_trainer

EXTRA_IMPLS = {
    "fullshard-hybrid_shard-block": Impl(
        "fullshard-hybrid_shard-block", "fullshard",
        "fullshard HYBRID_SHARD (shard within a host, replicate across), bucketing BLOCK",
        nproc=4, threads=1, comm_words=0, sharded_state=True,
        options={"sharding_strategy": "HYBRID_SHARD", "bucketing_strategy": "BLOCK"}),
    # compressed collectives (cluster_compression.py) and their fair peer
    "fullshard-full_shard-block-int8w": Impl(
        "fullshard-full_shard-block-int8w", "fullshard",
        "fullshard FULL_SHARD, bucketing BLOCK, weights gathered int8", nproc=2, threads=1,
        comm_words=0, sharded_state=True,
        options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK",
                 "compression": {"weights": "int8"}}),
    "fullshard-full_shard-block-int8wg": Impl(
        "fullshard-full_shard-block-int8wg", "fullshard",
        "fullshard FULL_SHARD, bucketing BLOCK, weights and gradients int8", nproc=2,
        threads=1, comm_words=0, sharded_state=True,
        options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK",
                 "compression": {"weights": "int8", "gradients": "int8"}}),
    # hpZ: after forward each block kept sharded over a host (2 ranks), backward gathers there
    "fullshard-full_shard-block-hpz2": Impl(
        "fullshard-full_shard-block-hpz2", "fullshard",
        "fullshard FULL_SHARD, bucketing BLOCK, reshard_after_forward=2 (hpZ: a host)",
        nproc=4, threads=1, comm_words=0, sharded_state=True,
        options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK",
                 "reshard_after_forward": 2}),
    "fullshard-full_shard-block-int8w-hpz2": Impl(
        "fullshard-full_shard-block-int8w-hpz2", "fullshard",
        "fullshard FULL_SHARD, bucketing BLOCK, int8 weights, reshard_after_forward=2 "
        "(ZeRO++'s qwZ + hpZ)", nproc=4, threads=1, comm_words=0, sharded_state=True,
        options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK",
                 "reshard_after_forward": 2, "compression": {"weights": "int8"}}),
    "fsdp2-hpz2": Impl(
        "fsdp2-hpz2", "fsdp2", "torch FSDP2, reshard_after_forward=2 (a host)", nproc=4,
        threads=1, comm_words=0, sharded_state=True, options={"reshard_after_forward": 2}),
    "ddp-bf16hook": Impl(
        "ddp-bf16hook", "ddp", "torch DDP, bf16_compress_hook's all-reduce in bf16", nproc=2,
        threads=1, comm_words=1, sharded_state=False, options={"comm_hook": "bf16"}),
}
CLUSTER_IMPLS = {**IMPLS_BY_NAME, **EXTRA_IMPLS}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", required=True, choices=sorted(CLUSTER_IMPLS))
    p.add_argument("--config", default="A", choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per rank (default 4)")
    p.add_argument("--world", type=int, default=None,
                   help="single-process impls: the world size whose global batch to train on")
    p.add_argument("--out", default=None)
    p.add_argument("--ready-dir", default=None)
    p.add_argument("--ready-after", type=int, default=2)
    p.add_argument("--option", action="append", default=[],
                   help="fullshard impls: an extra fullshard.fsdp option key=value (JSON value)")
    p.add_argument("--trace", default=None,
                   help="directory: write a timeline of every step there (cluster_trace.py)")
    args = p.parse_args()
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        p.error(f"need steps >= 1 and 0 <= warmup < steps, got {args.steps} / {args.warmup}")
    return args


def link_counters() -> dict[str, int] | None:
    iface = os.environ.get("CLUSTER_IFACE")
    if not iface:
        return None
    base = Path("/sys/class/net") / iface / "statistics"
    return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes")}


def main() -> None:
    args = parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps the stacks
    impl = CLUSTER_IMPLS[args.impl]
    if args.option:
        if impl.family != "fullshard":
            raise SystemExit(f"--option is for fullshard implementations, not {impl.name}")
        extra = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
        impl = dataclasses.replace(impl, options={**impl.options, **extra})
    torch.set_num_threads(impl.threads)
    distributed = impl.family != "single"
    if distributed:
        comm_count.install()  # before fullshard is imported (see comm_count's docstring)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    data_world = world if distributed else (args.world or 1)
    cfg = dataclasses.replace(CONFIGS[args.config], global_batch=args.micro_batch * data_world)
    model = build_model(cfg)
    trainer = build_trainer(impl, model, world, args.micro_batch)
    nice = int(os.environ.get("CLUSTER_NICE_COMPUTE", "0"))
    if nice:
        # Only this (the compute) thread: Linux's nice is per thread, and the process groups'
        # IO threads, all started by now, keep theirs, so they preempt compute on a busy core.
        os.nice(nice)
    engine = None
    if impl.family == "fullshard":
        import fullshard as engine
    tracer = None
    if args.trace and engine is not None:
        import cluster_trace

        tracer = cluster_trace.install()
        tracer.on = True
    marks: list[dict[str, float]] = []
    batches = [rank_rows(b, rank, world) for b in data_pool(cfg)]

    step_s: list[float] = []
    losses: list[float] = []
    window: dict[str, Any] = {}
    for step in range(args.steps):
        if step == args.warmup:
            if distributed:
                dist.barrier()
            window["link_start"] = link_counters()
            if engine is not None:
                engine.reset_comm_stats()
            if distributed:
                comm_count.start()
            window["t0"] = time.perf_counter()
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        trainer.zero_grad()
        t_zero = time.perf_counter()
        loss = lm_loss(trainer.forward(batch[:, :-1]), batch[:, 1:])
        t_fwd = time.perf_counter()
        trainer.backward(loss)
        t_bwd = time.perf_counter()
        trainer.step()
        t_end = time.perf_counter()
        step_s.append(t_end - t0)
        marks.append({"start": t0, "zero_grad": t_zero, "forward": t_fwd, "backward": t_bwd,
                      "end": t_end})
        losses.append(loss.item())
        if args.ready_dir and step == args.ready_after:
            path = Path(args.ready_dir) / f"rank{rank}.pid"
            path.with_suffix(".tmp").write_text(str(os.getpid()))
            path.with_suffix(".tmp").rename(path)
    window["seconds"] = time.perf_counter() - window["t0"]
    if tracer is not None:
        import cluster_trace

        cluster_trace.dump(str(Path(args.trace) / f"trace-rank{rank}.json"), rank, marks)
    if distributed:
        window["c10d"] = comm_count.stop()
    window["fullshard"] = engine.comm_stats() if engine is not None else None
    if engine is not None:  # divergence headers: on the wire, not in comm_stats()
        from fullshard.distributed.comm import header_stats

        window["headers"] = header_stats()
    if distributed:
        dist.barrier()
    window["link_end"] = link_counters()
    result = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
              "host": int(os.environ.get("GROUP_RANK", 0)), "step_s": step_s,
              "losses": losses, "window": window}
    ranks = [result]
    if distributed:
        ranks = [None] * world
        dist.all_gather_object(ranks, result)
    if rank == 0:
        record = {
            "impl": impl.name, "config": cfg.name, "world": world, "data_world": data_world,
            "micro_batch": args.micro_batch, "global_batch": cfg.global_batch,
            "steps": args.steps, "warmup": args.warmup,
            "psi": param_count(cfg),
            "step_s": [max(c) for c in zip(*(r["step_s"] for r in ranks))],
            "losses": [sum(c) / len(c) for c in zip(*(r["losses"] for r in ranks))],
            "ranks": [{k: v for k, v in r.items() if k not in ("step_s", "losses")}
                      for r in ranks],
        }
        line = json.dumps(record)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(line, flush=True)
    if distributed:
        del trainer, model  # see bench_worker.py: drop groups while the interpreter is alive
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
