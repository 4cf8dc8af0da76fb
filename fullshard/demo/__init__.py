"""`fullshard demo`: train a byte-level GPT on shipped public-domain text with FULL_SHARD.

    fullshard demo                        # 2 CPU ranks, 300 steps, checkpoint + figure in runs/demo
    fullshard demo --resume --steps 100   # continue the previous run from its checkpoint
    fullshard demo --compression int8     # int8 weights and gradients on the wire, beside exact

`add_parser` registers the subcommand; `main(args)` validates the options before any process
starts, launches the ranks through Lightning's Fabric with fullshard's `FSDPStrategy` (its
launcher: this process becomes rank 0 and re-runs the same command for the others), and prints
rank 0's report. Needs Lightning: `pip install "fullshard[demo]"` (`make demo` installs it).
Each `fullshard demo` without `--resume` starts a new run and replaces the previous checkpoint
once the new one is complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fullshard.config import (
    FSDPBucketingStrategy,
    resolve_bucketing_strategy,
    resolve_sharding_strategy,
    valid_strategy_names,
)

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on 2 CPU processes with FULL_SHARD (the main demo)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--strategy", default="FULL_SHARD",
                   help=f"sharding strategy: {', '.join(valid_strategy_names())}")
    p.add_argument("--precision", default="32-true",
                   help="'32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'")
    p.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    p.add_argument("--bucketing", default="BLOCK",
                   help=f"bucketing: {', '.join(FSDPBucketingStrategy.__members__)}")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compression", default="none", choices=("none", "int8", "bf16"),
                   help="weights and gradients on the wire in this format; the exact run "
                        "trains the same steps after it, both loss curves are reported")
    p.set_defaults(handler=main)


def _fail(message: str) -> int:
    print(f"fullshard demo: error: {message}", file=sys.stderr)
    return 2


def _check_options(args: argparse.Namespace) -> str | None:
    """The first problem with the options, or None."""
    try:
        strategy = resolve_sharding_strategy(args.strategy).name
        resolve_bucketing_strategy(args.bucketing)
    except (ValueError, TypeError) as e:
        return str(e)
    if args.compression != "none" and (strategy == "NO_SHARD" or args.nproc < 2):
        return "--compression needs a shard axis: --nproc >= 2 and not NO_SHARD"
    if strategy == "HYBRID_SHARD" and args.nproc < 2:
        return "HYBRID_SHARD needs --nproc >= 2"
    if args.nproc < 1:
        return f"--nproc must be >= 1, got {args.nproc}"
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"the output folder {str(out)!r} is not writable ({e.strerror or e})"
    if args.resume and not (out / "checkpoint").exists():
        return f"--resume: no checkpoint in {str(out)!r}; run without --resume first"
    try:
        import lightning  # noqa: F401
    except ImportError:
        return ("the demo runs on Lightning's Fabric, which is not installed: "
                'pip install "fullshard[demo]"')
    return None


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    problem = _check_options(args)
    if problem:
        return _fail(problem)
    import lightning as L

    from fullshard import FSDPStrategy
    from fullshard.demo.config import DemoConfig
    from fullshard.demo.report import format_report, write_figure
    from fullshard.demo.train import train
    from fullshard.testing.models import Block

    cfg = DemoConfig(
        strategy=resolve_sharding_strategy(args.strategy).name,
        precision=args.precision,
        bucketing=resolve_bucketing_strategy(args.bucketing).name,
        steps=args.steps,
        out=args.out,
        resume=args.resume,
        seed=args.seed,
        compression=None if args.compression == "none" else args.compression,
    )
    hybrid = {"device_mesh": (args.nproc // 2, 2)} if cfg.strategy == "HYBRID_SHARD" else {}
    strategy = FSDPStrategy(
        sharding_strategy=cfg.strategy,
        auto_wrap_policy={Block},
        bucketing_strategy=cfg.bucketing,
        state_dict_type="sharded",
        compression=cfg.compression,
        **hybrid,
    )
    fabric = L.Fabric(
        accelerator=args.device, strategy=strategy, devices=args.nproc, precision=cfg.precision
    )
    result = fabric.launch(train, cfg)
    if result is not None:
        figure = write_figure(result, Path(cfg.out) / "demo.png")
        print(format_report(result, figure), flush=True)
    return 0
