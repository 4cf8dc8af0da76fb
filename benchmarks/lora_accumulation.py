"""A LoRA fine-tune with gradient accumulation: what a frozen base costs per optimizer step.

    sudo python benchmarks/lora_accumulation.py --config A --rate-mbit 200 --reps 3
    fullshard run --nproc-per-node 2 benchmarks/lora_accumulation.py --worker --impl kept

The benchmark GPT (`gpt.py`) with peft's LoRA (r 8) on every block's qkv, proj, fc1 and fc2:
the base -- embeddings, head, norms and the four Linears' weights -- is frozen. fullshard
FULL_SHARD, BLOCK bucketing, units: each block, each frozen base Linear (so that a unit is
all frozen or trainable), the root. 4 micro-batches of 4 rows per rank, backward each, then
AdamW on the LoRA weights; no `no_sync` (each micro-batch's gradients are reduced, the loop
FSDP2 users write). `--impl`:

- `regather`: `keep_frozen_gathered=False`, the strategy's schedule: each frozen unit
  gathered in every micro-batch's forward and again for its backward;
- `kept`: `keep_frozen_gathered=True`: gathered once per optimizer step;
- `kept-int8`: kept, and `Compression(frozen_weights="int8")` for those gathers.

Driver (root: network namespaces): 2 emulated hosts, one rank each, over a tbf-shaped link
(`cluster_net.py`), the impls interleaved over `--reps`. Per optimizer step (the median over
the measured steps, per-step max over ranks): step time, all-gathers and reduce-scatters
counted by `comm_stats()`, the bytes sent, the link bytes; the loss of the last step. Records
`results/<date>-lora_accumulation.{md,json}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IMPLS = ("regather", "kept", "kept-int8")
MICRO_BATCHES, ROWS = 4, 4


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from cluster_worker import link_counters
    from gpt import CONFIGS, Block, build_model, data_pool, lm_loss, rank_rows
    from peft import LoraConfig, get_peft_model
    from torch import nn

    import fullshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(CONFIGS[args.config], global_batch=ROWS * world)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                      target_modules=["qkv", "proj", "fc1", "fc2"])
    model = get_peft_model(build_model(cfg), lora)

    def units(module: nn.Module, recurse: bool, numel: int) -> bool:
        base = isinstance(module, nn.Linear) and not module.weight.requires_grad
        return recurse or isinstance(module, Block) or base

    model = fullshard.fsdp(
        model, device="cpu", sharding_strategy="FULL_SHARD", bucketing_strategy="BLOCK",
        auto_wrap_policy=units, keep_frozen_gathered=args.impl != "regather",
        compression=fullshard.Compression(frozen_weights="int8")
        if args.impl == "kept-int8" else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    pool = [rank_rows(b, rank, world) for b in data_pool(cfg)]
    steps, losses, stats = [], [], []
    for step in range(args.steps):
        fullshard.reset_comm_stats()
        dist.barrier()
        start = time.perf_counter()
        total = 0.0
        for micro in range(MICRO_BATCHES):
            batch = pool[(step * MICRO_BATCHES + micro) % len(pool)]
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:]) / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - start)
        losses.append(total)
        stats.append(fullshard.comm_stats())
    link = link_counters()
    record = {"rank": rank, "steps": steps, "losses": losses, "stats": stats, "link": link}
    ranks = [None] * world
    dist.all_gather_object(ranks, record)
    if rank == 0:
        line = json.dumps({"impl": args.impl, "config": args.config, "warmup": args.warmup,
                           "ranks": ranks})
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(line[:300], flush=True)
    # Drop the wrapped model (it holds process groups) while the interpreter is fully alive:
    # torn down at exit, gloo's threads sometimes abort (as in bench_worker.py).
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per impl: medians over the measured optimizer steps of every rep."""
    rows = []
    for impl in dict.fromkeys(r["impl"] for r in records):
        mine = [r for r in records if r["impl"] == impl]
        times, gathers, reduces, sent = [], set(), set(), []
        for rec in mine:
            w = rec["warmup"]
            per_step = list(zip(*(r["steps"] for r in rec["ranks"])))[w:]
            times.append(statistics.median(max(s) for s in per_step))
            for s in rec["ranks"][0]["stats"][w:]:
                gathers.add(s.get("all_gather", {}).get("calls", 0))
                reduces.add(s.get("reduce_scatter", {}).get("calls", 0))
                sent.append(sum(v["wire_bytes"] for v in s.values()))
        rows.append({"impl": impl, "step_s": times, "all_gathers": sorted(gathers),
                     "reduce_scatters": sorted(reduces), "sent_mb": statistics.median(sent) / 1e6,
                     "loss": mine[0]["ranks"][0]["losses"][-1]})
    return rows


