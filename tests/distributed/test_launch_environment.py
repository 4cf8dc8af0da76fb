"""`fullshard run` called in-process (`fullshard.cli.main`, as a notebook or a sweep driver
does) leaves the caller's environment as it found it: the variables it sets for its workers
(the silence bound, the agent's pid, the failure-record directory, torch's store sharing) do
not leak into a later run in the same process."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fullshard.cli import main as cli_main
from fullshard.launch.heartbeat import SILENCE_VAR
from tests.distributed.test_fabric import ROOT, child_env

SCRIPT = ROOT / "tests/distributed/env_report.py"


def test_fullshard_run_in_process_leaves_the_environment(tmp_path: Path, monkeypatch) -> None:
    for var, value in child_env().items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv(SILENCE_VAR, raising=False)
    before = dict(os.environ)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert cli_main(["run", "--nproc-per-node", "2", "--silence-timeout", "7", str(SCRIPT),
                     str(first)]) == 0
    assert json.loads(first.read_text())[SILENCE_VAR] == "7"  # the workers got it
    assert dict(os.environ) == before, {
        k: os.environ.get(k) for k in set(os.environ) ^ set(before)}
    # A later run without --silence-timeout gets the default bound, not the earlier run's.
    assert cli_main(["run", "--nproc-per-node", "2", str(SCRIPT), str(second)]) == 0
    assert SILENCE_VAR not in json.loads(second.read_text())
    assert dict(os.environ) == before
