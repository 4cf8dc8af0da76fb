"""Silence detection: a rank (or host) that stops answering makes the others fail within a
bound, naming it, instead of hanging in a collective for gloo's 30-minute timeout.

A rank that is SIGSTOPped, swapped out or cut off by the network does not die, so neither
its launcher nor its peers' connections notice: the peers wait in their next collective until
the process-group timeout. Here every rank runs one heartbeat thread (`fullshard-heartbeat`)
over the process group's store (a TCPStore: a second connection to it, so the main thread's
store traffic is not held up), and a second thread (`fullshard-heartbeat-judge`) times the
store's answers, since a store op to a stopped host can block with no timeout:

- every `interval` (bound / 10, 0.2-5 s) it adds 1 to its counter `beat/<rank>`;
- rank 0 reads every peer's counter, every other rank reads rank 0's, and a peer whose counter
  has not moved for `bound` seconds (by this process's clock: no clocks are compared) is
  silent; rank 0 also posts its verdict, which every rank reads and fails with;
- a store that does not answer for `bound` seconds means its host (rank 0's, or node 0's
  launcher) is silent or cut off;
- a failing rank says which rank, host and pid went silent, writes a failure record
  (`failure_records.py`), posts it on the failure board (`failure_board.py`) and exits with status 1
  (`os._exit`: the main thread is blocked in a collective that cannot be interrupted), so the
  launcher stops the rest;
- where the peers span several nodes, the heartbeat also reads the failure board every
  second: a real failure posted by another rank (or by its node's launcher, for a rank killed
  by a signal) stops this rank at once, naming it, so a rank stuck in a collective with a dead
  peer does not wait for the silence bound.

Only counters that have moved are judged: a rank that has not started its heartbeat yet (it
is still loading data before it creates its process group) is not called silent. At a normal
end a rank marks `done/<rank>` before its heartbeat stops, so a peer that exits early is not silent
either; a store that refuses connections belongs to a process that ended, which its launcher
reports: the thread then just stops.

The bound: `FULLSHARD_SILENCE_TIMEOUT` seconds (`fullshard run --silence-timeout S`), default
60; 0 turns detection off. The second connection is the store's `clone()`, or on a torch
without it a new client of the TCPStore below the process group's prefixes; a store that
offers neither (one written in Python) leaves detection off, and every rank says so once
(a `RuntimeWarning` naming why and what is lost).

Started by `install_rank_hooks` (`fullshard run`'s workers, `FSDPStrategy`); at exit the
rank is marked done first (`_at_exit`), and `stop_heartbeat` (after fullshard's exit barrier,
or from `FSDPStrategy.teardown`) stops and joins both threads.

The beat, the watch and the verdict (`Heartbeat`) serve the launchers of a multi-node job too,
one member per node (`node_heartbeat.py`); what a rank adds, the failure board and its way of
failing, is `_RankHeartbeat`.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

from fullshard.launch import failure_board, failure_records

SILENCE_VAR = "FULLSHARD_SILENCE_TIMEOUT"
DEFAULT_SILENCE_S = 60.0
_PREFIX = "fullshard/heartbeat/"
_BOARD_TICK_S = 1.0  # how often the failure board is read


def silence_timeout() -> float:
    """The bound in seconds from `FULLSHARD_SILENCE_TIMEOUT` (0: off)."""
    text = os.environ.get(SILENCE_VAR, "").strip()
    if not text:
        return DEFAULT_SILENCE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{SILENCE_VAR}={text!r}: expected a number of seconds >= 0 (0 turns silence "
            f"detection off)"
        )
    return value


def _is_timeout(error: BaseException) -> bool:
    """A store op that got no answer in time (not a closed or refused connection)."""
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


class _HeartbeatThread(threading.Thread):
    """A heartbeat daemon with `stop()` (stops the whole heartbeat it belongs to): Lightning's
    test fixtures stop left-over daemon threads that way and then require them gone."""

    def __init__(self, owner: Heartbeat, target: Any, name: str) -> None:
        super().__init__(target=target, daemon=True, name=name)
        self.owner = owner

    def stop(self) -> None:
        self.owner.halt()


class Heartbeat:
    """The beat, the watch and the verdict over one store, for the members `0..world-1` of a
    job: the ranks of a process group (`_RankHeartbeat`) or the launchers of the nodes
    (`node_heartbeat.py`). Member 0 watches everyone, the others watch member 0 and read its
    verdict; `_fail(verdict)` is what a member does when it finds one silent (it must not
    return normally: it ends the process)."""

    noun = "rank"
    thread_name = "fullshard-heartbeat"

    def __init__(self, store: Any, me: int, world: int, bound: float, *, me_said: str,
                 store_said: str, bound_said: str) -> None:
        self.store, self.me, self.world, self.bound = store, me, world, bound
        self.me_said, self.store_said, self.bound_said = me_said, store_said, bound_said
        self.interval = min(5.0, max(0.2, bound / 10))
        self.stopped = threading.Event()
        self.last_answer = time.monotonic()
        self.store_gone = False
        self.threads = [_HeartbeatThread(self, self._loop, self.thread_name),
                        _HeartbeatThread(self, self._judge, f"{self.thread_name}-judge")]
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it moved)
        self.board: failure_board.Board | None = None  # read by `_loop` when set (`_RankHeartbeat`)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _watched(self) -> list[int]:
        return [r for r in range(self.world) if r != self.me] if self.me == 0 else [0]

    def _who(self, member: int) -> str:
        try:
            return self.store.get(f"who/{member}").decode()
        except Exception:  # noqa: BLE001 - only for the message
            return f"{self.noun} {member}"

    def _loop(self) -> None:
        """The store traffic: beat, read the watched counters, post or read a verdict; every
        `_BOARD_TICK_S`, read the failure board (`failure_board.py`) where there is one."""
        try:
            self.store.set(f"who/{self.me}", self.me_said)
        except Exception:  # noqa: BLE001 - the judge below times the store
            pass
        tick = min(self.interval, _BOARD_TICK_S) if self.board is not None else self.interval
        next_beat = time.monotonic() + self.interval
        while not self.stopped.wait(tick):
            posted = self._board_verdict() if self.board is not None else None
            if posted is not None and not self.stopped.is_set():
                self._fail_after(posted)
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.interval
            try:
                self.store.add(f"beat/{self.me}", 1)
                verdict = self._check()
                self.last_answer = time.monotonic()
            except Exception as e:  # noqa: BLE001
                if self.stopped.is_set() or not _is_timeout(e):
                    self.store_gone = True  # its process ended: its launcher reports that
                    return
                continue  # no answer in time: the judge decides when that is silence
            if verdict and not self.stopped.is_set():
                self._fail(verdict)

    def _judge(self) -> None:
        """A store op can block with no timeout of its own when the store's host is stopped or
        cut off, so a second thread times the store's answers."""
        while not self.stopped.wait(self.interval):
            if self.store_gone:
                return
            silent_for = time.monotonic() - self.last_answer
            if silent_for > self.bound and not self.stopped.is_set():
                self._fail(f"{self.store_said} has not answered for {silent_for:.0f} s: that "
                           f"host is stopped or cut off")

    def _check(self) -> str | None:
        if self.me != 0 and self.store.check(["verdict"]):
            return self.store.get("verdict").decode()
        now = time.monotonic()
        for peer in self._watched():
            count = self.store.add(f"beat/{peer}", 0)
            before = self._seen.get(peer)
            if before is None or count != before[0]:
                self._seen[peer] = (count, now)
                continue
            if count > 0 and now - before[1] > self.bound:
                if self.store.check([f"done/{peer}"]):
                    continue
                verdict = (f"{self._who(peer)} has not answered for {now - before[1]:.0f} s "
                           f"({self.bound_said}): it is stopped, hung outside Python, or cut "
                           f"off from the network")
                if self.me == 0:
                    self.store.set("verdict", verdict)
                return verdict
        return None

    def _fail(self, verdict: str) -> None:
        raise NotImplementedError  # ends the process

    def _fail_after(self, first: failure_board.Posted) -> None:
        raise NotImplementedError  # only where a board is read

    def _board_verdict(self) -> failure_board.Posted | None:
        return None

    def mark_done(self) -> None:
        try:
            self.store.set(f"done/{self.me}", "1")
        except Exception:  # noqa: BLE001 - the peers' stores may be gone already
            pass

    def stop(self, done: bool) -> None:
        self.stopped.set()
        if done:
            self.mark_done()
        for thread in self.threads:  # one blocked in a store op is left behind (daemon)
            if thread is not threading.current_thread() and thread.is_alive():
                thread.join(timeout=2 * self.interval + 1)

    def halt(self) -> None:
        """`stop()` of one of its threads: stop the whole heartbeat, this member done."""
        self.stop(done=True)


