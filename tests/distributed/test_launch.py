"""Launching: `fullshard run` arguments and help, environment detection, and rank death -- a
rank raising / exiting / SIGKILLed mid-step under `fullshard run` and under Lightning's
Fabric.launch() with fullshard's strategy (its launcher):
every process gone and a non-zero exit within 20 s of the death, the failing rank named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fullshard.cli import main as cli_main
from fullshard.launch.environment import (
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
    first_slurm_host,
)
from fullshard.launch.torchrun import torchrun_argv
from tests.distributed.test_fabric import FULLSHARD, ROOT, SCRIPT, child_env


def test_run_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["run", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
                 "--master-port", "--node-rank 1"):
        assert flag in text
    # ... and through the installed entry point's module, as a user runs it.
    proc = subprocess.run([*FULLSHARD, "run", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "torch.distributed.run" in proc.stdout


@pytest.mark.parametrize("bad, said", [
    (["--nproc-per-node", "abc"], "--nproc-per-node.*expected an int >= 1 or one of auto.*'abc'"),
    (["--nproc-per-node", "-2"], "--nproc-per-node.*'-2'"),
    (["--nproc-per-node", "0"], "--nproc-per-node.*'0'"),
    (["--master-port", "99999"], r"--master-port.*expected an int in \[1, 65535\], got '99999'"),
    (["--max-restarts", "-1"], "--max-restarts: expected an int >= 0, got '-1'"),
    (["--monitor-interval", "-1"], "--monitor-interval: expected a number of seconds > 0"),
    (["--monitor-interval", "nan"], "--monitor-interval: .*'nan'"),
    (["--shutdown-timeout", "-3"], "--shutdown-timeout: expected an int >= 0, got '-3'"),
    (["--nnodes", "0"], "--nnodes.*'0'"),
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr and --master-port"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank must be in"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_run_argument_errors(capsys, bad, said) -> None:
    """A bad call is one line on stderr and exit 2, before any worker starts."""
    import re

    with pytest.raises(SystemExit) as info:
        cli_main(["run", *bad, str(SCRIPT)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fullshard run: error: ") and re.search(said, err), err


def test_run_with_a_bad_silence_variable_is_one_line(capsys, monkeypatch) -> None:
    """$FULLSHARD_SILENCE_TIMEOUT is read by the launcher too: a bad one is a usage error."""
    monkeypatch.setenv("FULLSHARD_SILENCE_TIMEOUT", "abc")
    with pytest.raises(SystemExit) as info:
        cli_main(["run", str(SCRIPT)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fullshard run: error: FULLSHARD_SILENCE_TIMEOUT='abc': expected"), err


def test_run_of_a_missing_script_starts_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([*FULLSHARD, "run", "--nproc-per-node", "2", "nope.py", "--x"],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().splitlines() == [
        f"fullshard run: error: the script 'nope.py' does not exist (from {tmp_path}); give "
        f"a path to a Python file, or -m and a module name (see --help)"], proc.stderr


def test_torchrun_argv() -> None:
    one = torchrun_argv("t.py", ["--x", "1"], nproc_per_node=2)
    assert "--standalone" in one and "--max-restarts=0" in one and "--nproc-per-node=2" in one
    assert one[-3:] == ["t.py", "--x", "1"]
    two = torchrun_argv("t.py", nproc_per_node=2, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                        master_port=29511, module=True)
    assert "--standalone" not in two and "--module" in two
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=29511"} <= set(two)
    with pytest.raises(ValueError, match="--node-rank must be in"):
        torchrun_argv("t.py", nnodes=2, node_rank=2, master_port=1)


def test_environment_detection(monkeypatch) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "SLURM_JOB_NAME"):
        monkeypatch.delenv(var, raising=False)
    env = detect_environment()
    assert isinstance(env, LocalEnvironment) and not env.creates_processes_externally
    env.set_world_ranks(world_size=4, global_rank=2)
    assert (env.world_size(), env.global_rank()) == (4, 2)

    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x4)")
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[007-010],cpu1")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    env = detect_environment()
    assert isinstance(env, SLURMEnvironment) and env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 5, 1, 2)
    assert env.main_address == "gpu007" and env.main_port == 15000 + 3456
    env.validate_settings(2, 4)
    with pytest.raises(ValueError, match="tasks per node"):
        env.validate_settings(4, 2)
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive allocation: not managed
    assert isinstance(detect_environment(), LocalEnvironment)

    for k, v in dict(TORCHELASTIC_RUN_ID="x", RANK="3", WORLD_SIZE="4", LOCAL_RANK="1",
                     LOCAL_WORLD_SIZE="2", GROUP_RANK="1").items():
        monkeypatch.setenv(k, v)
    env = detect_environment()
    assert isinstance(env, TorchElasticEnvironment)
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    with pytest.raises(ValueError, match=r"devices=1 and num_nodes=1, but torchrun started 4"):
        env.validate_settings(1, 1)
    assert first_slurm_host("node1,node2") == "node1"


# -- which failure came first ----------------------------------------------------------------
def test_failure_records_order_the_ranks(tmp_path: Path, monkeypatch) -> None:
    from fullshard.launch import failure_records

    monkeypatch.delenv(failure_records.FAILURE_DIR_VAR, raising=False)
    failure_records.record_failure(0, 0, "no directory: nothing written")  # and no error
    assert failure_records.first_failure(None) is None
    monkeypatch.setenv(failure_records.FAILURE_DIR_VAR, str(tmp_path))
    failure_records.record_failure(1, 1, "RuntimeError: injected")
    time.sleep(0.01)
    failure_records.record_failure(0, 0, "RuntimeError: Connection closed by peer")
    (tmp_path / "rank-7.json").write_text("{half a rec")  # unreadable: skipped
    records = failure_records.read_failures(str(tmp_path))
    assert sorted(records) == [0, 1] and records[1].error == "RuntimeError: injected"
    assert failure_records.first_failure(str(tmp_path)).rank == 1
    assert failure_records.first_failure(str(tmp_path), among=[0]).rank == 0
    assert not list(tmp_path.glob("*.tmp"))

    # a SIGKILLed launcher's directory (its pid is gone) is removed by the next launch;
    # a live launcher's, another machine's or container's, and one named the old way are kept
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    where = failure_records._pid_space()
    orphan = tmp_path / f"fullshard-failures-{where}.{dead.pid}-abc123"
    kept = [tmp_path / f"fullshard-failures-{where}.{os.getppid()}-def456",
            tmp_path / f"fullshard-failures-0badc0de.{dead.pid}-jkl012",
            tmp_path / "fullshard-failures-ghi789"]
    for d in (orphan, *kept):
        d.mkdir()
    (orphan / "rank-1.json").write_text("{}")
    made = failure_records.make_failure_directory()
    assert os.environ[failure_records.FAILURE_DIR_VAR] == made and os.path.isdir(made)
    assert Path(made).name.startswith(f"fullshard-failures-{where}.{os.getpid()}-")
    assert not orphan.exists() and all(d.is_dir() for d in kept)
    failure_records.remove_failure_directory(made)
    assert not os.path.exists(made) and failure_records.FAILURE_DIR_VAR not in os.environ


def test_fullshard_run_names_the_first_failure_not_torchelastics_tie(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """torchelastic orders failures by whole seconds and gives ties to the lowest rank; the
    ranks' records (sub-second) decide, and a rank killed by a signal outranks them."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from fullshard.launch import failure_records
    from fullshard.launch.torchrun import _first_failure

    def failed(**codes: int) -> ChildFailedError:
        return ChildFailedError("script.py", {
            int(r[1:]): ProcessFailure(local_rank=int(r[1:]), pid=100 + int(r[1:]), exitcode=c,
                                       error_file="<N/A>")
            for r, c in codes.items()})

    directory = str(tmp_path)
    # Nothing recorded: torchelastic's pick.
    assert _first_failure(failed(r0=1, r1=1), directory).startswith("rank 0 (local rank 0")
    monkeypatch.setenv(failure_records.FAILURE_DIR_VAR, directory)
    failure_records.record_failure(1, 1, "RuntimeError: injected failure on rank 1")
    time.sleep(0.01)
    failure_records.record_failure(0, 0, "RuntimeError: Connection closed by peer")
    said = _first_failure(failed(r0=1, r1=1), directory)
    assert said == ("rank 1 (local rank 1, pid 101) exited with code 1 (the first failure: "
                    "RuntimeError: injected failure on rank 1)")
    # Rank 0 stopped by the agent's SIGTERM after recording its (second) failure: still rank 1.
    assert _first_failure(failed(r0=-signal.SIGTERM, r1=1), directory).startswith("rank 1 ")
    # Rank 1 raised first, but was still exiting when the agent stopped the others: its
    # exception, not the SIGTERM, is how it failed.
    assert _first_failure(failed(r0=1, r1=-signal.SIGTERM), directory) == (
        "rank 1 (local rank 1, pid 101) raised, and was stopped by the launcher's SIGTERM "
        "while exiting (the first failure: RuntimeError: injected failure on rank 1)")
    # Rank 2 was SIGKILLed (no record): the peers' exceptions are its consequence.
    said = _first_failure(failed(r0=1, r1=1, r2=-signal.SIGKILL), directory)
    assert said.startswith("rank 2 (local rank 2, pid 102) was killed by signal SIGKILL")


