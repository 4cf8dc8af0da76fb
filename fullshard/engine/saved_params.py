"""ZeRO-3's saved-tensor hooks: autograd keeps tokens, not gathered parameters, until backward.

[Note: ZeRO-3 and saved tensors]
Autograd saves the unsharded parameters its backward formulas need (a Linear saves its
weight). If those references stayed, ZeRO-3 would quietly hold every unit until backward, i.e.
behave like ZeRO-2 with identical numbers. So while the root runs forward under ZeRO-3 we push
`saved_tensors_hooks`: a saved tensor whose storage is a gathered bucket buffer is packed as a
`SavedParamView` (bucket + offset/size/stride, no data); unpacking it in backward gathers the
unit again (prefetching the one expected next) and returns the same view of the new buffer.
This only works because the tensors handed to modules are views of the tracked buffer, never
copies (see bucket.py). Only the root pushes the hooks: the innermost hooks win and ours
handle every unit.

The runtime (hooks.py) tells `SavedParams` which buffers are gathered (`track` / `untrack`),
pushes the hooks for the root's forward and pops them at its end; unpacking a token calls the
runtime back (`regather`) before the view of the new buffer is returned. What else autograd
holds of a unit, and the Functions that route its gradients: [Note: fullshard and autograd] in
engine/autograd.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fullshard.engine.bucket import Bucket
from fullshard.engine.eager import EagerFn
from fullshard.engine.unit import Unit


class SavedParamView(NamedTuple):
    """What autograd keeps for a saved tensor that is a view of a gathered bucket buffer."""

    unit: Unit
    bucket: Bucket
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SavedParams:
    """The gathered buffers of one runtime, by storage, and the saved-tensor hooks over them."""

    def __init__(self, *, regather: Callable[[Unit], None]) -> None:
        self._regather = regather
        # data_ptr of a gathered bucket buffer -> (unit, bucket); only for buckets whose
        # unsharded buffer is not the shard itself (the runtime tracks none on one rank).
        self._owner: dict[int, tuple[Unit, Bucket]] = {}
        self._hooks: Any = None
        self._eager_pack, self._eager_unpack = EagerFn(self._pack_hook), EagerFn(self._unpack_hook)

    def track(self, unit: Unit) -> None:
        """`unit` is gathered: saved views of its buffers become tokens."""
        for b in unit.buckets:
            assert b.unsharded is not None
            self._owner[b.unsharded.untyped_storage().data_ptr()] = (unit, b)

    def untrack(self, unit: Unit) -> None:
        for b in unit.buckets:
            if b.unsharded is not None:
                self._owner.pop(b.unsharded.untyped_storage().data_ptr(), None)

    def push(self) -> None:
        """Enter the hooks (the root's forward begins)."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._eager_pack.get(), self._eager_unpack.get()
        )
        self._hooks.__enter__()

    def pop(self) -> bool:
        """Leave the hooks if they were pushed (the root's forward ends); whether they were."""
        if self._hooks is None:
            return False
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        return True

    # Under torch.compile the hooks run eagerly: dynamo cannot trace storage pointers and
    # would otherwise try (and recompile) on every tensor autograd saves. They are looked up
    # at every push, disabled once dynamo is imported (eager.py). They call `_pack` and
    # `_unpack` through the instance, so a benchmark or test can wrap those.
    def _pack_hook(self, t: torch.Tensor) -> Any:
        return self._pack(t)

    def _unpack_hook(self, saved: Any) -> torch.Tensor:
        return self._unpack(saved)

    def _pack(self, t: torch.Tensor) -> Any:
        owner = self._owner.get(t.untyped_storage().data_ptr())
        if owner is None or t.dtype != owner[1].compute_dtype:
            return t
        unit, bucket = owner
        return SavedParamView(unit, bucket, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedParamView):
            return saved
        self._regather(saved.unit)
        buf = saved.bucket.unsharded
        assert buf is not None
        return buf.as_strided(saved.size, saved.stride, saved.offset)
