"""Step time, memory and traffic of fullshard against torch FSDP2, DDP and one process.

    python benchmarks/step_time.py                          # configs A and B, 3 reps, everything
    python benchmarks/step_time.py --config S               # the latency-bound config (or `all`)
    python benchmarks/step_time.py --config A --steps 4 --warmup 1 --reps 1     # quick check
    python benchmarks/step_time.py --impls 'fullshard-full_shard*' 'fsdp2-*' ddp  # like with like
    python benchmarks/step_time.py --list                   # the implementations

Each measurement is one fresh launch of `bench_worker.py`: 2 ranks on gloo through
`python -m torch.distributed.run --standalone --nproc-per-node 2` with one torch thread per
rank, or a single process for the `single-*` implementations. Runs are interleaved: rep 1 runs
every config and implementation in turn, then rep 2 does it all again, and so on, so machine
noise hits all implementations alike and ratios are taken within a rep.

At the end it prints the tables and writes `<date>-step_time.json` (machine info, every raw
record, the summary) and `<date>-step_time.md` into `--results-dir` (default
`benchmarks/results/`). Ctrl-C stops early and still reports what ran. See README.md for the
columns and formulas.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import report
import torch
from gpt import CONFIGS
from impls import IMPLS, Impl

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "bench_worker.py"
STDERR_LINES = 40
"""Lines of a failed run's stderr kept in the JSON record."""
_CAUSE_WORDS = ("Error", "error:", "terminate called", "what():", "Signal", "Killed")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="both", choices=[*CONFIGS, "both", "all"],
                   help="one config, `both` (A and B, the default) or `all` (A, B and S)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run, warmup included (default: A 20, B 15, S 40)")
    p.add_argument("--warmup", type=int, default=3, help="untimed leading steps (default 3)")
    p.add_argument("--impls", nargs="+", default=["*"], metavar="PATTERN",
                   help="implementation names or shell patterns (default: all; see --list)")
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="print only; write no files")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is "
                   "killed and recorded as failed (default 1800)")
    p.add_argument("--retries", type=int, default=1,
                   help="relaunch a failed run this many times (default 1); failures are "
                   "recorded either way")
    p.add_argument("--list", action="store_true", help="list the implementations and exit")
    args = p.parse_args()
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.steps is not None and not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps")
    return args


def select_impls(patterns: list[str]) -> list[Impl]:
    chosen = [i for i in IMPLS if any(fnmatch.fnmatchcase(i.name, p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(i.name, p) for i in IMPLS)]
    if unknown:
        sys.exit(f"no implementation matches {unknown}; --list shows them")
    return chosen


def unavailable_reason(impl: Impl) -> str | None:
    """Why `impl` cannot run here, or None. DeepSpeed is optional."""
    if impl.family != "deepspeed":
        return None
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                           text=True, env=_env(impl))
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"`import deepspeed` failed ({last})"
    return None


def _env(impl: Impl) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(impl.threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def worker_command(impl: Impl, config: str, steps: int, warmup: int, out: Path) -> list[str]:
    launcher = [sys.executable]
    if impl.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(impl.nproc)]
    return [*launcher, str(WORKER), "--impl", impl.name, "--config", config,
            "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]


class RunFailed(RuntimeError):
    """A run that crashed or timed out; `log` keeps the end of its stderr."""

    def __init__(self, reason: str, stderr: str = "") -> None:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        # torchrun's own summary hides the cause: keep the lines that name it.
        causes = [ln.strip() for ln in lines if any(w in ln for w in _CAUSE_WORDS)]
        super().__init__(reason + (f": {causes[-1]}" if causes else ""))
        self.log = "\n".join(lines[-STDERR_LINES:])



def run_one(impl: Impl, config: str, steps: int, warmup: int, timeout: float,
            scratch: Path) -> dict[str, Any]:
    """Launch one measurement; return its record, or raise `RunFailed`."""
    out = scratch / f"{config}-{impl.name}.jsonl"
    out.unlink(missing_ok=True)
    cmd = worker_command(impl, config, steps, warmup, out)
    # Own session, so a timeout can stop torchrun and its ranks together.
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(impl), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate()
        raise RunFailed(f"timed out after {timeout:.0f} s", stderr) from None
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate()
        raise
    if proc.returncode or not out.exists():
        raise RunFailed(f"exit code {proc.returncode}", stderr)
    return json.loads(out.read_text().splitlines()[-1])


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "reps": args.reps,
        "steps": args.steps or {c: cfg.default_steps for c, cfg in CONFIGS.items()},
        "warmup": args.warmup,
    }


