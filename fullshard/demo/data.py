"""The demo's data: public-domain text shipped with the package, read as bytes.

Tokens are the UTF-8 bytes of `corpus.txt` (vocabulary 256, no tokenizer to download). A batch
is `global_batch` random windows of `seq + 1` bytes, drawn from one generator seeded by the
step number, so every rank draws the same global batch and keeps its own rows -- and a resumed
run sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

from importlib import resources

import torch

VOCAB = 256


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8-valued long tensor."""
    data = resources.files("fullshard.demo").joinpath("corpus.txt").read_bytes()
    return torch.tensor(list(data), dtype=torch.long)


def global_batch(corpus: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()])


def rank_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))
