"""`predict()`: the memory and step time of ONE configuration, as the search prices it.

For checking the model against a real run (the demo, `benchmarks/plan_accuracy.py`, the
tests): the search restricted to a single point of its space.
"""

from __future__ import annotations

from fullshard.planner.recommendation import Evaluated
from fullshard.planner.search import SearchSpace


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
    from fullshard.planner.api import plan

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
