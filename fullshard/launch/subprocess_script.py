"""`Fabric.launch()` from a plain `python script.py`: this process becomes local rank 0 and
starts local ranks 1..N-1 as subprocesses running the same command (as Lightning's
`_SubprocessScriptLauncher` does). The children find `LOCAL_RANK` in their environment and do
not launch again.

Rank death (docs/architecture.md, invariant 6: a dead rank makes the others fail within
seconds, not after the 30-minute collective timeout):

- rank 0 runs a watchdog thread polling its children; when one exits non-zero (an exception,
  `os._exit`, a signal such as SIGKILL) it prints which rank failed and how, ends the other
  children (SIGTERM, then SIGKILL) and exits the whole launch with status 1;
- when rank 0 itself fails, its exit handler names it (or a child that failed first, whose
  death is what usually makes rank 0 fail: the ranks' failure records, `failure_records.py`, say
  which came first) and ends the children before exiting;
- every child polls its parent: if rank 0 disappears (even SIGKILLed, when no handler can
  run), the child says so and exits at once; a worker of `fullshard run` dies with that
  launcher too (`_die_with_agent`);
- every rank runs a heartbeat (`heartbeat.py`): a rank that stops answering without dying
  (SIGSTOP, a cut link) makes the others fail within a bound, naming it;
- a rank that fails posts its failure on the failure board (`failure_board.py`); across nodes, a
  rank that merely lost its connection to a dead peer waits a moment for the board to name
  the cause, and says it;
- at a normal end rank 0 waits for its children and exits non-zero if any of them failed.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch.distributed as dist

from fullshard.distributed.comm import Group, barrier
from fullshard.launch import failure_board, failure_records
from fullshard.launch.environment import ClusterEnvironment
from fullshard.launch.heartbeat import start_heartbeat, stop_heartbeat

_PARENT_PID_VAR = "FULLSHARD_LAUNCHER_PID"
AGENT_PID_VAR = "FULLSHARD_AGENT_PID"  # set by `fullshard run` for its workers
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.1
_TERM_GRACE_S = 2.0
# How long a failing rank 0 waits for the exit code of a child it knows failed first (from
# the child's failure record): that child is already dying, but interpreter shutdown can take
# seconds on a loaded machine.
_FAILED_CHILD_EXIT_S = 10.0
_END_WAIT_S = 10.0
"""How long, beyond the children's grace, a thread waits for another one ending the launch."""


