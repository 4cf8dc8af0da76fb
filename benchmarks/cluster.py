"""fullshard on an emulated cluster: 2 or 3 hosts as network namespaces over shaped links.

    sudo python benchmarks/cluster.py check                   # 2 and 3 hosts at 1 Gbit/s
    sudo python benchmarks/cluster.py check --hosts 2 --rate-mbit 200
    sudo python benchmarks/cluster.py overlap                 # item 2's table; picks the rate
    sudo python benchmarks/cluster.py overlap --rate-mbit 400 --reps 3 --no-record

The hosts, links and shaping are `cluster_net.py`'s; every rank is `cluster_worker.py`, one
`fullshard run --nnodes N --node-rank i --master-addr 10.77.0.1 --master-port P` per host,
run inside that host's namespace with gloo bound to its veth (`GLOO_SOCKET_IFNAME=eth0`).

`check`, for each host count:
- losses: fullshard FULL_SHARD (BLOCK) across the hosts against one process training the same
  seeded model on the same global batch (`single-t1`), every step, at rtol 1e-5 / atol 1e-6;
- bytes: what each host's veth carried during the measured steps against what
  `fullshard.comm_stats()` on that host's rank says it sent (`wire_bytes`);
- link: a plain TCP transfer between two hosts, to show the shaping holds;
- a rank killed: SIGKILL to the rank on the last host mid-training; every launcher must exit
  non-zero within `KILL_BOUND_S` of the kill (torchrun's 0.1 s monitor interval plus its 5 s
  shutdown timeout, plus 5 s for interpreters to exit on a loaded machine).

`overlap` (2 hosts): each implementation's step time with the links unshaped (its compute
time, communication nearly free) and shaped at `--rate-mbit` (default: chosen from a
calibration run so FULL_SHARD's communication per step equals its compute), interleaved over
`--reps`; communication time = the bytes the busiest link direction carried per step / rate;
overlap efficiency = (compute + comm - step) / min(compute, comm). Then HYBRID_SHARD against
FULL_SHARD on 2 hosts x 2 ranks over the shaped link. Records go to
`results/<date>-cluster.{md,json}` (see `cluster_report.py`).

Root is needed (namespaces); without it, or where namespaces are not permitted, the script
says so and exits with status 2. Everything is torn down on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cluster_report
import torch
from cluster_net import HOST_IF, EmulatedCluster, NetnsUnavailable, wait_all

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "cluster_worker.py"
KILL_BOUND_S = 10.0
RUN_TIMEOUT_S = 900.0
OVERLAP_IMPLS = ("fullshard-full_shard-block", "fullshard-shard_grad_op-block",
                 "fsdp2-default", "ddp")
"""fullshard's defaults against FSDP2's default (both keep the root gathered into backward)."""
_port = [29500 + os.getpid() % 1000]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=HOST_IF, CLUSTER_IFACE=HOST_IF,
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    return env


class RunFailed(RuntimeError):
    pass


def launch(net: EmulatedCluster, impl: str, *, nproc: int = 1, config: str = "A",
           steps: int = 10, warmup: int = 3, scratch: Path, extra: tuple[str, ...] = (),
           wait: bool = True) -> Any:
    """One `fullshard run` per host, running `cluster_worker.py --impl impl`. With `wait`,
    returns the record (or raises `RunFailed`); else the (procs, logs, out) to watch."""
    _port[0] += 1
    out = scratch / f"{impl}-{_port[0]}.jsonl"
    procs, logs = [], []
    for host in range(net.hosts):
        cmd = [sys.executable, "-m", "fullshard.cli", "run", "--nproc-per-node", str(nproc),
               "--nnodes", str(net.hosts), "--node-rank", str(host),
               "--master-addr", net.address(0), "--master-port", str(_port[0]),
               str(WORKER), "--impl", impl, "--config", config, "--steps", str(steps),
               "--warmup", str(warmup), "--out", str(out), *extra]
        log = scratch / f"{impl}-{_port[0]}-host{host}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(net.popen(host, cmd, cwd=REPO, env=_env(), stdout=f,
                                   stderr=subprocess.STDOUT))
    if not wait:
        return procs, logs, out
    ended = wait_all(procs, RUN_TIMEOUT_S)
    if any(e is None for e in ended):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise RunFailed(f"{impl} timed out after {RUN_TIMEOUT_S:.0f} s")
    codes = [p.returncode for p in procs]
    if any(codes) or not out.exists():
        tail = "\n".join("\n".join(log.read_text().splitlines()[-15:])
                         for log in logs if log.exists())
        raise RunFailed(f"{impl}: launchers exited {codes}\n{tail}")
    return json.loads(out.read_text().splitlines()[-1])


def reference(world: int, *, config: str = "A", steps: int = 10, warmup: int = 3,
              scratch: Path) -> dict[str, Any]:
    """One process (1 thread) on the global batch of `world` ranks, in the root namespace."""
    out = scratch / f"single-{world}-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, str(WORKER), "--impl", "single-t1", "--world", str(world),
           "--config", config, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    env = _env()
    env.pop("CLUSTER_IFACE")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if proc.returncode:
        raise RunFailed(f"single-t1 exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out.read_text().splitlines()[-1])


# -- check ------------------------------------------------------------------------------------
def losses_match(got: list[float], ref: list[float]) -> tuple[bool, float]:
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    ok = len(got) == len(ref) and all(d <= 1e-6 + 1e-5 * abs(b) for d, b in zip(diffs, ref))
    return ok, max(diffs)


def kill_check(net: EmulatedCluster, scratch: Path) -> dict[str, Any]:
    """SIGKILL the rank on the last host mid-training; time every launcher's exit."""
    ready = scratch / f"ready-{time.monotonic_ns()}"
    ready.mkdir()
    procs, logs, _ = launch(net, "fullshard-full_shard-block", steps=100000, warmup=1,
                            scratch=scratch, wait=False,
                            extra=("--ready-dir", str(ready), "--ready-after", "2"))
    victim_rank = net.hosts - 1
    pid_file = ready / f"rank{victim_rank}.pid"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all((ready / f"rank{r}.pid").exists() for r in range(net.hosts)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RunFailed("kill check: the ranks did not start training:\n" + "\n".join(
                log.read_text()[-1500:] for log in logs))
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # the namespaces share the PID namespace: pids are global
    ended = wait_all(procs, 120)
    after = [None if e is None else round(e - t_kill, 3) for e in ended]
    lines = []
    for log in logs:
        lines += [ln for ln in log.read_text().splitlines() if ln.startswith("fullshard run:")]
    ok = all(a is not None and a <= KILL_BOUND_S for a in after) and all(
        p.returncode not in (0, None) for p in procs)
    return {"killed": f"rank {victim_rank} (host {victim_rank}, pid {pid}) with SIGKILL",
            "launcher_exit_after_s": after, "exit_codes": [p.returncode for p in procs],
            "messages": lines, "bound_s": KILL_BOUND_S, "ok": ok}


def bytes_check(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per host (local rank 0's view): veth tx/rx over the window against the counted wire
    bytes of that host's ranks."""
    rows = []
    for r in record["ranks"]:
        w = r["window"]
        if r["local_rank"] != 0 or not w.get("link_start"):
            continue
        tx = w["link_end"]["tx_bytes"] - w["link_start"]["tx_bytes"]
        rx = w["link_end"]["rx_bytes"] - w["link_start"]["rx_bytes"]
        host_ranks = [q for q in record["ranks"] if q["host"] == r["host"]]
        counted = sum(cluster_report.counted_wire(q["window"]) for q in host_ranks)
        c10d = sum(cluster_report.c10d_wire(q["window"]) for q in host_ranks)
        rows.append({"host": r["host"], "tx_bytes": tx, "rx_bytes": rx, "counted": counted,
                     "c10d_wire": c10d, "carried_over_counted": tx / counted if counted else None})
    return rows


def run_check(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    results = []
    for hosts in args.hosts:
        print(f"== {hosts} hosts, {args.rate_mbit} Mbit/s links", flush=True)
        with EmulatedCluster(hosts, rate_mbit=args.rate_mbit) as net:
            entry: dict[str, Any] = {"net": net.describe()}
            entry["link_mbit_measured"] = round(net.measure_link(hosts - 1, 0, 20.0), 1)
            print(f"  TCP 20 MB host {hosts - 1} -> 0: {entry['link_mbit_measured']} Mbit/s",
                  flush=True)
            rec = launch(net, "fullshard-full_shard-block", steps=args.steps,
                         warmup=args.warmup, scratch=scratch)
            ref = reference(hosts, steps=args.steps, warmup=args.warmup, scratch=scratch)
            ok, diff = losses_match(rec["losses"], ref["losses"])
            entry["losses"] = {"cluster": rec["losses"], "single": ref["losses"],
                               "max_abs_diff": diff, "ok": ok}
            print(f"  losses vs one process: max |diff| {diff:.2e} -> "
                  f"{'equal' if ok else 'DIFFER'}", flush=True)
            entry["bytes"] = bytes_check(rec)
            for row in entry["bytes"]:
                print(f"  host {row['host']}: veth tx {row['tx_bytes'] / 1e6:.2f} MB, counted "
                      f"{row['counted'] / 1e6:.2f} MB -> {row['carried_over_counted']:.4f}x",
                      flush=True)
            entry["step_s"] = rec["step_s"]
            entry["kill"] = kill_check(net, scratch)
            k = entry["kill"]
            print(f"  kill {k['killed']}: launchers exited after {k['launcher_exit_after_s']} s "
                  f"with {k['exit_codes']} -> {'ok' if k['ok'] else 'FAILED'}", flush=True)
            for line in k["messages"]:
                print(f"    {line}")
            results.append(entry)
    return results


# -- overlap ----------------------------------------------------------------------------------
def pick_rate(net: EmulatedCluster, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Calibrate: FULL_SHARD unshaped gives compute s/step and bytes per step; the rate that
    makes comm = compute."""
    net.set_rate(None)
    rec = launch(net, "fullshard-full_shard-block", config=args.config, steps=args.steps,
                 warmup=args.warmup, scratch=scratch)
    compute = cluster_report.step_time(rec)
    per_step = cluster_report.link_bytes_per_step(rec)
    mbit = per_step * 8 / compute / 1e6
    rate = max(10, int(round(mbit / 10) * 10))
    print(f"calibration: FULL_SHARD unshaped {compute:.3f} s/step, {per_step / 1e6:.1f} MB per "
          f"step on the busiest link direction -> rate {rate} Mbit/s", flush=True)
    return {"record": rec, "compute_s": compute, "bytes_per_step": per_step, "rate_mbit": rate}


def run_overlap(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    out: dict[str, Any] = {"records": records, "failures": failures}

    def one(net: EmulatedCluster, impl: str, link: str, rep: int, nproc: int = 1) -> None:
        try:
            rec = launch(net, impl, nproc=nproc, config=args.config, steps=args.steps,
                         warmup=args.warmup, scratch=scratch)
        except RunFailed as e:
            failures.append({"impl": impl, "link": link, "rep": rep, "error": str(e)[-3000:]})
            print(f"  {impl} {link} rep {rep} FAILED: {str(e)[:300]}", flush=True)
            return
        rec.update(link=link, rep=rep, hosts=net.hosts, nproc_per_host=nproc)
        records.append(rec)
        print(f"  rep {rep} {link:8s} {impl:32s} {cluster_report.step_time(rec):.3f} s/step, "
              f"{cluster_report.link_bytes_per_step(rec) / 1e6:.1f} MB/step on the link",
              flush=True)

    try:
        with EmulatedCluster(2, rate_mbit=None) as net:
            for host in range(net.hosts):
                for kv in args.sysctl:
                    net.run(host, ["sysctl", "-w", kv])
            out["sysctl"] = list(args.sysctl)
            rate = args.rate_mbit
            if rate is None:
                out["calibration"] = pick_rate(net, args, scratch)
                rate = out["calibration"]["rate_mbit"]
            out["rate_mbit"] = rate
            net.set_rate(rate)
            out["net"] = net.describe()
            out["link_mbit_measured"] = round(net.measure_link(1, 0, 20.0), 1)
            print(f"shaped link: {rate} Mbit/s (TCP measured {out['link_mbit_measured']})")
            for rep in range(1, args.reps + 1):
                for link in ("unshaped", "shaped"):
                    net.set_rate(None if link == "unshaped" else rate)
                    for impl in args.impls:
                        one(net, impl, link, rep)
            net.set_rate(rate)
            if args.hybrid:
                for rep in range(1, args.reps + 1):
                    for impl in ("fullshard-hybrid_shard-block", "fullshard-full_shard-block"):
                        one(net, impl, "shaped", rep, nproc=2)
            refs = {}
            for world in sorted({r["world"] for r in records}):
                refs[world] = reference(world, config=args.config, steps=args.steps,
                                        warmup=args.warmup, scratch=scratch)
            out["references"] = refs
    except KeyboardInterrupt:
        print("\ninterrupted: reporting the runs that finished")
    return out


# -- main -------------------------------------------------------------------------------------
def _git(*a: str) -> str:
    try:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="losses, bytes and rank death on 2 and 3 hosts")
    c.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    c.add_argument("--rate-mbit", type=float, default=1000)
    c.add_argument("--steps", type=int, default=6)
    c.add_argument("--warmup", type=int, default=2)
    o = sub.add_parser("overlap", help="step time near the link's limit, 2 hosts")
    o.add_argument("--rate-mbit", type=float, default=None,
                   help="shaped rate (default: calibrated so FULL_SHARD's comm = compute)")
    o.add_argument("--reps", type=int, default=3)
    o.add_argument("--steps", type=int, default=10)
    o.add_argument("--warmup", type=int, default=3)
    o.add_argument("--impls", nargs="+", default=list(OVERLAP_IMPLS))
    o.add_argument("--config", choices=("A", "B"), default="A",
                   help="the benchmark GPT (benchmarks/gpt.py): A, or B (root 25%% of Psi)")
    o.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every host namespace first, e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0 (repeatable)")
    o.add_argument("--no-hybrid", dest="hybrid", action="store_false",
                   help="skip HYBRID_SHARD vs FULL_SHARD on 2 hosts x 2 ranks")
    for q in (c, o):
        q.add_argument("--results-dir", type=Path, default=HERE / "results")
        q.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if args.command == "check" and any(h < 2 for h in args.hosts):
        p.error(f"--hosts: at least 2 hosts each, got {args.hosts}")
    if args.steps < 2 or not 1 <= args.warmup < args.steps:
        p.error(f"need --steps >= 2 and 1 <= --warmup < --steps, got {args.steps}/{args.warmup}")
    return args


def main() -> int:
    args = parse_args()
    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "uptime_start": _uptime(), "config": getattr(args, "config", "A"), "micro_batch": 4,
    }
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
            if args.command == "check":
                result = run_check(args, Path(tmp))
            else:
                result = run_overlap(args, Path(tmp))
    except NetnsUnavailable as e:
        print(f"cluster.py: cannot build the emulated cluster: {e}", file=sys.stderr)
        return 2
    meta["uptime_end"] = _uptime()
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    section = {"meta": meta, **(result if isinstance(result, dict) else {"results": result})}
    text = cluster_report.render({args.command: section})
    print("\n" + text)
    if not args.no_record:
        # one record per day: each command replaces its own section of it
        args.results_dir.mkdir(parents=True, exist_ok=True)
        json_path = args.results_dir / f"{datetime.date.today().isoformat()}-cluster.json"
        doc = json.loads(json_path.read_text()) if json_path.exists() else {}
        doc[args.command] = section
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        json_path.with_suffix(".md").write_text(cluster_report.render(doc))
        print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    return 0 if cluster_report.passed({args.command: section}) else 1


if __name__ == "__main__":
    sys.exit(main())
