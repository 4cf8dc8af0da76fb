"""Lightning's own `Fabric` with fullshard's strategy in it (lightning_fabric_loop.py), on 2 CPU
ranks started by fullshard's launcher, against the same script on one process with Lightning's
own single-device strategy: the losses and gradient norms of every step (two micro-batches
under `fabric.no_backward_sync`, clipping by norm and by value), a `fabric.save` /
`fabric.load` round trip mid-run that training continues from, the strategy by instance and
by its registered name, and a dead rank ending the launch with its name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_fabric import ROOT, child_env, run

pytest.importorskip("lightning")

SCRIPT = Path(__file__).with_name("lightning_fabric_loop.py")


def run_loop(tmp: Path, name: str, *args: str) -> dict:
    out = tmp / f"{name}.json"
    run([sys.executable, str(SCRIPT), "--out", str(out), "--ckpt", str(tmp / f"{name}.ckpt"),
         *args])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, Lightning's single-device strategy, the same global micro-batch (4 rows)."""
    tmp = tmp_path_factory.mktemp("ref")
    ref = run_loop(tmp, "ref", "--strategy", "single", "--devices", "1", "--batch", "4")
    assert ref["strategy"].startswith("lightning.") and ref["world_size"] == 1
    return ref


@pytest.mark.parametrize("strategy, state_dict_type", [("instance", "full"),
                                                       ("fullshard", "sharded")])
def test_lightning_fabric_with_fullshard_matches_one_process(
    tmp_path: Path, reference: dict, strategy: str, state_dict_type: str
) -> None:
    got = run_loop(tmp_path, strategy, "--strategy", strategy, "--devices", "2", "--batch", "2",
                   "--state-dict-type", state_dict_type)
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert len(got["norms"]) == len(reference["norms"]) == 4
    for ours, ref in zip(got["norms"], reference["norms"]):
        assert (ours is None) == (ref is None)  # the step clipped by value returns no norm
        if ref is not None:
            assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert got["world_size"] == 2
    assert got["strategy"] == "fullshard.api.lightning_strategy.FSDPStrategy"
    assert got["is_lightning_fsdp"]  # isinstance(strategy, lightning's FSDPStrategy)
    assert got["launcher"] == "fullshard.launch.subprocess_script"
    ckpt = tmp_path / f"{strategy}.ckpt"
    assert ckpt.is_dir() == (state_dict_type == "sharded")  # the strategy's format was used
    # The launcher gives the children FULLSHARD_FAILURE_DIR and LOCAL_WORLD_SIZE without
    # setting them in rank 0's own process (where they outlived the run, e.g. in a test).
    assert set(got["env_left_set"]) <= LIGHTNING_LAUNCH_VARIABLES, got["env_left_set"]


# What Lightning's own launcher leaves set in rank 0's process (its test fixtures allow these).
LIGHTNING_LAUNCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE",
                              "LOCAL_RANK", "RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"}


def test_a_dead_rank_ends_a_lightning_fabric_launch_and_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "2", "--fail-rank", "1"], cwd=ROOT,
        env={**child_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
        timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(r"fullshard: rank 1 \(local rank 1, pid \d+\) exited with code 1", out), \
        out[-3000:]
    assert "injected failure on rank 1" in out
    assert not list(tmp_path.glob("fullshard-failures-*")), "failure records left behind"
