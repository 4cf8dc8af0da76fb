"""What model the planner looks at: a built-in config name, `package.module:factory`, a
factory callable or a module, turned into an `nn.Module` (on the meta device when we build it)
plus the wrap policy that chooses its units; and the Llama-style decoder of the built-in
`llama-*` configs.

Built-in configs (`BUILTIN_CONFIGS`), each wrapped per transformer block:

| name        | model                                        | params (Psi) |
|-------------|----------------------------------------------|--------------|
| `tiny`      | `TinyGPT()` of `fullshard.testing.models`     | ~7.6 K       |
| `demo`      | the model `fullshard demo` trains (bytes)     | ~0.83 M      |
| `llama-7b`  | Llama: 32 x 4096, SwiGLU 11008, vocab 32000   | 6.74 B       |
| `llama-13b` | Llama: 40 x 5120, SwiGLU 13824, vocab 32000   | 13.0 B       |
| `llama-70b` | Llama: 80 x 8192, GQA 8 kv heads, SwiGLU 28672| 69.0 B       |
| `llama3-8b` | Llama 3: 32 x 4096, GQA 8, SwiGLU 14336, V 128256 | 8.03 B   |
| `llama3-70b`| Llama 3: 80 x 8192, GQA 8, SwiGLU 28672, V 128256 | 70.6 B   |

`tiny` and `demo` live in the packages above the planner (`testing`, `demo`), which it does not
import: they are named as `package.module:factory`, resolved when asked for, as a user's are.

A wrap policy may also be given as class names (`["LlamaBlock"]`, the CLI's `--wrap`).
Factories are called under `torch.device("meta")`, so nothing is allocated however large the
model. Without an explicit policy a model that is not built in gets the engine's default
units (`fullshard.engine.wrap.default_unit_modules`, exactly what `fsdp()` picks): the classes
named in its `_no_split_modules` (the Hugging Face convention), else its repeated blocks, else
the root alone. `"root"` (or `--wrap root`) plans the whole model as one unit.

The Llama decoder: plain `nn.Module`s, written to be built on the meta device: pre-norm blocks
of RMSNorm, grouped-query causal self-attention with rotary position embeddings (computed on
the fly, so there are no buffers) and a SwiGLU MLP; token embedding, final RMSNorm and an
untied LM head. No biases, as in Llama. The wrap unit is `LlamaBlock`. Parameter count
(vocabulary V, width d, L layers, MLP width f, kv width d_kv = d * kv/heads):
    Psi = L * (2 * d * d + 2 * d * d_kv + 3 * d * f + 2 * d) + 2 * V * d + d
which is 6,738,415,616 for the 7B config (d 4096, L 32, f 11008, V 32000, d_kv = d).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.engine.wrap import ROOT_ONLY, choose_units


# -- the Llama decoder -----------------------------------------------------------------------------
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


# -- resolving what the user passed --------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    name: str
    description: str
    build: Callable[[], nn.Module]
    unit_classes: tuple[str, ...]
    """Class names of the units (the transformer block)."""


BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("tiny", "TinyGPT (vocab 37, dim 16, 2 layers, tied head)",
                    lambda: load_factory("fullshard.testing.models:TinyGPT")(), ("Block",)),
        ModelConfig("demo", "GPT, byte vocab 256, dim 128, 4 layers, seq 64, tied head",
                    lambda: load_factory("fullshard.demo.config:build_demo_model")(),
                    ("Block",)),
        ModelConfig("llama-7b", "Llama 32 x 4096, SwiGLU 11008, vocab 32000",
                    lambda: Llama(LlamaConfig()), ("LlamaBlock",)),
        ModelConfig("llama-13b", "Llama 40 x 5120, SwiGLU 13824, vocab 32000",
                    lambda: Llama(LlamaConfig(dim=5120, layers=40, heads=40, kv_heads=40,
                                              ffn=13824)), ("LlamaBlock",)),
        ModelConfig("llama-70b", "Llama 80 x 8192, GQA (8 kv heads), SwiGLU 28672, vocab 32000",
                    lambda: Llama(LlamaConfig(dim=8192, layers=80, heads=64, kv_heads=8,
                                              ffn=28672)), ("LlamaBlock",)),
        ModelConfig("llama3-8b", "Llama 3 32 x 4096, GQA (8 kv heads), SwiGLU 14336, vocab "
                    "128256", lambda: Llama(LlamaConfig(vocab=128256, kv_heads=8, ffn=14336,
                                                        max_seq=8192, rope_theta=500000.0)),
                    ("LlamaBlock",)),
        ModelConfig("llama3-70b", "Llama 3 80 x 8192, GQA (8 kv heads), SwiGLU 28672, vocab "
                    "128256", lambda: Llama(LlamaConfig(vocab=128256, dim=8192, layers=80,
                                                        heads=64, kv_heads=8, ffn=28672,
                                                        max_seq=8192, rope_theta=500000.0)),
                    ("LlamaBlock",)),
    )
}


@dataclass
class ResolvedModel:
    name: str
    module: nn.Module
    policy: object
    """The wrap policy the planner uses (what `fsdp(auto_wrap_policy=...)` would get)."""
    policy_source: str
    """How the policy was chosen, for the table's header."""
    built_here: bool
    """True when the planner built `module` itself (on meta): it may change it freely."""