def render(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], summarize(doc["records"])
    base = {r["impl"]: r for r in rows}.get("regather")
    lines = ["# LoRA with 4 accumulated micro-batches: a frozen base per optimizer step", "",
             f"- command: `{meta['command']}`, {meta['date']}, wall {meta['wall_s']} s",
             f"- commit {meta['git_commit']}, torch {meta['torch']}, config {meta['config']}, "
             f"link {meta['rate_mbit']} Mbit/s (TCP measured {meta.get('link_mbit')}), "
             f"2 hosts x 1 rank; load: `{meta['uptime_start']}` / `{meta['uptime_end']}`", "",
             "| impl | step s (per rep) | / regather | all-gathers | reduce-scatters | "
             "sent MB per rank | loss, last step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (statistics.median(r["step_s"]) / statistics.median(base["step_s"])
                 if base else float("nan"))
        lines.append(f"| {r['impl']} | {', '.join(f'{t:.3f}' for t in r['step_s'])} | "
                     f"{ratio:.2f} | {r['all_gathers']} | {r['reduce_scatters']} | "
                     f"{r['sent_mb']:.2f} | {r['loss']:.5f} |")
    return "\n".join(lines) + "\n"


def drive(args: argparse.Namespace) -> int:
    import subprocess

    import torch
    from cluster import _env, _git, _uptime
    from cluster_net import EmulatedCluster, NetnsUnavailable, wait_all

    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python", *sys.argv]), "git_commit": _git("rev-parse", "HEAD"),
            "torch": torch.__version__, "config": args.config, "rate_mbit": args.rate_mbit,
            "uptime_start": _uptime()}
    records: list[dict[str, Any]] = []
    start, port = time.perf_counter(), 31500
    try:
        with tempfile.TemporaryDirectory() as tmp, \
                EmulatedCluster(2, rate_mbit=args.rate_mbit) as net:
            meta["link_mbit"] = round(net.measure_link(1, 0, 10.0), 1)
            for rep in range(1, args.reps + 1):
                for impl in args.impls:
                    port += 1
                    out = Path(tmp) / f"{impl}-{rep}.jsonl"
                    logs = [open(Path(tmp) / f"{impl}-{rep}-host{h}.log", "w") for h in range(2)]
                    procs = [net.popen(h, [
                        sys.executable, "-m", "fullshard.cli", "run", "--nproc-per-node", "1",
                        "--nnodes", "2", "--node-rank", str(h), "--master-addr", net.address(0),
                        "--master-port", str(port), str(Path(__file__)), "--worker",
                        "--impl", impl, "--config", args.config, "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--out", str(out)],
                        cwd=HERE.parent, env=_env(), stdout=logs[h],
                        stderr=subprocess.STDOUT) for h in range(2)]
                    wait_all(procs, 900)
                    for log in logs:
                        log.close()
                    if any(p.returncode for p in procs) or not out.exists():
                        tails = "\n".join(Path(log.name).read_text()[-2000:] for log in logs)
                        print(f"  {impl} rep {rep} FAILED ({[p.returncode for p in procs]})\n"
                              f"{tails}", flush=True)
                        continue
                    rec = json.loads(out.read_text().splitlines()[-1])
                    records.append(rec)
                    row = summarize([rec])[0]
                    print(f"  rep {rep} {impl:10s} {row['step_s'][0]:.3f} s/step, "
                          f"gathers {row['all_gathers']}, sent {row['sent_mb']:.2f} MB",
                          flush=True)
    except NetnsUnavailable as e:
        print(f"lora_accumulation.py: cannot build the emulated cluster: {e}", file=sys.stderr)
        return 2
    meta.update(uptime_end=_uptime(), wall_s=round(time.perf_counter() - start, 1))
    doc = {"meta": meta, "records": records}
    text = render(doc)
    print("\n" + text)
    if not args.no_record:
        path = args.results_dir / f"{datetime.date.today().isoformat()}-lora_accumulation.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
        print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help="run as one rank (under fullshard run)")
    p.add_argument("--impl", choices=IMPLS, default="kept")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--config", choices=("A", "B"), default="A")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, warmup included")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=200.0)
    p.add_argument("--out", default=None)
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= --warmup < --steps, got {args.warmup} / {args.steps}")
    if args.worker:
        worker(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