def describe_exit(code: int) -> str:
    """`exited with code 3` / `was killed by signal SIGKILL`."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"exited with code {code}"


def install_rank_hooks(global_rank: int | None = None, local_rank: int | None = None) -> None:
    """Name this rank when it dies of an uncaught exception; in a child of our launcher, also
    exit as soon as the launching process (rank 0, or `fullshard run`) is gone; open the
    failure board (`failure_board.py`) and start the heartbeat (`heartbeat.py`), which live in
    the process group's store: at once if the group exists, else as soon as it does.
    Idempotent. The ranks default to the process group's and `LOCAL_RANK`.

    `fullshard run` (`worker_entry.py`) and `FSDPStrategy` install these in their ranks;
    `fsdp()` does not. A script started any other way (plain torchrun, SLURM) may call this
    after `init_process_group` to get the heartbeat and failure records."""
    global _HOOKED_RANK
    if _HOOKED_RANK is not None:
        return
    if global_rank is None:
        global_rank = dist.get_rank()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    _HOOKED_RANK = (global_rank, local_rank)
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _FAILED
        _FAILED = True
        first = None
        cause = failure_board.brief(short(exc))
        if exc_type is not KeyboardInterrupt:  # first, before the slow traceback printing
            failure_board.post_own_failure(global_rank, local_rank, "raised", cause)
            if failure_board.spans_nodes() and failure_board.looks_like_lost_peer(cause):
                # A consequence: wait a moment for the board to name the cause (a rank of
                # another node, posted by itself or, killed by a signal, by its launcher).
                first = failure_board.wait_for_cause(global_rank)
            if _launcher_gone():  # nobody will read a record: leave no directory behind
                failure_records.remove_failure_directory(os.environ.get(failure_records.FAILURE_DIR_VAR))
            else:
                failure_records.record_failure(global_rank, local_rank, cause,
                                        first=first.describe() if first else "")
        previous(exc_type, exc, tb)
        if exc_type is not KeyboardInterrupt and not _LAUNCHING_PARENT:
            after = f", after {first.describe()} (the first failure)" if first else ""
            failure_records.say_last_words(
                f"rank {global_rank} (local rank {local_rank}, pid {os.getpid()}) failed with "
                f"{cause}{after}"
            )

    sys.excepthook = hook
    parent = os.environ.get(_PARENT_PID_VAR)
    if parent and parent.isdigit() and int(parent) != os.getpid():
        WatchThread(_watch_parent, int(parent), global_rank,
                    f"the launching process (local rank 0, pid {parent})",
                    name="fullshard-parent-watch").start()
    agent = os.environ.get(AGENT_PID_VAR)
    if agent and agent.isdigit() and int(agent) == os.getppid():
        _die_with_agent(int(agent), global_rank)
    if dist.is_available() and dist.is_initialized():
        _open_board_and_beat(global_rank, local_rank)
    else:  # `fullshard run`'s worker, before its script creates the process group
        WatchThread(_when_group_exists, global_rank, local_rank, name="fullshard-group-watch"
                    ).start()


def _open_board_and_beat(global_rank: int, local_rank: int) -> None:
    failure_board.open_board()
    start_heartbeat(global_rank, local_rank)


def _when_group_exists(global_rank: int, local_rank: int, stopped: threading.Event) -> None:
    while not stopped.wait(_POLL_S):
        if dist.is_available() and dist.is_initialized():
            _open_board_and_beat(global_rank, local_rank)
            return


class WatchThread(threading.Thread):
    """A daemon thread running `target(*args, stopped)` (`stopped`: a `threading.Event` it
    polls), with `stop()`: set it and join. `FSDPStrategy.teardown` stops every live one, so
    no watch thread outlives the run that started it (Lightning's test fixtures call `stop()`
    on left-over daemon threads and then require them to be gone)."""

    live: ClassVar[list[WatchThread]] = []

    def __init__(self, target: Callable[..., None], *args: Any, name: str) -> None:
        self.stopped = threading.Event()
        super().__init__(target=target, args=(*args, self.stopped), daemon=True, name=name)
        WatchThread.live.append(self)

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout)
        if self in WatchThread.live:
            WatchThread.live.remove(self)


def stop_watch_threads() -> None:
    """Stop and join every watch thread of this process (the run is over)."""
    for thread in list(WatchThread.live):
        thread.stop()


_HOOKED_RANK: tuple[int, int] | None = None
_LAUNCHING_PARENT = False  # this process started local ranks: its launcher reports failures
_FAILED = False


def rank_failed() -> bool:
    """Whether this rank is exiting because of an uncaught exception."""
    return _FAILED


def launcher_ends_this_process() -> bool:
    """Whether this is a failing rank 0 of `Fabric.launch()`: its exit handler names the
    failure, ends the children and leaves with `os._exit`, so nothing else should run first.
    (Tearing the process group down before it would kill the children first -- they lose
    their peer -- and the report would name a child instead of rank 0.)"""
    return _FAILED and _LAUNCHING_PARENT


def destroy_process_group_at_exit() -> None:
    """An `atexit` handler for a group fullshard initialized. At a normal exit: wait for every
    rank, then tear the group down, so no rank closes its connections while a peer still
    talks to it. After a failure: just tear down."""
    if not (dist.is_available() and dist.is_initialized()) or launcher_ends_this_process():
        return
    try:
        if not rank_failed():
            barrier(Group.from_process_group(None))
    except Exception:  # noqa: BLE001 - a peer is gone; nothing left to wait for
        pass
    stop_heartbeat()  # after the barrier: a peer silent in it is still detected
    # Free finished Works and the tensors they hold while the interpreter can still take
    # them: freed by gloo's threads during finalization, they abort the process.
    gc.collect()
    dist.destroy_process_group()


def short(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _launcher_gone() -> bool:
    """Whether this is a child of our launcher whose launching process has died."""
    parent = os.environ.get(_PARENT_PID_VAR)
    return bool(parent and parent.isdigit() and int(parent) != os.getpid()
                and os.getppid() != int(parent))


def _die_with_agent(agent_pid: int, global_rank: int) -> None:
    """A worker of `fullshard run`: die with the launcher even if it is SIGKILLed (torchelastic
    starts the workers in sessions of their own, so nothing else would end them). On Linux the
    kernel does it (`PR_SET_PDEATHSIG`, no thread); elsewhere a thread polls the parent."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != agent_pid:  # it died before the call took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    WatchThread(_watch_parent, agent_pid, global_rank,
                f"the fullshard run launcher (pid {agent_pid})",
                name="fullshard-parent-watch").start()


