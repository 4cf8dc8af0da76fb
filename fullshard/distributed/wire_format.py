"""Compressed wire formats: the tensor math that turns a flat tensor into the bytes a
collective moves and back (no collectives here; the seam, unit_comm.py, calls it).

Formats (`fmt`):
- "exact": the tensor's own bytes; decoding is the identity (the wire dtype is `out_dtype`).
- "bf16": a cast to bfloat16 (2 bytes per element); decoding casts to `out_dtype`.
- "int8": block-wise int8 as ZeRO++'s qwZ. The flat tensor is cut into blocks of
  `block_size` elements (the last one shorter); each block gets one fp32 scale,
  `absmax / 127`, and its elements become `round(x / scale)` in [-127, 127]. Decoding gives
  `q * scale`, so the error of an element is at most scale / 2 = absmax / 254 of its block
  (up to fp32 rounding, ~1e-7 relative to absmax; decoding into bf16 or fp16 adds that
  dtype's own rounding of the result). A block of zeros gets scale 0 and decodes
  to exact zeros; -0.0 decodes to -0.0 (`NEGATIVE_ZERO`), as bf16 keeps it too. (A block
  whose absmax is below ~1.8e-43, where absmax / 127 underflows to 0, decodes to zeros
  too: its error is that absmax.)

int8 buffer layout, one contiguous uint8 tensor per tensor (or per row of a 2-d input):
`[numel int8 values][0-3 zero bytes to a multiple of 4][nblocks fp32 scales]`, so a
transport moves one byte tensor and `wire_nbytes` is always a multiple of 4. Decoding views
the scales as fp32 in place: a buffer must start at a 4-byte-aligned offset (a fresh tensor,
or a slice of a concatenation of int8 buffers, is). A bf16 buffer is 2 * numel bytes and
must start 2-byte aligned.

Nonfinite inputs are propagated, never raised: a block holding any inf or NaN gets a
nonfinite scale and zero values, and decodes to all NaN. So an fp16 gradient overflow under
'16-mixed' stays visible to the grad scaler after a compressed reduction (it checks
finiteness), and a nonfinite weight -- a bug upstream -- shows as a NaN loss. Raising would
need a host sync on every call.

Everything is vectorized over blocks and rows and uses no host syncs, so it runs the same
on CUDA; the numbers are computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WIRE_FORMATS = ("exact", "bf16", "int8")

INT8_MAX = 127

NEGATIVE_ZERO = -128
"""The int8 code of an element that is exactly -0.0 (quantized values use -127..127): it
decodes to -0.0, so a reduction keeps the engine's mark of a gradient no rank produced (all
-0: engine/bucket.py's `unused_grad`), which a plain 0 would turn into +0."""


def _check(fmt: str, block_size: int) -> None:
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"wire format {fmt!r} is not one of {WIRE_FORMATS}")
    if fmt == "int8" and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        or block_size % 4
    ):
        raise ValueError(
            f"block_size={block_size!r} must be a positive multiple of 4 for int8 "
            f"(fullshard.config.Compression takes powers of two from 32 to 4096)"
        )


def _payload_nbytes(numel: int) -> int:
    return (numel + 3) // 4 * 4


