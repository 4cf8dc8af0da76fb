"""Multi-process test harness: real ``torch.distributed`` ranks on one machine.

This file owns spawning, driving and reaping the worker processes that tests use
to exercise collectives (gloo by default, so it runs on CPU-only machines).
It knows nothing about the sharding engine.

A :class:`DistributedGroup` starts ``world_size`` processes once (forked from a server
process that has imported torch, so a rank does not import it again: `_context`); each initializes
its process group and then waits for work. ``group.run(fn, *args)`` runs a
picklable top-level function on every rank and returns the per-rank results in
rank order. A rank that raises, dies or hangs never hangs the caller: the group
is killed, an error naming the ranks is raised, and the next ``run`` respawns.

Typical test module::

    import pytest
    import torch.distributed as dist
    from fullshard.testing import DistributedGroup

    @pytest.fixture(scope="module")
    def group2():
        with DistributedGroup(2) as g:
            yield g

    def _whoami():                         # module top level, so it pickles by name
        return dist.get_rank(), dist.get_world_size()

    def test_ranks(group2):
        assert group2.run(_whoami) == [(0, 2), (1, 2)]

The function runs as ``tests.distributed.test_x._whoami`` in the children, so the
``tests`` directories are packages and pytest puts the repo root on ``sys.path``
(``pythonpath = ["."]``); the children inherit the parent's ``sys.path``.
Note that ``run`` reserves the keyword ``timeout`` for itself.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedGroup", "RankFailure", "run_distributed"]

_STOP = "stop"


class RankFailure(RuntimeError):
    """One or more ranks raised or died; ``failures`` maps rank -> traceback or exit text."""

    def __init__(self, what: str, failures: Mapping[int, str], silent: list[int] | None = None):
        self.what = what
        self.failures = dict(sorted(failures.items()))
        self.silent = list(silent or [])
        ranks = ", ".join(str(r) for r in self.failures)
        parts = [f"{what} failed on rank(s) {ranks}"]
        if self.silent:
            parts[0] += f"; rank(s) {', '.join(map(str, self.silent))} had not answered"
        for rank, text in self.failures.items():
            parts.append(f"--- rank {rank} ---\n{text.rstrip()}")
        super().__init__("\n".join(parts))

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.failures, self.silent)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_cpu(obj: Any) -> Any:
    """Move tensors in (nested) lists/tuples/dicts to CPU so they pickle by value."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        items = [_to_cpu(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    return obj


