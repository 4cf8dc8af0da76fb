"""The compressed wire formats' tensor math (distributed/wire_format.py) and
config.Compression's validation: single process, no collectives."""

from __future__ import annotations

import pytest
import torch

from fullshard.config import Compression
from fullshard.distributed.wire_format import (
    decode,
    encode,
    encode_with_feedback,
    reduce_encoded,
    wire_nbytes,
)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _block_bound(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per element: its block's absmax / 254, the documented int8 error bound, plus fp32
    rounding of the scale arithmetic (a few ulps of absmax)."""
    flat = x.reshape(-1).double()
    n = flat.numel()
    nblocks = (n + block_size - 1) // block_size
    padded = torch.nn.functional.pad(flat, (0, nblocks * block_size - n))
    absmax = padded.view(nblocks, block_size).abs().amax(dim=1)
    per_elem = absmax.repeat_interleave(block_size)[:n]
    return per_elem / 254 + per_elem * 4 * 2.0**-24


def _inputs() -> dict[str, torch.Tensor]:
    g = _gen()
    wide = torch.randn(3000, generator=g) * torch.logspace(-6, 6, 3000)
    return {
        "random": torch.randn(4096, generator=g),
        "large_dynamic_range": wide[torch.randperm(3000, generator=g)],
        "all_zero": torch.zeros(700),
        "single": torch.tensor([-3.25]),
        "not_multiple": torch.randn(1001, generator=g),
        "empty": torch.zeros(0),
        "3d_input_flattened": torch.randn(7, 3, 11, generator=g),
    }


@pytest.mark.parametrize("block_size", [32, 256, 1024])
@pytest.mark.parametrize("name", list(_inputs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_within_block_bound(name, dtype, block_size):
    x = _inputs()[name]
    if name == "large_dynamic_range" and dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # fp16's range
    x = x.to(dtype)
    buf = encode(x, "int8", block_size=block_size)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == wire_nbytes(x.numel(), "int8", block_size=block_size)
    y = decode(buf, x.numel(), dtype, "int8", block_size=block_size)
    assert y.dtype == dtype and y.numel() == x.numel()
    y32 = decode(buf, x.numel(), torch.float32, "int8", block_size=block_size)
    err = (y32.double() - x.reshape(-1).double()).abs()
    assert bool((err <= _block_bound(x.float(), block_size)).all())
    if name == "all_zero":
        assert bool((y32 == 0).all())


def test_int8_bound_is_reached_not_just_respected():
    # a bound that is never approached would hide a too-coarse quantizer: uniform data hits
    # within 5% of absmax/254 somewhere
    x = torch.rand(1 << 14, generator=_gen()) * 2 - 1
    y = decode(encode(x, "int8", block_size=256), x.numel(), torch.float32, "int8",
               block_size=256)
    err = (y - x).abs()
    bound = _block_bound(x, 256)
    assert float((err / bound).max()) > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [0, 1, 5, 1001])
def test_bf16_and_exact_round_trip(dtype, numel):
    x = torch.randn(numel, generator=_gen()).to(dtype)
    exact = encode(x, "exact")
    assert exact.numel() == wire_nbytes(numel, "exact", dtype=dtype)
    assert torch.equal(decode(exact, numel, dtype, "exact"), x)
    half = encode(x, "bf16")
    assert half.numel() == wire_nbytes(numel, "bf16") == 2 * numel
    assert torch.equal(decode(half, numel, dtype, "bf16"), x.to(torch.bfloat16).to(dtype))


def test_wire_nbytes_counts_payload_padding_and_scales():
    assert wire_nbytes(0, "int8", block_size=256) == 0
    assert wire_nbytes(1, "int8", block_size=256) == 4 + 4
    assert wire_nbytes(256, "int8", block_size=256) == 256 + 4
    assert wire_nbytes(257, "int8", block_size=256) == 260 + 8
    assert wire_nbytes(10, "exact", dtype=torch.bfloat16) == 20


def test_2d_rows_encode_as_separate_tensors():
    x = torch.randn(5, 300, generator=_gen())
    rows = encode(x, "int8", block_size=64)
    assert rows.shape == (5, wire_nbytes(300, "int8", block_size=64))
    for i in range(5):
        assert torch.equal(rows[i], encode(x[i], "int8", block_size=64))


def test_nonfinite_blocks_decode_to_nan_and_other_blocks_unaffected():
    x = torch.randn(4 * 64, generator=_gen())
    x[3] = float("inf")
    x[64 + 7] = float("-inf")
    x[128 + 1] = float("nan")
    y = decode(encode(x, "int8", block_size=64), x.numel(), torch.float32, "int8",
               block_size=64)
    assert bool(y[: 3 * 64].isnan().all())
    clean = x[3 * 64:]
    assert bool(((y[3 * 64:] - clean).abs() <= clean.abs().max() / 254 * 1.0001).all())
    # a reduction summing a nonfinite chunk stays nonfinite: the grad scaler sees the overflow
    chunks = torch.stack([x[:64], torch.ones(64)])
    total = reduce_encoded(encode(chunks, "int8", block_size=64), 64, torch.float16, "int8",
                           block_size=64)
    assert not bool(torch.isfinite(total).any())


@pytest.mark.parametrize("fmt", ["int8", "bf16", "exact"])
def test_reduce_encoded_sums_decoded_chunks_in_fp32(fmt):
    n_ranks, numel = 8, 1500
    chunks = torch.randn(n_ranks, numel, generator=_gen()) * 10
    received = encode(chunks, fmt, block_size=128)
    got = reduce_encoded(received, numel, torch.float32, fmt, block_size=128,
                         divisor=n_ranks)
    decoded = decode(received, numel, torch.float32, fmt, block_size=128).double()
    want = decoded.sum(dim=0) / n_ranks
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    as_list = reduce_encoded(list(received), numel, torch.bfloat16, fmt, block_size=128,
                             divisor=n_ranks)
    assert as_list.dtype == torch.bfloat16
    assert torch.equal(as_list, got.to(torch.bfloat16))


def test_reduce_encoded_rejects_wrong_sizes():
    buf = encode(torch.randn(2, 100, generator=_gen()), "int8", block_size=32)
    with pytest.raises(ValueError, match="bytes per row"):
        reduce_encoded(buf, 90, torch.float32, "int8", block_size=32)
    with pytest.raises(ValueError, match="not one of"):
        encode(torch.ones(3), "int4")


def test_error_feedback_carries_the_exact_error():
    x = torch.randn(1000, generator=_gen())
    buf, residual = encode_with_feedback(x, None, "int8", block_size=64)
    decoded = decode(buf, 1000, torch.float32, "int8", block_size=64)
    assert torch.equal(residual, x - decoded)
    # what was sent over two steps plus what is left equals the two inputs exactly (fp32)
    buf2, residual2 = encode_with_feedback(x, residual, "int8", block_size=64)
    decoded2 = decode(buf2, 1000, torch.float32, "int8", block_size=64)
    torch.testing.assert_close(decoded + decoded2 + residual2, 2 * x, rtol=0, atol=1e-6)


# -- config.Compression ---------------------------------------------------------------------


def test_compression_validation_names_what_was_found_and_the_fix():
    with pytest.raises(ValueError, match=r"weights='int4'.*'bf16', 'int8', or None"):
        Compression(weights="int4")
    with pytest.raises(ValueError, match=r"gradients='fp8'"):
        Compression(gradients="fp8")
    with pytest.raises(ValueError, match=r"block_size=100 is not a power of two from 32"):
        Compression(block_size=100)
    with pytest.raises(ValueError, match=r"block_size=8192"):
        Compression(block_size=8192)
    with pytest.raises(TypeError, match=r"block_size must be an int, got float"):
        Compression(block_size=256.0)
    with pytest.raises(TypeError, match=r"block_size must be an int, got bool"):
        Compression(block_size=True)
    with pytest.raises(TypeError):
        Compression("int8")  # keyword-only


def test_compression_shorthand_and_wire_names():
    both = Compression.coerce("int8")
    assert both == Compression(weights="int8", gradients="int8", frozen_weights="int8")
    assert Compression.coerce(" BF16 ").gradients == "bf16"
    assert Compression.coerce("none") is None and Compression.coerce(None) is None
    assert Compression.coerce(Compression()) is None  # nothing compressed
    only = Compression(weights="int8", block_size=64)
    assert Compression.coerce(only) is only
    assert (only.wire_for("weights"), only.wire_for("gradients")) == ("int8", "exact")
    with pytest.raises(ValueError, match="'int8', 'bf16', 'none'"):
        Compression.coerce("int4")
    with pytest.raises(TypeError, match="got int 8"):
        Compression.coerce(8)
    with pytest.raises(ValueError, match="traffic 'grads'"):
        only.wire_for("grads")


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_negative_zero_survives_so_a_reduction_keeps_the_unused_mark(fmt):
    # engine/bucket.py's unused_grad: a parameter no rank used is all -0.0 after the sum
    x = torch.tensor([-0.0, 0.0, 1.5, -0.0, -2.0] + [-0.0] * 300)
    back = decode(encode(x, fmt, block_size=32), x.numel(), torch.float32, fmt, block_size=32)
    assert torch.equal(back.signbit(), x.signbit()) and bool((back[5:] == 0).all())
    unused = torch.full((2, 64), -0.0)
    unused[1, :3] = 0.25  # rank 1 used the first three elements
    total = reduce_encoded(encode(unused, fmt, block_size=32), 64, torch.float32, fmt,
                           block_size=32, divisor=2)
    assert bool(total[3:].signbit().all()) and bool((total[3:] == 0).all())
    assert total[:3].tolist() == [0.125] * 3
