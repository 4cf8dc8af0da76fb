"""Gloo's all-gather, reduce-scatter and small all-reduce as point-to-point exchanges (for
comm.py).

comm.py decides which algorithm runs, counts it (every counter is added there, none here)
and is the only caller of torch.distributed collectives; this module holds the algorithms it
runs on gloo, which use only the point-to-point `isend` / `irecv`, and the divergence header.

[Note: gloo's all-gather and reduce-scatter]
On gloo (CPU) we do not call the all-gather / reduce-scatter collectives: gloo implements
reduce-scatter as an all-reduce plus a chunk (twice the traffic) and its all-gather peaks at
~8 MB per call, so both are several times slower than the network allows (measured on this
2-core machine at 32 MB, 2 ranks: all_gather 47 ms, reduce_scatter 61 ms, all_reduce 25 ms;
at 100 KB: all_gather 0.54 ms against 0.25 ms for one exchange of messages).
Instead each rank exchanges chunks directly with every peer (`isend`/`irecv`, all posted at
once, matched by a per-group tag sequence): an all-gather sends our shard to each peer and
receives theirs into place; a reduce-scatter sends peer j its chunk j and sums the N chunks of
ours in rank order (so every rank's sum has the same rounding). Each rank sends exactly
B·(N−1)/N bytes -- the ring optimum -- and the same 32 MB took ~14 ms either way. Large
exchanges work piece by piece (`*_pairwise`): an all-gather lands each parameter's rows in
place, and a reduce-scatter sends each peer its rows straight from every unpacked gradient (no
packed copy, no padding on the wire: wire bytes count what is really sent); only the pieces
too small to be worth a message (`SMALL_PIECE_BYTES`: biases, norms) go together, copied.
With many ranks this is N−1 messages per collective instead of a ring's pipeline; NCCL keeps
its own collectives, which already are optimal. Each gloo message has a fixed cost
(~0.1-0.2 ms here, more inside a busy step), so small exchanges (`*_packed`) send everything
as one message per peer -- every piece of a bucket, and the buckets of several small units
the engine issues together -- at the price of one copy of what is exchanged.

[Note: receives are posted first]
Gloo's TCP transport moves a message only once both ends have posted it: posting a receive
sends the peer a small "ready to receive" notice, and the peer's data follows when that
notice arrives. Notices and data share the pair's one TCP connection and its one send queue,
in posting order. Posting a send first puts its data (megabytes) in that queue ahead of our
receive notice of the same exchange, so the peer cannot start sending until our data has
crossed the link: on a link slower than the CPU (300 Mbit/s between hosts) one direction
idled for ~100 ms per large exchange, and whichever rank ran behind made the other's data
wait. So every exchange posts all its receives, then its sends (`_Posts`); the matching of
messages is unchanged (per peer and tag, receives and sends each keep their order).

[Note: ranks that run different units]
Every exchange is matched by its position in the group's sequence, so all ranks must issue
the engine's collectives in the same order. When they do not (LayerDrop with a per-rank RNG, an
MoE expert skipped on one rank, a data-dependent branch), the k-th exchange of one rank meets
the k-th of another that moves different rows: a hang, a size-mismatch crash or, when sizes
coincide, a silent exchange of the wrong unit's data. So the engine labels each exchange
(`label=`: the unit and bucket) and, on gloo:
- every point-to-point tag of a data message mixes the collective's sequence number, the crc32
  of kind + label and the piece index, so a message of one unit can never be received as
  another's (tags that collide are harmless: gloo matches equal tags in posting order, the
  same on every rank);
- exchanges that open a unit's gathers or reductions (`check=True`: the engine sets it on the
  first bucket of a unit, where any divergence begins), and every exchange that carries
  several collectives, carry a header -- sequence number and the crc32 of kind + label of
  each collective -- under a tag that does not depend on the label, and `wait()` checks the
  headers before it uses any data: a mismatch raises `RankDivergenceError` on every rank
  involved, naming each rank's units, as soon as both reach the exchange.
A small exchange folds its header into its one message (its first bytes): no extra message.
A large one sends the header as a message of its own. Either way the receive buffer of a
header holds `capacity` bytes, the largest folded message: gloo accepts a shorter message
than the buffer but aborts the process on a longer one, and a diverged peer may send either.
Header bytes are not in `comm_stats()` (they are counted apart: `header_stats()`). What it
cannot see: a rank that stops communicating altogether (the others then wait until the process
group's timeout), and the NCCL path (no headers: collectives are matched by NCCL).
Identifiers, tags, the header's bytes and the error's wording live in divergence.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fullshard.distributed.comm_handles import CommHandle, Group, _nbytes
from fullshard.distributed.divergence import (
    HEADER_MAX,
    RankDivergenceError,
    divergence_message,
    header_bytes,
    parse_header,
)
from fullshard.distributed.divergence import tag as tag_of


class Header:
    """The header of one labelled exchange (`idents`: one per collective it carries), from
    every peer: sent on its own (`rows=None`: posted here, received into rows of `capacity`
    bytes) or folded into the first bytes of the exchange's data messages (`rows`: the
    received rows, `works`: their sends and receives). `check()` waits and compares."""

    __slots__ = ("group", "seq", "idents", "rows", "works")

    def __init__(
        self,
        group: Group,
        seq: int,
        idents: Sequence[int],
        *,
        capacity: int = HEADER_MAX,
        rows: torch.Tensor | None = None,
        works: list[Any] | None = None,
    ) -> None:
        self.group, self.seq, self.idents = group, seq, tuple(idents)
        if rows is None:
            rows = torch.empty(group.size - 1, capacity, dtype=torch.uint8)
            mine, tag = header_bytes(seq, idents), tag_of(seq, 0, 0)
            works = _swap_with_peers(mine, rows, group, tag)
        self.rows, self.works = rows, works or []

    def check(self) -> None:
        for w in self.works:
            w.wait()
        mine = header_bytes(self.seq, self.idents)
        if bool((self.rows[:, : mine.numel()] == mine).all()):
            return
        rank = self.group.rank
        theirs = [parse_header(row) for row in self.rows]
        every = theirs[:rank] + [self.idents] + theirs[rank:]  # in group-rank order
        raise RankDivergenceError(divergence_message(self.seq, self.group.ranks, every))


class _Posts:
    """The point-to-point messages of one exchange, posted receives first (see [Note:
    receives are posted first]): collect them with `send` / `recv`, then `post()` returns the
    works."""

    __slots__ = ("group", "sends", "recvs")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.sends: list[tuple[torch.Tensor, int, int]] = []
        self.recvs: list[tuple[torch.Tensor, int, int]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """`peer`: the group rank."""
        self.sends.append((tensor, peer, tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.recvs.append((tensor, peer, tag))

    def swap(self, send: torch.Tensor, rows: torch.Tensor, tag: int) -> None:
        """`send` to every peer, and a receive of each peer's message into its row of `rows`
        (peer r's row: r - (r > rank), i.e. the peers in rank order)."""
        size, rank = self.group.size, self.group.rank
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            self.send(send, dst, tag)
            self.recv(rows[src - (src > rank)], src, tag)

    def post(self) -> list[Any]:
        works, g = [], self.group
        for t, peer, tag in self.recvs:
            works.append(dist.irecv(t, g.ranks[peer], group=g.pg, tag=tag))
        for t, peer, tag in self.sends:
            works.append(dist.isend(t, g.ranks[peer], group=g.pg, tag=tag))
        return works


def _swap_with_peers(send: torch.Tensor, rows: torch.Tensor, group: Group, tag: int) -> list[Any]:
    """`_Posts.swap` as an exchange of its own: the posted works, receives first."""
    posts = _Posts(group)
    posts.swap(send, rows, tag)
    return posts.post()


def _sum_into(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """`out` = the N ranks' `parts` summed in rank order (the same rounding on every rank);
    `out` may be one of the first two parts, never a later one."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


SMALL_PIECE_BYTES = 64 << 10
"""In a large exchange, the pieces of at most this many bytes per rank (a block's biases and
norms: 8 of its 12 parameters) travel together as one more message per peer instead of one
each. Measured on this 2-core machine (2 gloo ranks): each extra message of a round costs
~50 us, a 64 KiB copy ~13 us, and a packed piece is copied twice (in, then out)."""


def _small_pieces(sizes: Sequence[int], element_size: int) -> frozenset[int]:
    """Indices of the pieces sent together (none unless there are at least two)."""
    small = frozenset(j for j, n in enumerate(sizes) if 0 < n * element_size <= SMALL_PIECE_BYTES)
    return small if len(small) > 1 else frozenset()


def all_gather_pairwise(
    output: torch.Tensor,
    flat_in: torch.Tensor,
    pieces: list[int],
    group: Group,
    seq: int,
    ident: int,
    header: Header | None,
) -> CommHandle:
    """A large all-gather: each piece sent to and received from every peer in place, but the
    small pieces (`SMALL_PIECE_BYTES`) together in one message per peer, received into a
    staging row and copied into place at `wait()`."""
    size, rank = group.size, group.rank
    flat_out = output.view(-1)
    small = _small_pieces(pieces, flat_in.element_size())
    posts, start, packed = _Posts(group), 0, []  # packed: (our piece, its slots), small ones
    for j, piece in enumerate(pieces):
        mine = flat_in[start : start + piece]
        slots = flat_out[size * start : size * (start + piece)].view(size, piece)
        slots[rank].copy_(mine)
        start += piece
        if j in small:
            packed.append((mine, slots))
            continue
        tag = tag_of(seq, ident, j + 1)
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            posts.send(mine, dst, tag)
            posts.recv(slots[src], src, tag)
    if not packed:
        return CommHandle(posts.post(), refs=(output, flat_in), header=header)
    send = torch.cat([mine for mine, _ in packed])
    staged = send.new_empty((size - 1, send.numel()))
    posts.swap(send, staged, tag_of(seq, ident, len(pieces) + 1))
    works = posts.post()
    sizes = [mine.numel() for mine, _ in packed]

    def place() -> None:
        for r in range(size):
            if r != rank:
                torch.split_with_sizes_copy(
                    staged[r - (r > rank)], sizes, out=[slots[r] for _, slots in packed]
                )

    return CommHandle(works, on_done=place, refs=(output, flat_in, send, staged), header=header)


def all_gather_packed(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[int] | None, str | None]],
    group: Group,
    seq: int,
    idents: Sequence[int],
    fold: bool,
    capacity: int,
) -> CommHandle:
    """Small all-gathers in one message per peer (comm's `_small`): our inputs, one after the
    other (after the header if `fold`), go to each peer; each peer's message lands in
    a staging row and is split into its place in every segment of every output once it is
    complete (`wait()`). Same outputs, same data bytes on the wire."""
    size, rank = group.size, group.rank
    ins = [input.reshape(-1) for _, input, _, _ in items]
    plans = []  # (flat input, piece sizes, each piece's output region viewed (size, piece))
    for (output, _, segments, _), flat_in in zip(items, ins):
        pieces = list(segments) if segments is not None else [flat_in.numel()]
        flat_out, regions, start = output.view(-1), [], 0
        for piece in pieces:  # row r of a region: rank r's piece
            regions.append(flat_out[size * start : size * (start + piece)].view(size, piece))
            start += piece
        torch.split_with_sizes_copy(flat_in, pieces, out=[reg[rank] for reg in regions])
        plans.append((flat_in, pieces, regions))
    dtype, nbytes = ins[0].dtype, sum(_nbytes(x) for x in ins)
    prefix = header_bytes(seq, idents) if fold else None
    head = 0 if prefix is None else prefix.numel()
    send = ins[0] if prefix is None and len(ins) == 1 else _message(prefix, ins)
    row = capacity if fold else nbytes
    staged = torch.empty((size - 1, row), dtype=torch.uint8, device=send.device)
    tag = tag_of(seq, 0, 0) if fold else tag_of(seq, idents[0], 1)
    works = _swap_with_peers(send, staged, group, tag)
    header = Header(group, seq, idents, rows=staged, works=works) if fold else None

    def place() -> None:
        for r in range(size):
            if r == rank:
                continue
            data = staged[r - (r > rank), head : head + nbytes].view(dtype)
            start = 0
            for flat_in, pieces, regions in plans:
                n = flat_in.numel()
                torch.split_with_sizes_copy(
                    data[start : start + n], pieces, out=[reg[r] for reg in regions]
                )
                start += n

    # The caller's objects themselves, not views: memory.track counts a tensor until the
    # object dies, and the bucket relies on the handle to keep a cast input alive.
    refs = (tuple(x[0] for x in items), tuple(x[1] for x in items), staged, send)
    # A folded header waits for the messages itself (a gloo Work must be waited once).
    return CommHandle([] if fold else works, on_done=place, refs=refs, header=header)


def _message(prefix: torch.Tensor | None, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One message: the header bytes `prefix` (if any), then `parts` (one dtype) back to back
    -- the copy that packing costs."""
    head = 0 if prefix is None else prefix.numel()
    nbytes = sum(_nbytes(x) for x in parts)
    device = parts[0].device if parts else torch.device("cpu")
    out = torch.empty(head + nbytes, dtype=torch.uint8, device=device)
    if prefix is not None:
        out[:head].copy_(prefix)
    if parts:
        torch.cat(parts, out=out[head:].view(parts[0].dtype))
    return out


def segments_plan(
    output: torch.Tensor, inputs: Sequence[torch.Tensor], sizes: Sequence[int], group: Group
) -> list[tuple[torch.Tensor, int, list[int]]]:
    """(flat input, segment size, real elements of every rank's chunk) per segment."""
    pieces, offset = [], 0
    for x, n in zip(inputs, sizes):
        x = x.view(-1)
        pieces.append((x, n, [max(0, min(n, x.numel() - r * n)) for r in range(group.size)]))
        offset += n
    if offset != output.numel():
        raise ValueError(f"segment sizes add up to {offset}, output has {output.numel()}")
    return pieces


def reduce_scatter_pairwise(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    pieces: list[tuple[torch.Tensor, int, list[int]]],
    group: Group,
    seq: int,
    ident: int,
    header: Header | None,
) -> CommHandle:
    """A large reduce-scatter: every chunk sent straight from its input, piece by piece, but
    the small pieces' chunks (`SMALL_PIECE_BYTES`) together in one message per peer, received
    into a staging row."""
    size, rank = group.size, group.rank
    flat_out = output.view(-1)
    direct = size == 2
    # Received chunks of the peers in rank order (row r - (r > rank)); none on two ranks.
    received = None if direct else output.new_empty((size - 1, output.numel()))
    small = _small_pieces([n for _, n, _ in pieces], output.element_size())
    posts, offset, plan = _Posts(group), 0, []
    packed_for: list[list[torch.Tensor]] = [[] for _ in range(size)]  # chunks for each peer
    packed_mine = 0  # elements of our chunks of the small pieces (what each peer sends us)
    for j, (x, n, real) in enumerate(pieces):
        mine = real[rank]
        # where a small piece's peer chunks start in the staging rows (None: received whole)
        staged_at = packed_mine if j in small else None
        plan.append((x[rank * n : rank * n + mine], offset, mine, n, staged_at))
        if j in small:
            for dst in range(size):
                if dst != rank and real[dst] > 0:
                    packed_for[dst].append(x[dst * n : dst * n + real[dst]])
            packed_mine += mine
            offset += n
            continue
        tag = tag_of(seq, ident, j + 1)
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            if real[dst] > 0:
                chunk = x[dst * n : dst * n + real[dst]]
                posts.send(chunk, dst, tag)
            if mine > 0:
                into = flat_out if received is None else received[src - (src > rank)]
                posts.recv(into[offset : offset + mine], src, tag)
        offset += n
    sends, staged = [], None
    if small:
        tag = tag_of(seq, ident, len(pieces) + 1)
        staged = output.new_empty((size - 1, packed_mine))
        for step in range(1, size):
            dst, src = (rank + step) % size, (rank - step) % size
            if packed_for[dst]:
                sends.append(torch.cat(packed_for[dst]))
                posts.send(sends[-1], dst, tag)
            if packed_mine > 0:
                posts.recv(staged[src - (src > rank)], src, tag)
    works = posts.post()

    def sum_in_rank_order() -> None:
        for own, start, mine, n, staged_at in plan:
            out = flat_out[start : start + mine]
            if staged_at is not None:
                if mine > 0:
                    peers = staged[:, staged_at : staged_at + mine]  # type: ignore[index]
                    _sum_into(out, [own if r == rank else peers[r - (r > rank)]
                                    for r in range(size)])
            elif received is None:
                out.add_(own)
            elif mine > 0:
                parts = [
                    own if r == rank else received[r - (r > rank), start : start + mine]
                    for r in range(size)
                ]
                _sum_into(out, parts)
            flat_out[start + mine : start + n].zero_()

    refs = (output, tuple(inputs), received, staged, tuple(sends))
    return CommHandle(works, on_done=sum_in_rank_order, refs=refs, header=header)


def reduce_scatter_packed(
    items: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor], Sequence[int], str | None]],
    plans: list[list[tuple[torch.Tensor, int, list[int]]]],
    group: Group,
    seq: int,
    idents: Sequence[int],
    fold: bool,
    capacity: int,
) -> CommHandle:
    """Small reduce-scatters in one message per peer (comm's `_small`): peer j's real elements
    of every piece of every item, concatenated after the header if `fold` (one copy of what
    is sent), received into a staging row per peer and summed from there into the segments,
    in rank order as always (on two ranks: peer + own, the same operands and order as the
    per-piece path)."""
    size, rank = group.size, group.rank
    pieces = [piece for plan in plans for piece in plan]
    dtype = items[0][0].dtype
    esize = items[0][0].element_size()
    counts = [sum(real[r] for _, _, real in pieces) for r in range(size)]
    prefix = header_bytes(seq, idents) if fold else None
    head = 0 if prefix is None else prefix.numel()
    row = capacity if fold else counts[rank] * esize
    staged = torch.empty((size - 1, row), dtype=torch.uint8, device=items[0][0].device)
    tag = tag_of(seq, 0, 0) if fold else tag_of(seq, idents[0], 1)
    posts, sends = _Posts(group), []
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        if counts[dst] > 0 or fold:
            chunks = [x[dst * n : dst * n + real[dst]] for x, n, real in pieces if real[dst]]
            send = chunks[0] if prefix is None and len(chunks) == 1 else _message(prefix, chunks)
            sends.append(send)
            posts.send(send, dst, tag)
        if counts[rank] > 0 or fold:
            posts.recv(staged[src - (src > rank)], src, tag)
    works = posts.post()
    header = Header(group, seq, idents, rows=staged, works=works) if fold else None
    outs = [output.view(-1) for output, _, _, _ in items]
    mine_bytes = counts[rank] * esize

    def sum_in_rank_order() -> None:
        peers = [staged[i, head : head + mine_bytes].view(dtype) for i in range(size - 1)]
        compact = 0
        for flat_out, plan in zip(outs, plans):
            start = 0
            for x, n, real in plan:
                mine = real[rank]
                if mine > 0:
                    out = flat_out[start : start + mine]
                    parts = [
                        x[rank * n : rank * n + mine]
                        if r == rank
                        else peers[r - (r > rank)][compact : compact + mine]
                        for r in range(size)
                    ]
                    _sum_into(out, parts)
                if mine < n:
                    flat_out[start + mine : start + n].zero_()
                start += n
                compact += mine

    # The caller's input objects themselves, not views of them: memory.track counts a
    # tensor until that object dies.
    refs = (tuple(x[0] for x in items), tuple(tuple(x[1]) for x in items), staged, tuple(sends))
    return CommHandle([] if fold else works, on_done=sum_in_rank_order, refs=refs, header=header)


