"""Acceptance: a script on Lightning's own Fabric with fullshard's strategy (fabric_loop.py) on
real processes matches one process -- FULL_SHARD / SHARD_GRAD_OP / NO_SHARD on 2 ranks started
by Fabric.launch() (the strategy's launcher),
HYBRID_SHARD (2, 2) on 4 ranks, and 2 "nodes" x 2 ranks through two `fullshard run` -- and the
example script runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fullshard.launch.environment import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fabric_loop.py")
FULLSHARD = [sys.executable, "-m", "fullshard.cli"]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        env.pop(var, None)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_loop(tmp: Path, name: str, *args: str) -> dict:
    out = tmp / f"{name}.json"
    run([sys.executable, str(SCRIPT), "--out", str(out), "--ckpt", str(tmp / f"{name}.ckpt"),
         *args])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, the same global batch (2 ranks x 2 rows = 4 rows per micro-batch)."""
    tmp = tmp_path_factory.mktemp("ref")
    return run_loop(tmp, "ref", "--devices", "1", "--batch", "4")


def assert_parity(got: dict, ref: dict) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=1e-6)
    assert len(got["losses"]) == 4


@pytest.mark.parametrize(
    "strategy, state_dict_type",
    [("FULL_SHARD", "sharded"), ("SHARD_GRAD_OP", "full"), ("NO_SHARD", "sharded")],
)
def test_fabric_script_on_2_processes_matches_one(
    tmp_path: Path, reference: dict, strategy: str, state_dict_type: str
) -> None:
    got = run_loop(tmp_path, strategy, "--devices", "2", "--batch", "2", "--strategy", strategy,
                   "--state-dict-type", state_dict_type)
    assert_parity(got, reference)
    assert got["world_size"] == 2
    # The strategy launcher's watch threads: stoppable daemons (Lightning's test fixtures stop
    # left-over ones by `stop()`), and none left after the strategy's teardown.
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"{strategy}.json.threads.{rank}").read_text())
        assert all(daemon and stoppable for _, daemon, stoppable in threads["before"])
        assert threads["after"] == [], threads
    child = json.loads((tmp_path / f"{strategy}.json.threads.1").read_text())
    assert sorted(name for name, *_ in child["before"]) == [
        "fullshard-heartbeat", "fullshard-heartbeat-judge", "fullshard-parent-watch"]
    calls = {k: v["calls"] for k, v in got["counts"].items()}
    if strategy == "NO_SHARD":
        assert got["mesh"] == [2, 1]
        assert calls.get("all_reduce", 0) > 0 and "reduce_scatter" not in calls
    else:
        assert got["mesh"] == [1, 2]
        assert calls["reduce_scatter"] > 0 and "all_reduce" not in calls


def check_hybrid(got: dict, ref: dict, shard_ranks: list[int]) -> None:
    assert_parity(got, ref)
    assert got["world_size"] == 4 and got["mesh"] == [2, 2]
    assert got["shard_ranks"] == shard_ranks and got["replicate_ranks"] == [0, 2]
    rs, ar = got["counts"]["reduce_scatter"], got["counts"]["all_reduce"]
    # Each reduce-scatter over the 2-rank shard axis is followed by an all-reduce of its
    # output (half the bytes) over the replicate axis.
    assert rs["calls"] == ar["calls"] > 0
    assert rs["bytes"] == 2 * ar["bytes"]


def test_hybrid_shard_mesh_2x2_on_4_processes(tmp_path: Path, reference: dict) -> None:
    got = run_loop(tmp_path, "hybrid", "--devices", "4", "--batch", "1",
                   "--strategy", "HYBRID_SHARD", "--mesh", "2,2", "--state-dict-type", "full")
    check_hybrid(got, reference, [0, 1])


def test_hybrid_shard_on_2_nodes_through_fullshard_run(tmp_path: Path, reference: dict) -> None:
    port = free_port()
    out = tmp_path / "nodes.json"
    procs = [
        subprocess.Popen(
            [*FULLSHARD, "run", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT),
             "--devices", "2", "--num-nodes", "2", "--strategy", "HYBRID_SHARD", "--batch", "1",
             "--out", str(out), "--ckpt", str(tmp_path / "nodes.ckpt")],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    deadline = time.monotonic() + 240
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(s[-4000:] for s in logs)
    # No mesh given: HYBRID_SHARD uses (nodes, ranks per node) = (2, 2).
    check_hybrid(json.loads(out.read_text()), reference, [0, 1])


def test_example_script_runs(tmp_path: Path) -> None:
    proc = run([sys.executable, "examples/fabric_train.py", "--devices", "2", "--steps", "2",
                "--checkpoint", str(tmp_path / "ckpt")])
    assert "step   0  loss" in proc.stdout and "saved" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".fullshard-checksums.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
    ]
