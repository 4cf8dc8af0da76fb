"""The search: every configuration a user could pick, its memory and step time, and the fastest
that fits the budget; a configuration as data that goes straight into `fsdp(...)` /
`FSDPStrategy(...)`.

Varied (`SearchSpace`): world size; sharding strategy and mesh (FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD, HYBRID_SHARD as (world / ranks_per_node, ranks_per_node)); activation checkpointing
of no block, every k-th block or every block; CPU offload; precision; prefetch depth; and the
micro-batch, with gradient accumulation (reducing every micro-batch, or once under `no_sync`)
making up the per-rank batch (`global_batch / world_size`, or `batch` when no global batch is
given).

Memory per rank (`Memory`): the exact state of `sizes.py` and working set of `schedule.py`;
autograd's backward scratch; activations from the per-unit meta forward (`profile.py`), scaled
to the micro-batch: a checkpointed block keeps only its input, and the block being recomputed
holds its full activations once more in backward. With CPU offload the state is on the host.
Under `no_sync` the unsharded gradients (compute dtype) stay between micro-batches. Time:
`timing.py`.

Ranking: configurations that fit, by step time (ties: less memory); the rest are kept with the
reason they lose (over budget, by how much and on what; or slower, by how much).

`Config` is what the search varies; `Evaluated` adds its memory and time; `fsdp_kwargs()` /
`strategy_kwargs()` turn it into keyword arguments. Checkpointing "every k-th block" is the
policy `CheckpointEvery`, which the engine calls like any `(module, recurse,
nonwrapped_numel)` policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

from fullshard.config import mixed_precision_for, resolve_precision, resolve_sharding_strategy
from fullshard.distributed.unit_comm import small_units_bytes
from fullshard.planner.profile import ForwardProfile
from fullshard.planner.schedule import (
    StepTime,
    backward_scratch_bytes,
    simulate_step,
    unit_costs,
    working_set_bytes,
)
from fullshard.planner.sizes import (
    ModelStructure,
    OptimizerSpec,
    PrecisionSpec,
    model_state_bytes,
    resolve_precision_spec,
    size_of,
)
from fullshard.planner.timing import Hardware, optimizer_seconds, unit_times

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
ROOT_GATHERED_ONCE = True
"""The engine's default under FULL_SHARD (`reshard_after_forward=None`): the root stays gathered
from its forward into backward; every other unit is gathered twice."""


# -- a configuration and its price ---------------------------------------------------------------
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


# -- the search -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchSpace:
    strategies: tuple[str, ...] = STRATEGIES
    checkpoint_every: tuple[int, ...] = (0, 4, 2, 1)
    cpu_offload: tuple[bool, ...] = (False, True)
    prefetch: tuple[int, ...] = (1, 2)
    max_micro_batches: int = 64
    micro_batch: int | None = None
    """Only this micro-batch (None: every divisor of the per-rank batch)."""
    no_sync: tuple[bool, ...] = (True, False)


@dataclass
class SearchResult:
    budget: int
    hardware: Hardware
    global_batch: int | None
    seq: int
    ranked: list[Evaluated]
    """Every configuration evaluated, fitting ones first, each group fastest first."""
    skipped: list[str]

    @property
    def fitting(self) -> list[Evaluated]:
        return [e for e in self.ranked if e.fits]

    @property
    def best(self) -> Evaluated | None:
        return self.fitting[0] if self.fitting else None

    def best_at(self, world_size: int) -> Evaluated | None:
        return next((e for e in self.fitting if e.config.world_size == world_size), None)

    def why_not(self, e: Evaluated) -> str:
        """Why `e` is not the recommendation: over budget (by how much, mostly what) or slower."""
        if not e.fits:
            over = e.memory.total - self.budget
            return f"needs {_gib(over)} more than the budget (largest: {e.memory.largest()})"
        best = self.best
        if best is None or e is best:
            return "recommended"
        return f"{e.time.step / best.time.step:.2f}x the recommended step time"

    def to_dict(self) -> dict:
        best = self.best
        return {"budget": self.budget, "hardware": self.hardware.to_dict(),
                "global_batch": self.global_batch, "seq": self.seq,
                "evaluated": len(self.ranked), "fitting": len(self.fitting),
                "best": None if best is None else best.to_dict(),
                "best_per_world_size": {
                    str(n): (None if (b := self.best_at(n)) is None else b.to_dict())
                    for n in sorted({e.config.world_size for e in self.ranked})},
                "top": [e.to_dict() for e in self.fitting[:10]],
                "skipped": list(self.skipped)}


def variants(result: SearchResult, e: Evaluated) -> dict[str, Evaluated]:
    """What would hide `e`'s exposed communication: the same configuration with one more unit
    prefetched, as HYBRID_SHARD, and as SHARD_GRAD_OP (no second gather), where evaluated."""
    c = e.config
    wanted = {f"prefetch {c.prefetch_limit + 1}":
              dataclasses.replace(c, prefetch_limit=c.prefetch_limit + 1)}
    rpn = result.hardware.ranks_per_node
    if c.strategy != "HYBRID_SHARD" and c.world_size % rpn == 0 and c.world_size > rpn:
        wanted["HYBRID_SHARD"] = dataclasses.replace(
            c, strategy="HYBRID_SHARD", mesh=(c.world_size // rpn, rpn))
    if c.strategy == "FULL_SHARD":
        wanted["SHARD_GRAD_OP"] = dataclasses.replace(c, strategy="SHARD_GRAD_OP")
    by_config = {x.config: x for x in result.ranked}
    return {label: by_config[cfg] for label, cfg in wanted.items() if cfg in by_config}


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def search(
    structure_for: object,
    profile: ForwardProfile,
    *,
    world_sizes: Sequence[int],
    precisions: Sequence[PrecisionSpec],
    optimizer: OptimizerSpec,
    hardware: Hardware,
    budget: int,
    seq: int,
    batch: int | None,
    global_batch: int | None,
    backend: str = "nccl",
    max_pending_reductions: int = 2,
    space: SearchSpace = SearchSpace(),
    names: list[str] | None = None,
) -> SearchResult:
    """Evaluate the space (module docstring). `structure_for(precision)` gives the model
    structure with that precision's shard dtype."""
    rpn = hardware.ranks_per_node
    skipped: list[str] = []
    out: list[Evaluated] = []
    for precision in precisions:
        structure: ModelStructure = structure_for(precision)  # type: ignore[operator]
        scratch = backward_scratch_bytes(structure, precision)
        cache: dict[tuple, object] = {}
        for n in world_sizes:
            if global_batch is not None:
                if global_batch % n:
                    skipped.append(f"N={n}: global batch {global_batch} is not a multiple")
                    continue
                per_rank = global_batch // n
            else:
                per_rank = batch or 1
            micro = [m for m in _divisors(per_rank) if per_rank // m <= space.max_micro_batches
                     and space.micro_batch in (None, m)]
            for name in space.strategies:
                sp = resolve_sharding_strategy(name)
                # ZeRO-3 unless resharding is switched off: None (the engine's default, the
                # root kept gathered) reshards the blocks as True does.
                reshard = sp.reshard_after_forward is not False
                mesh = _mesh(name, n, rpn)
                if mesh is None:
                    if n > rpn:  # within one node HYBRID would be FULL_SHARD anyway
                        skipped.append(f"N={n}: {name} needs a multiple of {rpn} ranks")
                    continue
                if name == "HYBRID_SHARD" and mesh[0] == 1:
                    continue  # one node: the same as FULL_SHARD
                shard = mesh[1]
                key = ("state", shard)
                if key not in cache:
                    cache[key] = model_state_bytes(structure, shard, precision, optimizer)
                    cache[("costs", shard)] = unit_costs(structure, shard, precision, backend)
                state = cache[key]
                for prefetch in space.prefetch:
                    if shard == 1 and prefetch != space.prefetch[0]:
                        continue  # nothing is gathered: prefetch changes nothing
                    wkey = ("working", shard, name, prefetch)
                    if wkey not in cache:
                        cache[wkey] = working_set_bytes(
                            cache[("costs", shard)],  # type: ignore[arg-type]
                            reshard_after_forward=reshard, shard_size=shard,
                            prefetch_limit=prefetch,
                            max_pending_reductions=max_pending_reductions,
                            batch_bytes=small_units_bytes() if backend == "gloo" else 0)
                    working: int = cache[wkey]  # type: ignore[assignment]
                    for every in space.checkpoint_every:
                        ckpt = _checkpointed(len(structure.units), every)
                        for offload in space.cpu_offload:
                            for mb in micro:
                                accum = per_rank // mb
                                for no_sync in (space.no_sync if accum > 1 else (True,)):
                                    cfg = Config(n, name, mesh, every, offload, precision.name,
                                                 prefetch, mb, accum, no_sync)
                                    out.append(_evaluate(
                                        cfg, structure, profile, precision, optimizer, hardware,
                                        state, working, scratch, ckpt, budget, seq, backend,
                                        max_pending_reductions, reshard,
                                        names, cache))
    out.sort(key=lambda e: (not e.fits, e.time.step if e.fits else e.memory.total,
                            e.memory.total))
    return SearchResult(budget, hardware, global_batch, seq, out, skipped)


