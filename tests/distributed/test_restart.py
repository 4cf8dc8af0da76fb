"""Restarts that come back: `fullshard run --max-restarts 1` after a rank is SIGKILLed at a
random step restarts both ranks, the script resumes from its latest complete checkpoint
(`fullshard.api.resume`), and the final parameters equal one uninterrupted process's.
(10 trials: benchmarks/restart_trials.py.)"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import torch

from fullshard.api.resume import checkpoint_path, checkpoint_step, latest_checkpoint
from tests.distributed.restart_loop import reference
from tests.distributed.test_fabric import FULLSHARD, ROOT, child_env

SCRIPT = Path(__file__).with_name("restart_loop.py")


def test_latest_checkpoint_picks_the_newest_complete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none-yet") is None
    assert latest_checkpoint(tmp_path) is None
    assert checkpoint_path(tmp_path, 12) == tmp_path / "step-00000012"
    assert checkpoint_step(tmp_path / "step-00000012") == 12
    full = checkpoint_path(tmp_path, 4)
    full.write_bytes(b"a full checkpoint is one file")
    sharded = checkpoint_path(tmp_path, 10)
    sharded.mkdir()
    (sharded / "meta.pt").write_bytes(b"")
    # What a save cut short leaves: a temporary sibling, and a directory without its index.
    (tmp_path / ".step-00000020.fullshard-tmp-abc").mkdir()
    checkpoint_path(tmp_path, 30).mkdir()
    (tmp_path / "step-x").mkdir()
    assert latest_checkpoint(tmp_path) == sharded
    with pytest.raises(ValueError, match="takes an int >= 0, got -1"):
        checkpoint_path(tmp_path, -1)
    with pytest.raises(ValueError, match="not named like a checkpoint"):
        checkpoint_step(tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match="takes a directory, got the file"):
        latest_checkpoint(full)


def test_a_killed_rank_restarts_and_resumes_exactly(tmp_path: Path) -> None:
    steps = 8
    rng = random.Random()
    kill_rank, kill_step = rng.randrange(2), rng.randrange(1, steps)
    out = tmp_path / "out.pt"
    cmd = [*FULLSHARD, "run", "--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT),
           "--steps", str(steps), "--every", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--out", str(out), "--kill-rank", str(kill_rank), "--kill-step", str(kill_step)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    said = f"killed rank {kill_rank} at step {kill_step}\n{proc.stdout[-2000:]}\n" \
           f"{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    resumed_from = kill_step // 2 * 2  # the last checkpoint before the kill
    assert f"attempt 1: world size 2, from step {resumed_from}" in proc.stdout, said
    got, ref = torch.load(out), reference(steps)
    assert got.keys() == ref.keys()
    for name, value in ref.items():  # invariant 3: sharded == one process, to round-off
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
