"""The multi-process harness itself: results, collectives, failures, timeouts, dead ranks."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import DistributedGroup, RankFailure, run_distributed


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=2.0) as g:
        yield g


# Functions run on the ranks live at module top level so they pickle by name.
def _whoami(tag: str, *, scale: int = 1) -> tuple[str, int, int, str, int]:
    return (
        tag,
        dist.get_rank() * scale,
        dist.get_world_size(),
        os.environ["LOCAL_RANK"],
        torch.get_num_threads(),
    )


def _all_reduce_ranks() -> torch.Tensor:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t


def _note_time(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _since(path) -> float:
    """Seconds since the time a rank wrote to `path` (the event a bound is timed from)."""
    return time.time() - float(open(path).read())


def _raise_on_rank1(path: str) -> int:
    if dist.get_rank() == 1:
        _note_time(path)
        raise ValueError("boom from rank one")
    # Rank 0 blocks in a collective the failed rank never joins: the grace period ends it.
    dist.barrier()
    return 0


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _exit_on_rank0(path: str) -> int:
    if dist.get_rank() == 0:
        _note_time(path)
        os._exit(3)
    return dist.get_rank()


def test_results_in_rank_order(group2: DistributedGroup) -> None:
    assert group2.run(_whoami, "x", scale=10) == [("x", 0, 2, "0", 1), ("x", 10, 2, "1", 1)]


def test_collective_across_ranks(group2: DistributedGroup) -> None:
    out = group2.run(_all_reduce_ranks)
    assert [t.tolist() for t in out] == [[3.0], [3.0]]


# Bounds are timed from the event (a rank wrote the time just before it failed), not from the
# call, which may first have to respawn the group: on a loaded machine that alone takes longer.
def test_rank_exception_then_respawn(group2: DistributedGroup, tmp_path) -> None:
    with pytest.raises(RankFailure) as info:
        group2.run(_raise_on_rank1, str(tmp_path / "t"), timeout=60)
    assert _since(tmp_path / "t") < 15  # the grace period (2 s) ends rank 0's barrier
    msg = str(info.value)
    assert "rank(s) 1" in msg and 1 in info.value.failures
    assert "ValueError: boom from rank one" in msg and "Traceback" in msg
    assert "_raise_on_rank1" in msg  # the remote frame is in the text
    assert not group2.alive
    # The same group object transparently respawns for the next call.
    assert [t.item() for t in group2.run(_all_reduce_ranks)] == [3.0, 3.0]


def test_timeout_is_quick(group2: DistributedGroup) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_sleep.*rank\(s\) 0, 1"):
        group2.run(_sleep, 60, timeout=1.0)
    assert time.monotonic() - start < 5
    assert not group2.alive


def test_dead_rank_is_reported(group2: DistributedGroup, tmp_path) -> None:
    with pytest.raises(RankFailure, match=r"exit code 3") as info:
        group2.run(_exit_on_rank0, str(tmp_path / "t"), timeout=60)
    assert 0 in info.value.failures
    assert _since(tmp_path / "t") < 10


def test_unpicklable_fn_leaves_group_intact(group2: DistributedGroup) -> None:
    group2.run(_whoami, "warm")
    with pytest.raises((pickle.PicklingError, AttributeError)):
        group2.run(lambda: 1)
    assert group2.alive
    assert group2.run(_whoami, "y")[1][0] == "y"


def test_run_distributed_one_shot() -> None:
    assert [t.item() for t in run_distributed(_all_reduce_ranks, 2)] == [3.0, 3.0]


# -- silence: a rank that stops answering without dying (fullshard.launch.heartbeat) ----------
def _go_silent(stop_rank: int, bound: float, path: str) -> int:
    import signal

    from fullshard.launch.failure_records import FAILURE_DIR_VAR
    from fullshard.launch.heartbeat import start_heartbeat

    os.environ[FAILURE_DIR_VAR] = os.path.dirname(path)  # where the verdict is recorded
    assert start_heartbeat(dist.get_rank(), dist.get_rank(), timeout=bound)
    dist.barrier()
    time.sleep(1.0)  # a few beats each, so both have been seen alive
    if dist.get_rank() == stop_rank:
        _note_time(path)
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, but answers nothing
    dist.barrier()  # the other rank blocks here: its heartbeat must end it
    return 0


@pytest.mark.parametrize("stop_rank, said", [
    (1, r"rank 1 \(host \S+, pid \d+\) has not answered for \d+ s \(silence bound 3 s"),
    # Rank 0 also hosts the store: the others find the store silent.
    (0, r"the store at 127\.0\.0\.1:\d+ \(rank 0's host.*has not answered for \d+ s"),
], ids=["peer", "store-host"])
def test_a_silent_rank_fails_the_others_in_the_bound(group2: DistributedGroup, tmp_path,
                                                    stop_rank: int, said: str) -> None:
    import re

    from fullshard.launch.failure_records import read_failures

    with pytest.raises(RankFailure) as info:
        group2.run(_go_silent, stop_rank, 3.0, str(tmp_path / "t"), timeout=120)
    other = 1 - stop_rank
    assert "exit code 1" in info.value.failures[other], str(info.value)
    assert _since(tmp_path / "t") < 3.0 + 10  # the bound, plus a loaded machine's slack
    records = read_failures(str(tmp_path))  # what a launcher reports as the first failure
    assert list(records) == [other], records
    assert re.match(f"SilentRank: {said}", records[other].error), records[other]
