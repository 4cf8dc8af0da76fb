"""An emulated cluster on one Linux machine: hosts as network namespaces, links as veth pairs.

    with EmulatedCluster(hosts=2, rate_mbit=1000) as net:
        net.popen(0, ["python", ...])           # runs inside host 0's namespace
        net.counters(0)                         # {"tx_bytes": ..., "rx_bytes": ...} of its link

Topology: one namespace per host (`<prefix>h<i>`) and one for the switch (`<prefix>sw`), which
holds a Linux bridge. Host i has one interface, `eth0`, with address `10.77.0.<i+1>/24` on a
private subnet that exists only between these namespaces; the other end of its veth pair is
`h<i>` on the switch's bridge. Nothing is created in the machine's own (root) namespace, so
the host's routes, firewall and interfaces are untouched and deleting the namespaces removes
everything (a veth dies with its namespace).

Shaping: a token bucket (`tc qdisc ... tbf`) at `rate_mbit` on both ends of every link, so
each direction of each host's link carries at most that rate (the host's `eth0` shapes what it
sends, the switch's `h<i>` what it receives). `rate_mbit=None` leaves the links unshaped (a
veth then moves several GB/s, bounded by the CPU). The kernel here has `tbf` but no `netem`:
`delay_ms` adds latency with netem when the kernel has it and is refused otherwise, so the
round trip stays the bare veth's (~25 us).

Two ranks on one host talk over the host's own address, which the kernel routes through its
loopback: only traffic between hosts crosses (and is shaped on) the links, as on a real cluster.

Failures: `cut(i)` takes host i's switch port down (its `eth0` loses carrier: packets in
flight and after are dropped, no connection is reset, as when a cable or a switch port dies)
and `reconnect(i)` brings it back. `subnet=` and `prefix=` let two clusters run side by side
(tests use their own, so a cluster benchmark running meanwhile is not disturbed).

Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): `NetnsUnavailable` says so,
with the command that failed. Teardown runs on `__exit__` (also after an exception or Ctrl-C)
and, for a process that dies of SIGTERM/SIGHUP or simply exits, from a signal handler and an
`atexit` hook: namespaces are deleted and every process started in them is killed.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
"""Host i has address f"{SUBNET}.{i + 1}"."""
HOST_IF = "eth0"


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or veth / tc) cannot be used here."""


def _run(cmd: Sequence[str]) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, list(cmd), proc.stdout, proc.stderr)
    return proc.stdout


