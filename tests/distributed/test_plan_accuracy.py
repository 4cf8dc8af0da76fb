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

Then the time model against this machine (`--hardware local`, measured on the same ranks): of
two configurations predicted >= 1.3x apart, the one predicted faster must be measured faster;
and the recommended configuration's options pass straight to `fsdp()`, holding the predicted
state.

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


# -- the time model against this machine ----------------------------------------------------------
TIMED = [  # strategy, layers, per-rank batch, checkpoint every block
    ("FULL_SHARD", 4, 8, False),
    ("FULL_SHARD", 4, 2, False),
    ("FULL_SHARD", 4, 8, True),
    ("SHARD_GRAD_OP", 2, 8, False),
]


def _time_configs(configs, steps: int = 3) -> dict:
    """On each rank: this machine's measured hardware numbers, then each configuration's
    median step time (after one warm-up step)."""
    import time

    from fullshard.planner.hardware import measure_ranks
    from fullshard.testing.models import Block

    out = {"hardware": measure_ranks(), "steps": []}
    for strategy, layers, batch, ckpt in configs:
        torch.manual_seed(0)
        model = fullshard.fsdp(build_demo_model(layers=layers), sharding_strategy=strategy,
                               bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                               activation_checkpointing_policy={Block} if ckpt else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        times = []
        for _ in range(steps + 1):
            x, y = model.make_batch(batch, gen)
            t0 = time.perf_counter()
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        out["steps"].append(sorted(times[1:])[len(times[1:]) // 2])
    return out


def test_predicted_faster_is_measured_faster(group):
    """Issue 23's loose bound for `make test`: with `--hardware local` (measured on these
    ranks), of two configurations the planner predicts >= 1.3x apart, the one predicted
    faster is measured faster; and no prediction is off by more than 4x."""
    from fullshard.planner.api import predict
    from fullshard.planner.hardware import measure_local, worst_of

    n = group.world_size
    if n != 2:
        pytest.skip("timed on 2 ranks only, for the suite's time; benchmarks/plan_accuracy.py "
                    "records 2 and 3 ranks")
    runs = group.run(_time_configs, TIMED)
    measured_hw = worst_of([r["hardware"] for r in runs])
    hw = measure_local(link=measured_hw["link"], compute=measured_hw["compute"])
    measured = [max(r["steps"][i] for r in runs) for i in range(len(TIMED))]
    predicted = [
        predict(lambda layers=layers: build_demo_model(layers=layers), world_size=n,
                strategy=strategy, batch=batch, seq=64, hardware=hw,
                checkpoint_every=1 if ckpt else 0).time.step
        for strategy, layers, batch, ckpt in TIMED
    ]
    report = [f"{c}: predicted {p * 1e3:.0f} ms, measured {m * 1e3:.0f} ms"
              for c, p, m in zip(TIMED, predicted, measured)]
    for i in range(len(TIMED)):
        assert 0.25 < measured[i] / predicted[i] < 4, report
        for j in range(len(TIMED)):
            if predicted[j] >= 1.3 * predicted[i]:
                assert measured[j] > measured[i], report


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
