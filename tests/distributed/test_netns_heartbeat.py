"""Silence across emulated hosts (network namespaces, `netns.py`): one `fullshard run` per
host, a plain `fsdp()` script over gloo on the hosts' veths. A host whose link is cut, or whose
rank is SIGSTOPped, must end the job: the surviving host's rank fails within the silence bound
(timed from the cut / the stop), naming the silent rank, and its launcher exits non-zero --
instead of waiting in a collective for gloo's 30-minute timeout. Under `--max-restarts` the
cut also ends the job: the restarted attempt cannot form its process group, and the launchers'
own heartbeat (`node_heartbeat.py`) ends both nodes, each naming the other side, and leaves no
worker behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fullshard.launch.node_heartbeat import LAUNCHER_GRACE_S
from tests.distributed.netns import ROOT, emulated_hosts, fullshard_run, host_env

SCRIPT = Path(__file__).with_name("plain_fsdp_loop.py")
BOUND_S = 10.0
SLACK_S = 15.0
"""A loaded machine's slack on top of the bound: a beat interval, the launcher's monitor
interval and shutdown, a Python exit."""
_port = [31500 + os.getpid() % 1000]


def _start(net, tmp_path: Path, restarts: int = 0
           ) -> tuple[list[subprocess.Popen], list[Path], Path]:
    _port[0] += 1
    pids = tmp_path / "pids"
    pids.mkdir()
    procs, logs = [], []
    for host in range(net.hosts):
        log = tmp_path / f"host{host}.log"
        logs.append(log)
        cmd = fullshard_run(net, host, _port[0], SCRIPT,
                            ["--pids-dir", str(pids), "--steps", "100000", "--sleep", "0.05"],
                            options=["--silence-timeout", f"{BOUND_S:g}",
                                     "--max-restarts", str(restarts)])
        with open(log, "w") as f:
            procs.append(net.popen(host, cmd, cwd=ROOT, env=host_env(net, tmp_path), stdout=f,
                                   stderr=subprocess.STDOUT))
    return procs, logs, pids


def _wait_training(procs, logs, pids: Path, timeout: float = 90.0) -> list[int]:
    """Every rank's pid, once every rank has written it (after its `fsdp()`: the heartbeat
    runs) and trained a little."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [pids / f"rank{r}.pid" for r in range(len(procs))]
        if all(f.exists() and f.read_text() for f in files):
            time.sleep(2.0)  # a few steps and beats on every rank
            return [int(f.read_text()) for f in files]
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    pytest.fail("the ranks did not start training:\n" + _logs(logs))


def _logs(logs) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())


def _wait_ends(procs, t0: float, timeout: float, need: list[int]) -> list[float | None]:
    """Seconds from `t0` until each process ended; None for one still running when those in
    `need` have ended, or `timeout` seconds after `t0`."""
    ended: list[float | None] = [None] * len(procs)
    while time.monotonic() - t0 < timeout and any(ended[i] is None for i in need):
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.05)
    return ended


def _left_behind(net, wait: float = 5.0) -> dict[int, list[int]]:
    """The processes still in each host's namespace, waiting up to `wait` s for killed ones to
    be gone."""
    deadline = time.monotonic() + wait
    while True:
        left = {host: net.pids(host) for host in range(net.hosts)}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("how, victim, restarts", [("cut", 1, 1), ("sigstop", 1, 0),
                                                   ("cut", 0, 0)],
                         ids=["cut-host1-restarts", "sigstop-host1", "cut-store-host0"])
def test_a_silent_host_ends_the_job_within_the_bound(tmp_path: Path, how: str, victim: int,
                                                     restarts: int) -> None:
    survivor = 1 - victim
    # Under restarts the ranks' verdict ends attempt 0 and the launchers' ends the job.
    bound = BOUND_S + (LAUNCHER_GRACE_S if restarts else 0.0)
    with emulated_hosts(2) as net:
        procs, logs, pids = _start(net, tmp_path, restarts)
        rank_pids = _wait_training(procs, logs, pids)
        assert all(p.poll() is None for p in procs), _logs(logs)
        t_event = time.monotonic()
        if how == "cut":
            net.cut(victim)
        else:
            os.kill(rank_pids[victim], signal.SIGSTOP)
        need = [0, 1] if how == "cut" else [survivor]  # a stopped rank's launcher waits on
        ended = _wait_ends(procs, t_event, bound + SLACK_S, need)
        left = _left_behind(net) if restarts else {}
        said = (f"{how} of host {victim}: the launchers ended {ended} s after it; processes "
                f"left {left}\n{_logs(logs)}")
        assert ended[survivor] is not None, said
        assert ended[survivor] < bound + SLACK_S, said
        assert procs[survivor].returncode != 0, said
        if how == "cut":  # the cut-off side cannot reach the rest either: it stops too
            assert ended[victim] is not None and procs[victim].returncode != 0, said
        text = logs[survivor].read_text()
        if restarts:  # each launcher names the other side, and no worker is left behind
            assert not any(left.values()), said
            assert re.search(rf"fullshard run: node {survivor} is stopping the job: node "
                             rf"{victim} \(host \S+, launcher pid \d+\) has not answered for "
                             rf"\d+ s \(silence bound {BOUND_S:g} s \+ {LAUNCHER_GRACE_S:g} s",
                             text), said
            assert re.search(rf"fullshard run: node {victim} is stopping the job: the job's "
                             rf"store at {re.escape(net.address(0))}:\d+ \(node 0's launcher\) "
                             rf"has not answered", logs[victim].read_text()), said
        if survivor == 1 and how == "cut":  # rank 0's host also holds the store
            silent = (rf"the store at {re.escape(net.address(0))}:\d+ \(rank 0's host, or "
                      rf"node 0's launcher\) has not answered for \d+ s")
        else:
            silent = (rf"rank {victim} \(host \S+, pid {rank_pids[victim]}\) has not answered "
                      rf"for \d+ s \(silence bound {BOUND_S:g} s")
        assert re.search(rf"rank {survivor} is stopping the job: {silent}", text), said
        if not restarts:
            assert f"fullshard run: rank {survivor} " in text, said  # the launcher's summary