class _RankHeartbeat(Heartbeat):
    """A rank's heartbeat over its process group's store; where the peers span several nodes
    it also reads the failure board."""

    def __init__(self, store: Any, keep: Any, rank: int, local_rank: int, world: int,
                 bound: float) -> None:
        super().__init__(
            store, rank, world, bound,
            me_said=f"rank {rank} (host {socket.gethostname()}, pid {os.getpid()})",
            store_said=(f"the store at {os.environ.get('MASTER_ADDR', '?')}:"
                        f"{os.environ.get('MASTER_PORT', '?')} (rank 0's host, or node 0's "
                        f"launcher)"),
            bound_said=f"silence bound {bound:g} s, {SILENCE_VAR}")
        self._keep = keep  # rank 0's store server stays up
        self.rank, self.local_rank = rank, local_rank
        # Its own connection to the failure board, read only where peers are on other nodes.
        self.board = failure_board.Board.of_process_group() if failure_board.spans_nodes() else None
        self._consequence_seen: float | None = None

    def halt(self) -> None:
        stop_heartbeat()

    def _board_verdict(self) -> failure_board.Posted | None:
        """Another rank's failure to stop for: a real one at once; when only consequences (a
        lost peer) are posted, the first of them after `failure_board.CAUSE_WAIT_S`, the time its
        cause gets to be posted. None while this rank is failing itself (its excepthook
        reports) or nothing is posted."""
        if self.board is None or failure_board.own_failure_posted():
            return None
        try:
            first = failure_board.first_posted(self.board.read(), besides=self.rank)
        except Exception:  # noqa: BLE001 - the board's store is gone: the heartbeat decides
            return None
        if first is None or not first.consequence:
            return first
        now = time.monotonic()
        if self._consequence_seen is None:
            self._consequence_seen = now
        return first if now - self._consequence_seen >= failure_board.CAUSE_WAIT_S else None

    def _fail_after(self, first: failure_board.Posted) -> None:
        said = first.describe()
        failure_records.say_last_words(
            f"rank {self.rank} is stopping the job: {said} (the first failure)")
        cause = f"PeerFailed: {said}"
        failure_records.record_failure(self.rank, self.local_rank, cause, first=said)
        failure_board.post_own_failure(self.rank, self.local_rank, "stopped", cause)
        os._exit(1)

    def _fail(self, verdict: str) -> None:
        message = f"rank {self.rank} is stopping the job: {verdict}"
        # Said first: the post below may have to give up on a store that is cut off.
        failure_records.say_last_words(message)
        cause = f"SilentRank: {verdict}"
        failure_records.record_failure(self.rank, self.local_rank, cause)
        failure_board.post_own_failure(self.rank, self.local_rank, "stopped", cause)
        os._exit(1)


