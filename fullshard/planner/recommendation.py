"""A searched configuration as data that goes straight into `fsdp(...)` / `FSDPStrategy(...)`.

`Config` is what the search varies (strategy and mesh, activation checkpointing, CPU offload,
precision, prefetch, micro-batch and accumulation); `Evaluated` adds its memory and time;
`fsdp_kwargs()` / `strategy_kwargs()` turn it into keyword arguments. Checkpointing "every
k-th block" is the policy `CheckpointEvery`, which the engine calls like any
`(module, recurse, nonwrapped_numel)` policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fullshard.config import mixed_precision_for, resolve_precision
from fullshard.planner.timing import StepTime


@dataclass(frozen=True)
class CheckpointEvery:
    """Activation checkpointing of every `every`-th module of `classes` in module order
    (the 1st, the (1 + every)-th, ...); `every=1` is all of them."""

    classes: tuple[type[nn.Module], ...]
    every: int = 1
    _seen: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"CheckpointEvery(every=) must be an int >= 1, got {self.every!r}")

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        if not isinstance(module, self.classes):
            return False
        index = self._seen.setdefault(id(module), len(self._seen))
        return index % self.every == 0


@dataclass(frozen=True)
class Config:
    world_size: int
    strategy: str
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    mesh: tuple[int, int]
    checkpoint_every: int
    """0: no activation checkpointing; k: every k-th block (1: every block)."""
    cpu_offload: bool
    precision: str
    prefetch_limit: int
    micro_batch: int
    accumulation: int
    """Micro-batches per optimizer step."""
    no_sync: bool
    """With accumulation: reduce only on the last micro-batch (holds unsharded gradients)."""

    def describe(self) -> str:
        mesh = f" {self.mesh[0]}x{self.mesh[1]}" if self.strategy == "HYBRID_SHARD" else ""
        ac = {0: "no AC", 1: "AC all"}.get(self.checkpoint_every,
                                           f"AC 1/{self.checkpoint_every}")
        accum = ""
        if self.accumulation > 1:
            accum = f" x{self.accumulation}" + (" no_sync" if self.no_sync else "")
        return (f"{self.strategy}{mesh}, {ac}{', offload' if self.cpu_offload else ''}, "
                f"{self.precision}, prefetch {self.prefetch_limit}, mb {self.micro_batch}{accum}")


@dataclass(frozen=True)
class Memory:
    state: int
    """Parameters + gradients + optimizer state on the device (0 with CPU offload)."""
    working: int
    scratch: int
    activations: int
    accumulation: int = 0
    """no_sync: the unsharded gradients kept between micro-batches."""
    host: int = 0
    """CPU offload: the state in host memory."""

    @property
    def total(self) -> int:
        return self.state + self.working + self.scratch + self.activations + self.accumulation

    def largest(self) -> str:
        parts = {"state": self.state, "working set": self.working, "activations":
                 self.activations, "grad scratch": self.scratch,
                 "accumulated grads": self.accumulation}
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True)
class Evaluated:
    config: Config
    memory: Memory
    time: StepTime
    fits: bool
    unit_classes: tuple[type[nn.Module], ...] = ()
    wrap_policy: object = None

    def fsdp_kwargs(self) -> dict:
        """Keyword arguments for `fullshard.fsdp(model, **kwargs)`. For '16-true' /
        'bf16-true' convert the model to that dtype first (`model.to(torch.bfloat16)`); there
        is no mixed precision to pass then."""
        c = self.config
        name = resolve_precision(c.precision)
        mixed = None if name.endswith("-true") else mixed_precision_for(name)
        out: dict = {"sharding_strategy": c.strategy, "bucketing_strategy": "BLOCK",
                     "prefetch_limit": c.prefetch_limit, "cpu_offload": c.cpu_offload,
                     "mixed_precision": mixed,
                     "auto_wrap_policy": self.wrap_policy,
                     "activation_checkpointing_policy": self._checkpoint_policy()}
        if c.strategy == "HYBRID_SHARD":
            out["device_mesh"] = c.mesh
        return out

    def strategy_kwargs(self) -> dict:
        """Keyword arguments for `fullshard.FSDPStrategy(**kwargs)` (precision as a string:
        the Lightning way, which also covers '-true' conversion)."""
        kw = self.fsdp_kwargs()
        kw.pop("mixed_precision")
        kw["precision"] = self.config.precision
        return kw

    def _checkpoint_policy(self) -> object:
        c = self.config
        if c.checkpoint_every == 0 or not self.unit_classes:
            return None
        if c.checkpoint_every == 1:
            return set(self.unit_classes)
        return CheckpointEvery(self.unit_classes, c.checkpoint_every)

    def to_dict(self) -> dict:
        c = self.config
        return {
            "world_size": c.world_size, "strategy": c.strategy, "mesh": list(c.mesh),
            "checkpoint_every": c.checkpoint_every, "cpu_offload": c.cpu_offload,
            "precision": c.precision, "prefetch_limit": c.prefetch_limit,
            "micro_batch": c.micro_batch, "accumulation": c.accumulation,
            "no_sync": c.no_sync, "fits": self.fits, "description": c.describe(),
            "memory": {"state": self.memory.state, "working": self.memory.working,
                       "scratch": self.memory.scratch, "activations": self.memory.activations,
                       "accumulation": self.memory.accumulation, "host": self.memory.host,
                       "total": self.memory.total},
            "time": self.time.to_dict(),
        }
