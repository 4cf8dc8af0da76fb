"""The pairwise gloo collectives in `fullshard.distributed.comm` against their definitions.

The engine tests check these end to end (parity with one process); here each exchange is
checked on its own, on 2 and 3 ranks, with the awkward shapes: pieces whose last chunks are
short or empty (padding), one rank owning nothing, and what the counters say was sent.
"""

from __future__ import annotations

import pytest
import torch

from fullshard.distributed import comm, gloo
from fullshard.engine.layout import ShardLayout
from fullshard.engine.layout import pad_rows as pad

# (rows, cols) of each parameter in one bucket: 5 and 7 rows leave padding on 2 and 3 ranks,
# 1 row leaves ranks with nothing, 6 rows divide evenly.
SHAPES = [(5, 3), (1, 4), (7, 2), (6, 1)]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def group(request):
    from fullshard.testing import DistributedGroup

    with DistributedGroup(request.param) as g:
        yield g


def _grads(rank: int) -> list[torch.Tensor]:
    """Every rank's own 'unsharded gradients', distinct per rank and element."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


# (COALESCE_BYTES, SMALL_PIECE_BYTES): one message per peer; every piece a message of its own;
# a message per piece of more than 16 bytes per rank and one for the others (2 of 4 pieces
# on 2 and 3 ranks: see SHAPES).
EXCHANGES = {"coalesced": (1 << 20, gloo.SMALL_PIECE_BYTES), "per-piece": (0, 0),
             "small-pieces-together": (0, 16)}


def _set_sizes(exchange: str) -> None:
    """Set the thresholds in this rank process (every call sets them again)."""
    comm.COALESCE_BYTES, gloo.SMALL_PIECE_BYTES = EXCHANGES[exchange]


def _reduce_scatter_of_segments(exchange: str) -> dict:
    _set_sizes(exchange)
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    layouts = [ShardLayout(torch.Size(s), size, rank) for s in SHAPES]
    sizes = [lay.padded_shard_numel for lay in layouts]
    out = torch.full((sum(sizes),), float("nan"))
    comm.reset_comm_stats()
    grads = [g.reshape(-1) for g in _grads(rank)]
    comm.reduce_scatter_batch([(out, grads, sizes, None)], shard, async_op=True)[0].wait()
    # The definition: every rank's gradients summed in rank order, this rank's padded rows.
    total = [sum(parts) for parts in zip(*(_grads(r) for r in range(size)))]
    expected = []
    for g, lay in zip(total, layouts):
        rows = torch.zeros(lay.padded_shard_shape)
        start, stop = lay.owned
        mine = g[start:stop]
        rows[: mine.shape[0]] = mine
        expected.append(rows.reshape(-1))
    sent = sum(lay.numel - lay.local_rows * lay.row_numel for lay in layouts) * 4
    stats = comm.comm_stats()["reduce_scatter"]
    # The packed form (rank-major, padded: what NCCL and no_sync reduce) gives the same.
    packed = torch.cat([
        torch.cat([pad(g, lay)[r * lay.chunk_rows : (r + 1) * lay.chunk_rows].reshape(-1)
                   for g, lay in zip(_grads(rank), layouts)])
        for r in range(size)
    ])
    from_packed = torch.empty(sum(sizes))
    comm.reduce_scatter(from_packed, packed, shard)
    return {
        "out": out,
        "from_packed": from_packed,
        "expected": torch.cat(expected),
        "stats": stats,
        "real_bytes_of_peers": sent,
        "logical_bytes": size * sum(sizes) * 4,
    }


@pytest.mark.parametrize("exchange", list(EXCHANGES))
def test_reduce_scatter_segments_equals_the_definition(group, exchange):
    for got in group.run(_reduce_scatter_of_segments, exchange):
        torch.testing.assert_close(got["out"], got["expected"], rtol=0, atol=0)
        torch.testing.assert_close(got["from_packed"], got["expected"], rtol=0, atol=0)
        assert got["stats"]["calls"] == 1
        assert got["stats"]["bytes"] == got["logical_bytes"]
        # only the real rows of the peers' chunks go on the wire, never padding
        assert got["stats"]["wire_bytes"] == got["real_bytes_of_peers"]


def _all_gather_segments(exchange: str) -> list[torch.Tensor]:
    _set_sizes(exchange)
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    layouts = [ShardLayout(torch.Size(s), size, rank) for s in SHAPES]
    sizes = [lay.padded_shard_numel for lay in layouts]
    mine = torch.arange(sum(sizes), dtype=torch.float32) + 1000 * rank
    out = torch.empty(size * sum(sizes))
    comm.all_gather(out, mine, shard, async_op=True, segments=sizes).wait()
    # Segment-major: piece j of every rank in rank order, then piece j + 1.
    pieces = [torch.split(mine - 1000 * rank + 1000 * r, sizes) for r in range(size)]
    expected = torch.cat([torch.cat([pieces[r][j] for r in range(size)])
                          for j in range(len(sizes))])
    return [out, expected]


@pytest.mark.parametrize("exchange", list(EXCHANGES))
def test_segmented_all_gather_lands_each_piece_in_place(group, exchange):
    for out, expected in group.run(_all_gather_segments, exchange):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _messages_per_peer(exchange: str) -> dict:
    """Point-to-point sends of one labelled segmented all-gather and reduce-scatter."""
    _set_sizes(exchange)
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    layouts = [ShardLayout(torch.Size(s), size, rank) for s in SHAPES]
    sizes = [lay.padded_shard_numel for lay in layouts]
    sends = []
    isend = comm.dist.isend
    comm.dist.isend = lambda t, *a, **k: sends.append(t.numel()) or isend(t, *a, **k)
    try:
        out = torch.empty(size * sum(sizes))
        comm.all_gather(out, torch.ones(sum(sizes)), shard, segments=sizes, label="u", check=True)
        gather_sends, sends[:] = len(sends), []
        grads = [g.reshape(-1) for g in _grads(rank)]
        comm.reduce_scatter_batch([(torch.empty(sum(sizes)), grads, sizes, "u")], shard)
        reduce_sends = len(sends)
    finally:
        comm.dist.isend = isend
    return {"gather": gather_sends, "reduce": reduce_sends}


def test_small_segmented_exchanges_send_one_message_per_peer(group):
    """Below COALESCE_BYTES a bucket's pieces travel together, the divergence header folded
    into the same message: one message per peer, not one per piece -- the fixed cost of
    small units."""
    peers = group.world_size - 1
    for got in group.run(_messages_per_peer, "coalesced"):
        assert got == {"gather": peers, "reduce": peers}
    for got in group.run(_messages_per_peer, "per-piece"):  # what large buckets do
        assert got["gather"] == peers * (1 + len(SHAPES))  # a header, then each piece
    # ... except with their small pieces (biases, norms) in one message: header, 2 pieces, 1
    for got in group.run(_messages_per_peer, "small-pieces-together"):
        assert got["gather"] == peers * (1 + 2 + 1)
        assert got["reduce"] <= peers * (1 + 2 + 1)  # a rank sends no empty chunk


def _posting_order(exchange: str) -> dict:
    """The order one rank posts the point-to-point messages of unlabelled (headerless)
    exchanges in: 'r' for a receive, 's' for a send."""
    _set_sizes(exchange)
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    sizes = [ShardLayout(torch.Size(s), size, rank).padded_shard_numel for s in SHAPES]
    log: list[str] = []
    isend, irecv = comm.dist.isend, comm.dist.irecv
    comm.dist.isend = lambda *a, **k: log.append("s") or isend(*a, **k)
    comm.dist.irecv = lambda *a, **k: log.append("r") or irecv(*a, **k)
    orders = {}
    try:
        out = torch.empty(size * sum(sizes))
        comm.all_gather(out, torch.ones(sum(sizes)), shard, segments=sizes)
        orders["gather"], log[:] = "".join(log), []
        grads = [g.reshape(-1) for g in _grads(rank)]
        comm.reduce_scatter_batch([(torch.empty(sum(sizes)), grads, sizes, None)], shard)
        orders["reduce"], log[:] = "".join(log), []
        comm.all_reduce(torch.ones(8), shard)
        orders["sum"] = "".join(log)
    finally:
        comm.dist.isend, comm.dist.irecv = isend, irecv
    return orders


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_exchanges_post_their_receives_before_their_sends(group, exchange):
    """Gloo moves a message only after the receiver's notice reached the sender, through the
    pair's one TCP connection, in posting order: a send posted first queues its data ahead of
    our notice, and the peer waits for our data to cross the link before it may send (see
    [Note: receives are posted first] in fullshard/distributed/gloo.py). So every receive
    goes out first."""
    for orders in group.run(_posting_order, exchange):
        for kind, order in orders.items():
            if not order:  # a small sum on 2 ranks may be gloo's own all-reduce
                continue
            assert "s" in order and "r" in order, (kind, order)
            assert order.rindex("r") < order.index("s"), (kind, order)


def _native_collectives() -> dict:
    """The NCCL code path on gloo (`use_native_collectives`): the backend's own collectives."""
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    previous = comm.use_native_collectives(True)
    try:
        assert not comm.pairwise_exchanges(shard)
        comm.reset_comm_stats()
        mine = torch.arange(5, dtype=torch.float32) + 100 * rank
        gathered = torch.empty(5 * size)
        comm.all_gather(gathered, mine, shard, async_op=True, label="g").wait()
        packed = torch.arange(4 * size, dtype=torch.float32) * (rank + 1)
        reduced = torch.empty(4)
        comm.reduce_scatter(reduced, packed, shard, label="r")
        stats = comm.comm_stats()
    finally:
        comm.use_native_collectives(previous)
    total = sum(r + 1 for r in range(size))
    return {
        "gathered": gathered,
        "want_gathered": torch.cat([torch.arange(5.0) + 100 * r for r in range(size)]),
        "reduced": reduced,
        "want_reduced": torch.arange(4 * size, dtype=torch.float32)[4 * rank : 4 * rank + 4]
        * total,
        "calls": {k: stats[k]["calls"] for k in ("all_gather", "reduce_scatter")},
    }


