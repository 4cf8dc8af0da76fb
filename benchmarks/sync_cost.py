"""What a synchronization costs between compute segments, on 2 and 3 ranks of this machine.

    python benchmarks/sync_cost.py                 # 2 and 3 ranks, prints a table
    python benchmarks/sync_cost.py --worlds 3 --rows 16 64 256

Each rank (gloo, one torch thread) runs a fixed number of `(rows x 1024) @ (1024 x 1024)`
matmuls, `rare`: with one barrier per sample (~60 ms of work), `every`: with a barrier before
each matmul; and `back to back`: barriers alone. The cost of one synchronization between
segments of that length is `every - rare` per matmul. Why it matters (issue 23): with more ranks
than cores, a rank waiting on an exchange waits for a peer the scheduler has set aside, and the
planner charges an exchange only its latency measured back to back. Medians of 7 samples, all
ranks started together; the table shows each rank's figures. Not a record: printed only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CALLS = {16: 120, 64: 40, 256: 10}
"""Matmuls per sample by row count (the same on every rank: each barrier must match)."""


def measure(rows_list: list[int]) -> dict[str, float]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    for rows in rows_list:
        a, b = torch.randn(rows, 1024), torch.randn(1024, 1024)
        a @ b
        n = CALLS.get(rows, max(1, 10 * 256 // rows))
        for mode in ("rare", "every"):
            samples = []
            for _ in range(7):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    if mode == "every":
                        dist.barrier()
                    a @ b
                samples.append((time.perf_counter() - t0) / n)
            out[f"{rows} {mode}"] = statistics.median(samples)
    samples = []
    for _ in range(7):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            dist.barrier()
        samples.append((time.perf_counter() - t0) / 20)
    out["back to back"] = statistics.median(samples)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    p.add_argument("--rows", nargs="+", type=int, default=[16, 64, 256])
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import sync_cost  # pickled by module name into the ranks

    from fullshard.testing import DistributedGroup

    print("| ranks | matmul rows | segment ms (rare) | with a barrier each ms "
          "| cost per barrier ms "
          "| barriers back to back ms |\n|---|---|---|---|---|---|")
    for world in args.worlds:
        with DistributedGroup(world) as group:
            ranks = group.run(sync_cost.measure, args.rows, timeout=600.0)
        b2b = max(r["back to back"] for r in ranks)
        for rows in args.rows:
            rare = max(r[f"{rows} rare"] for r in ranks)
            every = max(r[f"{rows} every"] for r in ranks)
            print(f"| {world} | {rows} | {rare * 1e3:.2f} | {every * 1e3:.2f} | "
                  f"{(every - rare) * 1e3:.2f} | {b2b * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
