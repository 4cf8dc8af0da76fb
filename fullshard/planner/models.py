"""A Llama-style decoder for the planner's built-in configs (`llama-7b`, `llama-70b`).

Plain `nn.Module`s, written to be built on the meta device: pre-norm blocks of RMSNorm,
grouped-query causal self-attention with rotary position embeddings (computed on the fly, so
there are no buffers) and a SwiGLU MLP; token embedding, final RMSNorm and an untied LM head.
No biases, as in Llama. The wrap unit is `LlamaBlock`.

Parameter count (vocabulary V, width d, L layers, MLP width f, kv width d_kv = d * kv/heads):
    Psi = L * (2 * d * d + 2 * d * d_kv + 3 * d * f + 2 * d) + 2 * V * d + d
which is 6,738,415,616 for the 7B config (d 4096, L 32, f 11008, V 32000, d_kv = d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    ffn: int = 11008
    max_seq: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads != 0:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads "
                             f"({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def num_params(self) -> int:
        d, kv = self.dim, self.kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * kv + 3 * d * self.ffn + 2 * d
        return self.layers * block + 2 * self.vocab * d + d


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of `x` (batch, heads, seq, head_dim)."""
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = _rotate(q, cfg.rope_theta), _rotate(k, cfg.rope_theta)
        if cfg.kv_heads != cfg.heads:
            rep = cfg.heads // cfg.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, cfg.dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One transformer block: the planner's (and the wrap policy's) unit."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
