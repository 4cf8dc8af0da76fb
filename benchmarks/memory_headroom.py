"""Memory headroom: peak RSS per rank of training a ~1B-parameter GPT, against 16*Psi/N (issue 14).

    python benchmarks/memory_headroom.py                     # 1b: fullshard and FSDP2
    python benchmarks/memory_headroom.py --sizes 0.1b --impls fullshard fsdp2 ddp --no-record
    python benchmarks/memory_headroom.py --sizes 1b 0.1b 0.5b 0.3b \
        --impls fullshard fsdp2 ddp deepspeed                # the recorded run (size search)

Each (implementation, size) runs in its own fresh 2-rank gloo group (two processes started
here with the spawn method, one torch thread each), so a rank's peak RSS (`VmHWM` from
/proc/self/status) is that implementation's alone. Every rank builds `gpt.py`'s GPT on the meta
device and materializes it the implementation's way:

- fullshard FULL_SHARD: `fullshard.fsdp(model, device="cpu", auto_wrap_policy={Block},
  bucketing_strategy="BLOCK")` materializes and shards one unit at a time;
- torch FSDP2: `fully_shard` on every Block and the root (`reshard_after_forward=True`), then
  `to_empty(device="cpu")` and every module's `reset_parameters()` on the local shards;
- torch DDP: `to_empty` + `reset_parameters()` of the whole model on every rank (16*Psi per
  rank plus DDP's gradient buckets, so only small sizes);
- DeepSpeed ZeRO-3: measured only if `import deepspeed` works (it is not installed here).

Then `--steps` AdamW(lr=1e-3) steps, batch 1 per rank, sequence `--seq`. Per rank it records the
RSS before the model is built (the baseline: Python, torch, the process group), `VmHWM` after
setup and after every step (so one sees where the peak happened), the model state after the last
optimizer step (params + grads + AdamW state, distinct storages), and for fullshard the engine's
`peak_unsharded_bytes` (`fullshard.memory_stats()`) over all steps.

The prediction is `fullshard.plan(...)` for the same model, world size 2, FULL_SHARD, BLOCK
bucketing, gloo, batch 1, `--seq`: model state + working set + backward scratch + activations.
It is compared with the measured peak RSS *growth* (peak minus baseline), since the planner does
not count the interpreter; the absolute peak is in the table too.

A watchdog in this process polls /proc/meminfo and kills the ranks when MemAvailable falls below
`--min-available` (default 1.5 GiB), and a run is not started when the estimate of what it needs
exceeds what is available minus that margin; such runs are reported as skipped / killed.
Records go to `benchmarks/results/<date>-memory_headroom.{md,json}` unless `--no-record`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import queue
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from gpt import GPT, Block, GPTConfig, lm_loss, param_count  # noqa: E402
from impls import LR, _torch_state, unique_storage_bytes  # noqa: E402
from precision_memory import machine as precision_memory_machine  # noqa: E402

GiB = 2**30
MiB = 2**20
WORLD = 2
SIZES = {  # vocab 8192 (gpt.py's); seq is set per run
    "0.1b": (6, 1024),    # 92M
    "0.3b": (10, 1536),   # 308M
    "0.5b": (10, 2048),   # 537M
    "1b": (20, 2048),     # 1.04B
    "1.2b": (23, 2048),   # 1.19B
}
IMPLS = ("fullshard", "fsdp2", "ddp", "deepspeed")
RESERVE = 1 * GiB
"""Left to the OS and other processes when extrapolating to the whole machine."""


def config(size: str, seq: int) -> GPTConfig:
    layers, dim = SIZES[size]
    return GPTConfig(f"gpt-{size}", layers=layers, dim=dim, seq=seq, global_batch=WORLD)


# -- inside a rank ------------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_parameters(modules: Any) -> None:
    for m in modules:
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _wrap(impl: str, model: torch.nn.Module, world: int) -> torch.nn.Module:
    if impl == "fullshard":
        import fullshard

        return fullshard.fsdp(model, device="cpu", auto_wrap_policy={Block},
                              sharding_strategy="FULL_SHARD", bucketing_strategy="BLOCK")
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            _reset_parameters(model.modules())
        return model
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model.to_empty(device="cpu")
        with torch.no_grad():
            _reset_parameters(model.modules())
        return DistributedDataParallel(model)
    raise ValueError(f"unknown implementation {impl!r}")


def _rank_main(rank: int, impl: str, size: str, seq: int, steps: int, port: int,
               out: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        if impl == "fullshard":
            import fullshard  # noqa: F401  (imported before the baseline, as torch is)
        cfg = config(size, seq)
        with torch.device("meta"):  # load the meta kernels before the baseline (~80 MiB)
            GPT(GPTConfig("warmup", layers=1, dim=64, vocab=64, seq=8))
        base = _status("VmRSS")
        t0 = time.perf_counter()
        torch.manual_seed(1234)
        with torch.device("meta"):
            model = GPT(cfg)
        model = _wrap(impl, model, WORLD)
        setup_s = time.perf_counter() - t0
        hwm = {"setup": _status("VmHWM")}
        rss_after_setup = _status("VmRSS")
        inner = model.module if impl == "ddp" else model
        params = list(inner.parameters())
        opt = torch.optim.AdamW(params, lr=LR)
        gen = torch.Generator().manual_seed(rank)
        losses, step_s, state = [], [], 0
        for step in range(steps):
            batch = torch.randint(0, cfg.vocab, (1, seq + 1), generator=gen)
            t = time.perf_counter()
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            opt.step()
            if step == steps - 1:  # gradients still present: the full model state
                state = unique_storage_bytes(_torch_state(params, opt))
            opt.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t)
            losses.append(loss.item())
            hwm[f"step{step + 1}"] = _status("VmHWM")
        engine = None
        if impl == "fullshard":
            import fullshard

            engine = fullshard.memory_stats()
        out.put({"rank": rank, "ok": True, "base_rss": base, "rss_after_setup": rss_after_setup,
                 "hwm": hwm, "peak_rss": _status("VmHWM"), "state_bytes": state,
                 "engine": engine, "setup_s": setup_s, "step_s": step_s, "losses": losses})
        del model, opt, params, inner
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, so the parent does not wait for the timeout
        out.put({"rank": rank, "ok": False, "error": traceback.format_exc(limit=6)})
        raise


# -- the parent ---------------------------------------------------------------------------------
def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def estimated_need(impl: str, psi: int) -> int:
    """A rough total over both ranks, to refuse runs that cannot fit (not the measurement)."""
    per_rank = 16 * psi // WORLD + psi if impl != "ddp" else 20 * psi
    return WORLD * (per_rank + 600 * MiB)


def run_one(impl: str, size: str, seq: int, steps: int, min_available: int,
            timeout: float) -> dict[str, Any]:
    """One fresh 2-rank group; the per-rank results, or why there are none."""
    cfg = config(size, seq)
    psi = param_count(cfg)
    row: dict[str, Any] = {"impl": impl, "size": size, "psi": psi, "seq": seq, "steps": steps}
    need, avail = estimated_need(impl, psi), mem_available()
    if need > avail - min_available:
        row["skipped"] = (f"needs ~{need / GiB:.1f} GiB in all, {avail / GiB:.1f} GiB available "
                          f"(margin {min_available / GiB:.1f})")
        return row
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, impl, size, seq, steps, port, out),
                         daemon=True) for r in range(WORLD)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    lowest = avail
    killed = None
    while len(results) < WORLD:
        try:
            r = out.get(timeout=0.2)
            results[r["rank"]] = r
            if not r["ok"]:
                break
        except queue.Empty:
            pass
        now = mem_available()
        lowest = min(lowest, now)
        if now < min_available:
            killed = f"killed: MemAvailable fell to {now / GiB:.2f} GiB"
        elif time.perf_counter() - start > timeout:
            killed = f"killed: over {timeout:.0f} s"
        elif all(not p.is_alive() for p in procs) and out.empty():
            killed = "ranks exited without a result"
        if killed:
            break
    if killed or len(results) < WORLD or not all(r["ok"] for r in results.values()):
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(timeout=30)
    row["wall_s"] = time.perf_counter() - start
    row["min_mem_available"] = lowest
    if killed:
        row["failed"] = killed
    errors = [r["error"] for r in results.values() if not r["ok"]]
    if errors:
        row["failed"] = errors[0].strip().splitlines()[-1]
        row["traceback"] = errors[0]
    if "failed" not in row:
        row["ranks"] = [results[r] for r in range(WORLD)]
    return row


def prediction(size: str, seq: int) -> dict[str, int]:
    """fullshard.plan for this model on 2 ranks, FULL_SHARD, gloo, batch 1."""
    import fullshard

    table = fullshard.plan(functools.partial(GPT, config(size, seq)), world_sizes=WORLD,
                           strategies=["FULL_SHARD"], optimizer="adamw", batch=1, seq=seq,
                           auto_wrap_policy={Block}, bucketing="BLOCK", backend="gloo",
                           attention="flash")
    r = table.row(WORLD, "FULL_SHARD")
    return {"model_state": r.model_state_bytes, "working_set": r.working_set_bytes,
            "backward_scratch": r.backward_scratch_bytes,
            "activations": r.activation_bytes or 0, "total": r.total_bytes}


def summarize(row: dict[str, Any], pred: dict[str, int]) -> None:
    """Max over ranks of each figure, the ratios (in place)."""
    if "ranks" not in row:
        return
    ranks = row["ranks"]
    ideal = 16 * row["psi"] / WORLD
    peak = max(r["peak_rss"] for r in ranks)
    growth = max(r["peak_rss"] - r["base_rss"] for r in ranks)
    row.update(
        base_rss=max(r["base_rss"] for r in ranks), peak_rss=peak, peak_growth=growth,
        state_bytes=max(r["state_bytes"] for r in ranks), ideal_state=ideal,
        peak_over_ideal=peak / ideal, growth_over_ideal=growth / ideal,
        setup_s=max(r["setup_s"] for r in ranks),
        step_s=[max(s) for s in zip(*(r["step_s"] for r in ranks))],
        hwm={k: max(r["hwm"][k] for r in ranks) for k in ranks[0]["hwm"]},
        peak_unsharded=(max(r["engine"]["peak_unsharded_bytes"] for r in ranks)
                        if ranks[0]["engine"] else None),
    )
    if row["impl"] == "fullshard":
        row["predicted"] = pred
        row["growth_over_predicted"] = growth / pred["total"]
        row["peak_over_predicted"] = peak / pred["total"]


def _f(x: float | None, unit: int = MiB) -> str:
    return "-" if x is None else f"{x / unit:,.0f}"


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    cols = ["impl", "size (Psi)", "baseline RSS MiB", "peak RSS MiB", "peak - baseline MiB",
            "model state MiB", "16Psi/N MiB", "peak unsharded MiB", "peak / (16Psi/N)",
            "(peak - base) / (16Psi/N)", "planner total MiB", "(peak - base) / planner",
            "VmHWM after setup / step 1 / last MiB", "setup s", "step s"]
    out = []
    for r in rows:
        name = [r["impl"], f"{r['size']} ({r['psi'] / 1e6:,.0f}M)"]
        if "ranks" not in r:
            out.append(name + [r.get("skipped") or r.get("failed", "?")] + [""] * (len(cols) - 3))
            continue
        hwm = list(r["hwm"].values())
        pred = r.get("predicted")
        out.append(name + [
            _f(r["base_rss"]), _f(r["peak_rss"]), _f(r["peak_growth"]), _f(r["state_bytes"]),
            _f(r["ideal_state"]), _f(r["peak_unsharded"]), f"{r['peak_over_ideal']:.3f}",
            f"{r['growth_over_ideal']:.3f}", _f(pred["total"]) if pred else "-",
            f"{r['growth_over_predicted']:.3f}" if pred else "-",
            " / ".join(_f(h) for h in (hwm[0], hwm[1], hwm[-1])),
            f"{r['setup_s']:.1f}", " ".join(f"{s:.1f}" for s in r["step_s"])])
    return cols, out


def _markdown(cols: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def target_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """fullshard against issue 14's targets, one row per size it trained."""
    cols = ["size", "16Psi/N + planned working set + activations MiB", "peak RSS MiB",
            "peak RSS / that (<= 1.15)", "(peak - base) / that", "planner total MiB",
            "planner / peak RSS", "planner / (peak - base)", "FSDP2 peak RSS MiB",
            "fullshard / FSDP2 peak RSS", "fullshard / FSDP2 peak - base"]
    fsdp2 = {r["size"]: r for r in rows if r["impl"] == "fsdp2" and "ranks" in r}
    out = []
    for r in rows:
        if r["impl"] != "fullshard" or "ranks" not in r:
            continue
        pred = r["predicted"]
        bound = r["ideal_state"] + pred["working_set"] + pred["activations"]
        f2 = fsdp2.get(r["size"])
        out.append([
            f"{r['size']} ({r['psi'] / 1e6:,.0f}M)", _f(bound), _f(r["peak_rss"]),
            f"{r['peak_rss'] / bound:.3f}", f"{r['peak_growth'] / bound:.3f}",
            _f(pred["total"]), f"{pred['total'] / r['peak_rss']:.3f}",
            f"{pred['total'] / r['peak_growth']:.3f}",
            _f(f2["peak_rss"]) if f2 else "-",
            f"{r['peak_rss'] / f2['peak_rss']:.3f}" if f2 else "-",
            f"{r['peak_growth'] / f2['peak_growth']:.3f}" if f2 else "-"])
    return cols, out


