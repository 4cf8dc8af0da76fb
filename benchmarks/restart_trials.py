"""Does `fullshard run --max-restarts K` come back after a SIGKILLed rank? Trials of
tests/distributed/restart_loop.py on 2 ranks, each killing a random rank at a random step of
the first attempt; a trial passes when the job exits 0 and its final parameters equal the
uninterrupted one-process run's (fp32 rtol 1e-5, atol 1e-6).

    python benchmarks/restart_trials.py --trials 10                 # --standalone (c10d)
    python benchmarks/restart_trials.py --trials 10 --static        # static rendezvous
    python benchmarks/restart_trials.py --trials 10 --torch-default # keep the shared store

`--torch-default` keeps torchelastic's shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, what
the launcher used to run with), so only FSDPStrategy's per-attempt store prefix keeps the
attempts apart. Other jobs on the machine slow the trials down; run it under
`flock /tmp/fullshard-bench.lock`. Not part of the test suite (one trial is:
tests/distributed/test_restart.py).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from restart_loop import reference  # noqa: E402

STEPS = 8


def trial(rng: random.Random, args: argparse.Namespace) -> tuple[str, float, str]:
    kill_rank, kill_step = rng.randrange(2), rng.randrange(STEPS)
    with tempfile.TemporaryDirectory(prefix="restart-trial-") as tmp:
        out = Path(tmp) / "out.pt"
        cmd = [sys.executable, "-m", "fullshard.cli", "run", "--nproc-per-node", "2",
               "--max-restarts", str(args.max_restarts)]
        if args.static:
            from fullshard.launch.environment import free_port

            cmd += ["--master-port", str(free_port())]
        cmd += [str(ROOT / "tests/distributed/restart_loop.py"), "--steps", str(STEPS),
                "--ckpt-dir", f"{tmp}/ckpt", "--out", str(out), "--kill-rank", str(kill_rank),
                "--kill-step", str(kill_step)]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=str(ROOT))
        if args.torch_default:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return "hung", time.monotonic() - start, f"rank {kill_rank} step {kill_step}"
        took = time.monotonic() - start
        what = f"rank {kill_rank} step {kill_step}"
        if proc.returncode != 0:
            refused = "Connection refused" in proc.stderr
            return "failed" + (" (connection refused)" if refused else ""), took, what
        got, ref = torch.load(out), reference(STEPS)
        same = all(torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
        return ("ok" if same else "wrong parameters"), took, what


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--max-restarts", type=int, default=1)
    p.add_argument("--static", action="store_true", help="the static rendezvous (--master-port)")
    p.add_argument("--torch-default", action="store_true")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        result, took, what = trial(rng, args)
        results.append(result)
        print(f"trial {i}: kill {what}: {result} ({took:.0f} s)", flush=True)
    ok = results.count("ok")
    store = "shared store, per-attempt prefix" if args.torch_default else "fresh store"
    print(f"{ok} of {args.trials} came back with the uninterrupted run's parameters "
          f"(rendezvous: {'static' if args.static else 'standalone'}, {store})")


if __name__ == "__main__":
    main()
