"""The planner against the engine: what `fullshard.plan()` predicts vs what a real step holds.

The demo model (and a deeper variant, where ZeRO-3 and ZeRO-2 differ) is wrapped with
`fsdp()` on 2 and 3 gloo ranks (3 ranks: the vocabulary of 256 rows and other dims leave
padding) and trained for three AdamW steps. On every rank we measure

- the unique storages of the parameters, of the gradients after a step and of the optimizer
  state after a step, which must equal the planner's bytes EXACTLY (optimizer state per shard
  rank: it excludes padding, so ranks differ);
- `memory_stats()["peak_unsharded_bytes"]` over each step, which the planner's working set
  must match within 10% (it replays the engine's schedule, and matches exactly today);
- `comm_stats()` wire bytes per step, which must equal the planner's communication exactly.

Then `--hardware local` measured on the same ranks gives a `Hardware` the time model prices a
configuration with, and the recommended configuration's options pass straight to `fsdp()`,
holding the predicted state. Whether measured steps follow the predicted ones is a benchmark's
question, not the suite's (a loaded machine reorders them): `benchmarks/plan_accuracy.py
--ordering` and the accuracy records.

One rank group per world size for the whole module.
"""

from __future__ import annotations

import pytest
import torch

import fullshard
from fullshard.config import FSDPBucketingStrategy, mixed_precision_for
from fullshard.demo.config import build_demo_model
from fullshard.planner.models import resolve_model
from fullshard.planner.sizes import (
    model_state_bytes,
    model_structure,
    resolve_optimizer,
    resolve_precision_spec,
)
from fullshard.testing import DistributedGroup

