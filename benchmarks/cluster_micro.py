"""What 2 emulated hosts allow: gloo exchanges over the shaped link, alone and beside compute.

    sudo python benchmarks/cluster_micro.py                      # 300 Mbit/s, prints a table
    sudo python benchmarks/cluster_micro.py --rate-mbit 300 --json out.json
    sudo python benchmarks/cluster_micro.py --sysctl net.ipv4.tcp_slow_start_after_idle=0

The engine's overlap on the cluster (`cluster.py overlap`) can be no better than what the
machine allows one rank per host, each with one of the 2 cores: this measures it with nothing
of fullshard's but the message pattern (comm's pairwise exchange: each rank `isend`s X bytes to
its peer and `irecv`s X bytes from it, one message each way, waited together), on the same
namespaces, veth pairs and tbf shaping (`cluster_net.py`). Each case reports the median over
`--reps` of the max over the 2 ranks, against the link time X / R:

- `exchange X`: one exchange alone;
- `4 x exchange X queued`: four issued at once, waited in order (prefetch: gloo's one TCP
  connection per pair carries them one after the other);
- `exchange X + compute`: the exchange issued, then a matmul loop of about the link time on
  the main thread (1 intra-op thread, as the benchmark ranks), then the wait: the overlap the
  2 cores give -- `overlap eff.` is (compute alone + link - both) / min(compute alone, link),
  and `compute slowed` what the exchange costs the compute beside it;
- `exchange X after idle`: an exchange after 0.5 s without traffic (TCP restarting from a
  small window after idle, `net.ipv4.tcp_slow_start_after_idle`, would show here);
- `ping-pong`: one small message there and back, the link's round trip with gloo's
  rendezvous (a receive is announced to the sender before data moves).

`--sysctl k=v` (repeatable) sets a sysctl inside every host namespace before the ranks start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEND_FIRST = False


# -- the ranks --------------------------------------------------------------------------------
def _exchange(buf_out: Any, buf_in: Any, peer: int, tag: int) -> list[Any]:
    import torch.distributed as dist

    # receive first, as comm's exchanges do (see [Note: receives are posted first] in
    # fullshard/distributed/gloo.py); the
    # 2026-12-03 record ran with the send posted first (`--send-first`), as they did then
    if SEND_FIRST:
        return [dist.isend(buf_out, peer, tag=tag), dist.irecv(buf_in, peer, tag=tag)]
    return [dist.irecv(buf_in, peer, tag=tag), dist.isend(buf_out, peer, tag=tag)]


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _matmul_loop(seconds: float, a: Any) -> int:
    """Run 256x256 matmuls for about `seconds`; return how many ran."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    return n


