"""The dim-0 shard layout and strategy-name parsing: pure functions, no processes.

The layout is docs/architecture.md's invariant 1.

The layout must be exactly `torch.chunk` / DTensor `Shard(0)`: shard-rank `i` owns rows
`[i*c, min((i+1)*c, d0))` with `c = ceil(d0 / S)`, held in a buffer of `c` rows padded with
zeros; a rank may own no rows; a 0-dim tensor is treated as shape `(1,)`. Round trips through
the padded shards are bit-exact for every dtype.
"""

from __future__ import annotations

import enum
import math

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from fullshard.config import (
    FSDPBucketingStrategy,
    FSDPType,
    ShardingPlan,
    ShardingStrategy,
    resolve_bucketing_strategy,
    resolve_sharding_strategy,
    valid_strategy_names,
)
from fullshard.engine.layout import (
    ShardLayout,
    chunk_rows,
    owned_rows,
    pad_rows,
    shard_tensor,
    unpad,
)
from fullshard.testing import local_rows

# DTensor's own `Shard(0)` split of d0 rows: (local rows, offset) of one rank. torch 2.8 (the
# declared floor) has it only under the private name; later releases made it public.
shard_size_and_offset = (getattr(Shard, "local_shard_size_and_offset", None)
                         or Shard._local_shard_size_and_offset)

