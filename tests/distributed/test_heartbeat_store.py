"""Hang detection is never off without a word (`fullshard.launch.heartbeat`, issue 40).

Its heartbeat needs a second connection to the process group's store. A store that cannot
give one -- here a store written in Python, which has no `clone()`, over a real FileStore, on
two real ranks -- leaves detection off, and each rank says so once, naming why and what is
lost; training goes on. On a torch without `Store.clone()` a TCPStore gets a new client of its
own instead (`tcp_client`), checked here against a real TCPStore server.

Run as a script (`python -m tests.distributed.test_heartbeat_store RANK FILE`) it is one rank."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fullshard.launch.heartbeat import SILENCE_VAR, start_heartbeat, tcp_client

ROOT = Path(__file__).resolve().parents[2]


class ForwardingStore(dist.Store):
    """A store implemented in Python (as users write them), keeping its keys in `inner`."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key, value):  # type: ignore[no-untyped-def]
        self.inner.set(key, value)

    def get(self, key):  # type: ignore[no-untyped-def]
        return self.inner.get(key)

    def add(self, key, value):  # type: ignore[no-untyped-def]
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.check(keys)

    def delete_key(self, key):  # type: ignore[no-untyped-def]
        return self.inner.delete_key(key)

    def num_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.num_keys()

    def set_timeout(self, timeout):  # type: ignore[no-untyped-def]
        self.inner.set_timeout(timeout)

    def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)


def _rank(rank: int, file: str) -> dict:
    store = ForwardingStore(dist.FileStore(file, 2))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            started = [start_heartbeat(rank, rank, timeout=5.0) for _ in range(2)]
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)  # the job itself goes on
        return {"started": started, "sum": total.item(),
                "said": [f"{w.category.__name__}: {w.message}" for w in said]}
    finally:
        dist.destroy_process_group()


def test_hang_detection_that_cannot_start_says_so_once(tmp_path) -> None:
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.distributed.test_heartbeat_store",
                               str(r), str(tmp_path / "store")], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    for rank, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["started"] == [False, False] and got["sum"] == 3.0, got
        assert len(got["said"]) == 1, got["said"]  # once, not at every call
        said = got["said"][0]
        assert said.startswith(f"RuntimeWarning: fullshard: hang detection is off on rank "
                               f"{rank}"), said
        assert "ForwardingStore.clone() failed" in said, said  # why
        assert "instead of failing within 5 s" in said and SILENCE_VAR in said, said  # the loss


def test_a_tcp_store_without_clone_gets_a_client_of_its_own(monkeypatch) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    group_store = dist.PrefixStore("default_pg", server)  # what the process group holds
    mine, why = tcp_client(group_store, timedelta(seconds=5), "no clone")
    peer, _ = tcp_client(group_store, timedelta(seconds=5), "no clone")
    assert why == "" and mine is not None and peer is not None
    mine.add("beat/0", 1)
    assert peer.add("beat/0", 0) == 1  # a peer's own client sees this rank's beats
    assert server.check(["fullshard/attempt-0/beat/0"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    later, _ = tcp_client(group_store, timedelta(seconds=5), "no clone")
    assert not later.check(["beat/0"])  # a restarted attempt starts clean
    # Nothing below the prefixes is a TCPStore: no connection, and the reason is kept.
    assert tcp_client(dist.PrefixStore("p", dist.HashStore()), timedelta(seconds=5),
                      "HashStore.clone() failed") == (None, "HashStore.clone() failed")


if __name__ == "__main__":
    print(json.dumps(_rank(int(sys.argv[1]), sys.argv[2])))