def _matmuls(n: int, a: Any) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        a @ a
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    rate = args.rate_mbit * 1e6 / 8  # bytes per second
    a = torch.randn(256, 256)
    tag = [0]
    results: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    def exch(nbytes: int, count: int = 1) -> float:
        outs = [torch.ones(nbytes // 4) for _ in range(count)]
        ins = [torch.empty(nbytes // 4) for _ in range(count)]
        dist.barrier()
        t0 = time.perf_counter()
        works = []
        for o, i in zip(outs, ins):
            tag[0] += 1
            works.append(_exchange(o, i, peer, tag[0]))
        for w in works:
            _wait(w)
        return time.perf_counter() - t0

    for nbytes in (1 << 20, 4 << 20):
        exch(nbytes)  # warm the connection
    # compute calibration: matmuls per second, alone
    per_s = _matmul_loop(0.3, a) / 0.3
    for _ in range(args.reps):
        for mb in args.sizes:
            nbytes = int(mb * 1e6) // 4 * 4
            link = nbytes / rate
            note(f"exchange {mb} MB", exch(nbytes))
            note(f"4 x exchange {mb} MB queued", exch(nbytes, 4))
            # compute beside an exchange: the same number of matmuls, alone and with it
            n = max(1, int(per_s * link))
            dist.barrier()
            alone = _matmuls(n, a)
            outs, ins = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
            dist.barrier()
            t0 = time.perf_counter()
            tag[0] += 1
            works = _exchange(outs, ins, peer, tag[0])
            beside = _matmuls(n, a)
            _wait(works)
            both = time.perf_counter() - t0
            note(f"exchange {mb} MB + compute: compute alone", alone)
            note(f"exchange {mb} MB + compute: compute beside", beside)
            note(f"exchange {mb} MB + compute: both", both)
            dist.barrier()
            time.sleep(0.5)
            note(f"exchange {mb} MB after idle", exch(nbytes))
        small = torch.ones(16)
        back = torch.empty(16)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            tag[0] += 1
            if rank == 0:
                dist.isend(small, peer, tag=tag[0]).wait()
                dist.irecv(back, peer, tag=tag[0]).wait()
            else:
                dist.irecv(back, peer, tag=tag[0]).wait()
                dist.isend(small, peer, tag=tag[0]).wait()
        note("ping-pong (round trip)", (time.perf_counter() - t0) / 20)
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, results)
    if rank == 0:
        merged = {k: [max(x, y) for x, y in zip(everyone[0][k], everyone[1][k])]
                  for k in results}
        Path(args.out).write_text(json.dumps(merged))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------
def summarize(raw: dict[str, list[float]], sizes: list[float], rate_mbit: float,
              reps: int) -> list[dict[str, Any]]:
    rate = rate_mbit * 1e6 / 8
    med = {k: statistics.median(v) for k, v in raw.items()}
    rows = []
    for mb in sizes:
        link = mb * 1e6 / rate
        rows.append({"case": f"exchange {mb} MB", "link_s": link,
                     "s": med[f"exchange {mb} MB"]})
        rows.append({"case": f"4 x exchange {mb} MB queued", "link_s": 4 * link,
                     "s": med[f"4 x exchange {mb} MB queued"]})
        alone = med[f"exchange {mb} MB + compute: compute alone"]
        beside = med[f"exchange {mb} MB + compute: compute beside"]
        both = med[f"exchange {mb} MB + compute: both"]
        rows.append({"case": f"exchange {mb} MB + compute", "link_s": link, "s": both,
                     "compute_alone_s": alone, "compute_beside_s": beside,
                     "overlap_eff": (alone + link - both) / min(alone, link),
                     "compute_slowed": beside / alone})
        rows.append({"case": f"exchange {mb} MB after idle", "link_s": link,
                     "s": med[f"exchange {mb} MB after idle"]})
    rows.append({"case": "ping-pong (round trip)", "link_s": 0.0,
                 "s": med["ping-pong (round trip)"]})
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"- link: {meta['shaping']}; sysctls: {meta['sysctl'] or 'defaults'}; "
             f"reps {meta['reps']}; load: start `{meta['uptime_start']}`, end "
             f"`{meta['uptime_end']}`", "",
             "| case | link time s (X / R) | measured s | / link time | compute alone s | "
             "compute beside s | overlap eff. |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['s'] / r['link_s']:.2f}" if r["link_s"] else "-"
        extra = ("-", "-", "-")
        if "overlap_eff" in r:
            extra = (f"{r['compute_alone_s']:.3f}", f"{r['compute_beside_s']:.3f} "
                     f"({r['compute_slowed']:.2f}x)", f"{r['overlap_eff']:.2f}")
        lines.append(f"| {r['case']} | {r['link_s']:.3f} | {r['s'] * 1e3 / 1e3:.4f} | {ratio} "
                     f"| {' | '.join(extra)} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=300)
    p.add_argument("--sizes", type=float, nargs="+", default=[1.6, 8.4],
                   help="MB per exchange and direction (default: a config-A block's and "
                        "the root's share per rank)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sysctl", action="append", default=[])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--send-first", action="store_true",
                   help="post each exchange's send before its receive")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        global SEND_FIRST
        SEND_FIRST = args.send_first
        worker(args)
        return 0
    sys.path.insert(0, str(HERE))
    from cluster_net import HOST_IF, EmulatedCluster, NetnsUnavailable, wait_all

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = Path(f"/tmp/cluster_micro-{os.getpid()}.json")
    try:
        with EmulatedCluster(2, rate_mbit=args.rate_mbit) as net:
            for kv in args.sysctl:
                for host in range(2):
                    net.run(host, ["sysctl", "-w", kv])
            procs = []
            for rank in range(2):
                env = dict(os.environ, MASTER_ADDR=net.address(0), MASTER_PORT="29733",
                           RANK=str(rank), WORLD_SIZE="2", GLOO_SOCKET_IFNAME=HOST_IF,
                           OMP_NUM_THREADS="1")
                cmd = [sys.executable, __file__, "--worker", "--rate-mbit", str(args.rate_mbit),
                       "--reps", str(args.reps), "--out", str(out),
                       *(["--send-first"] if args.send_first else []),
                       "--sizes", *map(str, args.sizes)]
                procs.append(net.popen(rank, cmd, env=env))
            ended = wait_all(procs, 900)
            if any(e is None for e in ended) or any(p.returncode for p in procs):
                print("cluster_micro: a rank failed or timed out", file=sys.stderr)
                return 1
            meta = {"shaping": net.describe()["shaping"]}
    except NetnsUnavailable as e:
        print(f"cluster_micro.py: cannot build the emulated cluster: {e}", file=sys.stderr)
        return 2
    raw = json.loads(out.read_text())
    out.unlink()
    meta.update(sysctl=args.sysctl, reps=args.reps, uptime_start=uptime,
                uptime_end=subprocess.run(["uptime"], capture_output=True,
                                          text=True).stdout.strip())
    rows = summarize(raw, args.sizes, args.rate_mbit, args.reps)
    print(render(rows, meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
