"""Restarts across emulated hosts (network namespaces, `netns.py`): `fullshard run --nnodes 2
--max-restarts 1` on each of two hosts (the static rendezvous at host 0, gloo over the veths),
running `restart_loop.py`; one rank is SIGKILLed at a random step of the first attempt. Both
hosts' ranks must start a second attempt, resume from the latest complete checkpoint, and end
with the uninterrupted one-process run's parameters (to round-off); both launchers exit 0."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import torch

from tests.distributed.netns import ROOT, emulated_hosts, fullshard_run, host_env
from tests.distributed.restart_loop import reference

SCRIPT = Path(__file__).with_name("restart_loop.py")
STEPS, EVERY = 8, 2
_port = [32600 + os.getpid() % 1000]


def test_a_killed_rank_restarts_both_hosts_and_resumes_exactly(tmp_path: Path) -> None:
    rng = random.Random()
    kill_rank, kill_step = rng.randrange(2), rng.randrange(1, STEPS)
    out, attempts = tmp_path / "out.pt", tmp_path / "attempts"
    _port[0] += 1
    with emulated_hosts(2) as net:
        procs, logs = [], []
        for host in range(2):
            cmd = fullshard_run(
                net, host, _port[0], SCRIPT,
                ["--steps", str(STEPS), "--every", str(EVERY), "--ckpt-dir",
                 str(tmp_path / "ckpt"), "--out", str(out), "--kill-rank", str(kill_rank),
                 "--kill-step", str(kill_step), "--attempts-dir", str(attempts),
                 "--devices", "1", "--num-nodes", "2"],
                options=["--max-restarts", "1"])
            log = tmp_path / f"host{host}.log"
            logs.append(log)
            with open(log, "w") as f:
                procs.append(net.popen(host, cmd, cwd=ROOT, env=host_env(net, tmp_path), stdout=f,
                                       stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        said = (f"killed rank {kill_rank} at step {kill_step}; launchers: {codes}; attempts: "
                f"{sorted(x.name for x in attempts.iterdir()) if attempts.exists() else []}\n"
                + "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs))
    assert codes == [0, 0], said
    resumed_from = kill_step // EVERY * EVERY  # the last checkpoint before the kill
    for rank in range(2):  # each host's rank came back, from the same checkpoint
        assert (attempts / f"attempt0-rank{rank}").read_text() == "0", said
        assert (attempts / f"attempt1-rank{rank}").read_text() == str(resumed_from), said
    assert not list(attempts.glob("attempt2-*")), said
    got, ref = torch.load(out), reference(STEPS)
    assert got.keys() == ref.keys()
    for name, value in ref.items():  # invariant 3: sharded == one process, to round-off
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
