"""Gloo's all-gather, reduce-scatter and small all-reduce as point-to-point exchanges, and
the divergence header. comm.py decides which algorithm runs, counts it and makes the handle;
this module only posts `isend` / `irecv` and says what to do once they are complete.

[Note: gloo's all-gather and reduce-scatter]
On gloo (CPU) we do not call the all-gather / reduce-scatter collectives: gloo implements
reduce-scatter as an all-reduce plus a chunk (twice the traffic) and its all-gather peaks at
~8 MB per call (measured, 32 MB on 2 ranks: all_gather 47 ms, reduce_scatter 61 ms,
all_reduce 25 ms; 100 KB: all_gather 0.54 ms against 0.25 ms for one exchange of messages).
Instead each rank exchanges chunks directly with every peer (`isend`/`irecv`, all posted at
once): an all-gather sends our shard to each peer and receives theirs into place; a
reduce-scatter sends peer j its chunk j and sums the N chunks of ours in rank order (the same
rounding on every rank). Each rank sends B·(N−1)/N bytes, the ring optimum (the same 32 MB:
~14 ms either way). Large exchanges go piece by piece: an all-gather lands each parameter's
rows in place, a reduce-scatter sends each peer its rows straight from every unpacked
gradient (no copy, no padding on the wire); only pieces too small to be worth a message
(`SMALL_PIECE_BYTES`: biases, norms) go together, copied. NCCL keeps its own collectives,
already optimal. Each gloo message has a fixed cost (~0.1-0.2 ms), so small exchanges
(`packed=True`) send everything as one message per peer (every piece of a bucket, and the
buckets of several small units issued together) at the price of one copy.

[Note: receives are posted first]
Gloo's TCP transport moves a message only once both ends have posted it: posting a receive
sends the peer a "ready to receive" notice, which shares the pair's one connection and send
queue with data, in posting order. Posting a send first puts its megabytes ahead of our
receive notice, so the peer cannot start sending until our data has crossed the link (at
300 Mbit/s between hosts one direction idled ~100 ms per large exchange). So every exchange
posts all its receives, then its sends (`_Posts`); matching (per peer and tag, in order) is
unchanged.

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
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fullshard.distributed.mesh import Group


# The identifiers, labels and header bytes of exchanges, and the error that names ranks
# running different units: see [Note: ranks that run different units].

class RankDivergenceError(RuntimeError):
    """Ranks issued different collectives at the same position: they ran different units."""


_LABELS: dict[int, str] = {}


def exchange_id(kind: str, label: str) -> int:
    """The identifier of a `kind` exchange labelled `label`, the same on every rank."""
    ident = zlib.crc32(f"{kind}\0{label}".encode())
    if ident not in _LABELS:
        _LABELS[ident] = f"the {kind} of {label}" if label else f"an unlabelled {kind}"
    return ident


def register_label(label: str) -> None:
    """Make `label` nameable in divergence errors even before this rank used it."""
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        exchange_id(kind, label)


def tag_of(seq: int, ident: int, slot: int) -> int:
    """Point-to-point tag of piece `slot` of collective `seq` whose kind + label hash to
    `ident` (the header: ident 0, slot 0). A mix below 2**31; equal tags are harmless (gloo
    matches them in posting order, the same on every rank that runs the same units)."""
    return (seq * 0x9E3779B1 + ident * 0x85EBCA77 + slot * 0xC2B2AE3D) & 0x7FFFFFFF


def divergence_message(seq: int, ranks: Sequence[int], idents: Sequence[Sequence[int]]) -> str:
    """The error for collective `seq` of the group of global `ranks`, whose members sent the
    headers with identifiers `idents` (in group-rank order; several for an exchange that
    carries several collectives, none for a header that could not be read)."""
    by_id: dict[tuple[int, ...], list[int]] = {}
    for ids, g in zip(idents, ranks):
        by_id.setdefault(tuple(ids), []).append(g)
    what = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
        + (" + ".join(_LABELS.get(i, f"an exchange with id {i:#x}") for i in ids)
           or "something else (an unreadable header)")
        for ids, rs in by_id.items()
    )
    return (
        f"Ranks ran different units: collective #{seq} on the process group of ranks "
        f"{list(ranks)} is {what}. Every rank must run the same wrapped units in the same "
        f"order each step (the engine gathers and reduces each unit collectively); a "
        f"per-rank random LayerDrop, an expert skipped on some ranks only or a branch on "
        f"the data diverges. Draw such decisions from a generator seeded the same on every "
        f"rank (or agree on them with a collective), or run the unit on every rank and "
        f"discard its output. The process group is unusable after this error: restart."
    )


MAX_BATCH = 256
"""Most collectives one exchange carries together (bounds the header's size)."""


def header_size(n: int) -> int:
    """Bytes of the header of an exchange of `n` collectives: int64 sequence number, n, and
    the n identifiers (crc32 of kind + label). A multiple of 8, so the data after it is
    aligned for every dtype."""
    return 8 * (2 + n)


HEADER_MAX = header_size(MAX_BATCH)


def header_bytes(seq: int, idents: Sequence[int]) -> torch.Tensor:
    return torch.tensor([seq, len(idents), *idents], dtype=torch.int64).view(torch.uint8)


def parse_header(row: torch.Tensor) -> tuple[int, ...]:
    """The identifiers in a peer's header (none if it is not one we can read)."""
    n = int(row[:16].view(torch.int64)[1])
    if not 0 < n <= MAX_BATCH or header_size(n) > row.numel():
        return ()
    return tuple(row[16 : header_size(n)].view(torch.int64).tolist())


def _row(r: int, rank: int) -> int:
    """Group rank `r`'s row among the peers' rows, which are in rank order without `rank`."""
    return r - (r > rank)


def _peers(group: Group) -> list[tuple[int, int]]:
    """(the peer to send to, the peer to receive from), once per peer, in ring order."""
    size, rank = group.size, group.rank
    return [((rank + step) % size, (rank - step) % size) for step in range(1, size)]


class _Posts:
    """The point-to-point messages of one exchange, posted receives first (see [Note:
    receives are posted first]): collect them with `send` / `recv` (peers are group ranks),
    then `post()` returns the works."""

    __slots__ = ("group", "sends", "recvs")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.sends: list[tuple[torch.Tensor, int, int]] = []
        self.recvs: list[tuple[torch.Tensor, int, int]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.sends.append((tensor, peer, tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.recvs.append((tensor, peer, tag))

    def swap(self, send: torch.Tensor, rows: torch.Tensor, tag: int) -> None:
        """`send` to every peer, and each peer's message into its row of `rows`."""
        for dst, src in _peers(self.group):
            self.send(send, dst, tag)
            self.recv(rows[_row(src, self.group.rank)], src, tag)

    def post(self) -> list[Any]:
        works, g = [], self.group
        for t, peer, tag in self.recvs:
            works.append(dist.irecv(t, g.ranks[peer], group=g.pg, tag=tag))
        for t, peer, tag in self.sends:
            works.append(dist.isend(t, g.ranks[peer], group=g.pg, tag=tag))
        return works


class Header:
    """The header of one labelled exchange (`idents`: one per collective it carries), from
    every peer: sent on its own (`rows=None`: posted here, received into rows of `capacity`
    bytes) or folded into the first bytes of the exchange's data messages (`rows`: the
    received rows, `works`: their sends and receives). `check()` waits and compares."""

    __slots__ = ("group", "seq", "idents", "rows", "works")

    def __init__(self, group: Group, seq: int, idents: Sequence[int], *, capacity: int = 0,
                 rows: torch.Tensor | None = None, works: list[Any] | None = None) -> None:
        self.group, self.seq, self.idents = group, seq, tuple(idents)
        if rows is None:
            rows = torch.empty(group.size - 1, capacity, dtype=torch.uint8)
            posts = _Posts(group)
            posts.swap(header_bytes(seq, idents), rows, tag_of(seq, 0, 0))
            works = posts.post()
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


def _message(prefix: torch.Tensor | None, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One message: the header bytes `prefix` (if any), then `parts` (one dtype) back to back
    -- the copy that packing costs."""
    head = 0 if prefix is None else prefix.numel()
    nbytes = sum(x.nbytes for x in parts)
    device = parts[0].device if parts else torch.device("cpu")
    out = torch.empty(head + nbytes, dtype=torch.uint8, device=device)
    if prefix is not None:
        out[:head].copy_(prefix)
    if parts:
        torch.cat(parts, out=out[head:].view(parts[0].dtype))
    return out


class _Staged:
    """The one message per peer of a packed exchange, or of a large one's small pieces, and the
    rows (one per peer, bytes) it is received into. With `fold` the header comes first and a
    row holds `capacity` bytes, the largest message a diverged peer may send (see [Note: ranks
    that run different units]); else a row holds the `nbytes` of data expected."""

    def __init__(self, group: Group, seq: int, idents: Sequence[int], *, fold: bool,
                 capacity: int, nbytes: int, device: torch.device, slot: int) -> None:
        self.group, self.seq, self.idents, self.fold = group, seq, idents, fold
        self.prefix = header_bytes(seq, idents) if fold else None
        self.head = 0 if self.prefix is None else self.prefix.numel()
        row = capacity if fold else nbytes
        self.rows = torch.empty((group.size - 1, row), dtype=torch.uint8, device=device)
        self.tag = tag_of(seq, 0, 0) if fold else tag_of(seq, idents[0], slot)

    def message(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """`parts` after the header, copied unless one part alone is the message."""
        return parts[0] if self.prefix is None and len(parts) == 1 else _message(self.prefix, parts)

    def data(self, row: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return row[self.head : self.head + nbytes].view(dtype)


Exchange = tuple[list[Any], Callable[[], None] | None, tuple, Header | None]
"""What an exchange hands comm.py, which makes a `CommHandle` of it: its works, what to do
once they are complete, what they read and write (kept alive until then), its header."""


def _handle(works: list[Any], staged: _Staged | None, own: Header | None,
            on_done: Callable[[], None] | None, refs: tuple) -> Exchange:
    if staged is not None and staged.fold:
        header = Header(staged.group, staged.seq, staged.idents, rows=staged.rows, works=works)
        # The folded header waits for the messages itself (a gloo Work must be waited once).
        return [], on_done, refs, header
    return works, on_done, refs, own


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


def _staged_pieces(sizes: Sequence[int], element_size: int, packed: bool) -> Sequence[int]:
    """Indices of the pieces sent together: all when `packed`, else the small ones if there
    are at least two."""
    if packed:
        return range(len(sizes))
    small = frozenset(j for j, n in enumerate(sizes) if 0 < n * element_size <= SMALL_PIECE_BYTES)
    return small if len(small) > 1 else frozenset()


def all_gather(items: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[int]]], group: Group,
               seq: int, idents: Sequence[int], header: bool, *, packed: bool, capacity: int
               ) -> Exchange:
    """All-gathers `(output, input, pieces)` into segment-major outputs: piece j of every rank,
    in rank order, then piece j+1 (comm's `all_gather`).

    `packed` (comm's `_small`): our inputs, one after the other (after the header, folded in
    if `header`), go to each peer as one message, which lands in a staging row and is split
    into place at `wait()`. Else (one item) each piece is sent and received in place, but
    the small pieces (`SMALL_PIECE_BYTES`) together as one staged message, and the header
    (if `header`) is a message of its own. Same outputs, same data bytes on the wire."""
    size, rank = group.size, group.rank
    own = Header(group, seq, idents, capacity=capacity) if header and not packed else None
    posts, small, regions = _Posts(group), [], []  # small: our staged pieces; regions: slots
    for output, input, pieces in items:
        flat_in, flat_out, start, slots = input.reshape(-1), output.view(-1), 0, []
        for piece in pieces:  # row r of a piece's slots: rank r's piece
            slots.append(flat_out[size * start : size * (start + piece)].view(size, piece))
            start += piece
        torch.split_with_sizes_copy(flat_in, list(pieces), out=[s[rank] for s in slots])
        staged_at = _staged_pieces(pieces, flat_in.element_size(), packed)
        for j, (mine, s) in enumerate(zip(flat_in.split(list(pieces)), slots)):
            if j in staged_at:
                small.append(mine)
                regions.append(s)
                continue
            tag = tag_of(seq, idents[0], j + 1)
            for dst, src in _peers(group):
                posts.send(mine, dst, tag)
                posts.recv(s[src], src, tag)
    staged, send, place = None, None, None
    if regions:
        parts = [input.reshape(-1) for _, input, _ in items] if packed else small
        nbytes, dtype = sum(p.nbytes for p in parts), parts[0].dtype
        staged = _Staged(group, seq, idents, fold=header and packed, capacity=capacity,
                         nbytes=nbytes, device=parts[0].device,
                         slot=1 if packed else len(items[0][2]) + 1)
        send = staged.message(parts)
        posts.swap(send, staged.rows, staged.tag)
        sizes = [s.shape[1] for s in regions]

        def place() -> None:
            for r in range(size):
                if r != rank:
                    data = staged.data(staged.rows[_row(r, rank)], nbytes, dtype)
                    torch.split_with_sizes_copy(data, sizes, out=[s[r] for s in regions])

    # The caller's objects themselves, not views: bucket.track counts a tensor until the
    # object dies, and the bucket relies on the handle to keep a cast input alive.
    refs = (tuple(x[0] for x in items), tuple(x[1] for x in items),
            None if staged is None else staged.rows, send)
    return _handle(posts.post(), staged, own, place, refs)


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


def reduce_scatter(
    items: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor], Sequence[int], str | None]],
    plans: Sequence[list[tuple[torch.Tensor, int, list[int]]]], group: Group, seq: int,
    idents: Sequence[int], header: bool, *, packed: bool, capacity: int,
) -> Exchange:
    """Reduce-scatters of unpacked inputs (comm's `reduce_scatter_batch`; `plans`: their
    `segments_plan`): peer j gets its real elements of every piece, never padding.

    `packed`: all of them, concatenated after the header if `header` (one copy of what is
    sent), go to each peer as one message, received into a staging row. Else (one item)
    every chunk is sent straight from its input, piece by piece, but the small pieces'
    (`SMALL_PIECE_BYTES`) together as one staged message. At `wait()` our chunk of each
    piece is summed in rank order; on two ranks a piece's peer chunk is received straight
    into the output and ours added to it (a + b == b + a bit for bit)."""
    size, rank = group.size, group.rank
    own = Header(group, seq, idents, capacity=capacity) if header and not packed else None
    output = items[0][0]
    dtype, esize = output.dtype, output.element_size()
    # Received chunks of the peers in rank order (row _row(r)), for pieces sent one by one.
    received = None if packed or size == 2 else output.new_empty((size - 1, output.numel()))
    # terms: (out, our chunk, padding, staged?, where the peers' chunks start in their rows)
    posts, terms = _Posts(group), []
    staged_for: list[list[torch.Tensor]] = [[] for _ in range(size)]  # each peer's chunks
    staged_mine = 0  # elements of our chunks of the staged pieces: what each peer sends us
    for (out_item, _, _, _), plan in zip(items, plans):
        flat_out, start = out_item.view(-1), 0
        staged_at = _staged_pieces([n for _, n, _ in plan], esize, packed)
        for j, (x, n, real) in enumerate(plan):
            mine = real[rank]
            out, pad = flat_out[start : start + mine], flat_out[start + mine : start + n]
            if j in staged_at:
                terms.append((out, x[rank * n : rank * n + mine], pad, True, staged_mine))
                for dst in range(size):
                    if dst != rank and real[dst] > 0:
                        staged_for[dst].append(x[dst * n : dst * n + real[dst]])
                staged_mine += mine
                start += n
                continue
            terms.append((out, x[rank * n : rank * n + mine], pad, False, start))
            tag = tag_of(seq, idents[0], j + 1)
            for dst, src in _peers(group):
                if real[dst] > 0:
                    posts.send(x[dst * n : dst * n + real[dst]], dst, tag)
                if mine > 0:
                    into = flat_out if received is None else received[_row(src, rank)]
                    posts.recv(into[start : start + mine], src, tag)
            start += n
    staged, sends = None, []
    if packed or any(term[3] for term in terms):
        fold = header and packed
        staged = _Staged(group, seq, idents, fold=fold, capacity=capacity,
                         nbytes=staged_mine * esize, device=output.device,
                         slot=1 if packed else len(plans[0]) + 1)
        for dst, src in _peers(group):
            if staged_for[dst] or fold:
                sends.append(staged.message(staged_for[dst]))
                posts.send(sends[-1], dst, staged.tag)
            if staged_mine > 0 or fold:
                posts.recv(staged.rows[_row(src, rank)], src, staged.tag)

    def sum_in_rank_order() -> None:
        rows = [] if staged is None else [staged.data(row, staged_mine * esize, dtype)
                                           for row in staged.rows]
        for out, ours, pad, in_staged, at in terms:
            mine = out.numel()
            if not in_staged and received is None:  # two ranks: the peer's chunk is in `out`
                out.add_(ours)
            elif mine > 0:
                peers = rows if in_staged else received
                _sum_into(out, [ours if r == rank else peers[_row(r, rank)][at : at + mine]
                                for r in range(size)])
            pad.zero_()

    # The caller's input objects themselves, not views of them: bucket.track counts a
    # tensor until that object dies.
    refs = (tuple(x[0] for x in items), tuple(tuple(x[1]) for x in items),
            received, None if staged is None else staged.rows, tuple(sends))
    return _handle(posts.post(), staged, own, sum_in_rank_order, refs)


def all_reduce(tensors: Sequence[torch.Tensor], group: Group, seq: int, idents: Sequence[int],
               header: bool, *, capacity: int) -> Exchange:
    """Small sum all-reduces (comm's `_packed_sum`) in one exchange: every tensor, one after
    the other (after the header, folded in if `header`), goes whole to each peer as one
    message; each peer's message lands in a staging row and, once all are in (`wait()`),
    every tensor becomes the sum of the N ranks' values in rank order -- the same operands in
    the same order on every rank, so the replicas stay bit-identical. One message round
    instead of a ring's 2(N-1) steps, for N-1 times the tensors' bytes sent instead of
    2(N-1)/N times (equal on two ranks)."""
    size, rank = group.size, group.rank
    flats = [t.view(-1) for t in tensors]
    dtype, nbytes = flats[0].dtype, sum(x.nbytes for x in flats)
    staged = _Staged(group, seq, idents, fold=header, capacity=capacity, nbytes=nbytes,
                     device=flats[0].device, slot=1)
    # Always a copy: besides being what is sent, it is our operand of the sum, which
    # overwrites the tensors themselves (rank r > 0 writes ranks 0 and 1's sum first).
    send = _message(staged.prefix, flats)
    posts = _Posts(group)
    posts.swap(send, staged.rows, staged.tag)

    def sum_in_rank_order() -> None:
        data = [staged.data(send if r == rank else staged.rows[_row(r, rank)], nbytes, dtype)
                for r in range(size)]
        start = 0
        for flat in flats:
            _sum_into(flat, [d[start : start + flat.numel()] for d in data])
            start += flat.numel()

    refs = (tuple(tensors), staged.rows, send)
    return _handle(posts.post(), staged, None, sum_in_rank_order, refs)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, seq: int,
               idents: Sequence[int], header: bool, *, capacity: int) -> Exchange:
    """Row r of `input` to group rank r, rank r's row for us into row r of `output` (comm's
    `all_to_all`): one message per peer, received in place; our own row is copied. The
    header (if `header`) is a message of its own."""
    own = Header(group, seq, idents, capacity=capacity) if header else None
    posts, tag = _Posts(group), tag_of(seq, idents[0], 1)
    for dst, src in _peers(group):
        posts.send(input[dst], dst, tag)
        posts.recv(output[src], src, tag)
    output[group.rank].copy_(input[group.rank])
    return _handle(posts.post(), None, own, None, (output, input))
