"""A rank that dies mid-forward (SIGKILL from inside a unit's forward, prefetched gathers in
flight) ends the job on every other rank and every node within a bound measured from the
death, and each launcher names the real first failure -- across nodes too, for a plain
`fsdp()` script (`fullshard.launch.failure_board`).

The nodes are several `fullshard run --nnodes N --node-rank K` launchers on this machine over
127.0.0.1: each launcher sees only its own workers, exactly as on separate hosts.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from fullshard.launch.environment import free_port
from tests.distributed.test_fabric import FULLSHARD, ROOT, child_env
from tests.distributed.test_launch import _gone

SCRIPT = ROOT / "tests/distributed/peer_death_loop.py"
# From the death to the last launcher's exit. What it takes: the survivors' connections break
# at once; a survivor waits for the board to name the cause (its launcher posts a SIGKILLed
# rank within a second or two), prints and exits; each launcher then reads the board and
# stops. The rest is slow process teardown on a loaded machine.
_ENDS_WITHIN_S = 20.0
_START_S = 300  # starting Python, torch and several launchers is slow on a loaded machine


def _launch(tmp_path: Path, *, nnodes: int, nproc: int, kill_rank: int,
            how: str = "sigkill") -> tuple[list[str], list[float], float, list[int]]:
    """Start `nnodes` launchers of `nproc` workers each; rank `kill_rank` dies at step 2 inside
    block 1's forward. Returns each launcher's output and end time, the death's time and the
    workers' pids."""
    pids = tmp_path / "pids"
    pids.mkdir()
    args = [str(SCRIPT), "--pids-dir", str(pids), "--kill-rank", str(kill_rank),
            "--kill-how", how, "--sleep", "0.02"]
    port = free_port()
    procs = []
    for node in range(nnodes):
        multi = ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr",
                 "127.0.0.1", "--master-port", str(port)] if nnodes > 1 else []
        procs.append(subprocess.Popen(
            [*FULLSHARD, "run", "--nproc-per-node", str(nproc), *multi, *args],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs, ends = [], []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=_START_S)[0])
            ends.append(time.time())
    finally:
        for proc in procs:
            proc.kill()
        for pid in [int(p.read_text()) for p in pids.glob("rank*.pid")]:
            if not _gone(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
    died = pids / "killed-at"
    log = "\n".join(f"--- node {i} (exit {p.returncode}):\n{out[-2500:]}"
                    for i, (p, out) in enumerate(zip(procs, outs)))
    assert died.exists(), f"rank {kill_rank} never reached its death\n{log}"
    for i, proc in enumerate(procs):
        assert proc.returncode != 0, f"node {i} exited 0\n{log}"
    killed = float(died.read_text())
    # communicate() returns in node order: a node's end time is only an upper bound when an
    # earlier node took longer, which makes the check stricter, never looser.
    elapsed = max(ends) - killed
    print(f"nodes ended {', '.join(f'{e - killed:.1f}' for e in ends)} s after the death")
    assert elapsed < _ENDS_WITHIN_S, f"the last node ended {elapsed:.1f}s after the death\n{log}"
    workers = [int(p.read_text()) for p in pids.glob("rank*.pid")]
    assert len(workers) == nnodes * nproc, log
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in workers), f"workers left running: {workers}\n{log}"
    return outs, ends, killed, workers


def _named(rank: int, how: str) -> str:
    return rf"rank {rank} \(local rank \d+, (host \S+, )?pid \d+\) {how}"


def test_sigkill_mid_forward_under_one_launcher(tmp_path: Path) -> None:
    """3 ranks, one `fullshard run`: its agent sees the death and stops the survivors."""
    outs, _, _, _ = _launch(tmp_path, nnodes=1, nproc=3, kill_rank=1)
    last = [line for line in outs[0].splitlines() if line.startswith("fullshard run:")]
    assert last and re.search(_named(1, "was killed by signal SIGKILL") + r" \(the first failure",
                              last[-1]), outs[0][-3000:]


def test_sigkill_mid_forward_every_node_names_it(tmp_path: Path) -> None:
    """3 ranks on 3 launchers (one per node): nobody but rank 1's own launcher sees it die.
    Each survivor fails at once and every launcher names rank 1, killed by SIGKILL, as the
    first failure (before the board, nodes 0 and 2 named their own rank)."""
    outs, _, _, _ = _launch(tmp_path, nnodes=3, nproc=1, kill_rank=1)
    for node, out in enumerate(outs):
        last = [line for line in out.splitlines() if line.startswith("fullshard run:")]
        assert last, f"node {node} said nothing\n{out[-3000:]}"
        assert re.search(_named(1, "was killed by signal SIGKILL") + r" \(the first failure",
                         last[-1]), f"node {node}: {last[-1]}\n{out[-3000:]}"
        if node != 1:  # the survivor itself says what it failed after, in one line
            assert re.search(rf"fullshard: rank {node} .*after "
                             + _named(1, "was killed by signal SIGKILL"), out), out[-3000:]


@pytest.mark.parametrize("how, said", [
    ("sigkill", "was killed by signal SIGKILL"),
    ("raise", "failed with RuntimeError: injected failure on rank 3"),
])
def test_node0_names_a_failure_on_node1(tmp_path: Path, how: str, said: str) -> None:
    """2 nodes x 2 ranks, rank 3 (node 1) dies: node 0's launcher names rank 3 and its cause,
    not its own rank 0, whose connection merely broke."""
    outs, _, _, _ = _launch(tmp_path, nnodes=2, nproc=2, kill_rank=3, how=how)
    last = [line for line in outs[0].splitlines() if line.startswith("fullshard run:")]
    assert last, outs[0][-3000:]
    assert re.search(_named(3, said) + r" \(the first failure, on node 1\)", last[-1]), (
        f"{last[-1]}\n{outs[0][-3000:]}")
    assert len(last[-1]) < 400, last[-1]  # concise
