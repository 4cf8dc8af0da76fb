"""`fullshard.plan()`: will this model fit, and with which strategy?

It resolves the model (built on the meta device), reads off the units and buckets the engine
would build, and for every (world size, strategy) computes the per-rank bytes and the
communication per step (`estimate.py`, `working_set.py`), an activation estimate when a batch
shape is given (`activations.py`), and which configurations fit a budget. The result is a
`PlanTable` (`table.py`): data, `.to_dict()`, `.recommend()`, and `str()` as a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fullshard.config import ShardingPlan, resolve_bucketing_strategy, resolve_sharding_strategy
from fullshard.distributed import comm
from fullshard.engine.hooks import small_units_bytes
from fullshard.planner.activations import activation_bytes
from fullshard.planner.estimate import (
    comm_bytes,
    dtype_names,
    model_state_bytes,
    resolve_optimizer,
    resolve_precision_spec,
)
from fullshard.planner.model_spec import resolve_model
from fullshard.planner.sizes import parse_bytes
from fullshard.planner.structure import model_structure
from fullshard.planner.table import STRATEGY_ORDER, PlanRow, PlanTable
from fullshard.planner.working_set import backward_scratch_bytes, unit_costs, working_set_bytes

_CANONICAL = {"ZERO3": "FULL_SHARD", "ZERO2": "SHARD_GRAD_OP"}


def plan(
    model_or_factory: object,
    *,
    world_sizes: Iterable[int] | int = (1, 2, 4, 8),
    strategies: Iterable[object] | None = None,
    precision: object = None,
    optimizer: str = "adamw",
    batch: int | None = None,
    seq: int | None = None,
    auto_wrap_policy: object = None,
    bucketing: object = "BLOCK",
    prefetch_limit: int = 1,
    budget: int | str | None = None,
    max_pending_reductions: int = 2,
    backend: str = "nccl",
    ranks_per_node: int = 8,
    attention: str = "flash",
) -> PlanTable:
    """Per-rank memory and communication of training `model_or_factory` with fullshard.

    Args:
        model_or_factory: a built-in config name ('tiny', 'demo', 'llama-7b', 'llama-13b',
            'llama-70b'), 'package.module:factory', a callable returning an `nn.Module`
            (called under `torch.device('meta')`), or a module (only shapes are read).
        world_sizes: the numbers of ranks to plan for.
        strategies: sharding strategies (any spelling `fsdp()` accepts); default FULL_SHARD,
            SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (a `(world / ranks_per_node,
            ranks_per_node)` mesh, n/a where the world size is not a multiple).
        precision: a Lightning precision string ('32-true', 'bf16-mixed', '16-mixed',
            'bf16-true', '16-true') or a `MixedPrecision`; None is fp32.
        optimizer: 'adamw' / 'adam' (2 states + a step counter), 'sgd-momentum' (1), 'sgd'.
        batch, seq: per-rank micro-batch and sequence length for the activation estimate
            (both or neither).
        auto_wrap_policy: the units, as `fsdp()` takes it; default: the config's block class,
            or a guess for other models (see `planner.model_spec`).
        bucketing: 'NONE', 'LAYER' or 'BLOCK'. prefetch_limit, max_pending_reductions: as in
            `fsdp()`; they set the working set.
        budget: per-rank memory, bytes or a string such as '80GiB'.
        backend: 'nccl' (GPUs; a multi-parameter gather is copied out once) or 'gloo'.
        ranks_per_node: the shard size of HYBRID_SHARD.
        attention: 'flash' (count fused attention as GPUs run it) or 'math'.
    """
    sizes = _world_sizes(world_sizes)
    plans = _strategies(strategies)
    precision_spec = resolve_precision_spec(precision)
    optim = resolve_optimizer(optimizer)
    bucketing_strategy = resolve_bucketing_strategy(bucketing)
    for name, value, low in (("prefetch_limit", prefetch_limit, 0),
                             ("max_pending_reductions", max_pending_reductions, 1),
                             ("ranks_per_node", ranks_per_node, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if (batch is None) != (seq is None):
        raise ValueError("Give both batch and seq for an activation estimate, or neither "
                         f"(got batch={batch!r}, seq={seq!r}).")
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    budget_bytes = None if budget is None else parse_bytes(budget)

    resolved = resolve_model(model_or_factory, auto_wrap_policy)
    structure = model_structure(resolved.module, resolved.policy, bucketing_strategy,
                                shard_dtype=precision_spec.shard_dtype)
    scratch = backward_scratch_bytes(structure, precision_spec)
    activations = None
    if batch is not None and seq is not None:
        mp = precision_spec.mixed
        compute = (mp.param_dtype if mp is not None else None) or precision_spec.shard_dtype
        activations = activation_bytes(resolved.module, batch, seq, compute_dtype=compute,
                                       attention=attention, copy_model=not resolved.built_here)

    rows = []
    costs_by_shard: dict[int, list] = {}
    for n in sizes:
        for name, sp in plans:
            mesh = _mesh(sp, n, ranks_per_node)
            if mesh is None:
                note = (f"needs a world size that is a multiple of {ranks_per_node} "
                        f"(ranks per node)")
                rows.append(PlanRow(n, name, None, applicable=False, note=note))
                continue
            shard = mesh[1]
            if shard not in costs_by_shard:
                costs_by_shard[shard] = unit_costs(structure, shard, precision_spec, backend)
            state = model_state_bytes(structure, shard, precision_spec, optim)
            working = working_set_bytes(
                costs_by_shard[shard], reshard_after_forward=sp.reshard_after_forward,
                shard_size=shard, prefetch_limit=prefetch_limit,
                max_pending_reductions=max_pending_reductions,
                batch_bytes=small_units_bytes() if backend == "gloo" else 0,
            )
            row = PlanRow(
                n, name, mesh,
                param_bytes=state.params, grad_bytes=state.grads,
                optimizer_bytes=state.optimizer, working_set_bytes=working,
                backward_scratch_bytes=scratch, activation_bytes=activations,
                comm_bytes_by_kind=comm_bytes(
                    structure, mesh, sp.reshard_after_forward, precision_spec, backend,
                    packed_sum_bytes=comm.COALESCE_BYTES if backend == "gloo" else 0,
                ),
            )
            if budget_bytes is not None:
                row = dataclasses.replace(row, fits=row.total_bytes <= budget_bytes)
            rows.append(row)

    table = PlanTable(
        model=resolved.name, num_params=structure.numel, units=structure.describe_units(),
        policy=resolved.policy_source, precision=precision_spec.name,
        dtypes=dtype_names(precision_spec), optimizer=optim.name,
        bucketing=bucketing_strategy.value, prefetch_limit=prefetch_limit, backend=backend,
        batch=batch, seq=seq, budget=budget_bytes, rows=rows,
    )
    best = {id(r) for r in table.recommendations().values() if r is not None}
    table.rows = [dataclasses.replace(r, recommended=True) if id(r) in best else r
                  for r in rows]
    return table


def _world_sizes(world_sizes: Iterable[int] | int) -> list[int]:
    values = [world_sizes] if isinstance(world_sizes, int) else list(world_sizes)
    if not values:
        raise ValueError("world_sizes must name at least one world size")
    for n in values:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"A world size must be an int >= 1, got {n!r}")
    return list(dict.fromkeys(values))


def _strategies(strategies: Iterable[object] | None) -> list[tuple[str, ShardingPlan]]:
    names = STRATEGY_ORDER if strategies is None else list(strategies)
    if isinstance(strategies, str):
        names = [strategies]
    out: dict[str, ShardingPlan] = {}
    for s in names:
        sp = resolve_sharding_strategy(s)
        out.setdefault(_CANONICAL.get(sp.name, sp.name), sp)
    if not out:
        raise ValueError("strategies must name at least one sharding strategy")
    return list(out.items())


def _mesh(sp: ShardingPlan, world: int, ranks_per_node: int) -> tuple[int, int] | None:
    """(replicate, shard) for this strategy and world size; None where it does not apply."""
    if sp.no_shard:
        return (world, 1)
    if sp.hybrid:
        if world % ranks_per_node != 0:
            return None
        return (world // ranks_per_node, ranks_per_node)
    return (1, world)
