"""The dim-0 shard layout: pure arithmetic, no processes, no state.

A parameter of shape `(d0, *rest)` is split along dim 0 into `S` chunks of `c = ceil(d0 / S)`
rows. Shard-rank `i` owns rows `[i*c, min((i+1)*c, d0))` -- exactly `torch.chunk`, FSDP2 and
DTensor `Shard(0)` -- and keeps them in a buffer of `c` rows whose tail is zero padding. A rank
may own zero real rows (e.g. `d0=5, S=4`: rows per rank 2, 2, 1, 0). A 0-dim parameter is
treated as shape `(1,)`.

Everything the engine needs to place bytes (offsets in flat buffers, how many rows are real)
comes from `ShardLayout`, so it can be tested exhaustively without starting a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_rows(dim0: int, shard_size: int) -> int:
    """Rows in every rank's (padded) shard: `ceil(dim0 / shard_size)`."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if dim0 < 0:
        raise ValueError(f"dim0 must be >= 0, got {dim0}")
    return -(-dim0 // shard_size)


def owned_rows(dim0: int, shard_size: int, shard_rank: int) -> tuple[int, int]:
    """The half-open row range `[start, stop)` that `shard_rank` owns (may be empty)."""
    if not 0 <= shard_rank < shard_size:
        raise ValueError(f"shard_rank must be in [0, {shard_size}), got {shard_rank}")
    c = chunk_rows(dim0, shard_size)
    start = min(shard_rank * c, dim0)
    stop = min(start + c, dim0)
    return start, stop


@dataclass(frozen=True)
class ShardLayout:
    """Where one parameter's rows live when it is split over `shard_size` ranks."""

    shape: torch.Size
    """The original (unsharded) shape; `()` for a 0-dim parameter."""
    shard_size: int
    shard_rank: int

    @property
    def dim0(self) -> int:
        return self.shape[0] if len(self.shape) > 0 else 1

    @property
    def rest(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])

    @property
    def row_numel(self) -> int:
        """Elements in one row (product of the trailing dims)."""
        return math.prod(self.rest)

    @property
    def numel(self) -> int:
        return self.dim0 * self.row_numel

    @property
    def chunk_rows(self) -> int:
        return chunk_rows(self.dim0, self.shard_size)

    @property
    def padded_shard_numel(self) -> int:
        """Elements in this rank's padded shard buffer (the same on every rank)."""
        return self.chunk_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the whole parameter padded to `shard_size * chunk_rows` rows."""
        return self.padded_shard_numel * self.shard_size

    @property
    def owned(self) -> tuple[int, int]:
        return owned_rows(self.dim0, self.shard_size, self.shard_rank)

    @property
    def local_rows(self) -> int:
        """Real (non-padding) rows this rank owns."""
        start, stop = self.owned
        return stop - start

    @property
    def local_shape(self) -> torch.Size:
        """Shape of the user-visible local shard (padding excluded)."""
        return torch.Size((self.local_rows, *self.rest))

    @property
    def padded_shard_shape(self) -> torch.Size:
        return torch.Size((self.chunk_rows, *self.rest))


def shard_tensor(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's padded shard of `full`: a new `(chunk_rows, *rest)` tensor, zero padded."""
    rows = full.reshape(layout.dim0, *layout.rest)
    out = torch.zeros(layout.padded_shard_shape, dtype=full.dtype, device=full.device)
    start, stop = layout.owned
    out[: stop - start].copy_(rows[start:stop])
    return out


def pad_rows(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """`full` as `(shard_size * chunk_rows, *rest)`, zero padded at the end (a copy if needed)."""
    rows = full.reshape(layout.dim0, *layout.rest)
    padded_rows = layout.chunk_rows * layout.shard_size
    if padded_rows == layout.dim0:
        return rows
    out = rows.new_zeros((padded_rows, *layout.rest))
    out[: layout.dim0].copy_(rows)
    return out


def unpad(gathered: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """View the gathered padded rows (`shard_size * chunk_rows` rows, flat or not) as the
    original shape, dropping the padding. No copy."""
    rows = gathered.reshape(-1)[: layout.numel]
    return rows.view(layout.shape)