def _evaluate(cfg: Config, structure: ModelStructure, profile: ForwardProfile,
              precision: PrecisionSpec, optimizer: OptimizerSpec, hardware: Hardware,
              state: object, working: int, scratch: int, ckpt: frozenset[int], budget: int,
              seq: int, backend: str, max_pending: int, reshard: bool,
              names: list[str] | None, cache: dict) -> Evaluated:
    mb = cfg.micro_batch
    acts = activation_bytes_with(profile, ckpt, mb)
    state_bytes = state.total  # type: ignore[attr-defined]
    accumulation = 0
    if cfg.accumulation > 1 and cfg.no_sync:
        accumulation = sum(b.numel * size_of(precision.dtypes(b)[1])
                           for u in structure.units for b in u.buckets if b.requires_grad)
    memory = Memory(
        state=0 if cfg.cpu_offload else state_bytes, working=working, scratch=scratch,
        activations=acts, accumulation=accumulation,
        host=state_bytes if cfg.cpu_offload else 0)
    key = ("times", cfg.mesh, mb, cfg.checkpoint_every, cfg.cpu_offload)
    if key not in cache:  # prefetch and no_sync only change the schedule
        cache[key] = unit_times(structure, profile, mb, cfg.mesh, precision, hardware,
                                checkpointed=ckpt, backend=backend, cpu_offload=cfg.cpu_offload)
        cache[("opt", *key[1:])] = optimizer_seconds(
            structure, cfg.mesh[1], precision, hardware, states=optimizer.states,
            cpu_offload=cfg.cpu_offload)
    times, opt = cache[key], cache[("opt", *key[1:])]
    step = simulate_step(
        times, zero3=reshard and cfg.mesh[1] > 1, root_regathered=not ROOT_GATHERED_ONCE,
        prefetch=cfg.prefetch_limit, max_pending_reductions=max_pending,
        micro_batches=cfg.accumulation, no_sync=cfg.no_sync, optimizer=opt,
        overlap=hardware.overlap, drift=(hardware.drift_per_s, hardware.drift_max),
        tokens_per_micro_batch=mb * seq, names=names)
    return Evaluated(cfg, memory, step, memory.total <= budget)