def largest_rows(rows: list[dict], mem_total: int, reserve: int) -> tuple[list[str], list]:
    """Per implementation: the largest size that trained, the next one, and an extrapolation.

    The extrapolation fits peak RSS per rank = a + b * Psi through the two largest sizes that
    trained, and solves WORLD * (a + b * Psi) <= mem_total - reserve for Psi."""
    cols = ["impl", "sizes (x: not run)", "largest that trained (peak RSS, 2 ranks)",
            "next size up", "extrapolated largest Psi for the whole machine"]
    out = []
    for impl in IMPLS:
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["psi"])
        if not mine:
            continue
        ok = [r for r in mine if "ranks" in r]
        tried = ", ".join(r["size"] + ("" if "ranks" in r else " x") for r in mine)
        if not ok:
            out.append([impl, tried, "none", mine[0].get("skipped") or mine[0].get("failed", ""),
                        "-"])
            continue
        best = ok[-1]
        above = [r for r in mine if r["psi"] > best["psi"]]
        nxt = (f"{above[0]['size']}: {above[0].get('skipped') or above[0].get('failed', '')}"
               if above else "not tried")
        extra = "-"
        if len(ok) >= 2:
            (p0, y0), (p1, y1) = [(r["psi"], r["peak_rss"]) for r in ok[-2:]]
            b = (y1 - y0) / (p1 - p0)
            a = y1 - b * p1
            psi_max = ((mem_total - reserve) / WORLD - a) / b
            extra = (f"~{psi_max / 1e9:.2f}B ({b:.1f} B/param/rank + {a / MiB:,.0f} MiB, "
                     f"{(mem_total - reserve) / GiB:.1f} GiB usable)")
        out.append([impl, tried, f"{best['size']} ({best['psi'] / 1e6:,.0f}M, "
                    f"{WORLD * best['peak_rss'] / GiB:.1f} GiB)", nxt, extra])
    return cols, out


