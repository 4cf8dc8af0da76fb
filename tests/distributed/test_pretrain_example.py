"""examples/pretrain.py (a litgpt-style pretraining loop) runs under `fullshard run` on 2
ranks and logs the losses of one process on the same global batch; resuming from a
checkpoint continues with the losses of the uninterrupted run.

Three launches: one process for steps 1-3 (saving a sharded checkpoint at step 3), two
processes for steps 1-6 uninterrupted, and two processes resuming from the one-process
checkpoint for steps 4-6 (a resume that also reshards from 1 to 2 ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fullshard.api.loggers import read_metrics
from tests.distributed.test_fabric import ROOT, child_env

SCRIPT = str(ROOT / "examples" / "pretrain.py")
COMMON = ["--max-steps", "6", "--save-interval", "3", "--global-batch-size", "8",
          "--seq", "16"]


def launch(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def losses(out_dir: Path) -> dict[int, float]:
    rows = read_metrics(out_dir / "logs" / "version_0" / "metrics.csv")
    return {int(r["step"]): float(r["loss"]) for r in rows if r.get("loss") is not None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pretrain")
    one, two, resumed = tmp / "one", tmp / "two", tmp / "resumed"
    # One process, 4 rows x 2 micro-batches = the global batch of 8; stops after step 3.
    launch([sys.executable, SCRIPT, "--devices", "1", "--micro-batch-size", "4",
            "--out-dir", str(one), "--throughput", "simple", *COMMON, "--max-steps", "3"])
    fullshard_run = [sys.executable, "-m", "fullshard.cli", "run", "--nproc", "2",
                     SCRIPT, "--micro-batch-size", "2", *COMMON]
    launch([*fullshard_run, "--out-dir", str(two)])  # Lightning's ThroughputMonitor if present
    ckpt = one / "step-00000003" / "lit_model.pth"
    stdout = launch([*fullshard_run, "--out-dir", str(resumed), "--resume", str(ckpt),
                     "--throughput", "simple"])
    assert f"Resuming training from {ckpt}" in stdout
    return {"one": one, "two": two, "resumed": resumed}


def test_two_ranks_log_the_losses_of_one_process(runs: dict[str, Path]) -> None:
    one, two = losses(runs["one"]), losses(runs["two"])
    assert sorted(one) == [1, 2, 3] and sorted(two) == [1, 2, 3, 4, 5, 6]
    assert [two[s] for s in (1, 2, 3)] == pytest.approx([one[s] for s in (1, 2, 3)],
                                                        rel=1e-5, abs=1e-6)
    assert two[6] < two[1]  # it learns
    assert sorted(p.name for p in runs["two"].glob("step-*")) == ["step-00000003",
                                                                  "step-00000006"]
    assert (runs["two"] / "step-00000006" / "lit_model.pth" / "meta.pt").exists()


def test_resume_continues_with_the_uninterrupted_losses(runs: dict[str, Path]) -> None:
    two, resumed = losses(runs["two"]), losses(runs["resumed"])
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([two[s] for s in (4, 5, 6)],
                                                            rel=1e-5, abs=1e-6)


def test_throughput_is_logged(runs: dict[str, Path]) -> None:
    rows = read_metrics(runs["two"] / "logs" / "version_0" / "metrics.csv")
    rates = [r["samples_per_sec"] for r in rows if r.get("samples_per_sec") is not None]
    assert rates and all(r > 0 for r in rates)
