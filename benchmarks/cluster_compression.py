"""Compressed collectives on an emulated cluster: step time, link bytes and loss against exact.

    sudo python benchmarks/cluster_compression.py --config B --rates 1000 200 --reps 3
    python benchmarks/cluster_compression.py --render results/<date>-cluster-compression-B.json
    sudo python benchmarks/cluster_compression.py --nproc 2 --impls-set hierarchy --config A

Two hosts (network namespaces, `--nproc` ranks each, tbf-shaped veth links: `cluster_net.py`),
every rank `cluster_worker.py` under `fullshard run`, as `cluster.py` runs them. At each
`--rates` link speed, `--reps` interleaved repetitions of every implementation of a set
(`IMPL_SETS`); "compression" (the default):

- fullshard FULL_SHARD exact; with `Compression(weights="int8")`; with weights and gradients
  int8 (block 256: fullshard/distributed/wire_format.py);
- torch DDP plain, and with its gradients all-reduced in bf16 (what torch's
  `bf16_compress_hook` runs; the peer of compressed gradients);
- torch FSDP2 (its default, the root kept gathered into backward, like fullshard's).

"hierarchy" (2 hosts x 2 ranks): FULL_SHARD across the 4 ranks, with an int
`reshard_after_forward=2` (hpZ: after forward each block stays sharded over its host, and
backward gathers it there), hpZ with int8 weights (ZeRO++'s qwZ + hpZ), HYBRID_SHARD (shard
within a host, replicate across), DDP, and torch FSDP2 with `reshard_after_forward=2`.

Per row: step time (median of a run's measured steps, per-step max over ranks; over reps
median [min-max]); the step against DDP's and against DDP-bf16's of the same rep; the bytes the
busiest link direction carried per step, and against exact FULL_SHARD's; carried / counted
(veth tx over what the ranks counted: fullshard's `comm_stats()`, the c10d wrapper for the
others); the last step's loss and its relative difference from exact FULL_SHARD's (every
implementation trains the same seeded model on the same batches). Root is needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cluster_report as report
import torch
from cluster import RunFailed, _git, _uptime, launch
from cluster_net import EmulatedCluster, NetnsUnavailable

HERE = Path(__file__).resolve().parent
EXACT, DDP, DDP_BF16 = "fullshard-full_shard-block", "ddp", "ddp-bf16hook"
INT8W, INT8WG = "fullshard-full_shard-block-int8w", "fullshard-full_shard-block-int8wg"
IMPL_SETS = {
    "compression": (EXACT, INT8W, INT8WG, DDP, DDP_BF16, "fsdp2-default"),
    "hierarchy": (EXACT, "fullshard-full_shard-block-hpz2", "fullshard-full_shard-block-int8w-hpz2",
                  "fullshard-hybrid_shard-block", DDP, "fsdp2-hpz2"),
}
TARGETS = {1000.0: (0.90, 1.00), 200.0: (0.60, 0.90)}
"""Per link rate: int8 weights and gradients at most this times DDP's step, and DDP-bf16's."""
BYTES_TARGET = 0.40
"""int8 weights and gradients: link bytes per step at most this times exact FULL_SHARD's."""


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    links: dict[str, float] = {}
    out: dict[str, Any] = {"records": records, "failures": failures, "links": links}
    try:
        with EmulatedCluster(2, rate_mbit=None) as net:
            for rate in args.rates:
                net.set_rate(rate)
                links[str(rate)] = round(net.measure_link(1, 0, 20.0), 1)
                out.setdefault("net", {})[str(rate)] = net.describe()
                print(f"== {rate:g} Mbit/s (TCP measured {links[str(rate)]})", flush=True)
                for rep in range(1, args.reps + 1):
                    for impl in args.impls:
                        try:
                            rec = launch(net, impl, nproc=args.nproc, config=args.config,
                                         steps=args.steps, warmup=args.warmup, scratch=scratch)
                        except RunFailed as e:
                            failures.append({"impl": impl, "rate": rate, "rep": rep,
                                             "error": str(e)[-3000:]})
                            print(f"  {impl} rep {rep} FAILED: {str(e)[-1500:]}", flush=True)
                            continue
                        rec.update(rate=rate, rep=rep)
                        records.append(rec)
                        print(f"  rep {rep} {impl:34s} {report.step_time(rec):.3f} s/step, "
                              f"{report.link_bytes_per_step(rec) / 1e6:.1f} MB/step, "
                              f"loss {rec['losses'][-1]:.5f}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: reporting the runs that finished")
    return out