def _watch_parent(parent_pid: int, global_rank: int, who: str, stopped: threading.Event) -> None:
    while not stopped.is_set():
        if os.getppid() != parent_pid:
            failure_records.say_last_words(
                f"rank {global_rank} (pid {os.getpid()}): {who} is gone; exiting.")
            # A SIGKILLed launcher cleaned nothing up; its failure records have no reader.
            failure_records.remove_failure_directory(os.environ.get(failure_records.FAILURE_DIR_VAR))
            os._exit(1)
        stopped.wait(_POLL_S)


class SubprocessScriptLauncher:
    """Starts the local ranks 1..N-1 of this node by re-running the current command."""

    is_interactive_compatible = False

    def __init__(
        self, cluster_environment: ClusterEnvironment, *, num_processes: int, num_nodes: int
    ) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.children: list[tuple[int, subprocess.Popen]] = []  # (local rank, process)
        self._lock = threading.Lock()
        self._ending = False
        self._rank0_failed: tuple[type[BaseException], BaseException] | None = None
        self._rank0_failed_at = 0.0
        self._failure_dir: str | None = None

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the other local ranks (unless something else already did), then run
        `fn(*args, **kwargs)` in this process."""
        env = self.cluster_environment
        if not env.creates_processes_externally and self.num_processes * self.num_nodes > 1:
            self._start_children()
        return fn(*args, **kwargs)

    # -- parent side ------------------------------------------------------------------------
    def _global_rank(self, local_rank: int) -> int:
        return self.cluster_environment.node_rank() * self.num_processes + local_rank

    def _start_children(self) -> None:
        env = self.cluster_environment
        world = self.num_processes * self.num_nodes
        if self.num_nodes > 1 and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise RuntimeError(
                f"Fabric(num_nodes={self.num_nodes}).launch() from a plain process needs "
                f"MASTER_ADDR and MASTER_PORT (node 0's address and a free port) and NODE_RANK "
                f"in the environment of every node; or start each node with `fullshard run "
                f"--nnodes {self.num_nodes} --node-rank K --master-addr A --master-port P`."
            )
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            WORLD_SIZE=str(world),
        )
        # Only the children get these: set in this process they would outlive the run (Lightning's
        # test fixtures flag them). Rank 0 reads LOCAL_WORLD_SIZE's default, WORLD_SIZE, which is
        # right on one node; nobody reads rank 0's own failure record (the launcher knows it).
        per_node = {"LOCAL_WORLD_SIZE": str(self.num_processes)}
        if self.num_nodes > 1:
            os.environ.update(per_node)
        command = _current_command()
        self._failure_dir = failure_records.make_failure_directory(export=False)
        for local_rank in range(1, self.num_processes):
            child_env = dict(os.environ)
            child_env.update(
                LOCAL_RANK=str(local_rank),
                RANK=str(self._global_rank(local_rank)),
                **per_node,
                **{_PARENT_PID_VAR: str(os.getpid()),
                   failure_records.FAILURE_DIR_VAR: self._failure_dir},
            )
            proc = subprocess.Popen(command, env=child_env)
            self.children.append((local_rank, proc))
        os.environ.update(LOCAL_RANK="0", RANK=str(self._global_rank(0)))
        global _LAUNCHING_PARENT
        _LAUNCHING_PARENT = True
        WatchThread(self._watchdog, name="fullshard-watchdog").start()
        previous = sys.excepthook

        def note_failure(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            self._rank0_failed = (exc_type, exc)
            self._rank0_failed_at = time.time()
            previous(exc_type, exc, tb)

        sys.excepthook = note_failure
        atexit.register(self._at_exit)

    def _failed_child(self) -> tuple[int, subprocess.Popen, int] | None:
        for local_rank, proc in self.children:
            code = proc.poll()
            if code is not None and code != 0:
                return local_rank, proc, code
        return None

    def _watchdog(self, stopped: threading.Event) -> None:
        while not self._ending and not stopped.is_set():
            failed = self._failed_child()
            if failed is not None:
                local_rank, proc, code = failed
                self._end(
                    f"rank {self._global_rank(local_rank)} (local rank {local_rank}, pid "
                    f"{proc.pid}) {describe_exit(code)}; ending the other ranks."
                )
            if all(proc.poll() == 0 for _, proc in self.children):
                return  # every child finished cleanly: nothing left to watch
            stopped.wait(_POLL_S)

    def _end(self, message: str, status: int = 1) -> None:
        """Report, end every child, exit this process. Runs once: a second caller waits for
        the first's exit (`_await_end`) instead of returning."""
        with self._lock:
            first = not self._ending
            self._ending = True
        if not first:
            self._await_end(status)
        failure_records.say_last_words(message)
        self._stop_children()
        failure_records.remove_failure_directory(self._failure_dir)
        os._exit(status)

    def _stop_children(self) -> None:
        alive = [p for _, p in self.children if p.poll() is None]
        for p in alive:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _TERM_GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _child_that_failed_first(self) -> tuple[int, subprocess.Popen, str] | None:
        """When rank 0 has failed: a child that failed before it, with how it ended, if any.

        Rank 0 often fails *because* a child died (its collective broke). A child whose
        failure record is older than rank 0's failure is named; it is already dying, so its
        exit code is awaited for up to `_FAILED_CHILD_EXIT_S`. A child that left no record
        (killed by a signal, `os._exit`) is named if it has exited non-zero within a moment."""
        by_rank = {self._global_rank(local_rank): (local_rank, proc)
                   for local_rank, proc in self.children}
        record = failure_records.first_failure(self._failure_dir, among=by_rank)
        if record is not None and record.time <= self._rank0_failed_at:
            local_rank, proc = by_rank[record.rank]
            try:
                code = proc.wait(timeout=_FAILED_CHILD_EXIT_S)
            except subprocess.TimeoutExpired:
                return local_rank, proc, f"failed with {record.error}"
            return local_rank, proc, f"{describe_exit(code)} ({record.error})"
        deadline = time.monotonic() + 1.0
        failed = self._failed_child()
        while failed is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            failed = self._failed_child()
        if failed is None:
            return None
        local_rank, proc, code = failed
        return local_rank, proc, describe_exit(code)

    def _await_end(self, status: int) -> None:
        """Wait while another thread ends the launch (`_end`, which leaves with `os._exit`).

        The main thread must not go on to finalize the interpreter meanwhile: a daemon thread
        that next needs the GIL after finalization began is frozen for good, so the watchdog
        stopped halfway through its report or through removing the failure records (launches
        under load ended with no reason printed, or left an empty records directory). Past a
        bound the ending thread is taken as stuck, and this one finishes the job."""
        time.sleep(_TERM_GRACE_S + _END_WAIT_S)
        failure_records.remove_failure_directory(self._failure_dir)
        os._exit(status)

    def _at_exit(self) -> None:
        if self._ending:  # the watchdog is ending the launch: let it finish
            self._await_end(1)
        if self._rank0_failed is not None:
            rank0 = (
                f"rank {self._global_rank(0)} (local rank 0, pid {os.getpid()}) failed with "
                f"{short(self._rank0_failed[1])}"
            )
            failed = self._child_that_failed_first()
            if failed is not None:
                local_rank, proc, how = failed
                self._end(
                    f"rank {self._global_rank(local_rank)} (local rank {local_rank}, pid "
                    f"{proc.pid}) {how} first; then {rank0}. Ending the other ranks."
                )
            self._end(f"{rank0}; ending the other ranks.")
        # A normal end: wait for the children (the watchdog still ends everything on failure).
        for _, proc in self.children:
            proc.wait()
        failure_records.remove_failure_directory(self._failure_dir)
        failed = self._failed_child()
        if failed is not None:
            local_rank, proc, code = failed
            self._end(
                f"rank {self._global_rank(local_rank)} (local rank {local_rank}, pid "
                f"{proc.pid}) {describe_exit(code)}."
            )


def _current_command() -> list[str]:
    """The command that started this process, to start the other ranks with."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        name = spec.name
        if name.endswith(".__main__"):
            name = name[: -len(".__main__")]
        return [sys.executable, "-m", name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise RuntimeError(
            "Fabric.launch() starts the other ranks by re-running this script, but this process "
            "was not started from a script file (an interactive session or `python -c`). Run a "
            "script, or launch it with `fullshard run --nproc-per-node N script.py`."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]