# -- rank death -------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie is dead
    except FileNotFoundError:
        return True
    except OSError:
        return True


# From a rank's death to the launcher's exit: the watchdogs poll every 0.1 s, a stopped rank
# gets 2 s (Fabric) / 5 s (torchelastic's shutdown timeout) after SIGTERM, and the rest is
# dying processes tearing down on a loaded machine.
_ENDS_WITHIN_S = 20.0


def _launch_and_kill(tmp_path: Path, launcher: str, fail_rank: int, how: str) -> str:
    pids = tmp_path / "pids"
    pids.mkdir()
    args = [str(SCRIPT), "--fail-rank", str(fail_rank), "--fail-how", how, "--fail-step", "1",
            "--pids-dir", str(pids)]
    if launcher == "run":  # Lightning's Fabric under a launcher: devices given, as under torchrun
        cmd = [*FULLSHARD, "run", "--nproc-per-node", "2", *args, "--devices", "2"]
    else:
        cmd = [sys.executable, *args, "--devices", "2"]
    tmp = tmp_path / "tmp"  # the launch's temporary files, to check that none is left over
    tmp.mkdir()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # generous: starting Python, torch and the ranks is slow on a loaded machine
        out = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    ended = time.time()
    assert proc.returncode != 0, out[-3000:]
    # Timed from the death itself (the failing rank wrote the time just before it), not from
    # the start: start-up time is not what this bounds.
    died = pids / "failed-at"
    assert died.exists(), f"no rank reached the failure\n{out[-3000:]}"
    elapsed = ended - float(died.read_text())
    assert elapsed < _ENDS_WITHIN_S, f"took {elapsed:.1f}s after the death\n{out[-3000:]}"
    recorded = [int(p.read_text()) for p in pids.glob("rank*.pid")]
    assert len(recorded) == 2, out[-3000:]
    deadline = time.monotonic() + 5  # the launcher has exited; its children must be gone too
    while not all(_gone(p) for p in recorded) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in recorded), f"left running: {recorded}\n{out[-3000:]}"
    assert not list(tmp.glob("fullshard-failures-*")), "the failure records were left behind"
    return out