_HEARTBEAT: _RankHeartbeat | None = None
_LOCK = threading.Lock()


def start_heartbeat(rank: int, local_rank: int, *, timeout: float | None = None) -> bool:
    """Start this rank's heartbeat over the default process group's store (once per process;
    `timeout` defaults to `silence_timeout()`). False when it does not run: one rank or the
    bound is 0 (nothing to say), or the store cannot be given a second connection (then it
    warns, once, naming why and what is lost)."""
    global _HEARTBEAT
    import torch.distributed as dist

    bound = silence_timeout() if timeout is None else timeout
    if bound <= 0 or not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.get_world_size()
    if world < 2:
        return False
    with _LOCK:
        if _HEARTBEAT is not None:
            return True
        keep = dist.distributed_c10d._get_default_store()
        store, why = second_connection(keep, timedelta(seconds=max(1.0, min(bound / 4, 10.0))))
        if store is None:
            _say_off(rank, keep, why, bound)
            return False
        _HEARTBEAT = _RankHeartbeat(dist.PrefixStore(_PREFIX, store), keep, rank, local_rank,
                                    world, bound)
        _HEARTBEAT.start()
    atexit.register(_at_exit)
    return True


def second_connection(store: Any, timeout: timedelta) -> tuple[Any, str]:
    """`(connection, "")`: a store of its own over the same keys as `store`, or `(None, why)`:
    `Store.clone()` where the store has it (TCPStore, FileStore, HashStore on a recent torch),
    else a new client of the TCPStore below it (`tcp_client`)."""
    try:
        connection = store.clone()
    except Exception as e:  # noqa: BLE001 - absent (older torch) or not implemented
        return tcp_client(store, timeout,
                          f"{_root_name(store)}.clone() failed ({type(e).__name__}: {e})")
    connection.set_timeout(timeout)
    return connection, ""