def render(meta: dict[str, Any], rows: list[dict]) -> str:
    order = {name: i for i, name in enumerate(IMPLS)}
    rows = sorted(rows, key=lambda r: (r["psi"], order.get(r["impl"], 99)))
    args = meta["args"]
    body = [f"# memory_headroom ({meta['started']})", "",
            f"torch {meta['torch']}, {meta['cpus']} CPUs, {meta['mem_total'] / GiB:.1f} GiB, "
            f"commit {meta['commit'][:10]}{' (dirty)' if meta['dirty'] else ''}, load average "
            f"{meta['loadavg'][0]:.2f} -> {meta.get('loadavg_end', meta['loadavg'])[0]:.2f}; "
            f"{WORLD} gloo ranks, 1 thread each, GPT (vocab 8192) built on the meta device, "
            f"{args['steps']} AdamW steps, batch 1 per rank, sequence {args['seq']}; "
            f"DeepSpeed installed: {meta['deepspeed']}.", "",
            "Per rank, max over the 2 ranks. RSS is VmRSS / VmHWM of the rank process; "
            "baseline = RSS after imports and the process group, before the model is built.",
            "", "### Per implementation and size", "", _markdown(*table_rows(rows)), "",
            "### fullshard FULL_SHARD against the targets", "", _markdown(*target_rows(rows)),
            "", "### Largest model per implementation (2 ranks)", "",
            _markdown(*largest_rows(rows, meta["mem_total"], RESERVE)), ""]
    return "\n".join(body)


