"""One configuration's step on N ranks taken apart, beside the planner's parts (issue 23).

    python benchmarks/plan_breakdown.py --config demo --world 3
    python benchmarks/plan_breakdown.py --config A --world 2 --steps 10

On `--world` gloo ranks (one torch thread each, all training at once, as in
`plan_accuracy.py`), after `--hardware local` is measured on the same ranks, each rank times,
in `--rounds` interleaved rounds of `--steps` steps (the first 3 of each round untimed):

- `bare fwd+bwd, no loss`: the model unwrapped, forward and backward of `logits.sum()`;
- `bare fwd+bwd`: the same with the cross-entropy loss;
- `bare step`: the same with AdamW: what the model costs with no sharding and no exchanges;
- fullshard SHARD_GRAD_OP and FULL_SHARD (BLOCK bucketing, the blocks as units), each without
  and with AdamW.

It prints, per round, the median step of the slowest rank, and the planner's prediction on
the measured hardware with its parts, and the planner's compute for the model alone (its
FLOPs, bytes, kernels, attention scores and transcendental elements at the measured rates,
forward and backward, without the engine's costs), which `bare fwd+bwd` measures. Not a
record: printed only. Read it with care on a shared machine: every figure moves with the load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROWS = ("bare fwd+bwd, no loss", "bare fwd+bwd", "bare step", "SHARD_GRAD_OP no optimizer",
        "SHARD_GRAD_OP", "FULL_SHARD no optimizer", "FULL_SHARD")


def _median_step(model, opt, data, steps: int, *, loss: bool = True) -> float:  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    times = []
    for i in range(steps + 3):
        batch = data[i % len(data)]
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        value = (F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) if loss
                 else logits.sum())
        value.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def measure(config: str, steps: int, rounds: int) -> dict:
    from plan_accuracy import _model_factory, _vocab

    import fullshard
    from fullshard.planner.hardware import measure_ranks

    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    factory, seq, global_batch, block = _model_factory(config)
    per_rank = -(-global_batch // world)
    out: dict = {"hardware": measure_ranks(), "per_rank": per_rank, "seq": seq,
                 **{row: [] for row in ROWS}}
    gen = torch.Generator().manual_seed(rank)
    vocab = _vocab(factory())
    data = [torch.randint(0, vocab, (per_rank, seq + 1), generator=gen) for _ in range(4)]
    for _ in range(rounds):
        torch.manual_seed(0)
        bare = factory()
        out["bare fwd+bwd, no loss"].append(_median_step(bare, None, data, steps, loss=False))
        out["bare fwd+bwd"].append(_median_step(bare, None, data, steps))
        out["bare step"].append(_median_step(
            bare, torch.optim.AdamW(bare.parameters(), lr=1e-4), data, steps))
        for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
            torch.manual_seed(0)
            model = fullshard.fsdp(factory(), sharding_strategy=strategy,
                                   bucketing_strategy="BLOCK", auto_wrap_policy={block},
                                   device="cpu")
            out[f"{strategy} no optimizer"].append(_median_step(model, None, data, steps))
            out[strategy].append(_median_step(
                model, torch.optim.AdamW(model.parameters(), lr=1e-4), data, steps))
            del model
    return out


def model_compute(config: str, batch: int, hardware) -> float:  # type: ignore[no-untyped-def]
    """The planner's forward + backward of the model alone on `hardware`: `timing.unit_times`
    of one rank with the engine's own costs set to 0 (no exchanges, no hooks)."""
    import dataclasses

    from plan_accuracy import _model_factory

    from fullshard.config import FSDPBucketingStrategy
    from fullshard.planner.models import resolve_model
    from fullshard.planner.profile import profile_forward
    from fullshard.planner.sizes import model_structure, resolve_precision_spec
    from fullshard.planner.timing import unit_times

    factory, seq, _, block = _model_factory(config)
    resolved = resolve_model(factory, auto_wrap_policy={block})
    structure = model_structure(resolved.module, resolved.policy, FSDPBucketingStrategy.BLOCK)
    profile = profile_forward(resolved.module, resolved.policy, 1, seq)
    bare = dataclasses.replace(hardware, unit_overhead=0.0, param_overhead=0.0)
    times = unit_times(structure, profile, batch, (1, 1), resolve_precision_spec("32-true"),
                       bare, backend="gloo")
    return sum(t.forward + t.backward for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="demo", choices=("A", "B", "S", "demo"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import plan_breakdown  # pickled by module name into the ranks
    from plan_accuracy import _model_factory

    from fullshard.planner.api import predict
    from fullshard.planner.hardware import measure_local, worst_of
    from fullshard.testing import DistributedGroup

    with DistributedGroup(args.world) as group:
        ranks = group.run(plan_breakdown.measure, args.config, args.steps, args.rounds,
                          timeout=1800.0)
    measured = worst_of([r["hardware"] for r in ranks])
    hw = measure_local(link=measured["link"], compute=measured["compute"])
    factory, seq, _, block = _model_factory(args.config)
    batch = ranks[0]["per_rank"]
    print(f"config {args.config}, {args.world} ranks, {batch} x {seq} tokens per rank; "
          f"ms, the slowest rank's median step per round")
    for row in ROWS:
        per_round = [max(r[row][k] for r in ranks) for k in range(args.rounds)]
        print(f"  measured  {row:<28}" + "".join(f"{x * 1e3:8.1f}" for x in per_round))
    alone = model_compute(args.config, batch, hw)
    print(f"  predicted model alone (fwd+bwd+loss)  {alone * 1e3:8.1f}")
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        t = predict(factory, world_size=args.world, strategy=strategy, batch=batch, seq=seq,
                    hardware=hw, auto_wrap_policy={block}, backend="gloo").time
        print(f"  predicted {strategy:<13} step {t.step * 1e3:.1f} = compute {t.compute * 1e3:.1f}"
              f" + exposed comm {t.exposed * 1e3:.1f} + optimizer {t.optimizer * 1e3:.1f}")


if __name__ == "__main__":
    main()
