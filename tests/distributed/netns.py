"""Emulated hosts for tests: `benchmarks/cluster_net.py`'s network namespaces, under a test's
own namespace prefix and subnet, so a cluster benchmark running meanwhile (prefix `fsc<pid>`,
subnet 10.77.0) is not disturbed.

    with emulated_hosts(2) as net:          # skips the test, naming why, without root / ip
        procs = [net.popen(i, fullshard_run(net, i, script, ...), ...) for i in range(2)]
        net.cut(1)                          # host 1's switch port down

The namespaces are deleted, and everything started in them killed, when the `with` ends (also
on a failed assertion), and from cluster_net's atexit / SIGTERM hooks if the test process ends
first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.78.0"
"""Not cluster_net's default (10.77.0)."""


def _cluster_net() -> Any:
    """benchmarks/cluster_net.py (benchmarks/ is no package): loaded by path, once."""
    name = "fullshard_bench_cluster_net"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "cluster_net.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_serial = [0]


@contextlib.contextmanager
def emulated_hosts(hosts: int) -> Iterator[Any]:
    """`hosts` unshaped emulated hosts (an `EmulatedCluster`), or `pytest.skip` naming why
    namespaces cannot be made here."""
    cn = _cluster_net()
    _serial[0] += 1
    net = cn.EmulatedCluster(hosts, prefix=f"fst{os.getpid()}n{_serial[0]}", subnet=SUBNET)
    try:
        net.up()
    except cn.NetnsUnavailable as e:
        pytest.skip(f"emulated hosts unavailable: {e}")
    try:
        yield net
    finally:
        net.down()


def host_env(net: Any, tmp: Path) -> dict[str, str]:
    """The environment of a `fullshard run` inside a namespace: gloo over its `eth0`, temporary
    files under `tmp` (a launcher the test SIGKILLs at the end, e.g. one waiting on a SIGSTOPped
    rank, cannot remove its failure records or torchelastic's log directory)."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               GLOO_SOCKET_IFNAME=_cluster_net().HOST_IF, TMPDIR=str(tmp / "tmp"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def fullshard_run(net: Any, host: int, port: int, script: str | Path, script_args: Sequence[str],
                  *, options: Sequence[str] = ()) -> list[str]:
    """`fullshard run` for node `host` of `net.hosts`, one rank per node, the static
    rendezvous at host 0's address."""
    return [sys.executable, "-m", "fullshard.cli", "run", "--nnodes", str(net.hosts),
            "--node-rank", str(host), "--nproc-per-node", "1", "--master-addr", net.address(0),
            "--master-port", str(port), *options, str(script), *script_args]