def result_paths(results_dir: Path) -> tuple[Path, Path]:
    """`<date>-step_time.{json,md}`, with -2, -3... when a run of that day is already there."""
    stem = f"{datetime.date.today().isoformat()}-step_time"
    n = 1
    while True:
        name = stem if n == 1 else f"{stem}-{n}"
        json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
        if not json_path.exists() and not md_path.exists():
            return json_path, md_path
        n += 1


def run_with_retries(impl: Impl, config: str, rep: int, args: argparse.Namespace,
                     scratch: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """One measurement, relaunched up to `--retries` times; failures go into `meta`."""
    steps = args.steps or CONFIGS[config].default_steps
    for attempt in range(1, 2 + args.retries):
        try:
            return run_one(impl, config, steps, args.warmup, args.timeout, scratch)
        except RunFailed as e:
            meta["failures"].append({"rep": rep, "config": config, "impl": impl.name,
                                     "attempt": attempt, "error": str(e), "stderr": e.log})
            print(f"  {config} {impl.name} FAILED (attempt {attempt}): {e}", flush=True)
    return None


def run_all(impls: list[Impl], configs: list[str], args: argparse.Namespace,
            meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rep runs every config's implementations in turn; returns the records (each with
    its `rep`). Ctrl-C ends early with what finished."""
    records: list[dict[str, Any]] = []
    total, done = args.reps * len(configs) * len(impls), 0
    with tempfile.TemporaryDirectory(prefix="step_time-") as tmp:
        try:
            for rep in range(1, args.reps + 1):
                for config in configs:
                    for impl in impls:
                        done += 1
                        record = run_with_retries(impl, config, rep, args, Path(tmp), meta)
                        if record is None:
                            continue
                        record["rep"] = rep
                        records.append(record)
                        print(f"[{done}/{total}] rep {rep} config {config} {impl.name:30s} "
                              f"{report.run_step_time(record):.3f} s/step, loss "
                              f"{record['losses'][-1]:.4f}, run {record['wall_s']:.0f} s",
                              flush=True)
        except KeyboardInterrupt:
            print("\ninterrupted: reporting the runs that finished")
    return records


def main() -> None:
    args = parse_args()
    if args.list:
        for impl in IMPLS:
            print(f"{impl.name:32s} {impl.label}")
        return
    configs = {"both": ["A", "B"], "all": list(CONFIGS)}.get(args.config, [args.config])
    meta = machine_info(args)
    meta["skipped"], meta["failures"] = {}, []
    impls = []
    for impl in select_impls(args.impls):
        reason = unavailable_reason(impl)
        if reason:
            meta["skipped"][impl.name] = reason
            print(f"skipping {impl.name}: {reason}")
        else:
            impls.append(impl)
    start = time.perf_counter()
    records = run_all(impls, configs, args, meta)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = time.perf_counter() - start
    if not records:
        sys.exit("no run finished")
    summary = report.summarize(records)
    report.print_summary(summary)
    if args.no_record:
        return
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = result_paths(args.results_dir)
    json_path.write_text(json.dumps({"meta": meta, "summary": summary, "records": records},
                                    indent=1) + "\n")
    md_path.write_text(report.markdown(summary, meta))
    print(f"\nwrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
