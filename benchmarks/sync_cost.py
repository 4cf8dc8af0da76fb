"""What one blocking exchange costs ranks that arrive at it from compute (issue 23).

    python benchmarks/sync_cost.py              # 2 and 3 ranks
    python benchmarks/sync_cost.py --worlds 3 --chunks 1 4 16

`--hardware local` prices an exchange's fixed cost (`intra_latency`) as a small all-gather
between ranks that do nothing else. In a step the ranks reach each exchange from compute; where
they outnumber the cores (3 ranks on this 2-core machine) the scheduler lets them drift apart
between exchanges, and the first to arrive waits for the last. On every rank at once (one torch
thread each, every sample started together): `k` matmuls of (256 x 1024) @ (1024 x 1024), then
the engine's small all-gather, against the same `k` matmuls alone; the difference per exchange,
beside the idle latency. Printed, not recorded: the curve behind `--hardware local`'s
`drift_per_s` and `drift_max` (which sample it after 1 and after 4 matmuls).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def measure(chunks: list[int]) -> dict:
    from fullshard.distributed import comm
    from fullshard.planner.hardware import _median_of, _world

    torch.set_num_threads(1)
    group = _world()
    small = torch.zeros(256)
    out = torch.empty(group.size * small.numel())
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)

    def exchange() -> None:
        comm.all_gather(out, small, group)

    result = {"idle": _median_of(exchange, repeats=9, inner=20), "chunks": {}}
    for k in chunks:
        def compute(k: int = k) -> None:
            for _ in range(k):
                a @ b

        def both(k: int = k) -> None:
            compute(k)
            exchange()

        alone = _median_of(compute, repeats=7, inner=10)
        result["chunks"][k] = (alone, _median_of(both, repeats=7, inner=10) - alone)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4, 8, 16],
                   help="matmuls between two exchanges")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import sync_cost  # pickled by module name into the ranks

    from fullshard.testing import DistributedGroup

    print("ms per exchange, the slowest rank: idle = between ranks doing nothing else; "
          "after k matmuls = (compute + exchange) - compute alone")
    for world in args.worlds:
        with DistributedGroup(world) as group:
            ranks = group.run(sync_cost.measure, args.chunks, timeout=600.0)
        idle = max(r["idle"] for r in ranks)
        parts = [f"idle {idle * 1e3:.2f}"]
        for k in args.chunks:
            alone = max(r["chunks"][k][0] for r in ranks)
            cost = max(r["chunks"][k][1] for r in ranks)
            parts.append(f"after {k} ({alone * 1e3:.0f} ms): {cost * 1e3:.2f}")
        print(f"{world} ranks on {os.cpu_count()} cores: " + "; ".join(parts))


if __name__ == "__main__":
    main()
