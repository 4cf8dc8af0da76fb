"""Mixed precision, activation checkpointing and sharded initialization, measured on 2 ranks.

    python benchmarks/precision_memory.py                     # small init model (default)
    python benchmarks/precision_memory.py --init-size 1b      # ~1B-parameter init comparison
    python benchmarks/precision_memory.py --only init --init-size 1b --no-record

Three measurements on `gpt.py`'s model, 2 gloo ranks (`fullshard.testing.DistributedGroup`,
one torch thread per rank), fullshard through `FSDPStrategy` (FULL_SHARD, one unit per
`Block`, BLOCK buckets), plain SGD:

1. precision (config A): '32-true' vs 'bf16-mixed': bytes all-gathered and reduce-scattered
   per step (`fullshard.comm_stats()`, rank 0, last step) and the step time (median over the
   timed steps of the max over ranks);
2. activation checkpointing (config B, fp32): without / with `activation_checkpointing_policy=
   {Block}`: bytes autograd keeps for backward after the forward (distinct storages of the
   tensors packed, counted through `saved_tensors_hooks` -- and the engine's own ZeRO-3 pack
   function, whose hooks sit inside -- plus the block inputs checkpointing keeps), the peak
   RSS growth of the fresh rank process over setup and all steps (`ru_maxrss`), the largest
   RSS growth within one timed step (sampled from /proc/self/statm; the allocator keeps
   freed memory, so read it beside the exact count, not instead of it), the engine's peak
   unsharded bytes and the step time;
3. initialization: the same model built on the meta device and materialized unit by unit at
   setup (`module_init_context(empty_init=True)`) vs built normally on every rank and then
   set up: wall time of build + setup and the peak RSS growth per rank (`ru_maxrss` of a fresh
   rank process against its RSS before building). `--init-size small` (default) is ~34M
   parameters; `1b` is ~1.04B (L=20, D=2048): 4.2 GB in fp32, so the normal path needs
   ~8.4 GB on 2 ranks. Runs that could not fit in the memory available now are skipped.

The record goes to `benchmarks/results/<date>-precision_memory[-<parts>][-1b].{md,json}`
(unless `--no-record`). Step times on a shared 2-core machine drift; read them as ratios.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt import CONFIGS, GPT, Block, GPTConfig, data_pool, param_count, rank_rows  # noqa: E402

MiB = 2**20
INIT_SIZES = {
    "small": GPTConfig("init-small", layers=8, dim=512),
    "1b": GPTConfig("init-1b", layers=20, dim=2048),
}


# -- helpers that run inside the ranks -----------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RSSPeak:
    """Peak RSS over a block, sampled every half millisecond in a thread."""

    def __enter__(self) -> _RSSPeak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _strategy(**kwargs: Any):
    from fullshard import FSDPStrategy

    s = FSDPStrategy(accelerator="cpu", auto_wrap_policy={Block}, bucketing_strategy="BLOCK",
                     **kwargs)
    s.setup_environment()
    return s


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _max_over_ranks(values: list[float]) -> list[float]:
    """Per-step max over ranks (call after the step's counters were read)."""
    import torch.distributed as dist

    from fullshard.distributed import comm

    t = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce(t, comm.Group.from_process_group(None), op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_precision(config: str, precision: str, steps: int, warmup: int) -> dict[str, Any]:
    """Train `steps` steps of config `config` under `precision`; time and count them."""
    import torch.distributed as dist

    import fullshard

    cfg = CONFIGS[config]
    rank, world = dist.get_rank(), dist.get_world_size()
    s = _strategy(precision=precision)
    torch.manual_seed(1234)
    model = s.setup_module(GPT(cfg))
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pool = data_pool(cfg)
    times, losses = [], []
    for step in range(steps):
        batch = rank_rows(pool[step % len(pool)], rank, world)
        fullshard.reset_comm_stats()
        start = time.perf_counter()
        loss = _loss(model, batch)
        s.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    stats = fullshard.comm_stats()
    times = _max_over_ranks(times)[warmup:]
    return {"precision": precision, "config": config, "params": param_count(cfg),
            "step_s": statistics.median(times), "step_s_all": times, "losses": losses,
            "comm": {k: v for k, v in stats.items() if v["calls"]}}


def _saved_bytes(model: torch.nn.Module, batch: torch.Tensor, checkpointing: bool) -> tuple:
    """Forward once; bytes autograd keeps for backward (see the module docstring)."""
    storages: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    def add(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        keep.append(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        add(t)
        return t

    runtime = model.fullshard_runtime
    engine_pack = runtime.saved._pack

    def counting_pack(t: torch.Tensor) -> Any:
        packed = engine_pack(t)
        if packed is t:
            add(t)
        return packed

    runtime.saved._pack = counting_pack
    handles = []
    if checkpointing:  # non-reentrant checkpointing keeps each block's input in a closure
        handles = [m.register_forward_pre_hook(lambda mod, args: add(args[0]))
                   for m in model.modules() if isinstance(m, Block)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, batch)
    finally:
        runtime.saved._pack = engine_pack
        for h in handles:
            h.remove()
    keep.clear()
    return loss, sum(storages.values())


def rank_checkpointing(config: str, checkpointing: bool, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    import fullshard

    cfg = CONFIGS[config]
    rank, world = dist.get_rank(), dist.get_world_size()
    base = _rss()
    s = _strategy(activation_checkpointing_policy={Block} if checkpointing else None)
    torch.manual_seed(1234)
    model = s.setup_module(GPT(cfg))
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pool = data_pool(cfg)
    times, saved, rss, peaks = [], 0, 0, 0
    for step in range(steps):
        batch = rank_rows(pool[step % len(pool)], rank, world)
        fullshard.reset_memory_stats()
        with _RSSPeak() as sampler:
            start = time.perf_counter()
            if step == steps - 1:  # the last step also counts the saved bytes
                loss, saved = _saved_bytes(model, batch, checkpointing)
            else:
                loss = _loss(model, batch)
            s.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        if step >= warmup:
            rss = max(rss, sampler.growth)
            peaks = max(peaks, fullshard.memory_stats()["peak_unsharded_bytes"])
    times = _max_over_ranks(times)[warmup:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"checkpointing": checkpointing, "config": config, "saved_bytes": saved,
            "rss_step_growth": rss, "rss_peak_growth": peak, "peak_unsharded": peaks,
            "step_s": statistics.median(times), "step_s_all": times}


def rank_init(size: str, meta: bool) -> dict[str, Any]:
    """Build + set up the init model one way; report time and peak RSS growth.

    The first meta-device op of a process loads torch's meta kernels (~1-2 s and ~70-90 MiB
    of RSS, once per process, whatever the model). Both paths pay it up front here, outside
    the measurement, and it is reported as `meta_warmup_*`."""
    import fullshard

    cfg = INIT_SIZES[size]
    base, start = _rss(), time.perf_counter()
    with torch.device("meta"):
        GPT(GPTConfig("warmup", layers=1, dim=64, vocab=64, seq=8))
    warmup_s, warmup_rss = time.perf_counter() - start, _rss() - base
    base = _rss()
    fullshard.reset_memory_stats()
    start = time.perf_counter()
    s = _strategy()
    torch.manual_seed(1234)
    with s.module_init_context(empty_init=meta):
        model = GPT(cfg)
    built = time.perf_counter() - start
    model = s.setup_module(model)
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"size": size, "meta": meta, "params": param_count(cfg), "build_s": built,
            "total_s": total, "peak_rss_growth": peak - base, "shard_bytes": shards,
            "after_rss_growth": _rss() - base, "meta_warmup_s": warmup_s,
            "meta_warmup_rss": warmup_rss,
            "peak_unsharded": fullshard.memory_stats()["peak_unsharded_bytes"]}


# -- driver -------------------------------------------------------------------------------------
def _run(fn: Any, *args: Any, timeout: float = 1800) -> list[Any]:
    """A fresh 2-rank group per measurement: fresh processes, so ru_maxrss means this run."""
    from fullshard.testing import DistributedGroup

    with DistributedGroup(2, pg_timeout=timeout) as group:
        return group.run(fn, *args, timeout=timeout)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_precision(steps: int, warmup: int) -> list[dict]:
    import precision_memory as pm  # by module name, so the ranks can unpickle the function

    return [pm._run(pm.rank_precision, "A", p, steps, warmup)[0]
            for p in ("32-true", "bf16-mixed")]


def measure_checkpointing(steps: int, warmup: int) -> list[dict]:
    import precision_memory as pm

    out = []
    for ckpt in (False, True):
        ranks = pm._run(pm.rank_checkpointing, "B", ckpt, steps, warmup)
        row = dict(ranks[0])
        for key in ("saved_bytes", "rss_step_growth", "rss_peak_growth", "peak_unsharded"):
            row[key] = max(r[key] for r in ranks)
        out.append(row)
    return out


def measure_init(size: str) -> list[dict]:
    import precision_memory as pm

    cfg = INIT_SIZES[size]
    full = 4 * param_count(cfg)
    out = []
    for meta in (True, False):  # the meta path first; the big normal build last, once
        unit = full // cfg.layers
        need = (full // 2 + 2 * unit) * 2 if meta else (full + 2 * unit) * 2
        if _mem_available() < 1.25 * need:
            out.append({"size": size, "meta": meta, "params": param_count(cfg),
                        "skipped": f"needs ~{need / 2**30:.1f} GiB, "
                                   f"{_mem_available() / 2**30:.1f} GiB available"})
            continue
        ranks = pm._run(pm.rank_init, size, meta)
        row = dict(ranks[0])
        for key in ("total_s", "build_s", "peak_rss_growth", "after_rss_growth"):
            row[key] = max(r[key] for r in ranks)
        row["full_bytes"] = full
        out.append(row)
    return out


def _fmt_mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def tables(results: dict[str, list[dict]]) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    if results.get("precision"):
        rows = []
        base = results["precision"][0]
        for r in results["precision"]:
            ag, rs = r["comm"].get("all_gather", {}), r["comm"].get("reduce_scatter", {})
            rows.append([r["precision"], f"{ag.get('calls', 0)}", _fmt_mib(ag.get("bytes")),
                         _fmt_mib(rs.get("bytes")),
                         f"{ag.get('bytes', 0) / base['comm']['all_gather']['bytes']:.3f}",
                         f"{r['step_s']:.3f}", f"{r['step_s'] / base['step_s']:.2f}",
                         f"{r['losses'][-1]:.4f}"])
        out.append(("Precision (config A, 2 ranks, FULL_SHARD, per step, rank 0)",
                    ["precision", "all-gathers", "gathered MiB", "reduce-scattered MiB",
                     "gathered / fp32", "step s", "step / fp32", "last loss"], rows))
    if results.get("checkpointing"):
        rows = []
        for r in results["checkpointing"]:
            rows.append(["on" if r["checkpointing"] else "off", _fmt_mib(r["saved_bytes"]),
                         _fmt_mib(r["rss_peak_growth"]), _fmt_mib(r["rss_step_growth"]),
                         _fmt_mib(r["peak_unsharded"]),
                         f"{r['step_s']:.3f}"])
        out.append(("Activation checkpointing (config B, fp32, FULL_SHARD; max over ranks)",
                    ["checkpointing", "saved for backward MiB", "process peak RSS MiB",
                     "step RSS growth MiB",
                     "engine peak unsharded MiB", "step s"], rows))
    if results.get("init"):
        rows = []
        for r in results["init"]:
            path = "meta (empty_init=True)" if r["meta"] else "built normally"
            if "skipped" in r:
                rows.append([path, f"{r['params'] / 1e6:,.0f}M", "skipped: " + r["skipped"],
                             "", "", "", ""])
                continue
            rows.append([path, f"{r['params'] / 1e6:,.0f}M", f"{r['total_s']:.1f}",
                         _fmt_mib(r["peak_rss_growth"]), _fmt_mib(r["after_rss_growth"]),
                         _fmt_mib(r["shard_bytes"]), _fmt_mib(r["full_bytes"])])
        out.append(("Initialization (2 ranks; time and memory per rank, max over ranks)",
                    ["path", "params", "build+setup s", "peak RSS growth MiB",
                     "RSS after MiB", "shards MiB", "full model MiB"], rows))
    return out


def _text(title: str, cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _markdown(title: str, cols: list[str], rows: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "loadavg": os.getloadavg(), "mem_available": _mem_available()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="*", choices=("precision", "checkpointing", "init"),
                   default=["precision", "checkpointing", "init"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--init-size", choices=sorted(INIT_SIZES), default="small")
    p.add_argument("--results-dir", default=str(HERE / "results"))
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= warmup < steps")
    meta = {"started": _dt.datetime.now().isoformat(timespec="seconds"), **machine(),
            "args": vars(args)}
    results: dict[str, list[dict]] = {}
    if "precision" in args.only:
        results["precision"] = measure_precision(args.steps, args.warmup)
    if "checkpointing" in args.only:
        results["checkpointing"] = measure_checkpointing(max(3, args.steps // 2), 1)
    if "init" in args.only:  # last: the big run happens once, at the end
        results["init"] = measure_init(args.init_size)
    meta["loadavg_end"] = os.getloadavg()
    rendered = tables(results)
    print("\n\n".join(_text(*t) for t in rendered))
    if args.no_record:
        return
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if len(args.only) == 3 else "-" + "-".join(args.only)
    suffix += "" if args.init_size == "small" or "init" not in args.only else f"-{args.init_size}"
    stem = out / f"{_dt.date.today().isoformat()}-precision_memory{suffix}"
    body = [f"# precision_memory ({meta['started']})", "",
            f"torch {meta['torch']}, {meta['cpus']} CPUs, commit {meta['commit'][:10]}"
            f"{' (dirty)' if meta['dirty'] else ''}, load average "
            f"{meta['loadavg'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}", ""]
    body += ["\n\n".join(_markdown(*t) for t in rendered), ""]
    stem.with_suffix(".md").write_text("\n".join(body))
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results},
                                                    indent=1, default=str))
    print(f"\nwrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
