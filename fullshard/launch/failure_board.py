"""The failure board: failures published in the job's store, so every rank and every node's
launcher can name the first real failure, not just the ones on its own host.

A rank's failure record (`failure_records.py`) is a file its own launcher reads: across hosts, the
survivors see only gloo's "Connection reset by peer" and node 0's launcher named its own rank
0 as the first failure. So failures are also posted in the store every rank already reaches:

- a rank that raises posts `failure/<n>` (rank, host, pid, time, cause) from its excepthook,
  before the slow traceback printing; a rank that stops the job for a silent peer does too;
- a rank killed by a signal posts nothing, so the launcher of its node posts for it
  (`fullshard run` on several nodes: `publish_for_workers`), from torchelastic's report;
- every rank's heartbeat reads the board each second and stops at once, naming the failure,
  so a survivor stuck in a collective does not wait for the silence bound;
- a rank whose own exception is a lost connection to a peer (a consequence) waits a moment
  for the board to name the cause (`wait_for_cause`), and its record carries that cause, so
  its launcher's report names the real first failure.

Where: the root of the process group's store (below torch's and fullshard's key prefixes),
under `fullshard/failures/attempt-<restart>/`. With `fullshard run --nnodes > 1` that root is
the agent store at MASTER_ADDR:MASTER_PORT, which every node's launcher reaches too; on one
node the launcher sees every worker itself. Best effort throughout: a board that cannot be
reached changes nothing else.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

_ROOT_PREFIX = "fullshard/failures/"
_STORE_TIMEOUT_S = 2.0
# The longest any board operation may take. TCPStore's own timeout does not bound every op
# to a host that is cut off (the op can sit in a send or a reconnect), and a rank must never
# hang on the board while it is on its way out: each op runs on a daemon thread, given up
# after this long.
_OP_LIMIT_S = _STORE_TIMEOUT_S + 1.0
# How long a rank that lost a peer waits for the board to name the cause before it exits.
CAUSE_WAIT_S = 8.0

# gloo's and torch's words for a connection to a peer that went away: such an exception is
# the consequence of a failure elsewhere, not a cause.
_LOST_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused",
                    "socket closed", "end of file", "connection timed out")


def brief(cause: str) -> str:
    """gloo's lost-peer message cut to its point: `RuntimeError: Read error [10.0.0.2]:4242:
    Connection reset by peer` (no source path, no advice)."""
    text = re.sub(r"\[[^\]\s]*\.(cc|cpp|h):\d+\]\s*", "", cause)
    return text.split(". This is typically")[0]


def looks_like_lost_peer(error: str) -> bool:
    text = error.lower()
    return any(w in text for w in _LOST_PEER_WORDS)


@dataclass(frozen=True)
class Posted:
    """One failure on the board. `how`: `raised` (an exception, `cause` its first line),
    `signal` (`cause`: the signal's name), `exit` (`cause`: `exit code C`), `stopped` (a rank
    that stopped the job for another's silence)."""

    rank: int
    local_rank: int
    host: str
    pid: int
    time: float
    how: str
    cause: str
    node: int = -1

    @property
    def consequence(self) -> bool:
        """A failure caused by another one: a lost peer or a stop for another's silence."""
        return self.how == "stopped" or (self.how == "raised" and looks_like_lost_peer(self.cause))

    def describe(self) -> str:
        """`rank R (local rank L, host H, pid P) was killed by signal SIGKILL` / `failed with
        CAUSE` / `exited with code C`."""
        where = f"rank {self.rank} (local rank {self.local_rank}, host {self.host}, pid {self.pid})"
        if self.how == "signal":
            return f"{where} was killed by signal {self.cause}"
        if self.how == "exit":
            return f"{where} exited with {self.cause}"
        return f"{where} failed with {self.cause}"


def first_posted(posted: list[Posted], *, besides: int | None = None) -> Posted | None:
    """The first real failure: an exception that is not a lost peer (earliest), else a death
    by signal or exit code (earliest), else the earliest consequence. `besides`: skip that
    rank's own posts."""
    posted = [p for p in posted if p.rank != besides]
    order = {"raised": 0, "signal": 1, "exit": 1, "stopped": 2}
    return min(posted, key=lambda p: (2 if p.consequence else order[p.how], p.time),
               default=None)


def _root(store: Any) -> Any:
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"


class Board:
    """A connection to this attempt's board (one per thread that uses it)."""

    def __init__(self, store: Any, attempt: str | None = None) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"{_ROOT_PREFIX}attempt-{attempt or _attempt()}/", store)
        self._stuck: threading.Thread | None = None  # an op given up on, still blocked

    def _bounded(self, op: Any) -> Any:
        """`op()` on a daemon thread, waited for at most `_OP_LIMIT_S` (see there). While an op
        given up on is still blocked, the next raises at once: at most one thread per board
        is ever left behind, and only when its store's host is unreachable."""
        if self._stuck is not None and self._stuck.is_alive():
            raise TimeoutError("the failure board's store is still not answering")
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = op()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome["error"] = e

        thread = threading.Thread(target=run, daemon=True, name="fullshard-failure-board")
        thread.start()
        thread.join(_OP_LIMIT_S)
        if thread.is_alive():
            self._stuck = thread
            raise TimeoutError(f"the failure board's store did not answer in {_OP_LIMIT_S:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    @classmethod
    def of_process_group(cls) -> Board | None:
        """A new connection to the board of the default process group's store; None if the
        store cannot be given another connection (FileStore, HashStore)."""
        import torch.distributed as dist

        try:
            store = _root(dist.distributed_c10d._get_default_store()).clone()
            store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - no board
            return None
        return cls(store)

    def post(self, posted: Posted) -> None:
        """Never raises, never blocks for more than `_OP_LIMIT_S`."""

        def op() -> None:
            n = self.store.add("count", 1)
            self.store.set(f"failure/{n}", json.dumps(asdict(posted)))

        try:
            self._bounded(op)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def read(self) -> list[Posted]:
        """Everything posted so far (raises on a store that does not answer within
        `_OP_LIMIT_S`)."""
        return self._bounded(self._read)

    def _read(self) -> list[Posted]:
        count = self.store.add("count", 0)
        found = []
        for n in range(1, count + 1):
            key = f"failure/{n}"
            if not self.store.check([key]):
                continue  # counted, not yet written
            try:
                found.append(Posted(**json.loads(self.store.get(key))))
            except (ValueError, TypeError):
                continue
        return found


_WRITER: Board | None = None
_OWN_POSTED = False


def open_board() -> None:
    """Open this rank's connection for posting (after the process group exists). Idempotent."""
    global _WRITER
    if _WRITER is None:
        _WRITER = Board.of_process_group()


def post_own_failure(rank: int, local_rank: int, how: str, cause: str) -> None:
    """Post this rank's failure (from its excepthook, or a stop for a silent peer)."""
    global _OWN_POSTED
    _OWN_POSTED = True
    if _WRITER is not None:
        _WRITER.post(Posted(rank, local_rank, socket.gethostname(), os.getpid(), time.time(),
                            how, cause, _node()))


def wait_for_cause(rank: int, limit: float = CAUSE_WAIT_S) -> Posted | None:
    """For a rank that lost a peer: the first real failure of another rank, waiting up to
    `limit` seconds for one to be posted (its launcher posts a rank killed by a signal)."""
    if _WRITER is None:
        return None
    deadline = time.monotonic() + limit
    while True:
        try:
            first = first_posted(_WRITER.read(), besides=rank)
        except Exception:  # noqa: BLE001 - the store is gone: nothing more to learn
            return None
        if first is not None and not first.consequence:
            return first
        if time.monotonic() >= deadline:
            return first
        time.sleep(0.2)


def _node() -> int:
    text = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or "-1"
    return int(text) if text.lstrip("-").isdigit() else -1


def spans_nodes() -> bool:
    """Whether this rank's peers include ranks of other launchers (nodes): only then is the
    board read by the ranks; on one node the launcher sees every rank itself."""
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and local.isdigit() and int(world) > int(local)


def launcher_board(addr: str, port: int, attempt: int) -> Board | None:
    """For a `fullshard run` launcher of several nodes: the board on the agent store at
    `addr:port` (node 0's launcher hosts it); None when it cannot be reached."""
    try:
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, is_master=False,
                              timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - node 0 is gone: nobody to tell
        return None
    return Board(store, str(attempt))


def publish_for_workers(board: Board, error: Any, *, node: int) -> list[Posted]:
    """Post the failures of this node's workers that could not post their own (killed by a
    signal other than the agent's SIGTERM, `os._exit`); `error`: torchelastic's
    ChildFailedError. Returns the whole board afterwards ([] when it cannot be read)."""
    import signal

    try:
        posted = board.read()
    except Exception:  # noqa: BLE001
        return []
    ranks = {p.rank for p in posted}
    host = socket.gethostname()
    for rank, f in error.failures.items():
        if rank in ranks or f.exitcode == -signal.SIGTERM:
            continue  # it posted its own failure, or the agent stopped it
        how, cause = (("signal", f.signal_name()) if f.exitcode < 0
                      else ("exit", f"code {f.exitcode}"))
        new = Posted(rank, f.local_rank, host, f.pid, float(f.timestamp), how, cause, node)
        board.post(new)
        posted.append(new)
    return posted


def own_failure_posted() -> bool:
    """Whether this rank has posted a failure of its own (it is failing: it reports itself)."""
    return _OWN_POSTED
