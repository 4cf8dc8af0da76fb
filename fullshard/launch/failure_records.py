"""Which rank failed first. Each rank records its uncaught exception, with a sub-second time,
in a directory its launcher names in `FULLSHARD_FAILURE_DIR`; when ranks fail, the launcher
reads the records and reports the earliest.

Why exit codes are not enough: when one rank raises, its exit handler tears its process group
down, and its peers then fail with gloo's "Connection closed by peer" -- often *before* the
first rank's process has finished dying (interpreter shutdown takes seconds on a loaded
machine). So the first exit code to arrive can be a consequence, not the cause, and
torchelastic's failure timestamps have one-second resolution, which makes the two a tie. The
time an exception reached the top of its rank orders them: a peer only loses its connection
after the failing rank's excepthook has run.

Records are best effort: a rank killed by a signal or by `os._exit` writes none, and a rank
that cannot write its record fails exactly as it would without one. Launchers fall back to
exit codes when no record exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

FAILURE_DIR_VAR = "FULLSHARD_FAILURE_DIR"


@dataclass(frozen=True)
class FailureRecord:
    """One rank's uncaught exception: who, when (`time.time()`), and its first line."""

    rank: int
    local_rank: int
    pid: int
    time: float
    error: str
    first: str = ""
    """When this rank failed because it lost a peer: the failure of another node's rank that
    the board (`failure_board.py`) names as the first, described; else empty."""


def record_failure(rank: int, local_rank: int, error: str, *, first: str = "") -> None:
    """Record this rank's failure if a launcher asked for records. Never raises."""
    directory = os.environ.get(FAILURE_DIR_VAR)
    if not directory:
        return
    record = {"rank": rank, "local_rank": local_rank, "pid": os.getpid(),
              "time": time.time(), "error": error, "first": first}
    path = os.path.join(directory, f"rank-{rank}.json")
    try:  # write then rename, so a reader never sees half a record
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(record, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError:
        pass


def read_failures(directory: str | None) -> dict[int, FailureRecord]:
    """The records in `directory` by global rank (none if it is unset or unreadable)."""
    found: dict[int, FailureRecord] = {}
    if not directory or not os.path.isdir(directory):
        return found
    for name in os.listdir(directory):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = FailureRecord(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        found[record.rank] = record
    return found


def first_failure(
    directory: str | None, among: Iterable[int] | None = None
) -> FailureRecord | None:
    """The earliest recorded failure (only of the ranks in `among`, when given)."""
    records = read_failures(directory)
    if among is not None:
        wanted = set(among)
        records = {r: rec for r, rec in records.items() if r in wanted}
    return min(records.values(), key=lambda rec: rec.time, default=None)


_PREFIX = "fullshard-failures-"


def make_failure_directory(*, export: bool = True) -> str:
    """A fresh directory for this launch's records, named in this process's environment so
    the ranks it starts inherit it (`export=False`: not named there; the caller passes it to
    the ranks it starts in their environment). A launcher that was SIGKILLed removes nothing (its
    workers die with it by `PR_SET_PDEATHSIG`, no cleanup either), so on Linux the name holds
    where this launcher runs (`_pid_space`) and its pid, and each new launch first removes
    the directories of launchers of the same pid space that are gone."""
    space = _pid_space()
    if space is None:
        directory = tempfile.mkdtemp(prefix=_PREFIX)
    else:
        _remove_orphans(tempfile.gettempdir(), f"{_PREFIX}{space}.")
        directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{space}.{os.getpid()}-")
    if export:
        os.environ[FAILURE_DIR_VAR] = directory
    return directory


def _pid_space() -> str | None:
    """Where a pid of this process means something: a hash of the boot (this machine, this
    boot) and the pid namespace (this container). None where Linux's /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return hashlib.sha1(f"{boot}/{namespace}".encode()).hexdigest()[:8]


def _remove_orphans(parent: str, head: str) -> None:
    """Remove the record directories `<head><pid>-*` under `parent` that this user's dead
    launchers left. Never raises; a directory of a live pid, of another user, or named
    otherwise (another machine or container, an older name) is kept."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(head)]
    except OSError:
        return
    for name in names:
        pid = name[len(head):].partition("-")[0]
        if not pid.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # raises if no such process
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive under another user, or gone meanwhile
            continue


def remove_failure_directory(directory: str | None) -> None:
    """Delete the records once the launch is over. Never raises.

    The launcher's watchdog thread ends the launch while this process's own excepthook may
    be writing rank 0's record into the directory: a file created while `rmtree` runs makes
    its last `rmdir` fail, and the directory outlived the launch (seen under load). So this
    process stops recording first (the variable `record_failure` reads), then the removal is
    repeated for a record already being written."""
    if not directory:
        return
    if os.environ.get(FAILURE_DIR_VAR) == directory:
        del os.environ[FAILURE_DIR_VAR]
    for _ in range(5):
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.exists(directory):
            return
        time.sleep(0.02)


def say_last_words(msg: str) -> None:
    """A launcher's or a rank's last words before it ends the job (`fullshard: msg`), written
    straight to file descriptor 2: the caller exits with `os._exit` next, often from a
    watchdog thread, while the main thread may be anywhere, even shutting the interpreter down
    (`sys.stderr` gone); a line through `sys.stderr` was lost that way under load (the launch
    tests saw an exit with no reason)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - best effort on a dying process
        pass
    try:
        os.write(2, f"fullshard: {msg}\n".encode())
    except OSError:
        pass