WORLD_SIZES = range(1, 9)
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
# Same-width integer dtypes, to compare floating tensors bit for bit (NaN, -0.0 included).
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.complex64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(bits(a), bits(b))


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Distinct, non-zero-ish values (so misplaced padding shows), with special floats."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(n, generator=g, dtype=torch.float64) + 1.5
        if n >= 4:
            t[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
        return t.to(dtype).reshape(shape)
    hi = 100 if dtype in (torch.int8, torch.uint8) else 10**6
    return torch.randint(1, hi, (n,), generator=g).to(dtype).reshape(shape)


def gather_all(full: torch.Tensor, shard_size: int) -> torch.Tensor:
    """What an all-gather of every rank's padded shard produces (rank-major)."""
    shards = [shard_tensor(full, ShardLayout(full.shape, shard_size, r)) for r in range(shard_size)]
    return torch.cat(shards)


# Shapes covering: 0-dim, dim0 < S, dim0 == 0, divisible and not, zero-size trailing dims.
SHAPES = [
    (),
    (1,),
    (2,),
    (5,),
    (7,),
    (8,),
    (13,),
    (0,),
    (0, 4),
    (3, 0),
    (7, 3),
    (13, 5),
    (5, 1),
    (1, 6),
    (37, 16),
    (48, 16),
    (3, 2, 4),
    (5, 3, 3, 3),
]

shapes_st = st.tuples(
    st.integers(0, 3).flatmap(lambda nd: st.tuples(st.integers(0, 40), *[st.integers(0, 4)] * nd)),
    st.booleans(),
).map(lambda t: () if t[1] and len(t[0]) == 1 and t[0][0] == 1 else t[0])
# (the map turns some `(1,)` draws into `()`, so 0-dim tensors are drawn too)


# -- chunk_rows / owned_rows ------------------------------------------------------------------


@pytest.mark.parametrize("shard_size", WORLD_SIZES)
def test_ranges_tile_dim0_exhaustive(shard_size: int) -> None:
    for d0 in range(0, 60):
        c = chunk_rows(d0, shard_size)
        assert c == math.ceil(d0 / shard_size)
        assert c * shard_size >= d0 and (d0 == 0 or (c - 1) * shard_size < d0)
        ranges = [owned_rows(d0, shard_size, i) for i in range(shard_size)]
        expected_stop = 0
        for i, (start, stop) in enumerate(ranges):
            assert 0 <= start <= stop <= d0
            assert stop - start <= c
            if stop > start:  # in order, no gap, no overlap
                assert start == expected_stop == i * c
                expected_stop = stop
            else:  # an empty range sits at the end of the rows
                assert start == stop == min(i * c, d0)
        assert expected_stop == d0
        assert sum(stop - start for start, stop in ranges) == d0
        # Ranks with rows come first; all of them but the last one hold exactly c rows.
        sizes = [stop - start for start, stop in ranges]
        assert sizes == sorted(sizes, reverse=True)
        nonempty = [s for s in sizes if s > 0]
        assert all(s == c for s in nonempty[:-1])


@pytest.mark.parametrize("shard_size", WORLD_SIZES)
def test_ranges_match_torch_chunk_and_dtensor(shard_size: int) -> None:
    for d0 in range(0, 60):
        rows = torch.arange(d0)
        chunks = torch.chunk(rows, shard_size) if d0 else ()
        for i in range(shard_size):
            start, stop = owned_rows(d0, shard_size, i)
            mine = rows[start:stop]
            if i < len(chunks):
                assert torch.equal(mine, chunks[i]), (d0, shard_size, i)
            else:  # torch.chunk yields fewer chunks: the rank owns nothing
                assert mine.numel() == 0, (d0, shard_size, i)
            # DTensor Shard(0): the same local size and (for non-empty shards) offset.
            size, offset = shard_size_and_offset(d0, shard_size, i)
            assert stop - start == size, (d0, shard_size, i)
            if size:
                assert start == offset, (d0, shard_size, i)


@pytest.mark.parametrize("shard_size", WORLD_SIZES)
def test_padded_shards_match_dtensor_split(shard_size: int) -> None:
    for d0 in range(0, 30):
        full = torch.arange(1, 2 * d0 + 1, dtype=torch.float32).reshape(d0, 2)
        split, pads = Shard(0)._split_tensor(full, shard_size, with_padding=True)
        for i in range(shard_size):
            layout = ShardLayout(full.shape, shard_size, i)
            mine = shard_tensor(full, layout)
            assert_bit_equal(mine, split[i])
            assert layout.chunk_rows - layout.local_rows == pads[i]


@pytest.mark.parametrize(
    "call",
    [
        lambda: chunk_rows(5, 0),
        lambda: chunk_rows(5, -2),
        lambda: chunk_rows(-1, 2),
        lambda: owned_rows(5, 4, 4),
        lambda: owned_rows(5, 4, -1),
        lambda: owned_rows(5, 0, 0),
        lambda: owned_rows(-3, 2, 0),
        lambda: ShardLayout(torch.Size((5,)), 4, 4).owned,
        lambda: ShardLayout(torch.Size((5,)), 0, 0).chunk_rows,
    ],
    ids=[
        "chunk_rows-S0",
        "chunk_rows-S-neg",
        "chunk_rows-dim0-neg",
        "owned_rows-rank-eq-S",
        "owned_rows-rank-neg",
        "owned_rows-S0",
        "owned_rows-dim0-neg",
        "layout-rank-eq-S",
        "layout-S0",
    ],
)
def test_invalid_inputs_raise_value_error(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"shard_size|shard_rank|dim0"):
        call()


# -- ShardLayout ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("shard_size", WORLD_SIZES)
def test_layout_properties(shape: tuple[int, ...], shard_size: int) -> None:
    size = torch.Size(shape)
    d0 = shape[0] if shape else 1
    rest = shape[1:]
    c = math.ceil(d0 / shard_size)
    local = []
    for i in range(shard_size):
        layout = ShardLayout(size, shard_size, i)
        assert layout.dim0 == d0
        assert layout.rest == rest
        assert layout.row_numel == math.prod(rest)
        assert layout.numel == math.prod(shape) == torch.empty(shape).numel()
        assert layout.chunk_rows == c
        assert layout.padded_shard_shape == torch.Size((c, *rest))
        assert layout.padded_shard_numel == c * math.prod(rest)
        assert layout.padded_numel == shard_size * layout.padded_shard_numel
        assert layout.owned == owned_rows(d0, shard_size, i)
        assert layout.local_rows == layout.owned[1] - layout.owned[0]
        assert layout.local_shape == torch.Size((layout.local_rows, *rest))
        local.append(layout.local_rows)
    assert sum(local) == d0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_round_trip_bit_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    full = make_tensor(shape, dtype)
    for shard_size in WORLD_SIZES:
        check_round_trip(full, shard_size)


def check_round_trip(full: torch.Tensor, shard_size: int) -> None:
    """shard -> every rank's padded shard -> concatenate -> unpad gives `full` back, exactly;
    the padding is zero; each shard's real rows are `torch.chunk`'s; pad_rows agrees."""
    d0 = full.shape[0] if full.dim() else 1
    rows = full.reshape(d0, *full.shape[1:])
    chunks = torch.chunk(rows, shard_size) if d0 else ()
    for i in range(shard_size):
        layout = ShardLayout(full.shape, shard_size, i)
        shard = shard_tensor(full, layout)
        assert shard.shape == layout.padded_shard_shape  # every rank holds chunk_rows rows
        assert shard.dtype == full.dtype
        assert shard.is_contiguous()
        n = layout.local_rows
        assert not shard[n:].any(), f"padding of rank {i} is not zero"
        assert_bit_equal(shard[:n], local_rows(full, shard_size, i))
        if i < len(chunks):
            assert_bit_equal(shard[:n], chunks[i])
        else:
            assert n == 0
        # the shard is a copy: writing it leaves `full` alone
        assert (
            full.numel() == 0
            or shard.numel() == 0
            or (shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr())
        )
    layout = ShardLayout(full.shape, shard_size, 0)
    gathered = gather_all(full, shard_size)
    assert gathered.shape == (shard_size * layout.chunk_rows, *layout.rest)
    assert gathered.numel() == layout.padded_numel
    assert_bit_equal(pad_rows(full, layout), gathered)
    back = unpad(gathered, layout)
    assert_bit_equal(back, full)
    flat_back = unpad(gathered.reshape(-1), layout)  # the flat form a collective hands back
    assert_bit_equal(flat_back, full)
    if back.numel():  # unpad is a view, never a copy
        assert back.data_ptr() == gathered.data_ptr()


@settings(max_examples=300, deadline=None)
@given(
    shape=shapes_st,
    shard_size=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    shape: tuple[int, ...], shard_size: int, dtype: torch.dtype, seed: int
) -> None:
    check_round_trip(make_tensor(shape, dtype, seed), shard_size)


@settings(max_examples=500, deadline=None)
@given(d0=st.integers(0, 10_000), shard_size=st.integers(1, 64))
def test_ranges_property(d0: int, shard_size: int) -> None:
    c = chunk_rows(d0, shard_size)
    assert c == -(-d0 // shard_size)
    pos = 0
    for i in range(shard_size):
        start, stop = owned_rows(d0, shard_size, i)
        assert start == min(i * c, d0) and stop == min((i + 1) * c, d0)
        assert start == pos or start == stop == d0
        pos = stop
        size, offset = shard_size_and_offset(d0, shard_size, i)
        assert (stop - start, start if size else offset) == (size, offset)
    assert pos == d0


def test_pad_rows_is_a_view_when_divisible() -> None:
    full = make_tensor((8, 3), torch.float32)
    layout = ShardLayout(full.shape, 4, 0)
    assert pad_rows(full, layout).data_ptr() == full.data_ptr()
    odd = make_tensor((7, 3), torch.float32)
    padded = pad_rows(odd, ShardLayout(odd.shape, 4, 0))
    assert padded.shape == (8, 3) and not padded[7:].any()
    assert_bit_equal(padded[:7], odd)


def test_zero_dim_is_one_row() -> None:
    full = torch.tensor(0.8)
    layout = ShardLayout(full.shape, 3, 0)
    assert (layout.dim0, layout.rest, layout.numel) == (1, (), 1)
    assert layout.local_shape == (1,) and layout.padded_shard_shape == (1,)
    for r in (1, 2):  # the other ranks own no real row but still hold one (zero) row
        other = ShardLayout(full.shape, 3, r)
        assert other.local_shape == (0,) and not shard_tensor(full, other).any()
    back = unpad(gather_all(full, 3), layout)
    assert back.shape == () and back.item() == pytest.approx(0.8)


def test_rank_owning_nothing() -> None:
    # d0=5 over 4 ranks: 2, 2, 1, 0 rows; d0=2 over 8 ranks: 1, 1, 0, ...
    assert [ShardLayout(torch.Size((5, 2)), 4, r).local_rows for r in range(4)] == [2, 2, 1, 0]
    assert [ShardLayout(torch.Size((2,)), 8, r).local_rows for r in range(8)] == [1, 1] + [0] * 6
    layout = ShardLayout(torch.Size((5, 2)), 4, 3)
    shard = shard_tensor(make_tensor((5, 2), torch.float32), layout)
    assert shard.shape == (2, 2) and not shard.any()


# -- strategy parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "name", "reshard", "no_shard", "hybrid"),
    [
        (FSDPType.ZERO3, "ZERO3", True, False, False),
        (FSDPType.ZERO2, "ZERO2", False, False, False),
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", True, False, False),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False, False, False),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", False, True, False),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True, False, True),
        (torch_fsdp.ShardingStrategy.FULL_SHARD, "FULL_SHARD", True, False, False),
        (torch_fsdp.ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False, False, False),
        (torch_fsdp.ShardingStrategy.NO_SHARD, "NO_SHARD", False, True, False),
        (torch_fsdp.ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True, False, True),
        (
            torch_fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2,
            "_HYBRID_SHARD_ZERO2",
            False,
            False,
            True,
        ),
        ("zero3", "ZERO3", True, False, False),
        ("Zero2", "ZERO2", False, False, False),
        ("full_shard", "FULL_SHARD", True, False, False),
        (" Shard_Grad_Op ", "SHARD_GRAD_OP", False, False, False),
        ("no_shard", "NO_SHARD", False, True, False),
        ("hybrid_SHARD", "HYBRID_SHARD", True, False, True),
    ],
    ids=repr,
)
def test_resolve_sharding_strategy(spelling, name, reshard, no_shard, hybrid) -> None:  # type: ignore[no-untyped-def]
    plan = resolve_sharding_strategy(spelling)
    assert isinstance(plan, ShardingPlan)
    assert (plan.name, plan.reshard_after_forward, plan.no_shard, plan.hybrid) == (
        name,
        reshard,
        no_shard,
        hybrid,
    )
    assert resolve_sharding_strategy(plan) is plan  # idempotent