def machine() -> dict[str, Any]:
    """precision_memory's machine facts (torch, commit, load), plus the total memory."""
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return {**precision_memory_machine(), "mem_total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=["fullshard", "fsdp2"])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["1b"])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--min-available", type=float, default=1.5, help="GiB (watchdog)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--results-dir", default=str(HERE / "results"))
    p.add_argument("--append", action="store_true", help="add to today's record's JSON rows")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--render", action="store_true",
                   help="only rewrite today's markdown record from its JSON")
    args = p.parse_args()
    stem = Path(args.results_dir) / f"{_dt.date.today().isoformat()}-memory_headroom"
    if args.render:
        data = json.loads(stem.with_suffix(".json").read_text())
        stem.with_suffix(".md").write_text(render(data["meta"], data["rows"]))
        print(f"wrote {stem}.md")
        return
    meta = {"started": _dt.datetime.now().isoformat(timespec="seconds"), **machine(),
            "args": vars(args)}
    try:
        import deepspeed  # noqa: F401
        have_deepspeed = True
    except ImportError:
        have_deepspeed = False
    meta["deepspeed"] = have_deepspeed
    rows: list[dict] = []
    if args.append and stem.with_suffix(".json").exists():  # keep the first run's header
        old = json.loads(stem.with_suffix(".json").read_text())
        rows = old["rows"]
        old["meta"].setdefault("appended", []).append(meta)
        meta = old["meta"]
    for size in args.sizes:
        pred = prediction(size, args.seq)
        for impl in args.impls:
            if impl == "deepspeed":
                row = {"impl": impl, "size": size, "psi": param_count(config(size, args.seq)),
                       "skipped": "DeepSpeed is not installed" if not have_deepspeed
                       else "DeepSpeed meta-device init is not wired up in this script"}
                rows = [r for r in rows if (r["impl"], r["size"]) != (impl, size)] + [row]
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {impl} {size} ...", flush=True)
            row = run_one(impl, size, args.seq, args.steps, int(args.min_available * GiB),
                          args.timeout)
            summarize(row, pred)
            rows = [r for r in rows if (r["impl"], r["size"]) != (impl, size)] + [row]
            print(json.dumps({k: v for k, v in row.items() if k not in ("ranks", "traceback")},
                             default=str), flush=True)
            meta["loadavg_end"] = os.getloadavg()
            if not args.no_record:  # after every run: a later one may be killed
                _save(stem, meta, rows)
    print(render(meta, rows))
    if not args.no_record:
        print(f"wrote {stem}.json and {stem}.md")


def _save(stem: Path, meta: dict[str, Any], rows: list[dict]) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                    default=str))
    stem.with_suffix(".md").write_text(render(meta, rows))


if __name__ == "__main__":
    main()
