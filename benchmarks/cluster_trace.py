"""A timeline of one fullshard step on the emulated cluster: collectives, unit hooks, the link.

    sudo python benchmarks/cluster_trace.py                          # FULL_SHARD, 300 Mbit/s
    sudo python benchmarks/cluster_trace.py --impl fullshard-shard_grad_op-block --step -1
    sudo python benchmarks/cluster_trace.py --option prefetch_limit=2 --json /tmp/t.json

What it shows, per rank, in milliseconds from the start of the traced step (the same clock,
CLOCK_MONOTONIC, in every process of the machine):
- every collective fullshard issues (`comm.all_gather_batch` / `reduce_scatter_batch` /
  `all_reduce_batch`: the labels and bytes), when it was issued, when something first waited
  for it and when that wait returned;
- each unit's forward pre/post hook, its backward (`post_backward`, the unit's gradients
  complete) and each ZeRO-3 re-gather for backward (a saved tensor unpacked);
- zero_grad / forward / backward / optimizer step boundaries;
- the link: host 0's veth tx and rx bytes, sampled every ~0.5 ms by a process of its own in
  that namespace, summed per `--bin-ms` bin, against what the rate allows in a bin.

The wrappers are installed from here (monkeypatching the engine's module functions), not
compiled into the engine: tracing costs nothing unless this script runs. It is a diagnostic:
the sampler takes some CPU of its own, so its step times are not a record.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# -- inside a rank: the wrappers ----------------------------------------------------------------
class Tracer:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.on = False
        self._handles: dict[int, dict[str, Any]] = {}

    def mark(self, what: str, **kw: Any) -> None:
        if self.on:
            self.events.append({"t": time.perf_counter(), "ev": what, **kw})


TRACER = Tracer()


def install() -> Tracer:
    """Wrap fullshard's collectives, CommHandle.wait and the runtime's hooks."""
    from fullshard.distributed import comm
    from fullshard.engine import hooks

    tr = TRACER

    def wrap_batch(name: str) -> None:
        orig = getattr(comm, name)

        @functools.wraps(orig)
        def traced(items: Any, group: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            handles = orig(items, group, **kw)
            if tr.on:
                labels = [it[-1] for it in items]
                nbytes = sum(_item_bytes(name, it) for it in items)
                rec = {"t": t0, "t_issued": time.perf_counter(), "ev": name,
                       "labels": labels, "bytes": nbytes}
                tr.events.append(rec)
                for h in {id(h): h for h in handles}.values():
                    tr._handles[id(h)] = rec
                    rec.setdefault("_refs", []).append(h)  # keep ids unique while traced
            return handles

        setattr(comm, name, traced)

    for name in ("all_gather_batch", "reduce_scatter_batch", "all_reduce_batch"):
        wrap_batch(name)

    orig_wait = comm.CommHandle.wait

    def wait(self: Any) -> None:
        rec = tr._handles.get(id(self)) if tr.on and not self.done else None
        if rec is None:
            return orig_wait(self)
        t0 = time.perf_counter()
        orig_wait(self)
        rec.setdefault("wait_start", t0)
        rec["wait_end"] = time.perf_counter()

    comm.CommHandle.wait = wait

    rt = hooks.Runtime

    def wrap_method(name: str, ev: str, unit_arg: int = 0) -> None:
        orig = getattr(rt, name)

        @functools.wraps(orig)
        def traced(self: Any, *a: Any, **kw: Any) -> Any:
            unit = a[unit_arg] if len(a) > unit_arg else None
            uname = getattr(unit, "name", None)
            if name == "_regather_saved" and unit.is_gathered:  # only a unit to gather again
                return orig(self, *a, **kw)
            tr.mark(ev + ":begin", unit=uname or "<root>")
            try:
                return orig(self, *a, **kw)
            finally:
                tr.mark(ev + ":end", unit=uname or "<root>")

        setattr(rt, name, traced)

    wrap_method("pre_forward", "pre_forward")
    wrap_method("post_forward", "post_forward")
    wrap_method("post_backward", "post_backward")
    wrap_method("_regather_saved", "regather")
    wrap_method("_finalize_backward", "finalize", unit_arg=99)
    return tr


def _item_bytes(name: str, item: Any) -> int:
    import torch

    def nb(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if name == "all_gather_batch":
        return nb(item[1])  # our input: what we send to each peer
    if name == "reduce_scatter_batch":
        return sum(nb(t) for t in item[1]) // 2  # 2 ranks: the peer's half goes out
    return nb(item[0])


def dump(path: str, rank: int, step_marks: list[dict[str, Any]]) -> None:
    events = []
    for e in TRACER.events:
        e = {k: v for k, v in e.items() if k != "_refs"}
        events.append(e)
    Path(path).write_text(json.dumps({"rank": rank, "events": events, "steps": step_marks}))


# -- the link sampler (its own process, inside host 0's namespace) ------------------------------
def sampler(iface: str, out: str, stop: str) -> None:
    base = Path("/sys/class/net") / iface / "statistics"
    tx_f, rx_f = open(base / "tx_bytes"), open(base / "rx_bytes")
    rows = []
    n = 0
    while True:
        tx_f.seek(0)
        rx_f.seek(0)
        rows.append((time.perf_counter(), int(tx_f.read()), int(rx_f.read())))
        n += 1
        if n % 200 == 0 and os.path.exists(stop):
            break
        time.sleep(0.0005)
    Path(out).write_text(json.dumps(rows))


# -- rendering ----------------------------------------------------------------------------------
def render(traces: list[dict[str, Any]], link: list[tuple[float, int, int]], step: int,
           rate_mbit: float, bin_ms: float) -> str:
    r0 = next(t for t in traces if t["rank"] == 0)
    s = r0["steps"][step]
    t0, t1 = s["start"], s["end"]
    others = [(t["rank"], t["steps"][step]) for t in traces if t["rank"] != 0]
    lines = [f"step {step}: rank 0 {1e3 * (t1 - t0):.1f} ms; " + ", ".join(
        f"rank {r} {1e3 * (st['end'] - st['start']):.1f} ms" for r, st in others)]
    for tr in sorted(traces, key=lambda t: t["rank"]):
        st = tr["steps"][step]
        lines.append(f"\n## rank {tr['rank']} (phases: " + ", ".join(
            f"{k} {1e3 * (v - t0):.1f}" for k, v in st.items()) + ")")
        for e in tr["events"]:
            if not t0 - 0.002 <= e["t"] <= t1 + 0.002:
                continue
            at = 1e3 * (e["t"] - t0)
            if "labels" in e:
                labs = ",".join(sorted({(lab or "?").split(" ")[0] for lab in e["labels"]}))
                w0 = e.get("wait_start")
                w1 = e.get("wait_end")
                waits = (f" wait {1e3 * (w0 - t0):7.1f} -> {1e3 * (w1 - t0):7.1f}"
                         f" (blocked {1e3 * (w1 - w0):5.1f})" if w0 else " never waited")
                lines.append(f"{at:8.1f}  {e['ev']:<22} {e['bytes'] / 1e6:6.2f} MB  "
                             f"[{labs}]{waits}")
            else:
                lines.append(f"{at:8.1f}  {e['ev']:<22} {e.get('unit', '')}")
    # the link, in bins
    cap = rate_mbit * 1e6 / 8 * bin_ms / 1e3
    lines.append(f"\n## host 0 link per {bin_ms:g} ms bin (# = 10% of the rate; tx / rx)")
    pts = [(t, tx, rx) for t, tx, rx in link if t0 - 0.001 <= t <= t1 + 0.001]
    if pts:
        b, busy_tx, busy_rx, nbins = t0, 0.0, 0.0, 0
        i = 0
        while b < t1:
            e = b + bin_ms / 1e3
            inside = [p for p in pts[i:] if p[0] < e]
            i += len(inside)
            if inside:
                prev = pts[max(0, i - len(inside) - 1)]
                dtx, drx = inside[-1][1] - prev[1], inside[-1][2] - prev[2]
            else:
                dtx = drx = 0
            ftx, frx = dtx / cap, drx / cap
            busy_tx += min(ftx, 1.0)
            busy_rx += min(frx, 1.0)
            nbins += 1
            lines.append(f"{1e3 * (b - t0):8.1f}  tx {'#' * round(10 * ftx):<12} "
                         f"rx {'#' * round(10 * frx):<12}")
            b = e
        lines.append(f"link busy (fraction of the rate, summed over bins): tx "
                     f"{busy_tx / nbins:.2f}, rx {busy_rx / nbins:.2f} of {nbins} bins")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", default="fullshard-full_shard-block")
    p.add_argument("--rate-mbit", type=float, default=300)
    p.add_argument("--config", choices=("A", "B"), default="A")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--step", type=int, default=-1, help="which step to render (default last)")
    p.add_argument("--bin-ms", type=float, default=10.0)
    p.add_argument("--option", action="append", default=[],
                   help="fullshard.fsdp option key=value (JSON value), for the worker")
    p.add_argument("--sysctl", action="append", default=[])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--sampler", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sampler:
        sampler(*args.sampler)
        return 0
    sys.path.insert(0, str(HERE))
    import cluster
    from cluster_net import HOST_IF, EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="cluster-trace-") as tmp, \
            EmulatedCluster(2, rate_mbit=args.rate_mbit) as net:
        scratch = Path(tmp)
        for kv in args.sysctl:
            for host in range(2):
                net.run(host, ["sysctl", "-w", kv])
        link_out, stop = scratch / "link.json", scratch / "stop"
        samp = net.popen(0, [sys.executable, __file__, "--sampler", HOST_IF, str(link_out),
                             str(stop)])
        extra = ["--trace", str(scratch)]
        for o in args.option:
            extra += ["--option", o]
        rec = cluster.launch(net, args.impl, config=args.config, steps=args.steps,
                             warmup=args.warmup, scratch=scratch, extra=tuple(extra))
        stop.write_text("")
        samp.wait(timeout=30)
        traces = [json.loads(f.read_text()) for f in sorted(scratch.glob("trace-rank*.json"))]
        link = json.loads(link_out.read_text())
    text = render(traces, link, args.step, args.rate_mbit, args.bin_ms)
    print(f"{args.impl} at {args.rate_mbit} Mbit/s, options {args.option or 'default'}, "
          f"sysctls {args.sysctl or 'default'}; step times "
          + ", ".join(f"{x:.3f}" for x in rec["step_s"]))
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"traces": traces, "link": link, "record": rec}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
