"""Eager vs torch.compile'd fullshard: step time on the benchmark GPT (`gpt.py`, config A/B).

    python benchmarks/compile_step_time.py --config A                  # record a run
    python benchmarks/compile_step_time.py --config A --steps 4 --warmup 2 --reps 1 --no-record

Each variant runs in its own group of `--nproc` gloo ranks (spawned with
`fullshard.testing.DistributedGroup`), on the same seeded model and data as `step_time.py`,
with the model's default units (its blocks), AdamW, and `--strategy` (FULL_SHARD):

- `eager`: `fullshard.fsdp(model)`;
- `compiled`: `fullshard.fsdp(torch.compile(model, backend=--backend))` (litgpt's order: the
  compiled model is unwrapped, sharded and compiled again with the same options);
- `compiled-units`: each block `torch.compile`d, then sharded (torchtitan's order).

Per step each rank times forward + loss + backward + optimizer step; the first `--warmup`
steps (which include compilation) are not timed; a step's time is the max over ranks, and a
variant's figure is the median over steps and `--reps` interleaved repetitions. Also
recorded: compiled graphs (`unique_graphs`) after warm-up and at the end (equal: nothing
recompiles per step), graph breaks dynamo counted, and the losses (which must agree with
eager's to round-off). Timings on a contended machine mean little: run it on a quiet one.
Writes `results/<date>-compile_step_time.{json,md}` unless `--no-record`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

VARIANTS = ("eager", "compiled", "compiled-units")


def _train(variant: str, config: str, strategy: str, backend: str, steps: int,
           warmup: int, threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gpt import CONFIGS, build_model, data_pool, lm_loss, rank_rows
    from torch._dynamo.utils import counters

    import fullshard

    torch.set_num_threads(threads)
    torch._dynamo.reset()
    counters.clear()
    cfg = CONFIGS[config]
    model = build_model(cfg)
    if variant == "compiled":
        model = torch.compile(model, backend=backend)
    elif variant == "compiled-units":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    model = fullshard.fsdp(model, device="cpu", sharding_strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = data_pool(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    times, losses, graphs = [], [], []
    for step in range(steps):
        rows = rank_rows(pool[step % len(pool)], rank, world)
        t0 = time.perf_counter()
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"times": times[warmup:], "losses": losses, "graphs_after_warmup": graphs[warmup - 1]
            if warmup else 0, "graphs_at_end": graphs[-1],
            "graph_breaks": sum(counters["graph_break"].values())}


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from fullshard.testing import DistributedGroup

    with DistributedGroup(args.nproc) as group:
        per_rank = group.run(_train, variant, args.config, args.strategy, args.backend,
                             args.steps, args.warmup, args.threads, timeout=args.timeout)
    step_times = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    return {**per_rank[0], "step_times": step_times}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="A", choices=("A", "B"))
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed leading steps (compile)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps:
        p.error("need 0 < --warmup < --steps")
    return args


def main() -> None:
    args = parse_args()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for rep in range(args.reps):  # interleaved, so drifting load hits every variant alike
        for variant in args.variants:
            runs[variant].append(run_variant(variant, args))
            print(f"rep {rep} {variant}: median step "
                  f"{statistics.median(runs[variant][-1]['step_times']):.4f} s", flush=True)
    rows = []
    eager = runs.get("eager")
    for variant, reps in runs.items():
        steps = [t for r in reps for t in r["step_times"]]
        row = {
            "variant": variant,
            "median_step_s": statistics.median(steps),
            "graphs_after_warmup": reps[0]["graphs_after_warmup"],
            "graphs_at_end": reps[0]["graphs_at_end"],
            "graph_breaks": reps[0]["graph_breaks"],
            "max_loss_diff_vs_eager": None if eager is None else max(
                abs(a - b) for r, e in zip(reps, eager) for a, b in zip(r["losses"], e["losses"])
            ),
        }
        rows.append(row)
    base = next((r["median_step_s"] for r in rows if r["variant"] == "eager"), None)
    lines = [
        f"# fullshard eager vs torch.compile ({datetime.date.today().isoformat()})", "",
        f"config {args.config}, {args.strategy}, {args.nproc} ranks x {args.threads} thread(s),"
        f" backend {args.backend}, {args.steps} steps ({args.warmup} untimed) x {args.reps} "
        f"reps, load average at start {os.getloadavg()[0]:.2f}", "",
        "| variant | median step s | / eager | graphs after warm-up / at end | graph breaks |"
        " max loss diff vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['median_step_s'] / base:.2f}" if base else "-"
        diff = "-" if r["max_loss_diff_vs_eager"] is None else f"{r['max_loss_diff_vs_eager']:.1e}"
        lines.append(f"| {r['variant']} | {r['median_step_s']:.4f} | {ratio} | "
                     f"{r['graphs_after_warmup']} / {r['graphs_at_end']} | {r['graph_breaks']} |"
                     f" {diff} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        stem = args.results_dir / f"{datetime.date.today().isoformat()}-compile_step_time"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in
                                                                  vars(args).items()},
                                                         "rows": rows, "runs": runs}, indent=1))
        print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