@pytest.mark.parametrize(
    "launcher, how, expected",
    [
        # Exited, or still exiting when the agent stopped the other ranks (a race under load).
        ("run", "raise", r"rank 1 \(local rank 1, pid \d+\) (exited with code 1|raised, and was "
                         r"stopped by the launcher's SIGTERM while exiting) \(the first "
                         r"failure: RuntimeError: injected failure on rank 1\)"),
        ("run", "sigkill", r"rank 1 \(local rank 1, pid \d+\) was killed by signal SIGKILL"),
        ("fabric", "raise", r"rank 1 \(local rank 1, pid \d+\) exited with code 1"),
        ("fabric", "sigkill", r"rank 1 \(local rank 1, pid \d+\) was killed by signal SIGKILL"),
        ("fabric", "exit", r"rank 1 \(local rank 1, pid \d+\) exited with code 3"),
    ],
    ids=["run-raise", "run-sigkill", "fabric-raise", "fabric-sigkill", "fabric-os_exit"],
)
def test_a_dead_rank_ends_the_launch(tmp_path: Path, launcher, how, expected) -> None:
    import re

    out = _launch_and_kill(tmp_path, launcher, 1, how)
    assert re.search(expected, out), out[-3000:]
    if how == "raise":
        assert "injected failure on rank 1" in out


def test_fabric_rank0_failing_ends_its_children(tmp_path: Path) -> None:
    out = _launch_and_kill(tmp_path, "fabric", 0, "raise")
    assert "rank 0 (local rank 0" in out and "injected failure on rank 0" in out