def _burst_bytes(rate_mbit: float) -> int:
    """Token bucket depth: 2 ms at the rate, at least 128 KiB (two 64 KiB GSO packets:
    tbf has to hold one whole packet; a veth hands it packets up to 64 KiB)."""
    return max(128 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def check_permitted() -> None:
    """Raise `NetnsUnavailable` naming the reason when this process cannot build the cluster."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "the emulated cluster needs root (network namespaces, veth pairs and tc need "
            "CAP_SYS_ADMIN and CAP_NET_ADMIN); run it as root, e.g. with sudo")
    for tool in ("ip", "tc"):
        if not any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(":") + [
                "/usr/sbin", "/sbin"]):
            raise NetnsUnavailable(f"`{tool}` (iproute2) is not installed")


class EmulatedCluster:
    """`hosts` namespaces on a shaped switch; use as a context manager (see module docstring)."""

    _live: list[EmulatedCluster] = []
    _handlers_installed = False

    def __init__(self, hosts: int, *, rate_mbit: float | None = None,
                 delay_ms: float | None = None, prefix: str | None = None,
                 subnet: str = SUBNET) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be an int in [1, 250], got {hosts!r}")
        parts = subnet.split(".") if isinstance(subnet, str) else []
        if len(parts) != 3 or not all(x.isdigit() and int(x) < 256 for x in parts):
            raise ValueError(f"subnet must be the first three octets of a /24 like "
                             f"'10.77.0', got {subnet!r}")
        self.subnet = subnet
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None (unshaped), got {rate_mbit!r}")
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = prefix or f"fsc{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.host_ns = [f"{self.prefix}h{i}" for i in range(hosts)]
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # -- addresses -----------------------------------------------------------------------
    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": self.hosts,
            "topology": "one namespace per host, each with one veth to a bridge in a switch "
                        "namespace",
            "subnet": f"{self.subnet}.0/24",
            "addresses": [self.address(i) for i in range(self.hosts)],
            "rate_mbit": self.rate_mbit,
            "shaping": (f"tbf rate {self.rate_mbit}mbit burst {_burst_bytes(self.rate_mbit)}B "
                        f"latency 100ms on both ends of every link" if self.rate_mbit
                        else "none (bare veth)"),
            "delay_ms": self.delay_ms,
        }

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        check_permitted()
        self._install_handlers()
        EmulatedCluster._live.append(self)
        self._up = True
        try:
            self._build()
        except subprocess.CalledProcessError as e:
            self.down()
            raise NetnsUnavailable(
                f"building the emulated cluster failed at `{' '.join(e.cmd)}`: "
                f"{(e.stderr or '').strip() or f'exit code {e.returncode}'} (network namespaces "
                f"or veth may not be permitted in this container)") from None
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        if self.delay_ms is not None and not self.netem_available():
            raise NetnsUnavailable(
                f"delay_ms={self.delay_ms} needs the kernel's netem qdisc, which this kernel "
                f"lacks (tc qdisc add ... netem: unknown qdisc); leave delay_ms unset")
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.host_ns):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # both ends are created in their namespaces: nothing appears in the root namespace
            _run(["ip", "-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer",
                  "name", HOST_IF, "netns", ns])
            _run(["ip", "-n", self.switch, "link", "set", f"h{i}", "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", f"h{i}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IF])
            _run(["ip", "-n", ns, "link", "set", HOST_IF, "up"])
            self._shape(ns, HOST_IF)
            self._shape(self.switch, f"h{i}")

    def cut(self, host: int) -> None:
        """Take host `host`'s switch port down: it can no longer reach, or be reached by,
        any other host (its own loopback still works)."""
        _run(["ip", "-n", self.switch, "link", "set", f"h{host}", "down"])

    def reconnect(self, host: int) -> None:
        """Undo `cut(host)`."""
        _run(["ip", "-n", self.switch, "link", "set", f"h{host}", "up"])

    def set_rate(self, rate_mbit: float | None) -> None:
        """Reshape every link (both directions) to `rate_mbit`; None removes the shaping."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None (unshaped), got {rate_mbit!r}")
        self.rate_mbit = rate_mbit
        for i, ns in enumerate(self.host_ns):
            for where, dev in ((ns, HOST_IF), (self.switch, f"h{i}")):
                subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True)  # absent when unshaped
                self._shape(where, dev)

    def _shape(self, ns: str, dev: str) -> None:
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.rate_mbit is None and self.delay_ms is None:
            return
        if self.delay_ms is not None and self.rate_mbit is not None:
            _run([*base, "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"])
            base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent",
                    "1:1", "handle", "10:"]
        elif self.delay_ms is not None:
            _run([*base, "netem", "delay", f"{self.delay_ms}ms"])
            return
        _run([*base, "tbf", "rate", f"{self.rate_mbit}mbit", "burst",
              str(_burst_bytes(self.rate_mbit)), "latency", "100ms"])

    @staticmethod
    def netem_available() -> bool:
        probe = f"fscprobe{os.getpid()}"
        try:
            _run(["ip", "netns", "add", probe])
            try:
                _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                      "netem", "delay", "1ms"])
                return True
            except subprocess.CalledProcessError:
                return False
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)

    def down(self) -> None:
        """Kill what runs in the namespaces and delete them. Idempotent, never raises."""
        if not self._up:
            return
        self._up = False
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.host_ns, self.switch]:
            # a process that escaped its group would keep the namespace's network alive
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self in EmulatedCluster._live:
            EmulatedCluster._live.remove(self)

    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed:
            return
        cls._handlers_installed = True
        atexit.register(cls._teardown_all)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                cls._teardown_all()
                if callable(previous):
                    previous(signum, frame)
                else:
                    raise SystemExit(128 + signum)

            signal.signal(sig, handler)
        # SIGINT stays Python's KeyboardInterrupt: `with` blocks and finally clauses unwind.

    @classmethod
    def _teardown_all(cls) -> None:
        for net in list(cls._live):
            net.down()

    # -- running things inside -----------------------------------------------------------
    def popen(self, host: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` inside host `host`'s namespace, in its own session (so `down()` can
        kill it with everything it started)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.host_ns[host], *cmd],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: int, cmd: Sequence[str], timeout: float = 60) -> str:
        return subprocess.run(["ip", "netns", "exec", self.host_ns[host], *cmd],
                              capture_output=True, text=True, check=True,
                              timeout=timeout).stdout

    def pids(self, host: int) -> list[int]:
        """The processes still running inside host `host`'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.host_ns[host]], capture_output=True,
                             text=True).stdout
        return [int(pid) for pid in out.split()]

    def counters(self, host: int) -> dict[str, int]:
        """Bytes and packets host `host`'s `eth0` sent and received so far (the veth's counters,
        /sys/class/net/eth0/statistics as seen inside the namespace)."""
        out = self.run(host, ["sh", "-c", "cd /sys/class/net/eth0/statistics && "
                              "cat tx_bytes rx_bytes tx_packets rx_packets"])
        tx, rx, txp, rxp = (int(x) for x in out.split())
        return {"tx_bytes": tx, "rx_bytes": rx, "tx_packets": txp, "rx_packets": rxp}

    def qdisc_stats(self, host: int) -> str:
        return self.run(host, ["tc", "-s", "qdisc", "show", "dev", HOST_IF]).strip()

    def measure_link(self, src: int, dst: int, megabytes: float = 20.0) -> float:
        """Push `megabytes` over TCP from host `src` to host `dst`; the achieved Mbit/s."""
        port, nbytes, me = 29411, int(megabytes * 1e6), str(Path(__file__).resolve())
        rx = self.popen(dst, [sys.executable, me, "recv", str(port)], stdout=subprocess.PIPE,
                        text=True)
        try:
            out = self.run(src, [sys.executable, me, "send", self.address(dst), str(port),
                                 str(nbytes)], timeout=300)
            received = int(rx.communicate(timeout=60)[0])
        finally:
            if rx.poll() is None:
                rx.kill()
        if received != nbytes:
            raise RuntimeError(f"link test: sent {nbytes} bytes, received {received}")
        return nbytes * 8 / float(out) / 1e6


def _receive(port: int) -> None:
    """Accept one connection, read it to the end, print the byte count (link test)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    conn, _ = srv.accept()
    n = 0
    while chunk := conn.recv(1 << 20):
        n += len(chunk)
    print(n, flush=True)
    conn.close()


def _send(addr: str, port: int, nbytes: int) -> None:
    """Send `nbytes` to a `_receive`r; print the seconds until it has read them all."""
    for _ in range(200):
        try:
            conn = socket.create_connection((addr, port))
            break
        except OSError:
            time.sleep(0.05)
    t0 = time.perf_counter()
    conn.sendall(bytes(nbytes))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # returns when the receiver has read everything and closed
    print(time.perf_counter() - t0)


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[float | None]:
    """Wait for every process; return each one's exit time (time.monotonic()), None if it did
    not end within `timeout`."""
    deadline = time.monotonic() + timeout
    ended: list[float | None] = [None] * len(procs)
    while time.monotonic() < deadline and any(e is None for e in ended):
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.02)
    return ended


if __name__ == "__main__":  # the two ends of `measure_link`
    if sys.argv[1] == "recv":
        _receive(int(sys.argv[2]))
    else:
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
