"""`fullshard run`: run a script on many processes through torch's elastic launcher.

We do not manage processes ourselves here: the arguments are translated to
`torch.distributed.run` (torchrun) and its `main` runs in this process. torchelastic starts
the local workers, sets `RANK` / `LOCAL_RANK` / `WORLD_SIZE` / `LOCAL_WORLD_SIZE` /
`GROUP_RANK` / `MASTER_ADDR` / `MASTER_PORT`, and when a worker fails it stops the others
(SIGTERM, then SIGKILL after the shutdown timeout) and prints which rank failed and how.
We pass `--max-restarts 0` and a short monitor interval so that happens within a fraction of
a second, and a short shutdown timeout so a stuck worker is killed within seconds.

One node: `--standalone` (a rendezvous on a free local port) unless a master port is given.
Several nodes: the static rendezvous at `--master-addr:--master-port`, one invocation per node
with its `--node-rank`. The rank named as the first failure is this node's earliest recorded
one (`fullshard.launch.failure_records`); on several nodes, the first real failure on the failure
board (`fullshard.launch.failure_board`) when it is another node's: each launcher posts there the
workers that died without a word (a signal), the workers post their own exceptions.

Restarts (`--max-restarts K`). torchelastic lets the workers share its rendezvous store and
keeps that store across attempts, so the process group of attempt 2 finds attempt 1's keys
(each rank's gloo address) already there: a new rank may read a dead rank's address and fail
with "connectFullMesh failed ... Connection refused", or wait forever. Two fixes, either
enough on its own:
- the launcher sets `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (unless the user set it): with the
  c10d rendezvous of `--standalone`, each attempt's rank 0 then hosts a fresh store;
- the static rendezvous (several nodes) always shares the agent's store, so fullshard's own
  process-group init (`FSDPStrategy` / `Fabric`) gives `init_process_group` that store under
  a per-attempt prefix (`attempt_store`). A plain script that calls `init_process_group`
  itself on several nodes keeps torch's behaviour.

Silence between attempts (several nodes): the ranks' heartbeat does not run while a restarted
attempt forms its process group, so the launchers beat too (`node_heartbeat.py`): a node cut off
before or during a restart ends the job within the silence bound plus a grace.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from fullshard.launch import failure_board, failure_records, heartbeat, node_heartbeat
from fullshard.launch.subprocess_script import AGENT_PID_VAR


def _torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {opt for action in get_args_parser()._actions for opt in action.option_strings}


def torchrun_argv(
    script: str,
    script_args: Sequence[str] = (),
    *,
    nproc_per_node: str | int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    shutdown_timeout: int = 5,
    module: bool = False,
) -> list[str]:
    """The `torch.distributed.run` arguments for these options (validated)."""
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
    if nnodes > 1 and master_port is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --master-addr and --master-port: the address and a free "
            f"port of the node with --node-rank 0, the same on every node."
        )
    if isinstance(nproc_per_node, int) and nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    argv = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}"]
    if "--shutdown-timeout" in _torchrun_options():
        argv.append(f"--shutdown-timeout={shutdown_timeout}")
    if nnodes == 1 and master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}",
                 f"--master-addr={master_addr}", f"--master-port={master_port}"]
    # Each worker installs the rank's hooks first, then runs the script (worker_entry.py).
    entry = ["--module", "fullshard.launch.worker_entry", *(["-m"] if module else [])]
    return [*argv, *entry, script, *script_args]


def run_with_torchrun(argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
    """Run `torch.distributed.run` with `argv` in this process; 0 on success, else 1 (torch
    has printed which rank failed and how, and we name the one that failed first). `env`:
    more variables for the workers. This process's environment is as before afterwards
    (torchrun and we set variables for the workers that would leak into a later run)."""
    saved = dict(os.environ)
    try:
        os.environ.update(env or {})
        return _run(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    directory = failure_records.make_failure_directory()  # the workers inherit it
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see the module doc
    os.environ[AGENT_PID_VAR] = str(os.getpid())  # the workers die with this process
    watch = node_heartbeat.watch_nodes(
        _option(argv, "--master-addr"), _option(argv, "--master-port"),
        int(_option(argv, "--node-rank") or 0), int(_option(argv, "--nnodes") or 1),
        heartbeat.silence_timeout())
    try:
        try:
            torchrun_main(list(argv))
        finally:
            if watch is not None:  # this node is done: the others must not call it silent
                watch.stop()
    except ChildFailedError as e:
        sys.stderr.write(f"{e}\n")
        remote = _first_failure_on_board(e, argv, directory)
        said = (f"{remote.describe()} (the first failure, on node {remote.node})"
                f"{_local_note(e)}"
                if remote is not None else _first_failure(e, directory))
        sys.stderr.write(f"fullshard run: {said}; the other ranks were stopped.\n")
        sys.stderr.flush()
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        failure_records.remove_failure_directory(directory)
    sys.stdout.flush()
    return 0


# How long a launcher whose ranks only lost a peer waits for the board to name the cause.
_BOARD_WAIT_S = 5.0


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name=value` among the launcher options of `argv` (before the script)."""
    for arg in argv:
        if not arg.startswith("--"):
            return None
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def _first_failure_on_board(error: Any, argv: Sequence[str], directory: str) -> Any | None:
    """Several nodes: post this node's workers that died without a word on the failure board
    (`failure_board.py`), and return the board's first failure when it is a real one of another
    node (a rank of this node that failed first is named by `_first_failure`). With node 0's
    launcher gone, the board is unreachable: then what this node's ranks learned from it
    (their records' `first`) is all there is, and `_first_failure` says that."""
    nnodes, node = int(_option(argv, "--nnodes") or 1), int(_option(argv, "--node-rank") or 0)
    addr, port = _option(argv, "--master-addr"), _option(argv, "--master-port")
    if nnodes < 2 or not addr or not port:
        return None
    records = failure_records.read_failures(directory)
    mute = [r for r, f in error.failures.items()
            if r not in records and f.exitcode != -signal.SIGTERM]
    if node != 0 and not mute and any(rec.first for rec in records.values()):
        return None  # nothing to post, and this node's ranks learned the cause already
    # torchelastic raises ChildFailedError only once the restarts are spent: the failing
    # attempt is the last one, number --max-restarts.
    found = failure_board.launcher_board(addr, int(port), int(_option(argv, "--max-restarts") or 0))
    if found is None:
        return None
    first = failure_board.first_posted(failure_board.publish_for_workers(found, error, node=node))
    deadline = time.monotonic() + _BOARD_WAIT_S
    while (first is None or first.consequence) and time.monotonic() < deadline:
        time.sleep(0.2)  # the cause's launcher may not have posted yet
        try:
            first = failure_board.first_posted(found.read())
        except Exception:  # noqa: BLE001 - node 0's store is gone
            break
    if first is None or first.consequence or first.node == node:
        return None
    return first