def activation_bytes_with(profile: ForwardProfile, checkpointed: Iterable[int],
                          micro_batch: int) -> int:
    """Peak saved activations with the given units checkpointed, at `micro_batch` sequences.

    At the end of forward every block holds what it keeps (its input when checkpointed, else
    all it saved) and the root all it saved; backward then runs the blocks in reverse,
    freeing each one's activations when it is done, and recomputes a checkpointed block's
    full activations just before its backward. So the peak is the larger of the forward's end
    and, over the blocks i, the root + what blocks before i keep + block i's full activations.
    (The root's are counted throughout: the logits live until the loss has been
    back-propagated and the embedding's until the very end.)"""
    ckpt = set(checkpointed)
    root = profile.units[0].saved_bytes if profile.units else 0
    kept_before = 0
    peak = 0
    for i, u in enumerate(profile.units[1:], start=1):
        peak = max(peak, kept_before + u.saved_bytes)
        kept_before += u.input_bytes if i in ckpt else u.saved_bytes
    peak = max(peak, kept_before)
    return (root + peak) * micro_batch // profile.batch


def _checkpointed(units: int, every: int) -> frozenset[int]:
    """Block indices (1..units-1) checkpointed by `CheckpointEvery(every)`; never the root."""
    if every == 0:
        return frozenset()
    return frozenset(i for i in range(1, units) if (i - 1) % every == 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _mesh(strategy: str, world: int, ranks_per_node: int) -> tuple[int, int] | None:
    if strategy == "NO_SHARD":
        return (world, 1)
    if strategy == "HYBRID_SHARD":
        if world % ranks_per_node:
            return None
        return (world // ranks_per_node, ranks_per_node)
    return (1, world)


def precision_specs(precisions: Iterable[object]) -> list[PrecisionSpec]:
    specs = [resolve_precision_spec(p) for p in precisions]
    if not specs:
        raise ValueError("precision must name at least one precision")
    return list({s.name: s for s in specs}.values())

