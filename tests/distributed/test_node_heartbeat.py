"""The launchers' heartbeat (`fullshard.launch.node_heartbeat`), on real processes and a real
TCPStore: two "launchers" (processes that run `watch_nodes` as `fullshard run` does, each with
a worker child in a session of its own, as torchelastic starts them). A launcher that goes
silent (SIGSTOP) makes the other one name it, kill its worker and exit 1 within the bound plus
the launchers' grace, timed from the stop; a launcher that ends on purpose is never called
silent. The whole path across emulated hosts, a cut link under `--max-restarts`, is in
`test_netns_heartbeat.py`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fullshard.launch.node_heartbeat import LAUNCHER_GRACE_S
from tests.distributed.test_fabric import ROOT, child_env

BOUND_S = 1.0
SLACK_S = 10.0  # a loaded machine: a beat interval, a Python exit
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from fullshard.launch.node_heartbeat import watch_nodes
    import os
    port, node, pid_file, end_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    watch = watch_nodes("127.0.0.1", str(port), node, 2, {bound})
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              start_new_session=True)
    open(pid_file, "w").write(str(worker.pid))
    while not os.path.exists(end_file):
        time.sleep(0.05)
    watch.stop()          # this launcher's torchrun returned: done
    worker.kill()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _end(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    """Kill the launchers and their workers (a worker is a session of its own)."""
    for proc, pid_file in procs:
        proc.kill()
        proc.wait()
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except OSError:
                pass


def _beats(store: dist.Store, node: int) -> int:
    return dist.PrefixStore("fullshard/node-heartbeat/", store).add(f"beat/{node}", 0)


def test_a_silent_launcher_ends_the_others_and_a_done_one_does_not(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    script = LAUNCHER.format(bound=BOUND_S)
    env = dict(child_env(), PYTHONPATH=str(ROOT))

    def launch(node: int, case: int) -> tuple[subprocess.Popen, Path]:
        pid_file = tmp_path / f"worker{node}-{case}.pid"
        proc = subprocess.Popen([sys.executable, "-c", script, str(store.port), str(node),
                                 str(pid_file), str(tmp_path / f"end{node}-{case}")], env=env,
                                cwd=ROOT, stderr=subprocess.PIPE, text=True)
        return proc, pid_file

    def wait_beating() -> None:
        deadline = time.monotonic() + 60
        while not (_beats(store, 0) > 1 and _beats(store, 1) > 1):
            assert time.monotonic() < deadline, "the launchers never beat"
            assert all(p.poll() is None for p, _ in procs)
            time.sleep(0.1)

    # 1. Node 1 goes silent: node 0 names it, kills its worker, exits 1.
    procs = [launch(0, 1), launch(1, 1)]
    try:
        wait_beating()
        worker0 = int(procs[0][1].read_text())
        os.kill(procs[1][0].pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        code = procs[0][0].wait(timeout=BOUND_S + LAUNCHER_GRACE_S + SLACK_S)
        took = time.monotonic() - t_stop
        err = procs[0][0].stderr.read()
        assert code == 1, err
        assert took < BOUND_S + LAUNCHER_GRACE_S + SLACK_S
        assert re.search(rf"fullshard run: node 0 is stopping the job: node 1 \(host \S+, "
                         rf"launcher pid {procs[1][0].pid}\) has not answered for \d+ s "
                         rf"\(silence bound {BOUND_S:g} s \+ {LAUNCHER_GRACE_S:g} s", err), err
        deadline = time.monotonic() + 5
        while _alive(worker0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker0), "node 0's worker outlived its launcher"
    finally:
        _end(procs)

    # 2. Node 1 ends on purpose (its torchrun returned): node 0 goes on.
    keys = dist.PrefixStore("fullshard/node-heartbeat/", store)
    for key in ("beat/0", "beat/1", "done/0", "done/1", "verdict"):
        keys.delete_key(key)
    quiet = BOUND_S + LAUNCHER_GRACE_S + 3
    procs = [launch(0, 2), launch(1, 2)]
    try:
        wait_beating()
        (tmp_path / "end1-2").touch()
        assert procs[1][0].wait(timeout=30) == 0, procs[1][0].stderr.read()
        time.sleep(quiet)
        assert procs[0][0].poll() is None, procs[0][0].stderr.read()
    finally:
        _end(procs)
