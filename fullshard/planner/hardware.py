"""`--hardware local`: this machine, measured now (some 10-30 s on a loaded 2-core machine);
presets and files are presets.py's.

`local` is measured on the ranks that will train (as the benchmark and the tests do), or on two
ranks spawned for it (`measure_local()` alone), every rank at once -- a barrier starts each
sample on all ranks together, so N ranks on fewer cores measure the oversubscribed machine
they will train on -- with one torch thread per rank. Each figure is the median of several
samples of about `WINDOW` seconds each (not one short burst: on a shared machine a burst
catches one moment's load, a step lasts hundreds of milliseconds); the ranks' worst figures are
kept (the step waits for the slowest rank):

    peak_flops      FLOP/s of a (256 x 1024) @ (1024 x 1024) fp32 matmul (also used for 16-bit:
                    CPUs have no faster 16-bit path to count on); matmul_efficiency = 1
    mem_bandwidth   bytes/s of copying a 32 MiB tensor (read + write); mem_efficiency = 1
    op_overhead     seconds per kernel of a tiny transformer block (width 16, 4 tokens) run
                    forward and backward, over the kernels the profile counts (x 3)
    attention_score_s  seconds per score of a causal fused attention (batch 4, 4 heads, 128
                    tokens, head dim 64) forward and backward, less what the rest of the model
                    prices it at (its FLOPs at peak_flops, bytes, kernels), per score
    transcendental_s   the same per element of GELU forward and backward (512 x 512)
    optimizer_tensor_s, optimizer_byte_s   torch's AdamW step itself: on 64 tensors of 16
                    elements (per tensor) and on one tensor of 4 Mi elements, 16 MiB, beyond
                    the caches as a model's shards are (per byte)

and between the ranks (the engine's own collectives, gloo loopback):

    intra_latency   one small all-gather through the engine's path (one packed message per
                    peer, all peers at once): the fixed cost of one exchange at this N
    intra_bw        bytes/s of an all-gather of 4 MiB per rank (each rank sends its piece to
                    each peer), less that latency
    unit_overhead, param_overhead   the engine's fixed cost per unit and per parameter and
                    pass: SHARD_GRAD_OP models of 16 tiny units of 1 and of 6 Linear(8, 8)
                    against the same models unwrapped, per unit and pass (the difference per
                    parameter), less the exchanges' latency the time model charges those
                    units separately
    regather_overhead, regather_param_overhead   the same for what FULL_SHARD adds to that
                    (ZeRO-3's second gather in backward), per unit and per parameter

    drift_per_s, drift_max   how far the ranks drift apart while they compute (schedule.py):
                    a small all-gather reached from 1 and from 4 matmuls of the size above,
                    less those matmuls alone and less the latency; the first, per second of
                    its matmuls, is the rate, the larger of the two the cap (3 ranks on this
                    2-core machine: ~0.35 and ~11 ms; 2 ranks: ~0.3 and ~3 ms)
    overlap         1 - what an exchange costs the compute running beside it, per second of
                    the exchange: 4 all-gathers of 512 KiB per rank issued asynchronously, then
                    matmuls for ~1.2x their time, then the waits, against each alone. gloo's
                    threads (and the kernel's loopback copies) run on the cores the ranks
                    compute on; on this 2-core machine the compute beside an exchange slows by
                    about the exchange's whole time (overlap ~0, clipped to [0, 1])

All ranks share one node (`ranks_per_node` = 64).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from fullshard.config import FSDPBucketingStrategy, resolve_sharding_strategy
from fullshard.distributed import comm
from fullshard.distributed.mesh import build_mesh
from fullshard.distributed.unit_comm import small_units_bytes
from fullshard.engine.sharding import shard_module
from fullshard.planner.models import load_factory
from fullshard.planner.profile import WorkCounter
from fullshard.planner.timing import Hardware

# -- --hardware local -----------------------------------------------------------------------------
WINDOW = 0.03
"""Seconds per timing sample (several calls of the measured operation)."""

_CACHE: dict[str, Hardware] = {}


def _sync() -> None:
    """Start the next sample on every rank together (no-op outside a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        comm.barrier(_world())


def _world():  # type: ignore[no-untyped-def]
    return build_mesh(resolve_sharding_strategy("FULL_SHARD")).world


def _median_of(fn, repeats: int = 7, inner: int | None = None,  # type: ignore[no-untyped-def]
               together: bool = True) -> float:
    """Seconds per call of `fn`: the median (the steps being predicted see the same load) of
    `repeats` samples of `inner` calls (default: about `WINDOW` seconds' worth; a collective
    must pass it, every rank making the same calls), each started on all ranks together
    unless `together` is False (one process)."""
    fn()
    if inner is None:
        t0 = time.perf_counter()
        fn()
        inner = max(1, int(WINDOW / max(time.perf_counter() - t0, 1e-7)))
    runs = []
    for _ in range(repeats):
        if together:
            _sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner)
    return sorted(runs)[len(runs) // 2]


def measure_compute(*, together: bool = False) -> dict[str, float]:
    """The compute figures of this process (one thread; module docstring). `together`: on
    every rank of the process group, each sample started on all at once (`measure_ranks`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        mm = _median_of(lambda: a @ b, together=together)
        src = torch.empty(8 * 2**20)  # 32 MiB
        dst = torch.empty_like(src)
        copy = _median_of(lambda: dst.copy_(src), together=together)
        ops = _op_seconds(together)
        flops, bandwidth = 2 * 256 * 1024 * 1024 / mm, 2 * src.nbytes / copy
        score, transcendental = _residual_seconds(together, flops, bandwidth, ops)
        per_tensor, per_byte = _adamw_seconds(together)
    finally:
        torch.set_num_threads(threads)
    return {"flops": flops, "mem_bandwidth": bandwidth, "op_overhead": ops,
            "attention_score_s": score, "transcendental_s": transcendental,
            "optimizer_tensor_s": per_tensor, "optimizer_byte_s": per_byte}


def _op_seconds(together: bool) -> float:
    """Seconds per kernel of a block too small for its work to count, forward and backward
    (twice the forward's kernels). The block is the tests' and the demo's, named as a factory:
    the planner does not import the packages above it."""
    torch.manual_seed(0)
    block = load_factory("fullshard.testing.models:Block")(16, 2)
    x = torch.randn(1, 4, 16, requires_grad=True)
    counter = WorkCounter([0], 1)
    with counter:
        block(x)
    kernels = 3 * counter.ops[0]

    def step() -> None:
        block(x).sum().backward()

    return _median_of(step, together=together) / kernels


def _residual_seconds(together: bool, flops: float, bandwidth: float, op: float
                      ) -> tuple[float, float]:
    """(seconds per attention score, per transcendental element): each case less what
    `timing.py` charges it without these two figures, per score / element of its profile."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 128, 64, requires_grad=True) for _ in range(3))
    x = torch.randn(512, 512, requires_grad=True)
    cases = {
        "attention": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(),
        "transcendental": lambda: F.gelu(x).sum(),
    }
    out = {}
    for name, forward in cases.items():
        counter = WorkCounter([0], 1)
        with counter:
            forward()
        priced = 3 * (counter.flops[0] / flops + counter.moved[0] / bandwidth
                      + counter.ops[0] * op)
        count = counter.scores[0] if name == "attention" else counter.transcendental[0]
        seconds = _median_of(lambda f=forward: f().backward(), together=together)
        out[name] = max(seconds - priced, 0.0) / count
    return out["attention"], out["transcendental"]


def _adamw_seconds(together: bool) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per byte) of `torch.optim.AdamW.step()`."""

    def step_of(params: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        return opt.step

    tiny = [torch.zeros(16, requires_grad=True) for _ in range(64)]
    per_tensor = _median_of(step_of(tiny), together=together) / len(tiny)
    big = torch.zeros(4 * 2**20, requires_grad=True)
    seconds = _median_of(step_of([big]), repeats=5, together=together)
    per_byte = max(seconds - per_tensor, 0.0) / (big.numel() * 4)
    return per_tensor, per_byte


def measure_link() -> dict[str, float]:
    """On every rank of an initialized gloo process group (all must call it): the exchange
    latency and bandwidth and the engine's per-unit cost (module docstring)."""
    torch.set_num_threads(1)
    group = _world()
    n = group.size
    small = torch.zeros(256)
    out_small = torch.empty(n * small.numel())
    latency = _median_of(lambda: comm.all_gather(out_small, small, group), repeats=9,
                         inner=20)
    piece = torch.zeros(2**20)  # 4 MiB per rank, one message per peer
    out = torch.empty(n * piece.numel())
    gather = _median_of(lambda: comm.all_gather(out, piece, group, check=False), repeats=5,
                        inner=3)
    bandwidth = piece.nbytes * (n - 1) / max(gather - latency, 1e-9)

    overlap = _overlap(group, n)
    drift_per_s, drift_max = _drift(group, n, latency)

    # The engine's fixed costs: 16 tiny units of k Linear(8, 8) each (2k parameters), wrapped
    # against unwrapped, per unit and pass; k = 1 and 6 separate the cost per unit from the
    # cost per parameter, SHARD_GRAD_OP and FULL_SHARD ZeRO-3's second gather in backward.
    z2 = {k: _engine_seconds(k, "SHARD_GRAD_OP") for k in (1, 6)}
    z3 = {k: _engine_seconds(k, "FULL_SHARD") for k in (1, 6)}
    # What timing.unit_times charges these units for their exchanges: a share of one
    # exchange's latency each (small units travel together); ZeRO-2 has 2 per unit (a gather,
    # a reduce-scatter) over 2 passes, ZeRO-3 one more gather.
    unit_bytes = 4 * 9 * -(-8 // n)  # Linear(8, 8)'s weight rows and bias, per rank
    share = 1.0 / max(1, small_units_bytes() // unit_bytes) if small_units_bytes() else 1.0
    per_param = max(z2[6] - z2[1], 0.0) / (12 - 2)
    per_unit = max(z2[1] - 2 * per_param - share * latency, 0.0)
    extra = {k: 2 * (z3[k] - z2[k]) for k in (1, 6)}  # per unit, once (in backward)
    regather_param = max(extra[6] - extra[1], 0.0) / (12 - 2)
    regather = max(extra[1] - 2 * regather_param - share * latency, 0.0)
    return {"latency": latency, "bandwidth": bandwidth, "overlap": overlap,
            "drift_per_s": drift_per_s, "drift_max": drift_max,
            "unit_overhead": per_unit,
            "param_overhead": per_param, "regather_overhead": regather,
            "regather_param_overhead": regather_param}


def _overlap(group, n: int) -> float:  # type: ignore[no-untyped-def]
    """1 - (compute beside 4 async exchanges - compute alone) / the exchanges alone, clipped
    to [0, 1] (module docstring). Every rank calls it (the exchanges are collectives)."""
    piece = torch.zeros(2**17)  # 512 KiB per rank
    out = torch.empty(n * piece.numel())
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)

    def exchanges(work: int = 0) -> None:
        handles = [comm.all_gather(out, piece, group, async_op=True, check=False)
                   for _ in range(4)]
        for _ in range(work):
            a @ b
        for h in handles:
            h.wait()

    alone = _median_of(exchanges, repeats=7, inner=2)
    one = _median_of(lambda: a @ b, repeats=3, together=False)
    # the same count on every rank: the ranks' matmul times differ, the exchanges must match
    matmuls = max(comm.all_gather_object(max(1, int(1.2 * alone / one)), group))

    def compute() -> None:
        for _ in range(matmuls):
            a @ b

    compute_alone = _median_of(compute, repeats=7, inner=2)
    both = _median_of(lambda: exchanges(matmuls), repeats=7, inner=2)
    return min(max(1.0 - (both - compute_alone) / max(alone, 1e-9), 0.0), 1.0)


def _drift(group, n: int, latency: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(drift_per_s, drift_max): a small exchange reached from compute, less that compute and
    less `latency` (module docstring). Every rank calls it (the exchanges are collectives)."""
    small = torch.zeros(256)
    out = torch.empty(n * small.numel())
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    drifts = []
    for k in (1, 4):
        def compute(k: int = k) -> None:
            for _ in range(k):
                a @ b

        def then_exchange(k: int = k) -> None:
            compute(k)
            comm.all_gather(out, small, group)

        alone = _median_of(compute, repeats=5, inner=4)
        both = _median_of(then_exchange, repeats=5, inner=4)
        drifts.append((alone, max(both - alone - latency, 0.0)))
    (short, first), (_, second) = drifts
    return first / short, max(first, second)


def _engine_seconds(linears: int, strategy: str) -> float:
    """Seconds per unit and pass that `strategy` adds to 16 units of `linears` Linear(8, 8),
    sharded by the engine as `fsdp(blocks, sharding_strategy=strategy, auto_wrap_policy=
    {nn.Sequential}, bucketing_strategy="BLOCK", device="cpu")` shards them."""

    def blocks() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(*(nn.Linear(8, 8) for _ in range(linears)))
                               for _ in range(16)))

    x = torch.randn(2, 8)
    plain = blocks()
    wrapped = blocks()
    sharding = resolve_sharding_strategy(strategy).with_reshard_after_forward(None)
    shard_module(wrapped, mesh=build_mesh(sharding), plan=sharding, device=torch.device("cpu"),
                 bucketing=FSDPBucketingStrategy.BLOCK, auto_wrap_policy={nn.Sequential},
                 broadcast_from=None, mixed_precision=None, offload=False,
                 activation_checkpointing_policy=None, prefetch_limit=1,
                 backward_prefetch_limit=1, max_pending_reductions=2)
    for m in (plain, wrapped):
        m(x).sum().backward()
    base = _median_of(lambda: plain(x).sum().backward())
    step = _median_of(lambda: wrapped(x).sum().backward(), inner=5)
    return (step - base) / (16 * 2)


def measure_ranks() -> dict[str, dict[str, float]]:
    """On every rank of a gloo process group: `measure_compute()` and `measure_link()`."""
    return {"compute": measure_compute(together=True), "link": measure_link()}


_WORST = {"flops": min, "mem_bandwidth": min, "op_overhead": max, "attention_score_s": max,
          "transcendental_s": max, "optimizer_tensor_s": max,
          "optimizer_byte_s": max, "latency": max, "bandwidth": min, "overlap": min,
          "drift_per_s": max, "drift_max": max,
          "unit_overhead": max, "param_overhead": max, "regather_overhead": max,
          "regather_param_overhead": max}


def worst_of(results: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The ranks' worst figures of `measure_ranks()` results (the step waits for the slowest)."""
    return {part: {k: _WORST[k](r[part][k] for r in results) for k in results[0][part]}
            for part in ("compute", "link")}


def measure_local(*, link: dict[str, float] | None = None,
                  compute: dict[str, float] | None = None) -> Hardware:
    """This machine as `Hardware` (module docstring); cached for the process. `link` /
    `compute`: what `measure_link()` / `measure_compute()` returned on ranks already running
    (see `worst_of`); without `link` both are measured on two ranks spawned for it, with only
    `link` the compute figures are measured in this process."""
    if link is None and compute is None and "local" in _CACHE:
        return _CACHE["local"]
    if link is None:  # both on two ranks spawned for it, measuring at once
        measured = worst_of(_on_two_ranks(measure_ranks, timeout=180.0))
        link = measured["link"]
        compute = compute or measured["compute"]
    elif compute is None:  # the ranks measured their link (the demo): compute here
        compute = measure_compute()
    latency, bandwidth, unit = link["latency"], link["bandwidth"], link["unit_overhead"]
    cores = os.cpu_count() or 1
    hw = Hardware(
        "local", peak_flops=compute["flops"], peak_flops_fp32=compute["flops"],
        matmul_efficiency=1.0, mem_bandwidth=compute["mem_bandwidth"], mem_efficiency=1.0,
        memory=_host_memory(), intra_bw=bandwidth, intra_latency=latency, inter_bw=bandwidth,
        inter_latency=latency, ranks_per_node=64, op_overhead=compute["op_overhead"],
        attention_score_s=compute.get("attention_score_s", 0.0),
        transcendental_s=compute.get("transcendental_s", 0.0),
        unit_overhead=unit, param_overhead=link.get("param_overhead", 0.0),
        regather_overhead=link.get("regather_overhead", 0.0),
        regather_param_overhead=link.get("regather_param_overhead", 0.0),
        overlap=link.get("overlap", 0.5),
        drift_per_s=link.get("drift_per_s", 0.0), drift_max=link.get("drift_max", 0.0),
        backend="gloo", host_bw=compute["mem_bandwidth"],
        host_mem_bandwidth=compute["mem_bandwidth"],
        optimizer_tensor_s=compute.get("optimizer_tensor_s", 0.0),
        optimizer_byte_s=compute.get("optimizer_byte_s", 0.0),
        source=f"measured on this machine ({cores} CPUs, one thread per rank, gloo loopback)")
    _CACHE.setdefault("local", hw)
    return hw


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _on_two_ranks(fn: Callable[[], dict], *, timeout: float) -> list[dict]:
    """`fn()` on two gloo ranks spawned for it (loopback, one thread each); their results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank_main, args=(rank, port, fn, results), daemon=True)
             for rank in range(2)]
    for p in ranks:
        p.start()
    try:
        got = dict(results.get(timeout=timeout) for _ in ranks)
    except queue.Empty:
        raise RuntimeError(f"--hardware local: the measuring ranks gave no result within "
                           f"{timeout:.0f} s") from None
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = [out for out in got.values() if isinstance(out, str)]
    if failed:
        raise RuntimeError(f"--hardware local: a measuring rank failed:\n{failed[0]}")
    return [got[rank] for rank in sorted(got)]


def _rank_main(rank: int, port: int, fn: Callable[[], dict], results) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are local
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2,
                                             timeout=timedelta(seconds=120))
        results.put((rank, fn()))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
