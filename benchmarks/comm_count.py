"""Count the torch.distributed collectives any implementation issues, by wrapping c10d.

fullshard counts its own collectives (`fullshard.comm_stats()`); FSDP2, DDP and DeepSpeed do
not, so `install()` replaces the collective functions in both `torch.distributed` and
`torch.distributed.distributed_c10d` with counting wrappers. Callers look them up at call time
(`dist.all_gather_single(...)`), so every call is seen. A deprecated alias that forwards to the
new name (`all_gather_into_tensor` -> `all_gather_single`) is counted once, at the outermost
call. DDP's C++ reducer calls gloo directly; the benchmark routes it through a comm hook that
calls `dist.all_reduce` so it shows up here (see `impls.py`).

Per kind, the counters hold, like `fullshard.comm_stats()`:
- `calls`;
- `bytes`: the logical payload -- an all-gather's full output, a reduce-scatter's full input,
  an all-reduce's or broadcast's tensor;
- `wire_bytes`: what this rank sends under a ring algorithm with the backend's actual
  algorithm: all-gather and reduce-scatter `b*(N-1)/N`, all-reduce `2*b*(N-1)/N`, broadcast `b`;
  on gloo a reduce-scatter is an all-reduce plus a chunk (PyTorch PR #118911), so it costs
  `2*b*(N-1)/N`; a point-to-point send (`isend`/`send`, kind `p2p_send`) costs its tensor
  (receives are not counted: the peer's send already is);
- `call_s`: seconds spent inside the calls (for async calls only the time to issue them).

Counting is switched on only around the measured step (`start()` ... `stop()`), so the other
steps pay one attribute check per call.

Install it before importing fullshard: its comm module binds some collectives at import time.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p_send")

# function name -> (kind, argument holding the logical payload)
_TARGETS = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "isend": ("p2p_send", "tensor"),
    "send": ("p2p_send", "tensor"),
}


def ring_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends for a collective of `nbytes` logical payload in a ring algorithm."""
    if world <= 1:
        return 0.0
    share = nbytes * (world - 1) / world
    shares = {"all_gather": share, "reduce_scatter": share, "scatter": share,
              "all_reduce": 2 * share}
    return shares.get(kind, float(nbytes))  # broadcast, p2p_send: the payload itself


def wire_bytes(kind: str, nbytes: float, world: int, backend: str) -> float:
    """`ring_bytes`, except gloo's reduce-scatter, which is an all-reduce underneath."""
    if kind == "reduce_scatter" and backend == "gloo":
        return ring_bytes("all_reduce", nbytes, world)
    return ring_bytes(kind, nbytes, world)


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.active = False
            self.stats = {k: {"calls": 0, "bytes": 0, "wire_bytes": 0, "call_s": 0.0}
                          for k in KINDS}

    def wrap(self, fn: Callable[..., Any], kind: str, payload_arg: str) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            # Not counting, or an alias forwarding to another wrapped collective (count once).
            if not self.active or getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            self._local.depth = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._local.depth = 0
                self._add(kind, bound.get(payload_arg), bound.get("group"), elapsed)

        counted.__wrapped_by_bench__ = True  # type: ignore[attr-defined]
        return counted

    def _add(self, kind: str, payload: Any, group: Any, elapsed: float) -> None:
        tensors = payload if isinstance(payload, list | tuple) else [payload]
        nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        try:
            world = dist.get_world_size(group)
            backend = str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError):  # a group object c10d does not know: assume world
            world, backend = dist.get_world_size(), str(dist.get_backend()).lower()
        with self._lock:
            s = self.stats[kind]
            s["calls"] += 1
            s["bytes"] += nbytes
            s["wire_bytes"] += int(wire_bytes(kind, nbytes, world, backend))
            s["call_s"] += elapsed


COUNTER = _Counter()


def install() -> None:
    """Wrap the collectives (idempotent). They count only between `start()` and `stop()`;
    outside that window a wrapper costs one attribute check."""
    for name, (kind, payload_arg) in _TARGETS.items():
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__wrapped_by_bench__", False):
            continue
        counted = COUNTER.wrap(original, kind, payload_arg)
        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)


def start() -> None:
    """Zero the counters and start counting."""
    COUNTER.reset()
    COUNTER.active = True


def stop() -> dict[str, dict[str, float]]:
    """Stop counting; `{kind: {"calls", "bytes", "wire_bytes", "call_s"}}` since `start()`."""
    with COUNTER._lock:
        COUNTER.active = False
        return {k: dict(v) for k, v in COUNTER.stats.items()}
