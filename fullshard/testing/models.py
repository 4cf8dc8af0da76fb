"""Small models the tests (and examples) train: each exercises a different engine path.

- `TinyGPT`: token + position embeddings, pre-norm blocks (LayerNorm, causal self-attention,
  MLP), a final LayerNorm and an LM head *tied* to the token embedding.
- `OddMLP`: linear layers whose first dims are not divisible by 2, 3 or 4 (7, 13, 5, 1), so
  ranks own uneven rows, some own none, and padding is exercised; plus a 0-dim parameter
  (`out_scale`). It lives here rather than in TinyGPT because a scalar that multiplies every
  logit has a gradient summed from thousands of cancelling terms, whose float round-off
  depends on the reduction order and would need a looser tolerance than invariant 3 of
  docs/architecture.md.
- `ConvBNNet`: Conv2d + BatchNorm2d (running-stat buffers, which stay replicated).

Every model takes `(batch, ...)` inputs and has a matching `make_batch(model, n, generator)`
returning `(inputs, targets)` and a `loss(model, inputs, targets)` (mean over the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 37, dim: int = 16, layers: int = 2, heads: int = 2, seq: int = 8
    ) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def make_batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, self.vocab, (n, self.seq + 1), generator=generator)
        return data[:, :-1], data[:, 1:]

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class OddMLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (6, 7, 13, 5, 1)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.in_dim = dims[0]
        self.out_scale = nn.Parameter(torch.tensor(0.8))  # a 0-dim parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x * self.out_scale

    def make_batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.in_dim, generator=generator)
        return x, x.sum(dim=1, keepdim=True).sin()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(inputs), targets)


class ConvBNNet(nn.Module):
    def __init__(self, channels: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3)))

    def make_batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 3, 6, 6, generator=generator)
        return x, torch.randint(0, self.fc.out_features, (n,), generator=generator)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(inputs), targets)

