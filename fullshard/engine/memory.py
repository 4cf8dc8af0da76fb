"""Bytes the engine holds beyond the shards: unsharded parameters and gradients.

RSS and allocator statistics cannot tell whether sharding works (the allocator keeps freed
buffers), so the engine counts the bytes of every unsharded buffer it allocates -- all-gather
inputs and outputs, the parameter-major copies handed to modules, reduce-scatter inputs and
`no_sync` gradient accumulators -- from allocation until the buffer is actually freed: `track`
attaches a weakref finalizer, so a buffer that autograd (or anyone) still references stays
counted after the engine lets go of it. That is what makes a silent ZeRO-2 (autograd keeping
gathered parameters alive until backward) visible here. Between steps both current figures
must be zero; the peaks show ZeRO-3 against ZeRO-2 and check the planner.

Autograd's own tensors (activations, the unsharded gradients it computes before handing them to
the engine) are not counted: they are the model's, not the engine's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Literal

import torch


class _MemoryTracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.param_bytes = 0
        self.grad_bytes = 0
        self.reset_peaks()

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_param_bytes = self.param_bytes
            self.peak_grad_bytes = self.grad_bytes
            self.peak_total_bytes = self.param_bytes + self.grad_bytes

    def add_param(self, nbytes: int) -> None:
        with self._lock:
            self.param_bytes += nbytes
            self.peak_param_bytes = max(self.peak_param_bytes, self.param_bytes)
            self._update_total()

    def add_grad(self, nbytes: int) -> None:
        with self._lock:
            self.grad_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes)
            self._update_total()

    def _update_total(self) -> None:
        self.peak_total_bytes = max(self.peak_total_bytes, self.param_bytes + self.grad_bytes)


TRACKER = _MemoryTracker()


def track(tensor: torch.Tensor, kind: Literal["param", "grad"]) -> torch.Tensor:
    """Count `tensor`'s bytes as unsharded `kind` bytes until the tensor object is freed.

    Views keep their base tensor alive, so the count lasts as long as any view of it does.
    """
    nbytes = tensor.numel() * tensor.element_size()
    add = TRACKER.add_param if kind == "param" else TRACKER.add_grad
    add(nbytes)
    weakref.finalize(tensor, add, -nbytes)
    return tensor


def memory_stats() -> dict[str, int]:
    """Unsharded bytes the engine holds now and at its peak since the last reset.

    Keys: `unsharded_param_bytes`, `unsharded_grad_bytes` (now), `peak_unsharded_param_bytes`,
    `peak_unsharded_grad_bytes`, `peak_unsharded_bytes` (peak of their sum).
    """
    t = TRACKER
    return {
        "unsharded_param_bytes": t.param_bytes,
        "unsharded_grad_bytes": t.grad_bytes,
        "peak_unsharded_param_bytes": t.peak_param_bytes,
        "peak_unsharded_grad_bytes": t.peak_grad_bytes,
        "peak_unsharded_bytes": t.peak_total_bytes,
    }


def reset_memory_stats() -> None:
    """Set the peaks back to the current figures."""
    TRACKER.reset_peaks()
