"""Checkpoint I/O: fullshard's sharded and full save/load on 2 ranks vs torch.save/torch.load.

    python benchmarks/checkpoint_io.py                  # ~98M parameters, 2 reps
    python benchmarks/checkpoint_io.py --layers 2 --dim 256 --reps 1 --no-record   # smoke test

The model is `gpt.py`'s GPT at L=12 D=768 (Psi ~98M) with AdamW state (exp_avg, exp_avg_sq,
step) -- 3 fp32 copies, ~1.2 GB per checkpoint. fullshard runs on 2 gloo ranks
(`fullshard.testing.DistributedGroup`, FULL_SHARD, one unit per `Block`) through
`fullshard.checkpoint.save_checkpoint` / `load_checkpoint` (what `fabric.save` / `load` call):

- sharded save / load: DCP directory + meta.pt, each rank writes and reads its own shards;
- full save: gathered one parameter at a time onto rank 0, one file; full load: each rank
  reads its own rows of the memory-mapped file into the sharded model.

The baseline is one process holding the unwrapped model: `torch.save` of
`{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}` (with and without an
fsync: fullshard's saves fsync every file, so compare against the fsync'ed line) and
`torch.load` (alone, and followed by `load_state_dict` into model and optimizer).

Time is wall time from a barrier before the call to a barrier after it (rank 0's clock), the
best of `--reps`; MB/s is the checkpoint's tensor bytes (10^6 B) divided by it. Loads run right
after saves, so they read from the page cache: they measure deserialization and copying, not
the disk. On a shared 2-core machine read the figures as ratios.
The record goes to `benchmarks/results/<date>-checkpoint_io.{md,json}` unless `--no-record`.

    python benchmarks/checkpoint_io.py --train --layers 4 --dim 512   # blocking vs async

`--train` measures what an asynchronous save (`save_checkpoint(..., async_save=True)`) saves
a training loop instead: 2 ranks train the GPT for `--steps` AdamW steps and save a sharded
checkpoint every `--every` steps, once with blocking saves and once with async saves (each
waits for the previous one; the last is waited for inside the timed loop). Reported: the
loop's wall time, the time the training thread spent inside the save calls, and the
checksum cost (CRC-32 of the checkpoint's bytes, measured alone).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from gpt import Block, GPTConfig, build_model, param_count  # noqa: E402

MB = 1e6


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with its state created (one step on zero gradients: the weights do not move
    except for weight decay, which is 0 here)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def _timed(fn, barrier) -> float:  # type: ignore[no-untyped-def]
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def _fullshard(cfg: GPTConfig, root: str, reps: int) -> dict[str, Any]:
    """On every rank: sharded and full save/load timings (rank 0's clock)."""
    import torch.distributed as dist

    from fullshard import FSDPStrategy
    from fullshard.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    s = FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    s.setup_environment()
    model = s.setup_module(build_model(cfg))
    opt = _adam(model)
    state = {"model": model, "optimizer": opt, "step": 1}
    local = _state_bytes(model, opt)
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for fmt in ("sharded", "full"):
            path = f"{root}/fullshard-{fmt}"
            times.setdefault(f"{fmt} save", []).append(_timed(
                lambda p=path, f=fmt: save_checkpoint(p, state, state_dict_type=f), dist.barrier))
            times.setdefault(f"{fmt} load", []).append(_timed(
                lambda p=path: load_checkpoint(p, state), dist.barrier))
    sizes = {fmt: _disk_size(Path(f"{root}/fullshard-{fmt}")) for fmt in ("sharded", "full")}
    return {"times": times, "local_bytes": local, "disk": sizes}


def _train_loop(cfg: GPTConfig, root: str, steps: int, every: int) -> dict[str, Any]:
    """On every rank: the same training loop with blocking and with async saves."""
    import torch.distributed as dist
    from gpt import data_pool, lm_loss, rank_rows

    from fullshard import FSDPStrategy
    from fullshard.checkpoint import save_checkpoint

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pool = data_pool(cfg)
    out: dict[str, Any] = {}
    for mode in ("none", "blocking", "async", "blocking", "async"):
        s = FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
        s.setup_environment()
        model = s.setup_module(build_model(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        in_save = 0.0
        handle = None
        dist.barrier()
        start = time.perf_counter()
        for step in range(1, steps + 1):
            batch = rank_rows(pool[step % len(pool)], rank, world)
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mode != "none" and step % every == 0:
                t0 = time.perf_counter()
                handle = save_checkpoint(f"{root}/train-{mode}", {"model": model,
                                                                  "optimizer": opt,
                                                                  "step": step},
                                         async_save=mode == "async")
                in_save += time.perf_counter() - t0
        t0 = time.perf_counter()
        if mode == "async" and handle is not None:
            handle.wait()
        in_save += time.perf_counter() - t0
        dist.barrier()
        total = time.perf_counter() - start
        best = out.get(mode)
        if best is None or total < best["loop"]:
            out[mode] = {"loop": total, "in_save": in_save}
    files = sorted(Path(f"{root}/train-async").iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    from fullshard.checkpoint.integrity import crc_file

    t0 = time.perf_counter()
    for f in files:
        crc_file(f)
    out["crc"] = {"bytes": nbytes, "seconds": time.perf_counter() - t0}
    return out


def _train_main(args: argparse.Namespace, cfg: GPTConfig, root: Path) -> tuple[str, Any]:
    from fullshard.testing import DistributedGroup

    with DistributedGroup(2, pg_timeout=1800) as group:
        ranks = group.run(_train_loop, cfg, str(root), args.steps, args.every, timeout=3600)
    r0 = ranks[0]
    saves = args.steps // args.every
    base = r0["none"]["loop"]
    table = ["| saves | loop s | in save calls s | loop - no-save loop s |", "|---|---|---|---|"]
    for mode in ("none", "blocking", "async"):
        row = r0[mode]
        table.append(f"| {mode if mode != 'none' else 'no checkpoint'} | {row['loop']:.2f} | "
                     f"{row['in_save']:.2f} | {row['loop'] - base:+.2f} |")
    saved = r0["blocking"]["loop"] - r0["async"]["loop"]
    crc = r0["crc"]
    lines = [
        f"2 ranks, GPT {cfg.layers}x{cfg.dim} ({param_count(cfg) / 1e6:.1f}M parameters), "
        f"{args.steps} AdamW steps, a sharded checkpoint (model + AdamW state, "
        f"{crc['bytes'] / MB:.0f} MB on disk) every {args.every} steps ({saves} saves); best "
        f"of 2 runs per mode.",
        "",
        *table,
        "",
        f"async saves the loop {saved:.2f} s ({saved / max(r0['blocking']['loop'], 1e-9):.0%}"
        f" of the blocking loop; {saved / saves:.2f} s per save).",
        "",
        f"Checksum cost: CRC-32 (zlib) of the whole {crc['bytes'] / MB:.0f} MB checkpoint "
        f"from the page cache: {crc['seconds']:.3f} s ({crc['bytes'] / MB / crc['seconds']:.0f}"
        f" MB/s) on one rank.",
    ]
    return "\n".join(lines), ranks


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir())


def _baseline(cfg: GPTConfig, root: str, reps: int) -> dict[str, Any]:
    """One process, the unwrapped model: torch.save / torch.load."""
    torch.set_num_threads(1)
    model = build_model(cfg)
    opt = _adam(model)
    path = Path(root) / "torch.pt"
    noop = lambda: None  # noqa: E731

    def save(sync: bool) -> None:
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def load_restore() -> None:
        ckpt = torch.load(path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])

    times: dict[str, list[float]] = {}
    for _ in range(reps):
        times.setdefault("save", []).append(_timed(lambda: save(False), noop))
        times.setdefault("save + fsync", []).append(_timed(lambda: save(True), noop))
        times.setdefault("load", []).append(_timed(
            lambda: torch.load(path, map_location="cpu"), noop))
        times.setdefault("load + load_state_dict", []).append(_timed(load_restore, noop))
    return {"times": times, "bytes": _state_bytes(model, opt), "disk": path.stat().st_size}


def _git() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, cwd=HERE, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=HERE).stdout.strip()
        return rev + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--results-dir", default=str(HERE / "results"))
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--train", action="store_true",
                   help="time a training loop with blocking vs async saves instead")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    args = p.parse_args()
    cfg = GPTConfig("checkpoint", layers=args.layers, dim=args.dim)
    root = Path(tempfile.mkdtemp(prefix="fullshard-ckpt-bench-", dir=args.dir))
    load_before = os.getloadavg()[0]
    if args.train:
        try:
            text, ranks = _train_main(args, cfg, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        now = _dt.datetime.now().replace(microsecond=0)
        text = (f"## training with checkpoints: blocking vs async saves ({now.isoformat()})\n\n"
                f"torch {torch.__version__}, {os.cpu_count()} CPUs, commit {_git()}, load "
                f"average {load_before:.2f} -> {os.getloadavg()[0]:.2f}\n\n{text}\n")
        print(text)
        if not args.no_record:
            out = Path(args.results_dir)
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"{now.date().isoformat()}-checkpoint_io"
            with open(stem.with_suffix(".md"), "a") as f:
                f.write(text)
            stem.with_name(stem.name + "-train.json").write_text(json.dumps(
                {"date": now.isoformat(), "commit": _git(), "steps": args.steps,
                 "every": args.every, "config": {"layers": cfg.layers, "dim": cfg.dim},
                 "ranks": ranks}, indent=1))
            print(f"appended to {stem}.md")
        return
    try:
        from fullshard.testing import DistributedGroup

        with DistributedGroup(2, pg_timeout=1800) as group:
            ranks = group.run(_fullshard, cfg, str(root), args.reps, timeout=3600)
        shutil.rmtree(root / "fullshard-sharded", ignore_errors=True)
        (root / "fullshard-full").unlink(missing_ok=True)
        base = _baseline(cfg, str(root), args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = base["bytes"]
    rows = []
    for name, ts in ranks[0]["times"].items():
        fmt = name.split()[0]
        rows.append(("fullshard, 2 ranks", name, min(ts), ranks[0]["disk"][fmt]))
    for name, ts in base["times"].items():
        rows.append(("torch, 1 process", name, min(ts), base["disk"]))
    table = ["| who | operation | best s | MB/s | on disk MB |", "|---|---|---|---|---|"]
    for who, name, t, disk in rows:
        table.append(f"| {who} | {name} | {t:.2f} | {total / MB / t:.0f} | {disk / MB:.0f} |")
    now = _dt.datetime.now().replace(microsecond=0)
    header = [
        f"# checkpoint_io ({now.isoformat()})",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, commit "
        f"{_git()}, load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}",
        "",
        f"GPT L={cfg.layers} D={cfg.dim} V={cfg.vocab}: {param_count(cfg) / 1e6:.1f}M "
        f"parameters; model + AdamW state = {total / MB:.0f} MB of tensors "
        f"({ranks[0]['local_bytes'] / MB:.0f} MB on rank 0 when sharded over 2). Best of "
        f"{args.reps}; loads read from the page cache.",
        "",
    ]
    text = "\n".join(header + table) + "\n"
    print(text)
    if not args.no_record:
        out = Path(args.results_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"{now.date().isoformat()}-checkpoint_io"
        stem.with_suffix(".md").write_text(text)
        record = {"date": now.isoformat(), "torch": torch.__version__, "commit": _git(),
                  "params": param_count(cfg), "tensor_bytes": total,
                  "config": {"layers": cfg.layers, "dim": cfg.dim, "vocab": cfg.vocab},
                  "reps": args.reps, "fullshard_2_ranks": ranks, "torch_1_process": base,
                  "rows": [dict(who=w, op=n, seconds=t, mb_per_s=total / MB / t, disk=d)
                           for w, n, t, d in rows]}
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
        print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