def test_native_collectives_switch_runs_the_backend_collectives(group):
    for got in group.run(_native_collectives):
        torch.testing.assert_close(got["gathered"], got["want_gathered"], rtol=0, atol=0)
        torch.testing.assert_close(got["reduced"], got["want_reduced"], rtol=0, atol=0)
        assert got["calls"] == {"all_gather": 1, "reduce_scatter": 1}


def _diverging_labels(kind: str) -> str:
    """Two ranks label their k-th exchange differently: both raise, before any data moves.
    Small exchanges (default COALESCE_BYTES): the header is folded into the one message."""
    comm.COALESCE_BYTES = 1 << 20  # per rank process; earlier calls may have set it to 0
    shard = comm.Group.from_process_group()
    for label in ("unit 0", "unit 1"):  # as the engine registers every bucket at wrap time
        comm.register_label(label)
    label = f"unit {shard.rank % 2}"
    try:
        if kind == "all_gather":
            comm.all_gather(torch.empty(3 * shard.size), torch.ones(3), shard, label=label)
        else:  # a small sum
            comm.all_reduce(torch.ones(3), shard, label=label)
    except comm.RankDivergenceError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind", ["all_gather", "all_reduce"])
def test_a_label_mismatch_raises_on_every_rank(group, kind):
    for msg in group.run(_diverging_labels, kind):
        assert f"the {kind} of unit 0" in msg and f"the {kind} of unit 1" in msg, msg