def test_launch_from_an_interactive_process_says_how() -> None:
    code = (
        "import lightning as L, fullshard\n"
        "L.Fabric(accelerator='cpu', strategy=fullshard.FSDPStrategy(), devices=2).launch()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "fullshard run --nproc-per-node" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "getppid"), reason="needs getppid")
def test_children_exit_when_rank0_is_sigkilled(tmp_path: Path) -> None:
    out = _launch_and_kill(tmp_path, "fabric", 0, "sigkill")
    assert "the launching process (local rank 0" in out or "Connection" in out


def test_a_sigkilled_fullshard_run_takes_its_workers_with_it(tmp_path: Path) -> None:
    """torchelastic starts the workers in sessions of their own: without fullshard's
    parent-death watch they trained on after their launcher was SIGKILLed. A plain `fsdp()`
    script (not Fabric) gets it too."""
    import signal

    pids = tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen(
        [*FULLSHARD, "run", "--nproc-per-node", "2", str(ROOT / "tests/distributed/"
         "plain_fsdp_loop.py"), "--pids-dir", str(pids)],
        # TMPDIR: the killed launcher's failure records stay here (the next launch removes them)
        cwd=ROOT, env={**child_env(), "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(pids.glob("rank*.pid"))) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        workers = [int(p.read_text()) for p in pids.glob("rank*.pid")]
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        while not all(_gone(p) for p in workers) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        left = [p for p in workers if not _gone(p)]
    finally:
        for pid in [int(p.read_text()) for p in pids.glob("rank*.pid")]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert not left, f"workers {left} still running 10 s after their launcher was SIGKILLed"


_ENDING_WHILE_MAIN_EXITS = """
import atexit, os, sys, threading, time
from fullshard.launch import failure_records, subprocess_script
from fullshard.launch.subprocess_script import SubprocessScriptLauncher

launcher = SubprocessScriptLauncher(None, num_processes=2, num_nodes=1)
launcher._failure_dir = failure_records.make_failure_directory()
print(launcher._failure_dir, flush=True)
# The watchdog ends the launch; stopping its children takes a while (their SIGTERM grace).
launcher._stop_children = lambda: time.sleep(1.0)
atexit.register(launcher._at_exit)
threading.Thread(target=launcher._end, args=("ending the launch", 3), daemon=True).start()
time.sleep(0.2)
# ...and the main thread reaches its end meanwhile.
"""


def test_the_main_thread_lets_an_ending_watchdog_finish(tmp_path: Path) -> None:
    """Rank 0's watchdog ends the launch (report, stop the children, remove the failure
    records, `os._exit`) while the main thread runs out: the interpreter must not finalize
    under it, which froze the daemon thread midway (launches under load ended with no reason
    printed, or left an empty records directory behind)."""
    proc = subprocess.run([sys.executable, "-c", _ENDING_WHILE_MAIN_EXITS], cwd=ROOT,
                          env={**child_env(), "TMPDIR": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    directory = Path(proc.stdout.splitlines()[0])
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "fullshard: ending the launch" in proc.stderr
    assert not directory.exists(), "the failure records were left behind"


_NODE_BACKSTOP = """
import os, sys, types
from fullshard.launch import failure_records
from fullshard.launch.node_heartbeat import _NodeHeartbeat

failure_records.make_failure_directory()
failure_records.record_failure(1, 0, "SilentRank: the store has not answered for 11 s")
_NodeHeartbeat._fail(types.SimpleNamespace(me=1), "the job's store has not answered for 15 s")
"""


def test_the_node_backstop_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    """When the launchers' heartbeat ends the job (torchelastic's agent blocked on a silent
    store and never reported its failed rank), the launcher still names that rank, as its
    report would (a cut store host left only the node's line, seen under load in CI), and
    removes the node's failure records before it exits (its `os._exit` skips the launcher's
    cleanup: every backstop left a `fullshard-failures-*` directory in /tmp)."""
    proc = subprocess.run([sys.executable, "-c", _NODE_BACKSTOP], cwd=ROOT,
                          env={**child_env(), "TMPDIR": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"fullshard run: rank 1 \(local rank 0, pid \d+\) failed with SilentRank: "
                     r"the store has not answered for 11 s \(the first failure on this node\)",
                     proc.stderr), proc.stderr[-2000:]
    assert "fullshard run: node 1 is stopping the job: the job's store" in proc.stderr
    assert not list(tmp_path.glob("fullshard-failures-*")), "the failure records were left behind"