def _ratios(recs: list[dict[str, Any]], impl: str, peer: str, rate: float) -> list[float]:
    by = {(r["impl"], r["rep"]): r for r in recs if r["rate"] == rate}
    return [report.step_time(r) / report.step_time(by[(peer, r["rep"])])
            for (i, rep), r in by.items() if i == impl and (peer, rep) in by]


def summarize(section: dict[str, Any]) -> list[dict[str, Any]]:
    recs = section["records"]
    rows = []
    for rate in dict.fromkeys(r["rate"] for r in recs):
        exact = [r for r in recs if r["rate"] == rate and r["impl"] == EXACT]
        exact_bytes = statistics.median(report.link_bytes_per_step(r) for r in exact) \
            if exact else float("nan")
        exact_loss = exact[0]["losses"][-1] if exact else float("nan")
        for impl in dict.fromkeys(r["impl"] for r in recs if r["rate"] == rate):
            mine = [r for r in recs if r["rate"] == rate and r["impl"] == impl]
            per_step = statistics.median(report.link_bytes_per_step(r) for r in mine)
            loss = statistics.median(r["losses"][-1] for r in mine)
            vs_ddp, vs_bf16 = _ratios(recs, impl, DDP, rate), _ratios(recs, impl, DDP_BF16, rate)
            vs_exact = _ratios(recs, impl, EXACT, rate)
            rows.append({
                "rate": rate, "impl": impl,
                "step": report._spread([report.step_time(r) for r in mine]),
                "vs_ddp": report._spread(vs_ddp) if vs_ddp else None,
                "vs_ddp_bf16": report._spread(vs_bf16) if vs_bf16 else None,
                "vs_exact": report._spread(vs_exact) if vs_exact else None,
                "link_mb": per_step / 1e6, "link_vs_exact": per_step / exact_bytes,
                "carried_over_counted": statistics.median(
                    report.carried_over_counted(r) for r in mine),
                "loss": loss, "loss_rel_vs_exact": abs(loss - exact_loss) / abs(exact_loss),
            })
    return rows


