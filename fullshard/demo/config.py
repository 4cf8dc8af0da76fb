"""The demo's settings and its model: what `fullshard demo` trains, and what `fullshard plan demo`
plans (the planner names `build_demo_model` as a factory). Kept apart from train.py (which
imports all of fullshard) so building the demo model imports nothing that imports the planner."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fullshard.demo.data import VOCAB
from fullshard.testing.models import TinyGPT


@dataclass(frozen=True)
class DemoConfig:
    strategy: str = "FULL_SHARD"
    precision: str = "32-true"
    bucketing: str = "BLOCK"
    steps: int = 300
    batch: int = 16
    seq: int = 64
    dim: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    compression: str | None = None
    """A wire format ("int8", "bf16") for weights and gradients, trained beside the exact run."""
    out: str = "runs/demo"
    resume: bool = False
    sample_prompt: str = "Shall I compare thee"
    sample_length: int = 200


def build_model(cfg: DemoConfig) -> TinyGPT:
    return TinyGPT(vocab=VOCAB, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq)


def build_demo_model(**overrides: int) -> TinyGPT:
    """The model `fullshard demo` trains (its `DemoConfig`, any model field overridable), on
    the current default device."""
    fields = {"dim", "layers", "heads", "seq"}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"Unknown demo config field(s) {sorted(unknown)}; valid: {sorted(fields)}")
    return build_model(dataclasses.replace(DemoConfig(), **overrides))