def _nblocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def wire_nbytes(
    numel: int, fmt: str, *, block_size: int = 256, dtype: torch.dtype = torch.float32
) -> int:
    """The exact number of bytes `encode` produces for `numel` elements (`dtype` matters only
    for "exact", whose bytes are the tensor's own)."""
    _check(fmt, block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if fmt == "exact":
        return numel * dtype.itemsize
    if fmt == "bf16":
        return 2 * numel
    return _payload_nbytes(numel) + 4 * _nblocks(numel, block_size)


def encode(tensor: torch.Tensor, fmt: str, *, block_size: int = 256) -> torch.Tensor:
    """`tensor` flattened and encoded as one uint8 buffer of `wire_nbytes(tensor.numel())`
    bytes. A 2-d tensor is encoded row by row (each row its own blocks, e.g. the chunks an
    all-to-all sends to each rank): the result is `[rows, wire_nbytes(cols)]`."""
    _check(fmt, block_size)
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() == 2 else tensor.reshape(1, -1)
    if fmt == "exact":
        out = rows.contiguous().view(torch.uint8)
    elif fmt == "bf16":
        out = rows.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:
        out = _encode_int8(rows, block_size)
    return out if tensor.dim() == 2 else out.reshape(-1)


def _encode_int8(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    n_rows, numel = rows.shape
    nblocks = _nblocks(numel, block_size)
    payload = _payload_nbytes(numel)
    out = torch.zeros(n_rows, payload + 4 * nblocks, dtype=torch.uint8, device=rows.device)
    if numel == 0:
        return out
    blocks = _as_blocks(rows, numel, nblocks, block_size)
    # absmax without a temporary (aminmax is ~50x slower on CPU); NaN and inf propagate
    scale = torch.maximum(blocks.amax(dim=2), blocks.amin(dim=2).neg_()).div_(INT8_MAX)
    usable = torch.isfinite(scale) & (scale > 0)
    inverse = torch.where(usable, scale.reciprocal(), torch.zeros_like(scale))
    negative_zero = blocks.view(torch.int32) == _NEGATIVE_ZERO_BITS
    q = blocks * inverse.unsqueeze(2)
    q.round_().clamp_(-INT8_MAX, INT8_MAX)
    # a nonfinite block sends zeros (casting NaN to int8 is undefined); its scale carries it.
    # (its inverse is 0: only its inf and NaN elements are NaN here)
    q.nan_to_num_(nan=0.0).masked_fill_(negative_zero, NEGATIVE_ZERO)
    out[:, :numel].view(torch.int8).copy_(q.view(n_rows, nblocks * block_size)[:, :numel])
    out[:, payload:].copy_(scale.contiguous().view(torch.uint8))
    return out


_NEGATIVE_ZERO_BITS = -(2**31)  # -0.0 as an fp32 bit pattern read as int32


def _as_blocks(rows: torch.Tensor, numel: int, nblocks: int, block_size: int) -> torch.Tensor:
    """`rows` in fp32 as `[rows, nblocks, block_size]`, the last block padded with zeros: a
    view when nothing needs converting or padding, else one copy."""
    padded = nblocks * block_size
    if padded == numel and rows.dtype == torch.float32 and rows.is_contiguous():
        return rows.view(rows.shape[0], nblocks, block_size)
    blocks = torch.empty(rows.shape[0], padded, dtype=torch.float32, device=rows.device)
    blocks[:, :numel].copy_(rows)
    blocks[:, numel:].zero_()
    return blocks.view(rows.shape[0], nblocks, block_size)


def decode(
    buffer: torch.Tensor,
    numel: int,
    out_dtype: torch.dtype,
    fmt: str,
    *,
    block_size: int = 256,
) -> torch.Tensor:
    """The flat tensor of `numel` elements in `out_dtype` that `buffer` encodes (a 2-d buffer
    from a 2-d `encode`: `[rows, numel]`)."""
    rows = buffer.reshape(buffer.shape[0], -1) if buffer.dim() == 2 else buffer.reshape(1, -1)
    expected = wire_nbytes(numel, fmt, block_size=block_size, dtype=out_dtype)
    if buffer.dtype != torch.uint8 or rows.shape[1] != expected:
        raise ValueError(
            f"a {fmt!r} buffer for {numel} elements must be uint8 with {expected} bytes per row, "
            f"got {buffer.dtype} with {rows.shape[1]}"
        )
    if numel == 0:
        out = torch.zeros(rows.shape[0], 0, dtype=out_dtype, device=buffer.device)
    elif fmt == "exact":
        out = rows.view(out_dtype)
    elif fmt == "bf16":
        out = rows.view(torch.bfloat16).to(out_dtype)
    else:
        out = _decode_int8(rows, numel, block_size).to(out_dtype)
    return out if buffer.dim() == 2 else out.reshape(-1)


def _decode_int8(rows: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    n_rows = rows.shape[0]
    nblocks = _nblocks(numel, block_size)
    payload = _payload_nbytes(numel)
    scale = rows[:, payload:].contiguous().view(torch.float32)  # [rows, nblocks]
    q = rows[:, :numel].view(torch.int8)
    values = _as_blocks(q, numel, nblocks, block_size)
    values.mul_(scale.unsqueeze(2))
    flat = values.view(n_rows, nblocks * block_size)[:, :numel]
    return flat.masked_fill_(q == NEGATIVE_ZERO, -0.0)


def reduce_encoded(
    received: torch.Tensor | Sequence[torch.Tensor],
    numel: int,
    reduce_dtype: torch.dtype,
    fmt: str,
    *,
    block_size: int = 256,
    divisor: int = 1,
) -> torch.Tensor:
    """qgZ's reduction: the N ranks' encoded chunks destined for this rank (after the
    all-to-all: a `[N, nbytes]` tensor or N buffers, in rank order) decoded into fp32, summed
    in fp32 in rank order (never in int8), divided by `divisor` (N for a mean) and cast to
    `reduce_dtype`."""
    if isinstance(received, torch.Tensor):
        stacked = received
    else:
        stacked = torch.stack([b.reshape(-1) for b in received])
    if stacked.dim() != 2 or stacked.shape[0] == 0:
        raise ValueError(
            f"received must hold one encoded buffer per rank ([N, nbytes], N >= 1), got shape "
            f"{tuple(stacked.shape)}"
        )
    chunks = decode(stacked, numel, torch.float32, fmt, block_size=block_size)
    total = chunks[0].clone()
    for chunk in chunks[1:]:  # ranks, not blocks: N additions in a fixed order
        total.add_(chunk)
    if divisor != 1:
        total.div_(divisor)
    return total.to(reduce_dtype)


def encode_with_feedback(
    tensor: torch.Tensor, residual: torch.Tensor | None, fmt: str, *, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback: encode `tensor + residual` (residual: the fp32 error left from the
    previous call on the same shard, or None) and return the buffer and the new residual,
    the fp32 error of this encoding, to add before the next one."""
    target = tensor.float() if residual is None else tensor.float() + residual
    buffer = encode(target, fmt, block_size=block_size)
    numel = target.shape[1] if target.dim() == 2 else target.numel()
    decoded = decode(buffer, numel, torch.float32, fmt, block_size=block_size)
    return buffer, target - decoded.reshape(target.shape)