CASES = [  # strategy, precision, layers[, activation checkpointing of every block]
    ("FULL_SHARD", "32-true", 4),
    ("FULL_SHARD", "32-true", 4, True),
    ("SHARD_GRAD_OP", "32-true", 4),
    ("FULL_SHARD", "32-true", 8),
    ("SHARD_GRAD_OP", "32-true", 8),
    ("FULL_SHARD", "bf16-mixed", 4),
    ("NO_SHARD", "32-true", 4),  # on 3 ranks gloo's small sums send N-1 copies, large a ring
]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def group(request):
    with DistributedGroup(request.param) as g:
        yield g


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _train_and_measure(strategy: str, precision: str, layers: int, ckpt: bool = False) -> dict:
    """On each rank: three AdamW steps; unsharded peaks and comm per step, state after."""
    from fullshard.testing.models import Block

    torch.manual_seed(0)
    model = build_demo_model(layers=layers)
    fullshard.fsdp(
        model,
        sharding_strategy=strategy,
        bucketing_strategy="BLOCK",
        auto_wrap_policy={Block},
        mixed_precision=mixed_precision_for(precision),
        prefetch_limit=1,
        activation_checkpointing_policy={Block} if ckpt else None,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    peaks, comm = [], []
    for step in range(3):
        x, y = model.make_batch(4, gen)
        fullshard.reset_memory_stats()
        fullshard.reset_comm_stats()
        model.loss(x, y).backward()
        peaks.append(fullshard.memory_stats()["peak_unsharded_bytes"])
        comm.append({k: v["wire_bytes"] for k, v in fullshard.comm_stats().items()})
        opt.step()
        if step < 2:
            opt.zero_grad()
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "rank": torch.distributed.get_rank(),
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _storage_bytes(state),
        "peaks": peaks,
        "comm": comm,
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_planner_matches_the_engine(group, case):
    strategy, precision, layers, *ckpt = case
    n = group.world_size
    measured = group.run(_train_and_measure, strategy, precision, layers, *ckpt)
    table = fullshard.plan(
        lambda: build_demo_model(layers=layers),
        world_sizes=(n,),
        strategies=(strategy,),
        precision=precision,
        optimizer="adamw",
        bucketing="BLOCK",
        prefetch_limit=1,
        backend="gloo",
    )
    row = table.row(n, strategy)
    # Per shard rank: optimizer state is built from the unpadded local shards.
    resolved = resolve_model(lambda: build_demo_model(layers=layers))
    structure = model_structure(resolved.module, resolved.policy, FSDPBucketingStrategy.BLOCK)
    precision_spec, adamw = resolve_precision_spec(precision), resolve_optimizer("adamw")
    for m in measured:
        shard = 1 if strategy == "NO_SHARD" else n
        per_rank = model_state_bytes(
            structure, shard, precision_spec, adamw, shard_rank=m["rank"] % shard
        )
        assert (m["params"], m["grads"], m["optimizer"]) == (
            per_rank.params, per_rank.grads, per_rank.optimizer
        ), f"rank {m['rank']}"
        assert (m["params"], m["grads"]) == (row.param_bytes, row.grad_bytes)
        assert m["optimizer"] <= row.optimizer_bytes  # the row reports rank 0, the largest
        # The plan is the peak of training: the larger of the first step (no recorded order,
        # so no prefetch and no batching of small units) and a later one.
        peak = max(m["peaks"])
        assert abs(row.working_set_bytes - peak) <= 0.10 * peak, (
            f"rank {m['rank']}: measured peaks {m['peaks']}, predicted {row.working_set_bytes}"
        )
        assert all(p <= row.working_set_bytes * 1.10 for p in m["peaks"]), m["peaks"]
        for step, comm in enumerate(m["comm"]):
            predicted = {k: row.comm_bytes_by_kind.get(k, 0) for k in comm}
            if m["rank"] == n - 1:  # the busiest: gloo's reduce-scatter sends no padding,
                assert comm == predicted, f"rank {m['rank']} step {step}"
            else:  # so a rank with more rows of its own sends less
                assert all(comm[k] <= predicted[k] for k in comm), f"rank {m['rank']}"
                assert comm["all_gather"] == predicted["all_gather"]
    assert measured[0]["optimizer"] == row.optimizer_bytes
    if n == 3 and strategy != "NO_SHARD":
        # 256 vocabulary rows over 3 ranks: 86, 86, 84 -- the padding is in the shards.
        assert measured[2]["optimizer"] < measured[0]["optimizer"]
        shard_bytes = {"32-true": 4, "bf16-mixed": 4}[precision]  # shards stay fp32
        assert 3 * row.param_bytes > shard_bytes * table.num_params


def test_zero3_working_set_below_zero2_when_deep():
    deep = fullshard.plan(lambda: build_demo_model(layers=8), world_sizes=(2,), backend="gloo",
                          strategies=("FULL_SHARD", "SHARD_GRAD_OP"))
    assert (deep.row(2, "FULL_SHARD").working_set_bytes
            < deep.row(2, "SHARD_GRAD_OP").working_set_bytes)


# -- --hardware local on the training ranks -----------------------------------------------------
def test_local_hardware_is_measured_on_the_training_ranks(group):
    """What `--hardware local` measures on live ranks becomes a `Hardware` that prices a
    configuration. No duration is asserted: only that every figure is a number in its range."""
    from fullshard.planner.api import predict
    from fullshard.planner.hardware import measure_local, measure_ranks, worst_of

    n = group.world_size
    if n != 2:
        pytest.skip("measured on 2 ranks only, for the suite's time")
    measured = worst_of(group.run(measure_ranks))
    hw = measure_local(link=measured["link"], compute=measured["compute"])
    assert hw.backend == "gloo" and hw.ranks_per_node == 64
    assert hw.peak_flops > 0 and hw.mem_bandwidth > 0 and hw.intra_bw > 0
    assert 0.0 <= hw.overlap <= 1.0
    for name in ("op_overhead", "unit_overhead", "param_overhead", "regather_overhead",
                 "drift_per_s", "drift_max", "optimizer_tensor_s", "optimizer_byte_s"):
        value = getattr(hw, name)
        assert value >= 0 and value == value and value != float("inf"), (name, value)
    e = predict(lambda: build_demo_model(layers=2), world_size=n, strategy="FULL_SHARD",
                batch=2, seq=64, hardware=hw)
    t = e.time
    assert t.step > 0 and t.step >= t.compute and t.step >= t.optimizer > 0
    assert t.tokens_per_step == 2 * 64


def _train_recommended(kwargs: dict) -> dict:
    torch.manual_seed(0)
    model = fullshard.fsdp(build_demo_model(), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = model.make_batch(4, torch.Generator().manual_seed(1))
    model.loss(x, y).backward()
    opt.step()
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"state": _storage_bytes(params) + _storage_bytes(p.grad for p in params)
            + _storage_bytes(state)}


def test_recommendation_passes_straight_to_fsdp(group):
    n = group.world_size
    table = fullshard.plan("demo", world_sizes=(n,), budget="1GiB", seq=64, global_batch=4 * n,
                           hardware="l40s", backend="gloo")
    best = table.recommendation
    assert best is not None and best.fits and not best.config.cpu_offload
    measured = group.run(_train_recommended, best.fsdp_kwargs())
    assert measured[0]["state"] == best.memory.state  # rank 0 holds the most
