"""The launchers' heartbeat: on several nodes, a node that stops answering ends the job within
a bound even where no rank's heartbeat runs.

The ranks' heartbeat (`heartbeat.py`) starts only once a rank has its process group. Under
`fullshard run --max-restarts K` a cut link hangs between attempts:
the ranks of attempt 0 fail within the bound, but then torchelastic's agent on the cut-off node
blocks in its rendezvous' store ops (600 s), and the restarted ranks of the other nodes block
in `init_process_group`, waiting for peers that never come (gloo's 30 minutes). The agents
live across attempts, so they beat too: every `fullshard run` of a multi-node job joins the
job's store (the static rendezvous' TCPStore on node 0) with a connection of its own and runs
a `silence.Heartbeat` there as member `node` of `nnodes`, under `fullshard/node-heartbeat/`:

- node 0's launcher watches every node's counter, the others watch node 0's and read node 0's
  verdict: whichever finds a node (or the store's host) silent prints why, kills this node's
  workers (each is a session of its own, and a restarted one still in `init_process_group` has
  not asked to die with its parent yet) and exits with status 1;
- the bound is the ranks' silence bound plus `LAUNCHER_GRACE_S`, so where the ranks' heartbeat
  runs, its verdict, which names the silent rank, comes first; the launchers' is the backstop;
- a node's counter is judged only once it has moved; a launcher marks itself done when its
  torchrun returns, so a node that finished (or failed and reported) is never called silent,
  and a store that refuses connections belongs to node 0's launcher, which has ended: the
  heartbeat then just stops.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from datetime import timedelta

from fullshard.launch import failure_records
from fullshard.launch.heartbeat import SILENCE_VAR, Heartbeat

LAUNCHER_GRACE_S = 5.0
_PREFIX = "fullshard/node-heartbeat/"
_CONNECT_S = 2.0  # one try to reach the store; node 0's launcher may not have made it yet


class _NodeHeartbeat(Heartbeat):
    noun = "node"
    thread_name = "fullshard-node-heartbeat"

    def _fail(self, verdict: str) -> None:
        # A rank of this node may have failed first (its own heartbeat's verdict comes within
        # the ranks' bound) while torchelastic's agent, blocked on the silent store, never got
        # to report it: name it as the launcher's report would.
        first = failure_records.first_failure(os.environ.get(failure_records.FAILURE_DIR_VAR))
        if first is not None:
            sys.stderr.write(f"fullshard run: rank {first.rank} (local rank {first.local_rank}, "
                             f"pid {first.pid}) failed with {first.error} (the first failure "
                             f"on this node).\n")
        sys.stderr.write(f"fullshard run: node {self.me} is stopping the job: {verdict}; "
                         f"this node's ranks were killed.\n")
        sys.stderr.flush()
        kill_children()
        # os._exit skips the launcher's `finally`, which removes this node's failure records
        failure_records.remove_failure_directory(os.environ.get(failure_records.FAILURE_DIR_VAR))
        os._exit(1)


def kill_children() -> None:
    """SIGKILL this process's children and their sessions (Linux; elsewhere nothing: a worker
    watches its launcher itself, `worker_entry.py`)."""
    me = os.getpid()
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid != me:
            continue
        try:
            if os.getpgid(pid) == pid:  # torchelastic's worker: its own session and group
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class NodeWatch:
    """This launcher's heartbeat, started at once in the background (it connects to the
    store as soon as node 0's launcher has made it); `stop()` when torchrun returns."""

    def __init__(self, addr: str, port: int, node: int, nnodes: int, bound: float) -> None:
        self.addr, self.port, self.node, self.nnodes = addr, port, node, nnodes
        self.bound = bound + LAUNCHER_GRACE_S
        self.said_bound = f"silence bound {bound:g} s + {LAUNCHER_GRACE_S:g} s, {SILENCE_VAR}"
        self._stopped = threading.Event()
        self._beat: Heartbeat | None = None
        self._lock = threading.Lock()
        self._connector = threading.Thread(target=self._connect, daemon=True,
                                           name="fullshard-node-heartbeat-connect")
        self._connector.start()

    def _connect(self) -> None:
        import torch.distributed as dist

        while not self._stopped.is_set():
            try:
                # A bare TCP connection first: a TCPStore client that times out on a port
                # nobody listens on yet logs a C++ stack trace into the user's output.
                socket.create_connection((self.addr, self.port), timeout=_CONNECT_S).close()
                store = dist.TCPStore(self.addr, self.port, is_master=False,
                                      timeout=timedelta(seconds=_CONNECT_S))
                break
            except Exception:  # noqa: BLE001 - not up yet (or never: torchrun says so)
                self._stopped.wait(0.5)
        else:
            return
        store.set_timeout(timedelta(seconds=max(1.0, min(self.bound / 4, 10.0))))
        beat = _NodeHeartbeat(
            dist.PrefixStore(_PREFIX, store), self.node, self.nnodes, self.bound,
            me_said=f"node {self.node} (host {socket.gethostname()}, launcher pid "
                    f"{os.getpid()})",
            store_said=f"the job's store at {self.addr}:{self.port} (node 0's launcher)",
            bound_said=self.said_bound)
        with self._lock:
            if self._stopped.is_set():
                return
            self._beat = beat
            beat.start()

    def stop(self) -> None:
        """This launcher is done (its workers ended, or failed and were reported): tell the
        other nodes, and stop the threads."""
        with self._lock:
            self._stopped.set()
            beat, self._beat = self._beat, None
        if beat is not None:
            beat.stopped.set()  # no verdict from here on
            # Saying "done" is a store op, and one to a host that is cut off can block past
            # the store's timeout: it gets `_CONNECT_S`, on a daemon thread left behind.
            done = threading.Thread(target=beat.stop, args=(True,), daemon=True,
                                    name="fullshard-node-heartbeat-done")
            done.start()
            done.join(timeout=_CONNECT_S)
        self._connector.join(timeout=_CONNECT_S + 1)


def watch_nodes(addr: str | None, port: str | None, node: int, nnodes: int,
                bound: float) -> NodeWatch | None:
    """The launchers' heartbeat for a job of several nodes; None on one node, without the
    store's address, or with the bound 0 (detection off)."""
    if nnodes < 2 or not addr or not port or bound <= 0:
        return None
    return NodeWatch(addr, int(port), node, nnodes, bound)
