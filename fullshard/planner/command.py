"""The `fullshard plan` subcommand: argument parsing around `fullshard.plan()`.

`fullshard.cli` calls `add_plan_parser(subparsers)`; everything else lives here. Nothing heavy
is imported until the command runs, so `fullshard --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

_EPILOG = """\
MODEL is a built-in config (tiny, demo, llama-7b, llama-13b, llama-70b) or
package.module:factory, a callable returning an nn.Module; it is built on the meta device, so
nothing is allocated (a 70B model plans in seconds).

examples:
  fullshard plan llama-7b --world-sizes 8,16,32 --precision bf16-mixed --budget 80GiB
  fullshard plan llama-70b --precision bf16-mixed --batch 1 --seq 4096 --budget 80GiB \
      --world-sizes 8,16,64
  fullshard plan llama-13b --global-batch 256 --seq 4096 --budget 80GiB --hardware a100-80gb
  fullshard plan demo --world-sizes 2,3 --budget 1GiB --hardware local
  fullshard plan mypkg.models:build_model --wrap MyBlock --optimizer sgd-momentum

All numbers are per rank. state = parameters + gradients + optimizer state (exact, padding
included); working = unsharded parameters and gradients in flight (from the actual units,
bucketing and prefetch); comm/step = bytes each rank sends per training step.

With --budget (or --search) the planner also searches: strategy and mesh, activation
checkpointing (none, every 4th / 2nd block, every block), CPU offload, the precisions given,
prefetch 1-2, and micro-batch with gradient accumulation (to --global-batch), and recommends
the fastest configuration that fits, with its predicted step time and tokens/s per rank on
--hardware, the exposed communication and what would hide it.
"""


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory and communication of a model for each strategy and world size",
        description="Plan a model's memory per rank and communication per step for each "
        "sharding strategy and world size, and recommend the cheapest that fits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="built-in config or package.module:factory")
    p.add_argument("--world-sizes", default="1,2,4,8", metavar="N,N,...",
                   help="numbers of ranks to plan for (default: 1,2,4,8)")
    p.add_argument("--strategies", default=None, metavar="S,S,...",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (default: all)")
    p.add_argument("--precision", default="32-true",
                   help="32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, or several "
                   "comma-separated for the search to try (the table shows the first) "
                   "(default: 32-true)")
    p.add_argument("--optimizer", default="adamw",
                   choices=("adamw", "adam", "sgd", "sgd-momentum"),
                   help="optimizer state to count (default: adamw)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="per-rank micro-batch, for the activation estimate (with --seq)")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="sequence length, for the activation estimate (with --batch)")
    p.add_argument("--budget", default=None, metavar="BYTES",
                   help="memory per rank, e.g. 80GiB, 24GB, 512MiB")
    p.add_argument("--bucketing", default="BLOCK", help="NONE, LAYER or BLOCK (default: BLOCK)")
    p.add_argument("--prefetch-limit", type=int, default=1, metavar="K",
                   help="units gathered ahead, as fsdp(prefetch_limit=) (default: 1)")
    p.add_argument("--wrap", default=None, metavar="CLASS,...",
                   help="module class names that become units, or 'root' for the whole model "
                   "as one unit (default: the config's block, else fsdp()'s default units)")
    p.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                   help="collective backend (default: gloo with --hardware local, else nccl)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="shard size of HYBRID_SHARD (default: the hardware's, 8)")
    p.add_argument("--attention", default="flash", choices=("flash", "math"),
                   help="count attention activations as fused kernels save them, or the "
                   "math kernel's seq x seq matrix (default: flash)")
    p.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="sequences per optimizer step over all ranks: the search makes up "
                   "G / N per rank from micro-batches and gradient accumulation")
    p.add_argument("--hardware", default="h100-sxm", metavar="NAME|FILE|local",
                   help="for the time model: h100-sxm, h200-sxm, a100-80gb, l40s, a JSON "
                   "file of Hardware fields, or 'local' (measured now, a few seconds) "
                   "(default: h100-sxm)")
    p.add_argument("--search", dest="search", action="store_true", default=None,
                   help="search configurations for the fastest that fits (default: with "
                   "--budget)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="only the per-strategy table")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(handler=_handler(p))


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _handler(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace, object], int]:
    def run(args: argparse.Namespace, parser: object) -> int:
        from fullshard.planner.api import plan

        try:
            sizes = [int(t) for t in _split(args.world_sizes) or []]
        except ValueError:
            p.error(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
        try:
            precisions = _split(args.precision) or ["32-true"]
            table = plan(
                args.model,
                world_sizes=sizes,
                strategies=_split(args.strategies),
                precision=precisions[0],
                search_precisions=precisions,
                global_batch=args.global_batch,
                hardware=args.hardware,
                search=args.search,
                optimizer=args.optimizer,
                batch=args.batch,
                seq=args.seq,
                auto_wrap_policy=_split(args.wrap),
                bucketing=args.bucketing,
                prefetch_limit=args.prefetch_limit,
                budget=args.budget,
                backend=args.backend,
                ranks_per_node=args.ranks_per_node,
                attention=args.attention,
            )
        except (ValueError, TypeError) as e:
            p.error(str(e))
        print(json.dumps(table.to_dict(), indent=2) if args.json else table.render())
        return 0

    return run