def resolve_model(model: object, auto_wrap_policy: object = None) -> ResolvedModel:
    """Turn what the user passed into a module and a wrap policy."""
    if isinstance(model, nn.Module):
        name, module, built, block_names = type(model).__name__, model, False, None
    elif isinstance(model, str):
        key = model.strip()
        if key.lower() in BUILTIN_CONFIGS:
            cfg = BUILTIN_CONFIGS[key.lower()]
            name, module, built = cfg.name, _on_meta(cfg.build, cfg.name), True
            block_names = list(cfg.unit_classes)
        elif ":" in key:
            name, module, built, block_names = key, _on_meta(load_factory(key), key), True, None
        else:
            raise ValueError(
                f"Unknown model {model!r}: not a built-in config "
                f"({', '.join(BUILTIN_CONFIGS)}) and not 'package.module:factory'."
            )
    elif callable(model):
        name = getattr(model, "__qualname__", type(model).__name__)
        module, built, block_names = _on_meta(model, name), True, None
    else:
        raise TypeError(
            f"plan() expects an nn.Module, a factory callable, a built-in config name or "
            f"'package.module:factory'; got {type(model).__name__}: {model!r}"
        )
    if isinstance(auto_wrap_policy, str | list) and auto_wrap_policy in (ROOT_ONLY, [ROOT_ONLY]):
        return ResolvedModel(name, module, ROOT_ONLY, "root only", built)
    if _is_names(auto_wrap_policy):
        classes = _classes_named(module, auto_wrap_policy)  # type: ignore[arg-type]
        return ResolvedModel(name, module, classes, _names(classes), built)
    if auto_wrap_policy is not None:
        return ResolvedModel(name, module, auto_wrap_policy, "given", built)
    if block_names is not None:
        classes = _classes_named(module, block_names)
        return ResolvedModel(name, module, classes, _names(classes), built)
    policy, source = infer_policy(module)
    return ResolvedModel(name, module, policy, source, built)


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """`package.module:factory` (the factory may be a dotted attribute path) -> the callable."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"Bad factory path {spec!r}: expected 'package.module:factory'.")
    try:
        obj: object = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"Bad factory path {spec!r}: cannot import module {mod_name!r} "
                         f"({e}).") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"Bad factory path {spec!r}: module {mod_name!r} has no "
                             f"attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"Bad factory path {spec!r}: {attr!r} is a "
                         f"{type(obj).__name__}, not a callable returning an nn.Module.")
    return obj  # type: ignore[return-value]


def _on_meta(factory: Callable[[], object], name: str) -> nn.Module:
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"The factory for {name!r} returned a {type(module).__name__}, "
                        f"not an nn.Module.")
    return module


def infer_policy(model: nn.Module) -> tuple[object, str]:
    """No policy given: `fsdp()`'s default units (None), and the rule that picked them."""
    choice = choose_units(model, None)
    classes = {type(m) for m in choice.modules[1:]}
    return None, f"{_names(classes) or 'root'} ({choice.reason})"


def _is_names(policy: object) -> bool:
    return isinstance(policy, list | tuple | set | frozenset) and bool(policy) and all(
        isinstance(x, str) for x in policy
    )


def _classes_named(model: nn.Module, names: list[str]) -> set[type[nn.Module]]:
    """Wrap policy given by class names (the CLI's --wrap): the model's classes so named."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"No module class named {', '.join(map(repr, missing))} in "
            f"{type(model).__name__}; its classes are: {', '.join(sorted(present))}."
        )
    return {present[n] for n in names}


def _names(classes: object) -> str:
    return ", ".join(sorted(c.__name__ for c in classes))  # type: ignore[attr-defined]