def _send(conn: mpc.Connection, msg: Any) -> None:
    # Plain pickle, not the ForkingPickler of Connection.send: torch registers
    # shared-memory reductions there, and a tensor whose sender is killed right
    # after sending must still arrive intact.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    env: dict[str, str],
    threads: int,
    pg_timeout: float,
    conn: mpc.Connection,
) -> None:
    """Child main: init the process group, then serve ``run`` requests until stopped."""
    os.environ.clear()
    os.environ.update(env)
    if sys.platform.startswith("linux"):
        # All ranks are local: keep gloo off whatever interface the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
    except BaseException:
        _send(conn, ("err", -1, traceback.format_exc()))
        return
    _send(conn, ("ok", -1, None))  # ready
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:  # parent went away: exit rather than linger as an orphan
                break
            if msg == _STOP:
                break
            call_id, fn, args, kwargs = msg
            try:
                reply = ("ok", call_id, _to_cpu(fn(*args, **kwargs)))
                data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException:
                data = pickle.dumps(("err", call_id, traceback.format_exc()))
            conn.send_bytes(data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


_LIVE_GROUPS: weakref.WeakSet[DistributedGroup] = weakref.WeakSet()


def _context() -> Any:
    """Where the ranks come from. Not 'fork': forking a parent that has run torch (its thread
    pools, OpenMP state) can deadlock, and CUDA cannot be forked. 'forkserver' with torch
    preloaded where it exists: a server process started once imports torch (and nothing
    else: fullshard reads some variables at import, which must be the caller's) and has run
    no op, so forking it is safe. Measured here: a 2-rank group starts and closes in 0.3 s
    (the first, which starts the server, in 2.0 s) against 2.2-2.5 s spawned, every time.
    Elsewhere 'spawn'."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


@atexit.register
def _close_all_groups() -> None:
    # Safeguard for groups never closed: leave no orphan rank processes behind.
    for group in list(_LIVE_GROUPS):
        group.close()


class DistributedGroup:
    """``world_size`` persistent rank processes with an initialized process group.

    Args:
        world_size: number of ranks.
        backend: ``torch.distributed`` backend for ``init_process_group``.
        env: environment variables set in each child before init.
        threads_per_rank: ``torch.set_num_threads`` in each child.
        pg_timeout: process-group timeout (s): a stuck collective errors, not hangs.
        grace: after a rank fails, seconds to wait for the others to report before
            killing them (they are often blocked in a collective with the dead rank).
        start_timeout: seconds allowed for spawning and initializing all ranks.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
        threads_per_rank: int = 1,
        pg_timeout: float = 60.0,
        grace: float = 3.0,
        start_timeout: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.env = dict(env or {})
        self.threads_per_rank = threads_per_rank
        self.pg_timeout = pg_timeout
        self.grace = grace
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._conns: list[mpc.Connection] = []
        self._call_id = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def __enter__(self) -> DistributedGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn and initialize the ranks (no-op when already running)."""
        if self.alive:
            return
        ctx = _context()
        port = _free_port()
        _LIVE_GROUPS.add(self)
        # The children are forked from a server process started once, so they would see
        # its environment: they get this process's as it is now, as spawned children do.
        env = {**os.environ, **self.env}
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                args = (rank, self.world_size, port, self.backend, env)
                args += (self.threads_per_rank, self.pg_timeout, child_conn)
                proc = ctx.Process(target=_worker, name=f"fullshard-rank{rank}", args=args)
                try:
                    proc.start()
                finally:
                    child_conn.close()  # the child holds its own copy now
                self._procs.append(proc)
                self._conns.append(parent_conn)
        except BaseException:
            self._kill()
            raise
        self._collect(-1, "init_process_group", self.start_timeout)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises ``RankFailure`` if a rank raises or dies and ``TimeoutError`` if not all
        ranks answer within ``timeout`` seconds; either way the group is killed and the
        next call respawns it.
        """
        self.start()
        self._call_id += 1
        # Pickle once in the parent so an unpicklable fn fails here, group intact.
        payload = pickle.dumps((self._call_id, fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass  # that rank is dead; _collect reports its exit code
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self._call_id, name, timeout)

    def _collect(self, call_id: int, name: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(self._conns))
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                sentinels = {self._procs[r].sentinel: r for r in waiting}
                ready = mpc.wait([*waiting.values(), *sentinels], timeout=remaining)
                for obj in ready:
                    rank = sentinels[obj] if obj in sentinels else self._conns.index(obj)
                    if rank not in waiting:
                        continue
                    reply = self._receive(rank, call_id)
                    if reply is None:
                        continue  # a stale message, keep waiting
                    del waiting[rank]
                    if reply[0] == "ok":
                        results[rank] = reply[1]
                    else:
                        failures[rank] = reply[1]
                        # Give the others a short grace period to report too; they may
                        # instead be blocked in a collective with the failed rank.
                        deadline = min(deadline, time.monotonic() + self.grace)
        except BaseException:
            self._kill()
            raise
        if failures:
            self._kill()
            raise RankFailure(name, failures, silent=sorted(waiting))
        if waiting:
            self._kill()
            raise TimeoutError(
                f"{name} did not finish within {timeout:g}s on "
                f"{self.world_size} ranks; rank(s) "
                f"{', '.join(map(str, sorted(waiting)))} had not answered"
            )
        return [results[r] for r in range(self.world_size)]

    def _receive(self, rank: int, call_id: int) -> tuple[str, Any] | None:
        """One reply from ``rank`` as ("ok", value) / ("err", text), None if stale."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                status, got_id, value = pickle.loads(conn.recv_bytes())
                if got_id != call_id:
                    return None
                return status, value
        except (EOFError, OSError):
            pass
        proc.join(timeout=1.0)
        code = proc.exitcode
        if code is not None and code < 0:  # killed by a signal, e.g. a segfault
            return "err", f"rank process died (exit code {code}, {signal.Signals(-code).name})"
        return "err", f"rank process died (exit code {code})"

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._reap(timeout=5.0)

    def _reap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        _LIVE_GROUPS.discard(self)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers cleanly; kill any that do not exit within ``timeout``."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    _send(conn, _STOP)
                except OSError:
                    pass
        self._reap(timeout)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Spawn a one-shot group of ``world_size`` ranks, run ``fn`` on each, return results."""
    with DistributedGroup(world_size, backend=backend) as group:
        return group.run(fn, *args, timeout=timeout, **kwargs)