def test_every_torch_sharding_strategy_is_accepted() -> None:
    for member in torch_fsdp.ShardingStrategy:
        assert resolve_sharding_strategy(member).name == member.name


class _Other(enum.Enum):
    ZERO4 = "ZERO4"


@pytest.mark.parametrize(
    "bad", ["ZERO4", "", "full-shard", "DDP", _Other.ZERO4, FSDPBucketingStrategy.BLOCK], ids=repr
)
def test_unknown_sharding_strategy_lists_valid_names(bad: object) -> None:
    with pytest.raises(ValueError, match="Unknown sharding strategy") as info:
        resolve_sharding_strategy(bad)
    for name in ("ZERO2", "ZERO3", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
        assert name in str(info.value)
    assert set(valid_strategy_names()) >= {"ZERO2", "ZERO3", "NO_SHARD", "HYBRID_SHARD"}


@pytest.mark.parametrize("bad", [3, None, 2.0, True, ["ZERO3"], object()], ids=repr)
def test_sharding_strategy_of_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="sharding_strategy"):
        resolve_sharding_strategy(bad)


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (FSDPBucketingStrategy.NONE, FSDPBucketingStrategy.NONE),
        (FSDPBucketingStrategy.LAYER, FSDPBucketingStrategy.LAYER),
        (FSDPBucketingStrategy.BLOCK, FSDPBucketingStrategy.BLOCK),
        ("none", FSDPBucketingStrategy.NONE),
        ("Layer", FSDPBucketingStrategy.LAYER),
        (" BLOCK ", FSDPBucketingStrategy.BLOCK),
        ("bLoCk", FSDPBucketingStrategy.BLOCK),
    ],
    ids=repr,
)
def test_resolve_bucketing_strategy(spelling: object, expected: FSDPBucketingStrategy) -> None:
    assert resolve_bucketing_strategy(spelling) is expected


@pytest.mark.parametrize("bad", ["PARAM", "", "blocks"], ids=repr)
def test_unknown_bucketing_strategy_lists_valid_names(bad: object) -> None:
    with pytest.raises(ValueError, match="Unknown bucketing strategy") as info:
        resolve_bucketing_strategy(bad)
    for name in ("NONE", "LAYER", "BLOCK"):
        assert name in str(info.value)


@pytest.mark.parametrize("bad", [1, 2.5, ["BLOCK"], FSDPType.ZERO3], ids=repr)
def test_bucketing_strategy_of_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="bucketing"):
        resolve_bucketing_strategy(bad)
