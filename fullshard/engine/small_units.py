"""The byte budgets within which the runtime (hooks.py) sends several small units' gathers, or
holds several units' reductions, as one exchange.

[Note: small units travel together]
Each exchange has a fixed cost (on gloo a message round, ~0.1-1 ms in a busy step) that a
small unit cannot hide behind its compute. Where the backend can send several collectives as
one exchange (gloo's pairwise path, comm.all_gather_batch), the runtime gathers ahead, beyond
`prefetch_limit` units, as many more as keep `SMALL_UNITS_BYTES` per rank in flight, in one
exchange, and refills the window only when one of the next `prefetch_limit` units is not in
flight (`_gather_ahead`; the same in ZeRO-3's backward). Reductions of small units wait in a
batch until another unit of the same size would not fit, or backward ends
(`_queue_reductions`); NO_SHARD's all-reduces too (each sends its whole gradients to N-1
peers, so their budget is SMALL_UNITS_BYTES / (N-1); the gradients are `.grad`'s storage, so
waiting costs no memory). The collectives counted stay the algorithm's (one per bucket); only
the messages are fewer. Memory: ZeRO-3 holds the running unit plus at most
max(`prefetch_limit` units, SMALL_UNITS_BYTES per rank gathered) ahead, and up to
SMALL_UNITS_BYTES per rank of unsharded gradients waiting; large units are exactly as without
batching. NCCL issues one collective per bucket as before.
"""

from __future__ import annotations

from fullshard.distributed import comm
from fullshard.distributed.mesh import ShardMesh

SMALL_UNITS_BYTES = 1 << 20
"""Bytes per rank of small units gathered ahead (and of their gradients held) to travel in one
exchange, where the backend allows (see [Note: small units travel together]). A memory
decision: it bounds what ZeRO-3 holds beyond `prefetch_limit` units (at 4 MiB the 8-layer demo
model would be gathered whole), kept apart from comm.COALESCE_BYTES, the size up to which one
exchange is packed into one message, and capped by it."""


def small_units_bytes() -> int:
    """`SMALL_UNITS_BYTES`, within what comm sends as one message (0 when that is off)."""
    return min(SMALL_UNITS_BYTES, max(comm.COALESCE_BYTES, 0))


def gather_batch_bytes(mesh: ShardMesh) -> int:
    """Bytes per rank up to which small units' gathers go together (0: never)."""
    return small_units_bytes() if comm.gathers_segments(mesh.shard) else 0


def reduce_batch_bytes(mesh: ShardMesh) -> int:
    """The same for their reductions: the shard axis's reduce-scatters or, without one
    (NO_SHARD), the all-reduces, which send their whole tensors to each of N-1 peers."""
    if mesh.shard.size > 1:
        return gather_batch_bytes(mesh)
    replicate = mesh.replicate
    if not comm.pairwise_exchanges(replicate):
        return 0
    return small_units_bytes() // (replicate.size - 1)
