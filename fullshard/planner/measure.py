"""`--hardware local`: measure this machine in a few seconds and describe it as `Hardware`.

Measured in this process, with one torch thread (as the benchmark ranks run), each the median
of a few repeats:

    peak_flops      FLOP/s of a (256 x 1024) @ (1024 x 1024) fp32 matmul (also used for 16-bit:
                    CPUs have no faster 16-bit path to count on); matmul_efficiency = 1
    mem_bandwidth   bytes/s of copying a 32 MiB tensor (read + write); mem_efficiency = 1
    op_overhead     seconds per kernel of a tiny transformer block (width 16, 4 tokens) run
                    forward and backward, over the kernels the profile counts (x 3)

and between two gloo ranks on this machine (spawned through `fullshard.testing`, using the
engine's own collectives), the loopback link:

    intra_latency   half the round trip of an all-reduce of one float
    intra_bw        bytes/s of an all-gather of 4 MiB per rank (each rank sends its piece)
    unit_overhead   the engine's fixed cost per unit and pass: a FULL_SHARD model of 16 tiny
                    units against the same model unwrapped, per unit and pass, less the
                    collectives' latency counted separately

All ranks share one node (`ranks_per_node` = 64), and `overlap` = 0.5: gloo's threads run on
the same cores as compute, so communication hidden behind compute still costs about half its
time (an assumption, stated in the output).
"""

from __future__ import annotations

import os
import time

import torch

from fullshard.planner.hardware import Hardware

_CACHE: dict[str, Hardware] = {}


def _median_of(fn, repeats: int = 5, inner: int = 1) -> float:  # type: ignore[no-untyped-def]
    """The median of `repeats` timings of `inner` calls, per call. The median, not the best:
    on a shared machine the steps being predicted see the same load as this measurement."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner)
    return sorted(runs)[len(runs) // 2]


def measure_compute() -> dict[str, float]:
    """Matmul FLOP/s, copy bandwidth and per-op overhead of this process (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        mm = _median_of(lambda: a @ b, repeats=5, inner=2)
        src = torch.empty(8 * 2**20)  # 32 MiB
        dst = torch.empty_like(src)
        copy = _median_of(lambda: dst.copy_(src), repeats=5)
        ops = _op_seconds()
    finally:
        torch.set_num_threads(threads)
    return {"flops": 2 * 256 * 1024 * 1024 / mm, "mem_bandwidth": 2 * src.nbytes / copy,
            "op_overhead": ops}


def _op_seconds() -> float:
    """Seconds per kernel of a transformer block too small for its work to count (width 16,
    4 tokens), forward and backward, over the kernels `profile.py` counts in its forward
    (backward: twice as many)."""
    from fullshard.planner.profile import _WorkCounter
    from fullshard.testing.models import Block

    torch.manual_seed(0)
    block = Block(16, 2)
    x = torch.randn(1, 4, 16, requires_grad=True)
    counter = _WorkCounter([0], 1)
    with counter:
        block(x)
    kernels = 3 * counter.ops[0]

    def step() -> None:
        block(x).sum().backward()

    step()
    return _median_of(step, repeats=5, inner=3) / kernels


def measure_link() -> dict[str, float]:
    """On every rank of an initialized gloo process group (all must call it): the link's
    latency and bandwidth and the engine's per-unit cost (module docstring)."""
    from torch import nn

    from fullshard.api.functional import fsdp
    from fullshard.config import resolve_sharding_strategy
    from fullshard.distributed import comm
    from fullshard.distributed.mesh import build_mesh

    torch.set_num_threads(1)
    group = build_mesh(resolve_sharding_strategy("FULL_SHARD")).world
    one = torch.zeros(1)
    comm.all_reduce(one, group)
    latency = _median_of(lambda: comm.all_reduce(one, group), repeats=5, inner=20) / 2
    piece = torch.zeros(2**20)  # 4 MiB per rank
    out = torch.empty(group.size * piece.numel())
    comm.all_gather(out, piece, group)
    gather = _median_of(lambda: comm.all_gather(out, piece, group), repeats=3, inner=2)
    bandwidth = piece.nbytes * (group.size - 1) / max(gather, 1e-9)

    def blocks() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8)) for _ in range(16)))

    x = torch.randn(2, 8)
    plain = blocks()
    wrapped = fsdp(blocks(), sharding_strategy="FULL_SHARD",
                             auto_wrap_policy={nn.Sequential}, bucketing_strategy="BLOCK",
                             device="cpu")
    for m in (plain, wrapped):
        m(x).sum().backward()
    base = _median_of(lambda: plain(x).sum().backward(), repeats=5)
    step = _median_of(lambda: wrapped(x).sum().backward(), repeats=5)
    per_unit = (step - base) / (16 * 2) - 1.5 * latency  # 3 collectives per unit, 2 passes
    return {"latency": latency, "bandwidth": bandwidth, "unit_overhead": max(per_unit, 0.0)}


def measure_local(*, link: dict[str, float] | None = None,
                  compute: dict[str, float] | None = None) -> Hardware:
    """This machine as `Hardware` (module docstring); cached for the process. `link` /
    `compute`: what `measure_link()` / `measure_compute()` returned on ranks already running
    (else they are measured here, two ranks spawned for the link)."""
    if link is None and compute is None and "local" in _CACHE:
        return _CACHE["local"]
    compute = compute or measure_compute()
    if link is None:
        from fullshard.testing.harness import run_distributed

        results = run_distributed(measure_link, 2, timeout=120.0)
        link = {"latency": max(r["latency"] for r in results),
                "bandwidth": min(r["bandwidth"] for r in results),
                "unit_overhead": max(r["unit_overhead"] for r in results)}
    latency, bandwidth, unit = link["latency"], link["bandwidth"], link["unit_overhead"]
    cores = os.cpu_count() or 1
    hw = Hardware(
        "local", peak_flops=compute["flops"], peak_flops_fp32=compute["flops"],
        matmul_efficiency=1.0, mem_bandwidth=compute["mem_bandwidth"], mem_efficiency=1.0,
        memory=_host_memory(), intra_bw=bandwidth, intra_latency=latency, inter_bw=bandwidth,
        inter_latency=latency, ranks_per_node=64, op_overhead=compute["op_overhead"],
        unit_overhead=unit, overlap=0.5, backend="gloo", host_bw=compute["mem_bandwidth"],
        host_mem_bandwidth=compute["mem_bandwidth"],
        source=f"measured on this machine ({cores} CPUs, one thread per rank, gloo loopback)")
    _CACHE.setdefault("local", hw)
    return hw


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30