def render(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], summarize(doc)
    nproc = meta.get("nproc", 1)
    title = {"compression": "Compressed collectives", "hierarchy": "hpZ and HYBRID_SHARD"}
    lines = [f"# {title[meta.get('impls_set', 'compression')]} on an emulated cluster "
             f"(2 hosts x {nproc} rank{'s' if nproc > 1 else ''})", "",
             report.describe_config(meta["config"]), ""]
    lines += report._meta_lines(meta)
    lines += ["- links: " + "; ".join(f"{k} Mbit/s tbf, TCP measured {v} Mbit/s"
                                       for k, v in doc["links"].items()), ""]
    columns = [
        ("link Mbit/s", lambda r: f"{r['rate']:g}"),
        ("implementation", lambda r: r["impl"]),
        ("step s", lambda r: report._s(r["step"])),
        ("/ DDP (same rep)", lambda r: report._s(r["vs_ddp"], 2)),
        ("/ DDP-bf16 (same rep)", lambda r: report._s(r["vs_ddp_bf16"], 2)),
        ("/ exact FULL_SHARD (same rep)", lambda r: report._s(r["vs_exact"], 2)),
        ("link MB/step", lambda r: f"{r['link_mb']:.1f}"),
        ("bytes / exact", lambda r: f"{r['link_vs_exact']:.3f}"),
        ("carried / counted", lambda r: f"{r['carried_over_counted']:.3f}"),
        (f"loss at step {meta['steps']}", lambda r: f"{r['loss']:.5f}"),
        ("loss vs exact", lambda r: f"{r['loss_rel_vs_exact']:.1e}"),
    ]
    if not any(r["vs_ddp_bf16"] for r in rows):
        columns = [c for c in columns if c[0] != "/ DDP-bf16 (same rep)"]
    if nproc > 1:  # the ranks count what they send, not which of it leaves the host
        columns = [c for c in columns if c[0] != "carried / counted"]
        lines += ["Link bytes are what the busiest veth direction carried (measured); with "
                  "several ranks per host the ranks' counts include the traffic that stays "
                  "inside a host, so carried / counted is not shown (1-rank hosts check it: "
                  "the compression record).", ""]
    cols = [name for name, _ in columns]
    table = [[cell(r) for _, cell in columns] for r in rows]
    lines += [report._table(cols, table), ""]
    if any(r["impl"] == INT8WG for r in rows):
        lines += ["## Targets", ""]
    for r in rows:
        if r["impl"] != INT8WG:
            continue
        ddp_x, bf16_x = TARGETS.get(r["rate"], (None, None))
        if ddp_x is not None and r["vs_ddp"] and r["vs_ddp_bf16"]:
            got, got_bf16 = r["vs_ddp"]["median"], r["vs_ddp_bf16"]["median"]
            lines.append(f"- {r['rate']:g} Mbit/s: int8 weights+gradients {got:.2f}x DDP "
                         f"(target <= {ddp_x}: {'met' if got <= ddp_x else 'missed'}), "
                         f"{got_bf16:.2f}x DDP-bf16 (target <= {bf16_x}: "
                         f"{'met' if got_bf16 <= bf16_x else 'missed'})")
        lines.append(f"- {r['rate']:g} Mbit/s: link bytes {r['link_vs_exact']:.3f}x exact "
                     f"FULL_SHARD's (target <= {BYTES_TARGET}: "
                     f"{'met' if r['link_vs_exact'] <= BYTES_TARGET else 'missed'}); carried / "
                     f"counted {r['carried_over_counted']:.3f} (target 1 +- 0.01)")
    for f in doc.get("failures", []):
        lines.append(f"- FAILED: {f['impl']} at {f['rate']:g} Mbit/s rep {f['rep']}")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[1000.0, 200.0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--config", choices=("A", "B"), default="B")
    p.add_argument("--nproc", type=int, default=1, help="ranks per host")
    p.add_argument("--impls-set", choices=sorted(IMPL_SETS), default="compression")
    p.add_argument("--impls", nargs="+", default=None, help="instead of the set's")
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--render", type=Path, default=None, help="re-render a JSON record and exit")
    args = p.parse_args()
    args.impls = args.impls or list(IMPL_SETS[args.impls_set])
    if args.steps < 2 or not 1 <= args.warmup < args.steps:
        p.error(f"need --steps >= 2 and 1 <= --warmup < --steps, got {args.steps}/{args.warmup}")
    return args


def main() -> int:
    args = parse_args()
    if args.render is not None:
        print(render(json.loads(args.render.read_text())))
        return 0
    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "uptime_start": _uptime(), "config": args.config, "micro_batch": 4,
        "steps": args.steps, "warmup": args.warmup, "nproc": args.nproc,
        "impls_set": args.impls_set,
    }
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="cluster-compression-") as tmp:
            section = {"meta": meta, **run(args, Path(tmp))}
    except NetnsUnavailable as e:
        print(f"cluster_compression.py: cannot build the emulated cluster: {e}", file=sys.stderr)
        return 2
    meta["uptime_end"], meta["wall_s"] = _uptime(), round(time.perf_counter() - start, 1)
    text = render(section)
    print("\n" + text)
    if not args.no_record:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        name = {"compression": "cluster-compression", "hierarchy": "cluster-hierarchy"}
        stem = f"{datetime.date.today().isoformat()}-{name[args.impls_set]}-{args.config}"
        path = args.results_dir / f"{stem}.json"
        path.write_text(json.dumps(section, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
        print(f"wrote {path} and {path.with_suffix('.md')}")
    return 1 if section["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
