"""`fullshard demo` end to end on 2 processes, its resume, and its option errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fullshard", "demo", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def test_demo_trains_saves_plots_and_resumes(tmp_path: Path) -> None:
    """The first run compresses the wire (and trains the exact run beside it); the resumed
    run is exact, from the compressed run's full-precision checkpoint."""
    out = tmp_path / "run"
    first = _demo("--steps", "3", "--out", str(out), "--compression", "int8")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "steps 0 -> 3" in first.stdout
    assert "weights and gradients int8 on the wire" in first.stdout
    assert "exact run beside (3 steps, same seed and batches)" in first.stdout
    assert "model state per rank" in first.stdout and "rank 1:" in first.stdout
    assert (out / "checkpoint").exists()
    try:
        import matplotlib  # noqa: F401

        assert (out / "demo.png").stat().st_size > 0
    except ImportError:
        assert "figure: skipped" in first.stdout

    resumed = _demo("--steps", "2", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "steps 3 -> 5" in resumed.stdout  # continued from the saved step
    assert "on the wire" not in resumed.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "HALF_SHARD"], "Unknown sharding strategy 'HALF_SHARD'"),
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
        (["--bucketing", "ROW"], "Unknown bucketing strategy 'ROW'"),
        (["--out", "/proc/fullshard-demo"], "is not writable"),
        (["--compression", "int8", "--strategy", "NO_SHARD"], "--compression needs a shard axis"),
    ],
)
def test_demo_bad_options_fail_fast(args: list[str], message: str) -> None:
    result = _demo(*args, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