def tcp_client(store: Any, timeout: timedelta, why: str) -> tuple[Any, str]:
    """A new client to the host and port of the TCPStore below `store` (torch before
    `Store.clone()`); `(None, why)` when there is none. Its keys are the server's own, not
    under the process group's prefixes: a prefix per torchelastic attempt keeps an earlier
    attempt's beats and verdict apart."""
    import torch.distributed as dist

    root = _below_prefixes(store)
    if not isinstance(root, dist.TCPStore):
        return None, why
    try:
        client = dist.TCPStore(root.host, root.port, is_master=False, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return None, (f"{why}, and a new client of its TCPStore at {root.host}:{root.port} "
                      f"could not connect ({type(e).__name__}: {e})")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return dist.PrefixStore(f"fullshard/attempt-{attempt}", client), ""


def _below_prefixes(store: Any) -> Any:
    """The store below the process group's prefixes (the one torchrun or the user made)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _root_name(store: Any) -> str:
    return type(_below_prefixes(store)).__name__


_SAID_OFF = False


def _say_off(rank: int, store: Any, why: str, bound: float) -> None:
    """Hang detection cannot start: say so, once per process."""
    global _SAID_OFF
    if _SAID_OFF:
        return
    _SAID_OFF = True
    warnings.warn(
        f"fullshard: hang detection is off on rank {rank}: its heartbeat needs a second "
        f"connection to the process group's store ({_root_name(store)}), and {why}. A rank "
        f"that stops answering without dying (stopped, swapped out, cut off from the network) "
        f"will make the others wait in their next collective until the process group's "
        f"timeout, instead of failing within {bound:g} s ({SILENCE_VAR}) naming it. Initialize "
        f"the process group with a TCPStore (init_method='env://' or 'tcp://', as torchrun and "
        f"`fullshard run` do) to have it, or set {SILENCE_VAR}=0 to turn it off knowingly.",
        RuntimeWarning,
        stacklevel=3,
    )


def _at_exit() -> None:
    """This rank is ending: tell the peers (its silence from now on is no failure), but keep
    watching them while the process group lives -- fullshard's own exit handler, registered
    before this one and so run after it, waits for every rank in a barrier and then stops the
    heartbeat (`stop_heartbeat`); a peer that goes silent during that barrier is still caught.
    Without a process group there is nothing left to watch."""
    import torch.distributed as dist

    beat = _HEARTBEAT
    if beat is None:
        return
    if dist.is_available() and dist.is_initialized():
        beat.mark_done()
    else:
        stop_heartbeat()


def stop_heartbeat(done: bool = True) -> None:
    """Stop this rank's heartbeat and join its thread; `done` tells the peers this rank ended
    on purpose (so its silence from now on is not a failure). Idempotent."""
    global _HEARTBEAT
    with _LOCK:
        beat, _HEARTBEAT = _HEARTBEAT, None
    if beat is not None:
        beat.stop(done)