def _local_note(error: Any) -> str:
    """`; here rank R (local rank L, pid P) exited with code 1`: this node's own failure."""
    rank, failure = min(error.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return f"; here rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) " + (
        f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0
        else f"exited with code {failure.exitcode}")


def _first_failure(error: Any, directory: str) -> str:
    """`rank R (local rank L, pid P) exited with code C (the first failure...)`.

    torchelastic's own pick (`get_first_failure`) orders by one-second timestamps, and ties go
    to the lowest rank: usually rank 0, which failed only because the real first failure
    closed its connection. So:
    - a rank that died without an exception (killed by a signal, `os._exit`) and not by the
      agent's SIGTERM, which only stops the others after a failure, left no record to order
      it by, and an exception in a peer at the same time is most likely its consequence: the
      earliest of those by torchelastic's timestamps is named;
    - otherwise the earliest failure record (sub-second times) is named;
    - with neither, torchelastic's pick stands."""
    records = failure_records.read_failures(directory)
    silent = {rank: f for rank, f in error.failures.items()
              if rank not in records and f.exitcode != -signal.SIGTERM}
    recorded = [records[rank] for rank in error.failures if rank in records]
    cause = ""
    if silent:
        rank = min(silent, key=lambda r: (silent[r].timestamp, r))
    elif recorded:
        first = min(recorded, key=lambda rec: rec.time)
        rank, cause = first.rank, f": {first.error}"
        learned = [rec.first for rec in recorded if rec.first]
        # it lost a peer of another node, and the board named that peer's failure
        if learned and (first.first or failure_board.looks_like_lost_peer(first.error)):
            return f"{learned[0]} (the first failure, on another node){_local_note(error)}"
    else:
        rank, _ = error.get_first_failure()
    failure = error.failures[rank]
    code = failure.exitcode
    if code == -signal.SIGTERM and rank in records:
        # It raised first, and the agent's SIGTERM to the others reached it while it was
        # still exiting (interpreter shutdown takes seconds under load): the signal is not
        # how it failed.
        how = "raised, and was stopped by the launcher's SIGTERM while exiting"
    elif code < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with code {code}"
    return (f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how} "
            f"(the first failure{cause})")


def attempt_store(timeout: timedelta) -> Any | None:
    """For a worker of torchelastic that shares the agent's store (the static rendezvous):
    that store under a prefix naming this attempt, for `init_process_group(store=...)`, so a
    restarted attempt never reads the previous attempt's keys. None anywhere else (then
    `init_process_group` makes its store from the environment as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fullshard/attempt-{attempt}/", store)
