"""Naming the exchanges of ranks that run different units.

See [Note: ranks that run different units] in distributed/gloo.py.

Pure bookkeeping, no communication: each exchange is identified by the crc32 of its kind and
label (the unit and bucket), which goes into its point-to-point tags and its header; a
registry turns identifiers back into words, so a rank can name the unit a peer ran even if it
skipped that unit itself (the engine registers every bucket's label at wrap time); and the
error that says which rank ran what.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


class RankDivergenceError(RuntimeError):
    """Ranks issued different collectives at the same position: they ran different units."""


_LABELS: dict[int, str] = {}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def exchange_id(kind: str, label: str) -> int:
    """The identifier of a `kind` exchange labelled `label`, the same on every rank."""
    ident = zlib.crc32(f"{kind}\0{label}".encode())
    if ident not in _LABELS:
        _LABELS[ident] = f"the {kind} of {label}" if label else f"an unlabelled {kind}"
    return ident


def register_label(label: str) -> None:
    """Make `label` nameable in divergence errors even before this rank used it."""
    for kind in KINDS:
        exchange_id(kind, label)


def tag(seq: int, ident: int, slot: int) -> int:
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
