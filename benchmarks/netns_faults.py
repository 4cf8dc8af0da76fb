"""Faults on 2 emulated hosts (network namespaces, `cluster_net.py`): how long after a cut link
or a SIGSTOPped rank does each host's `fullshard run` end, with what code and message?

    python benchmarks/netns_faults.py cut                       # cut host 1's switch port
    python benchmarks/netns_faults.py sigstop --victim 0        # SIGSTOP host 0's rank
    python benchmarks/netns_faults.py cut --max-restarts 1      # a cut under restarts
    python benchmarks/netns_faults.py cut --silence-timeout 0   # detection off: the old hang

Each host runs `fullshard run --nnodes 2 --node-rank i --nproc-per-node 1` of the plain `fsdp()`
loop `tests/distributed/plain_fsdp_loop.py` (gloo over the veths); once both ranks train, the
fault is made and both launchers are watched for `--watch` seconds, timed from the fault.
Needs root. The short, bounded cases are tests (tests/distributed/test_netns_heartbeat.py); this
script is for the cases that take longer, or hang.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.distributed.netns import emulated_hosts, fullshard_run, host_env  # noqa: E402
from tests.distributed.test_netns_heartbeat import (  # noqa: E402
    SCRIPT,
    _wait_ends,
    _wait_training,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fault", choices=["cut", "sigstop"])
    p.add_argument("--victim", type=int, choices=[0, 1], default=1)
    p.add_argument("--silence-timeout", type=float, default=10.0)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--watch", type=float, default=120.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="netns-faults-"))
    pids = tmp / "pids"
    pids.mkdir()
    port = 34000 + os.getpid() % 1000
    with emulated_hosts(2) as net:
        procs, logs = [], []
        for host in range(2):
            cmd = fullshard_run(net, host, port, SCRIPT, ["--pids-dir", str(pids), "--steps",
                                                          "1000000", "--sleep", "0.05"],
                                options=["--silence-timeout", f"{args.silence_timeout:g}",
                                         "--max-restarts", str(args.max_restarts)])
            logs.append(tmp / f"host{host}.log")
            with open(logs[-1], "w") as f:
                procs.append(net.popen(host, cmd, cwd=ROOT, env=host_env(net), stdout=f,
                                       stderr=subprocess.STDOUT))
        rank_pids = _wait_training(procs, logs, pids)
        t0 = time.monotonic()
        if args.fault == "cut":
            net.cut(args.victim)
        else:
            os.kill(rank_pids[args.victim], signal.SIGSTOP)
        ended = _wait_ends(procs, t0, args.watch, [0, 1])
        workers = {host: net.pids(host) for host in range(net.hosts)}
    print(f"{args.fault} of host {args.victim}, silence timeout {args.silence_timeout:g} s, "
          f"max restarts {args.max_restarts}, watched {args.watch:g} s")
    for host in range(2):
        when = f"ended after {ended[host]:.1f} s, code {procs[host].returncode}" \
            if ended[host] is not None else f"still running ({len(workers[host])} processes)"
        print(f"host {host}: {when}")
        for line in logs[host].read_text().splitlines():
            if "stopping the job" in line or line.startswith("fullshard run:"):
                print(f"  {line[:300]}")
    print(f"logs: {tmp}")


if __name__ == "__main__":
    main()