def all_reduce_packed(
    tensors: Sequence[torch.Tensor],
    group: Group,
    seq: int,
    idents: Sequence[int],
    fold: bool,
    capacity: int,
) -> CommHandle:
    """Small sum all-reduces (comm's `_small`) in one exchange: every tensor, one after the
    other (after the header if `fold`), goes whole to each peer as one message; each peer's
    message lands in a staging row and, once all are in (`wait()`), every tensor becomes the
    sum of the N ranks' values in rank order -- the same operands in the same order on every
    rank, so the replicas stay bit-identical. One message round instead of a ring's 2(N-1)
    steps, for N-1 times the tensors' bytes sent instead of 2(N-1)/N times (equal on two
    ranks): comm takes this path only while that stays within `COALESCE_BYTES`."""
    size, rank = group.size, group.rank
    flats = [t.view(-1) for t in tensors]
    dtype, nbytes = flats[0].dtype, sum(_nbytes(x) for x in flats)
    prefix = header_bytes(seq, idents) if fold else None
    head = 0 if prefix is None else prefix.numel()
    # Always a copy: besides being what is sent, it is our operand of the sum, which
    # overwrites the tensors themselves (rank r > 0 writes ranks 0 and 1's sum first).
    send = _message(prefix, flats)
    staged = torch.empty((size - 1, capacity if fold else nbytes), dtype=torch.uint8,
                         device=send.device)
    tag = tag_of(seq, 0, 0) if fold else tag_of(seq, idents[0], 1)
    works = _swap_with_peers(send, staged, group, tag)
    header = Header(group, seq, idents, rows=staged, works=works) if fold else None

    def sum_in_rank_order() -> None:
        rows = [send if r == rank else staged[r - (r > rank)] for r in range(size)]
        data = [row[head : head + nbytes].view(dtype) for row in rows]
        start = 0
        for flat in flats:
            _sum_into(flat, [d[start : start + flat.numel()] for d in data])
            start += flat.numel()

    refs = (tuple(tensors), staged, send)
    return CommHandle([] if fold else works, on_done=sum_in_rank_order, refs=refs, header=header)
