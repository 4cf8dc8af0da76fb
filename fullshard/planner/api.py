"""`fullshard.plan()`: will this model fit, and with which strategy? `predict()`: the memory and
step time of one configuration. `fullshard plan`: the CLI subcommand around `plan()`.

`plan()` resolves the model (built on the meta device), reads off the units and buckets the
engine would build, and for every (world size, strategy) computes the per-rank bytes and the
communication per step (`sizes.py`, `schedule.py`), an activation estimate when a batch shape
is given (`profile.py`), and which configurations fit a budget; with a budget it also searches
(`search.py`). The result is a `PlanTable` (`table.py`): data, `.to_dict()`, `.recommend()`, and
`str()` as a table.

`predict()` is the search restricted to a single point of its space, for checking the model
against a real run (the demo, `benchmarks/plan_accuracy.py`, the tests).

`fullshard.cli` calls `add_plan_parser(subparsers)`; nothing heavy is imported until the
command runs, so `fullshard --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable

from fullshard.config import (
    Compression,
    ShardingPlan,
    resolve_bucketing_strategy,
    resolve_sharding_strategy,
)
from fullshard.distributed import comm
from fullshard.distributed.unit_comm import small_units_bytes
from fullshard.engine.wrap import select_units
from fullshard.planner.models import resolve_model
from fullshard.planner.presets import resolve_hardware
from fullshard.planner.profile import ForwardProfile, activation_bytes, profile_forward
from fullshard.planner.schedule import backward_scratch_bytes, unit_costs, working_set_bytes
from fullshard.planner.search import Evaluated, SearchSpace, precision_specs
from fullshard.planner.search import search as run_search
from fullshard.planner.sizes import (
    comm_bytes,
    dtype_names,
    model_state_bytes,
    model_structure,
    parse_bytes,
    resolve_optimizer,
    resolve_precision_spec,
)
from fullshard.planner.table import STRATEGY_ORDER, PlanRow, PlanTable

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
    backend: str | None = None,
    ranks_per_node: int | None = None,
    attention: str = "flash",
    global_batch: int | None = None,
    hardware: object = "h100-sxm",
    search: bool | None = None,
    search_precisions: Iterable[object] | None = None,
    search_space: SearchSpace | None = None,
    compression: object = None,
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
            or a guess for other models (see `planner.models`).
        bucketing: 'NONE', 'LAYER' or 'BLOCK'. prefetch_limit, max_pending_reductions: as in
            `fsdp()`; they set the working set.
        budget: per-rank memory, bytes or a string such as '80GiB'.
        backend: 'nccl' (GPUs; a multi-parameter gather is copied out once) or 'gloo'
            (default: the hardware's: gloo for 'local', else nccl).
        ranks_per_node: the shard size of HYBRID_SHARD (default: the hardware's; 8).
        attention: 'flash' (count fused attention as GPUs run it) or 'math'.
        global_batch: sequences per optimizer step over all ranks; the search makes up
            `global_batch / N` per rank from micro-batches and gradient accumulation.
        hardware: for the time model: a preset ('h100-sxm', 'h200-sxm', 'a100-80gb',
            'l40s'), 'local' (measured now), a JSON file or a `Hardware`.
        search: search configurations for the fastest that fits (`table.search`,
            `table.recommendation`); default: when a budget is given.
        search_precisions: precisions the search tries (default: `precision`).
        search_space: what the search varies (`planner.search.SearchSpace`).
        compression: as `fsdp()` takes it ("int8", "bf16", a `Compression`): the gathers'
            and reductions' bytes are priced in its wire formats (the time model and the
            search price exact bytes); NO_SHARD rows are n/a with it.
    """
    wire = Compression.coerce(compression)
    sizes = _world_sizes(world_sizes)
    if backend is None:
        local = isinstance(hardware, str) and hardware.strip().lower() == "local"
        backend = "gloo" if local or getattr(hardware, "backend", None) == "gloo" else "nccl"
    search_rpn = ranks_per_node
    if ranks_per_node is None:
        ranks_per_node = getattr(hardware, "ranks_per_node", 8)
    sharding_by_name = _strategies(strategies)
    precision_spec = resolve_precision_spec(precision)
    optim = resolve_optimizer(optimizer)
    bucketing_strategy = resolve_bucketing_strategy(bucketing)
    for name, value, low in (("prefetch_limit", prefetch_limit, 0),
                             ("max_pending_reductions", max_pending_reductions, 1),
                             ("ranks_per_node", ranks_per_node, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if (batch is None) != (seq is None) and global_batch is None:
        raise ValueError("Give both batch and seq for an activation estimate, or neither "
                         f"(got batch={batch!r}, seq={seq!r}).")
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    budget_bytes = None if budget is None else parse_bytes(budget)

    resolved = resolve_model(model_or_factory, auto_wrap_policy)
    structure = model_structure(resolved.module, resolved.policy, bucketing_strategy,
                                shard_dtype=precision_spec.shard_dtype,
                                mixed_precision=precision_spec.mixed)
    scratch = backward_scratch_bytes(structure, precision_spec)
    search_result, profiles = None, {}
    if search is None:
        search = budget_bytes is not None
    if search:
        search_result, profiles = _search(
            resolved, precision_spec, search_precisions, optim, hardware, budget_bytes,
            batch, seq, global_batch, sizes, bucketing_strategy, max_pending_reductions,
            attention, backend, search_rpn, search_space)
    activations = None
    if batch is not None and seq is not None:
        mp = precision_spec.mixed
        compute = (mp.param_dtype if mp is not None else None) or precision_spec.shard_dtype
        profiled = profiles.get(compute)
        if profiled is not None and profiled.seq == seq and batch == profiled.batch:
            activations = profiled.saved_bytes  # the same meta forward, already run
        else:
            activations = activation_bytes(resolved.module, batch, seq, compute_dtype=compute,
                                           attention=attention,
                                           copy_model=not resolved.built_here)

    rows = []
    costs_by_shard: dict[int, list] = {}
    for n in sizes:
        for name, sp in sharding_by_name:
            mesh = _mesh(sp, n, ranks_per_node)
            if mesh is None:
                note = (f"needs a world size that is a multiple of {ranks_per_node} "
                        f"(ranks per node)")
                rows.append(PlanRow(n, name, None, applicable=False, note=note))
                continue
            shard = mesh[1]
            if wire is not None and shard == 1 and mesh[0] > 1:
                rows.append(PlanRow(n, name, None, applicable=False,
                                    note="compression does not apply to NO_SHARD"))
                continue
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
                    compression=wire,
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
    table.search = search_result
    return table


def _search(resolved, precision_spec, search_precisions, optim, hardware, budget_bytes,  # type: ignore[no-untyped-def]
            batch, seq, global_batch, sizes, bucketing_strategy, max_pending, attention,
            backend, ranks_per_node, space):
    """Profile the model once per compute dtype and search (`search.py`)."""
    if global_batch is not None and (not isinstance(global_batch, int)
                                     or isinstance(global_batch, bool) or global_batch < 1):
        raise ValueError(f"global_batch must be an int >= 1, got {global_batch!r}")
    hw = resolve_hardware(hardware)
    if ranks_per_node is not None:
        hw = dataclasses.replace(hw, ranks_per_node=ranks_per_node)
    budget = budget_bytes if budget_bytes is not None else hw.memory
    if seq is None:
        seq = default_seq(resolved.module)
    precisions = (precision_specs(search_precisions) if search_precisions is not None
                  else [precision_spec])
    profiles: dict[object, ForwardProfile] = {}
    structures: dict[str, object] = {}

    def structure_for(p):  # type: ignore[no-untyped-def]
        if p.name not in structures:
            structures[p.name] = model_structure(resolved.module, resolved.policy,
                                                 bucketing_strategy, shard_dtype=p.shard_dtype,
                                                 mixed_precision=p.mixed)
        return structures[p.name]

    results = []
    for p in precisions:
        mp = p.mixed
        compute = (mp.param_dtype if mp is not None else None) or p.shard_dtype
        if compute not in profiles:
            profiles[compute] = profile_forward(resolved.module, resolved.policy, 1, seq,
                                                compute_dtype=compute, attention=attention)
        results.append(run_search(
            structure_for, profiles[compute], world_sizes=sizes, precisions=[p],
            optimizer=optim, hardware=hw, budget=budget, seq=seq, batch=batch,
            global_batch=global_batch, backend=backend or hw.backend,
            max_pending_reductions=max_pending, space=space or SearchSpace(),
            names=[u.name or "root" for u in profiles[compute].units]))
    merged = results[0]
    for r in results[1:]:
        merged.ranked += r.ranked
        merged.skipped += r.skipped
    merged.ranked.sort(key=lambda e: (not e.fits, e.time.step if e.fits else e.memory.total,
                                      e.memory.total))
    classes = _unit_classes(resolved)
    merged.ranked = [dataclasses.replace(e, unit_classes=classes, wrap_policy=resolved.policy)
                     for e in merged.ranked]
    return merged, profiles


def _unit_classes(resolved) -> tuple:  # type: ignore[no-untyped-def]
    """The block classes (the non-root units), which checkpointing applies to."""
    seen: dict[type, None] = {}
    for m in select_units(resolved.module, resolved.policy)[1:]:
        seen.setdefault(type(m), None)
    return tuple(seen)


def default_seq(module) -> int:  # type: ignore[no-untyped-def]
    """A sequence length when none is given: the model's own, else 2048."""
    cfg = getattr(module, "cfg", None)
    for value in (getattr(cfg, "max_seq", None), getattr(cfg, "seq", None),
                  getattr(module, "seq", None)):
        if isinstance(value, int) and value > 0:
            return value
    return 2048


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


# -- one configuration ----------------------------------------------------------------------------
def predict(
    model_or_factory: object,
    *,
    world_size: int,
    strategy: str = "FULL_SHARD",
    precision: str = "32-true",
    optimizer: str = "adamw",
    batch: int,
    seq: int,
    hardware: object = "h100-sxm",
    bucketing: object = "BLOCK",
    prefetch_limit: int = 1,
    checkpoint_every: int = 0,
    cpu_offload: bool = False,
    accumulation: int = 1,
    no_sync: bool = True,
    auto_wrap_policy: object = None,
    backend: str | None = None,
    ranks_per_node: int | None = None,
    max_pending_reductions: int = 2,
    attention: str = "flash",
) -> Evaluated:
    """Predicted memory and step time of training `model_or_factory` on `world_size` ranks
    with `batch` sequences of `seq` tokens per rank and micro-batch (times `accumulation`
    micro-batches per step). Options as `fullshard.plan()` and `fsdp()`."""
    if not isinstance(accumulation, int) or isinstance(accumulation, bool) or accumulation < 1:
        raise ValueError(f"accumulation must be an int >= 1, got {accumulation!r}")
    name = strategy.upper()
    space = SearchSpace(strategies=(name,), checkpoint_every=(checkpoint_every,),
                        cpu_offload=(cpu_offload,), prefetch=(prefetch_limit,),
                        micro_batch=batch, no_sync=(no_sync,),
                        max_micro_batches=accumulation)
    table = plan(model_or_factory, world_sizes=(world_size,), strategies=(name,),
                 precision=precision, optimizer=optimizer, batch=batch * accumulation,
                 seq=seq, auto_wrap_policy=auto_wrap_policy, bucketing=bucketing,
                 prefetch_limit=prefetch_limit, budget=None, backend=backend,
                 ranks_per_node=ranks_per_node, attention=attention, hardware=hardware,
                 search=True, search_space=space,
                 max_pending_reductions=max_pending_reductions)
    assert table.search is not None
    ranked = table.search.ranked
    if not ranked:
        raise ValueError(f"Nothing to predict: {'; '.join(table.search.skipped)}")
    return ranked[0]


# -- the CLI subcommand ---------------------------------------------------------------------------
_EPILOG = """\
MODEL is a built-in config (tiny, demo, llama-7b, llama-13b, llama-70b) or
package.module:factory, a callable returning an nn.Module; it is built on the meta device, so
nothing is allocated (a 70B model plans in seconds).

examples:
  fullshard plan llama-7b --world-sizes 8,16,32 --precision bf16-mixed --budget 80GiB
  fullshard plan llama-70b --precision bf16-mixed --batch 1 --seq 4096 --budget 80GiB \
      --world-sizes 8,16,64
  fullshard plan llama-13b --global-batch 256 --seq 4096 --budget 80GiB --hardware a100-80gb
  fullshard plan demo --world-sizes 2,3 --budget 1GiB --hardware local
  fullshard plan mypkg.models:build_model --wrap MyBlock --optimizer sgd-momentum

All numbers are per rank. state = parameters + gradients + optimizer state (exact, padding
included); working = unsharded parameters and gradients in flight (from the actual units,
bucketing and prefetch); comm/step = bytes each rank sends per training step.

With --budget (or --search) the planner also searches: strategy and mesh, activation
checkpointing (none, every 4th / 2nd block, every block), CPU offload, the precisions given,
prefetch 1-2, and micro-batch with gradient accumulation (to --global-batch), and recommends
the fastest configuration that fits, with its predicted step time and tokens/s per rank on
--hardware, the exposed communication and what would hide it.
"""


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory and communication of a model for each strategy and world size",
        description="Plan a model's memory per rank and communication per step for each "
        "sharding strategy and world size, and recommend the cheapest that fits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="built-in config or package.module:factory")
    p.add_argument("--world-sizes", default="1,2,4,8", metavar="N,N,...",
                   help="numbers of ranks to plan for (default: 1,2,4,8)")
    p.add_argument("--strategies", default=None, metavar="S,S,...",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (default: all)")
    p.add_argument("--precision", default="32-true",
                   help="32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, or several "
                   "comma-separated for the search to try (the table shows the first) "
                   "(default: 32-true)")
    p.add_argument("--optimizer", default="adamw",
                   choices=("adamw", "adam", "sgd", "sgd-momentum"),
                   help="optimizer state to count (default: adamw)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="per-rank micro-batch, for the activation estimate (with --seq)")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="sequence length, for the activation estimate (with --batch)")
    p.add_argument("--budget", default=None, metavar="BYTES",
                   help="memory per rank, e.g. 80GiB, 24GB, 512MiB")
    p.add_argument("--bucketing", default="BLOCK", help="NONE, LAYER or BLOCK (default: BLOCK)")
    p.add_argument("--prefetch-limit", type=int, default=1, metavar="K",
                   help="units gathered ahead, as fsdp(prefetch_limit=) (default: 1)")
    p.add_argument("--wrap", default=None, metavar="CLASS,...",
                   help="module class names that become units, or 'root' for the whole model "
                   "as one unit (default: the config's block, else fsdp()'s default units)")
    p.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                   help="collective backend (default: gloo with --hardware local, else nccl)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="shard size of HYBRID_SHARD (default: the hardware's, 8)")
    p.add_argument("--attention", default="flash", choices=("flash", "math"),
                   help="count attention activations as fused kernels save them, or the "
                   "math kernel's seq x seq matrix (default: flash)")
    p.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="sequences per optimizer step over all ranks: the search makes up "
                   "G / N per rank from micro-batches and gradient accumulation")
    p.add_argument("--hardware", default="h100-sxm", metavar="NAME|FILE|local",
                   help="for the time model: h100-sxm, h200-sxm, a100-80gb, l40s, a JSON "
                   "file of Hardware fields, or 'local' (measured now, a few seconds) "
                   "(default: h100-sxm)")
    p.add_argument("--search", dest="search", action="store_true", default=None,
                   help="search configurations for the fastest that fits (default: with "
                   "--budget)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="only the per-strategy table")
    p.add_argument("--compression", default=None, metavar="int8|bf16",
                   help="price gathers and reductions in this wire format (default: exact)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(handler=_handler(p))


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _handler(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace, object], int]:
    def run(args: argparse.Namespace, parser: object) -> int:
        try:
            sizes = [int(t) for t in _split(args.world_sizes) or []]
        except ValueError:
            p.error(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
        try:
            precisions = _split(args.precision) or ["32-true"]
            table = plan(
                args.model,
                world_sizes=sizes,
                strategies=_split(args.strategies),
                precision=precisions[0],
                search_precisions=precisions,
                global_batch=args.global_batch,
                hardware=args.hardware,
                search=args.search,
                optimizer=args.optimizer,
                batch=args.batch,
                seq=args.seq,
                auto_wrap_policy=_split(args.wrap),
                bucketing=args.bucketing,
                prefetch_limit=args.prefetch_limit,
                budget=args.budget,
                backend=args.backend,
                ranks_per_node=args.ranks_per_node,
                attention=args.attention,
                compression=args.compression,
            )
        except (ValueError, TypeError) as e:
            p.error(str(e))
        print(json.dumps(table.to_dict(), indent=2) if args.json else table.render())
        return 0

    return run
