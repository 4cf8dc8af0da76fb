"""The benchmark model and data: a small GPT-style decoder, its two sizes, the token pool.

The model is the one the project first measured FSDP2, DDP and DeepSpeed on (before fullshard
existed), kept so later numbers stay comparable:

- token embedding (vocab 8192) plus a learned position embedding;
- `layers` pre-norm `Block`s: LayerNorm -> qkv Linear -> causal SDPA (heads = dim / 64) -> proj,
  then LayerNorm -> fc1 (4 dim) -> GELU -> fc2, each with a residual connection;
- a final LayerNorm and an untied lm head without bias.

Every rank builds it after `torch.manual_seed(1234)`, so all ranks (and the single process)
start from the same weights without a broadcast. Config A is L=4 D=256 (Psi = 7,386,624),
config B is L=8 D=512 (Psi = 33,674,240); both use sequence 128 and a global batch of 8.
Config S (L=16 D=64, vocab 512, sequence 16, global batch 4; Psi = 866,432) is latency-bound:
its compute is tiny, so the per-unit fixed cost of a sharded engine (hooks, bookkeeping, one
message round per collective) is what its step time shows.

Data is a pool of `POOL_SIZE` seeded random-token batches of shape (global batch, seq + 1),
cycled step by step (so the loss falls); rank r of N trains on rows [r*B/N, (r+1)*B/N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_SEED = 1234
DATA_SEED = 0
POOL_SIZE = 4


@dataclass(frozen=True)
class GPTConfig:
    name: str
    layers: int
    dim: int
    vocab: int = 8192
    seq: int = 128
    global_batch: int = 8
    default_steps: int = 20
    """Steps per run (the first `warmup` of them are not timed) unless `--steps` says otherwise."""

    @property
    def heads(self) -> int:
        return self.dim // 64

    def describe(self) -> str:
        return (f"L={self.layers} D={self.dim} heads={self.heads} V={self.vocab} "
                f"seq={self.seq} global batch={self.global_batch}")


CONFIGS = {
    "A": GPTConfig("A", layers=4, dim=256, default_steps=20),
    "B": GPTConfig("B", layers=8, dim=512, default_steps=15),
    "S": GPTConfig("S", layers=16, dim=64, vocab=512, seq=16, global_batch=4, default_steps=40),
}


class Block(nn.Module):
    """One pre-norm transformer block: the unit every sharded implementation wraps."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, s, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: GPTConfig) -> GPT:
    """The model with the benchmark's initial weights (identical on every rank)."""
    torch.manual_seed(INIT_SEED)
    return GPT(cfg)


def param_count(cfg: GPTConfig) -> int:
    """Psi: the number of parameters, from the shapes alone."""
    d, v = cfg.dim, cfg.vocab
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + cfg.seq * d + cfg.layers * block + 2 * d + d * v


def data_pool(cfg: GPTConfig) -> list[torch.Tensor]:
    """`POOL_SIZE` batches of random tokens, (global batch, seq + 1) each, the same everywhere."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    shape = (cfg.global_batch, cfg.seq + 1)
    return [torch.randint(0, cfg.vocab, shape, generator=gen) for _ in range(POOL_SIZE)]


def rank_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of the global batch's rows."""
    if batch.shape[0] % world:
        raise ValueError(f"global batch {batch.shape[0]} is not divisible by {world} ranks")
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over this rank's tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