def _small_sums(coalesce_bytes: int) -> dict:
    """Small sum all-reduces: alone, batched, and one the packed path may not take."""
    comm.COALESCE_BYTES = coalesce_bytes
    group = comm.Group.from_process_group()
    size, rank = group.size, group.rank
    comm.reset_comm_stats()
    mine = _grads(rank)
    alone = mine[0].clone()
    comm.all_reduce(alone, group, label="alone")
    batch = [g.clone() for g in mine[1:]]
    handles = comm.all_reduce_batch([(t, f"unit {i}") for i, t in enumerate(batch)], group,
                                    async_op=True)
    for h in handles:
        h.wait()
    biggest = torch.full((4,), float(rank + 1))
    comm.all_reduce(biggest, group, op=comm.dist.ReduceOp.MAX)  # not a sum: gloo's own
    stats = comm.comm_stats()["all_reduce"]
    # The definition: every rank's tensors summed in rank order.
    want = [sum(parts[1:], parts[0]) for parts in zip(*(_grads(r) for r in range(size)))]
    return {
        "got": [alone, *batch],
        "want": want,
        "biggest": biggest,
        "max": float(size),
        "stats": stats,
        "sent": sum(g.numel() for g in mine) * 4 * (size - 1),
        "ring": 2 * 4 * (size - 1) / size * 4,
    }


@pytest.mark.parametrize("coalesce_bytes", [1 << 20, 0], ids=["packed", "gloo"])
def test_small_sum_all_reduces_equal_the_rank_order_sum(group, coalesce_bytes):
    """On gloo a small sum goes whole to every peer in one message (several units' sums in
    one exchange) and each rank adds the N values in rank order: bit for bit the definition,
    the same on every rank, counted as one all-reduce each with the bytes really sent."""
    results = group.run(_small_sums, coalesce_bytes)
    for got in results:
        for g, w in zip(got["got"], got["want"]):
            torch.testing.assert_close(g, w, rtol=0 if coalesce_bytes else 1e-6, atol=0)
        assert bool((got["biggest"] == got["max"]).all())
        assert got["stats"]["calls"] == len(SHAPES) + 1
        if coalesce_bytes:
            assert got["stats"]["wire_bytes"] == pytest.approx(got["sent"] + got["ring"], abs=1)
    for got in results[1:]:  # the replicas agree exactly, whichever path ran
        for g, first in zip(got["got"], results[0]["got"]):
            assert torch.equal(g, first)



def _dropped_unwaited(exchange: str) -> list[bool]:
    """Gathers dropped in flight (a model thrown away after a forward with grad), each followed
    by one that is waited for: every waited one must still land the peers' data."""
    import gc

    _set_sizes(exchange)
    shard = comm.Group.from_process_group()
    size, rank = shard.size, shard.rank
    ok = []
    for step in range(8):
        mine = torch.full((1 << 14,), float(rank + step))
        comm.all_gather(torch.empty(size * mine.numel()), mine, shard, async_op=True,
                        label=f"dropped {step}")
        gc.collect()  # the handle and its buffers are gone from here on
        small = torch.full((4,), float(100 * rank + step))
        out = torch.empty(4 * size)
        comm.all_gather(out, small, shard, label=f"kept {step}")
        ok.append(out.tolist() == [float(100 * r + step) for r in range(size) for _ in range(4)])
    return ok


@pytest.mark.parametrize("exchange", list(EXCHANGES))
def test_a_gather_dropped_unwaited_leaves_later_exchanges_intact(group, exchange):
    # Without the keep-alive of a dropped handle, gloo's next exchange between the same two
    # ranks waits for the dropped message until the group's timeout.
    for r in group.run(_dropped_unwaited, exchange):
        assert all(r), r
