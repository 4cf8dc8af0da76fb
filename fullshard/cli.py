"""The `fullshard` command. One subcommand per concern, each added by `_add_<name>(subparsers)`:

    fullshard run [--nproc-per-node N] [--nnodes M --node-rank K --master-addr A
                  --master-port P] script.py [script args...]

    fullshard consolidate [--unsafe-load] CKPT_DIR OUT

`run` starts a script on many processes through torch's elastic launcher (see
`fullshard.launch.torchrun`). `consolidate` turns a sharded checkpoint into one full file
(`fullshard.checkpoint.consolidate`), in this process, without a process group.
To add a subcommand, write `_add_<name>` registering its parser
with `set_defaults(handler=...)`, and call it from `build_parser`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

_RUN_EPILOG = """\
examples:
  # 4 processes on this machine
  fullshard run --nproc-per-node 4 train.py --lr 3e-4

  # 2 machines x 2 processes: run on each machine, with its own --node-rank
  fullshard run --nproc-per-node 2 --nnodes 2 --node-rank 0 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py
  fullshard run --nproc-per-node 2 --nnodes 2 --node-rank 1 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py

Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
Lightning's Fabric with fullshard's FSDPStrategy reads them (fabric.launch() then starts nothing
more; give Fabric the same devices/num_nodes as --nproc-per-node/--nnodes). When any process
fails, the others are stopped and the command exits non-zero, naming the failed rank.
"""


def _int_at_least(low: int, high: int | None = None):
    """An argparse `type=`: an int in [low, high]; otherwise argparse's one-line error saying
    what was given and what is accepted."""

    def parse(text: str) -> int:
        accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    return parse


def _seconds(*, positive: bool):
    """An argparse `type=`: a finite number of seconds, > 0 (`positive`) or >= 0."""

    def parse(text: str) -> float:
        accepted = "a number of seconds " + ("> 0" if positive else ">= 0")
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    return parse


_NPROC_WORDS = ("auto", "cpu", "gpu")


def _nproc(text: str) -> int | str:
    """`--nproc-per-node`: an int >= 1 or one of torchrun's words."""
    if text in _NPROC_WORDS:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected an int >= 1 or one of {', '.join(_NPROC_WORDS)}, got {text!r}"
        )
    return value


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make `parser` report a bad call as one line on stderr (exit 2), without the usage
    block: the message names the argument, what was given and what is accepted."""

    def error(message: str) -> None:  # argparse's contract: never returns
        parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")

    parser.error = error  # type: ignore[method-assign]


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training script on several processes (and machines)",
        description="Run a training script on several processes through torch's elastic "
        "launcher (torch.distributed.run).",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _one_line_errors(p)
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", "--devices", default=1,
                   type=_nproc, metavar="N", help="processes on this machine: an int, or "
                   "torchrun's 'auto', 'cpu', 'gpu' (default: 1)")
    p.add_argument("--nnodes", "--num-nodes", type=_int_at_least(1), default=1, metavar="M",
                   help="number of machines (default: 1)")
    p.add_argument("--node-rank", "--node_rank", type=_int_at_least(0), default=0, metavar="K",
                   help="this machine's index in [0, M) (default: 0)")
    p.add_argument("--master-addr", "--master_addr", "--main-address", default="127.0.0.1",
                   metavar="A", help="address of the machine with --node-rank 0 "
                   "(default: 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", "--main-port", type=_int_at_least(1, 65535),
                   default=None, metavar="P", help="a free port on that machine; required with "
                   "--nnodes > 1 (default: a free port, single machine only)")
    p.add_argument("--max-restarts", type=_int_at_least(0), default=0, metavar="R",
                   help="restart the whole group up to R times after a failure (default: 0)")
    p.add_argument("--monitor-interval", type=_seconds(positive=True), default=0.1, metavar="S",
                   help="seconds between checks of the workers' health (default: 0.1)")
    p.add_argument("--shutdown-timeout", type=_int_at_least(0), default=5, metavar="S",
                   help="seconds a worker gets to exit after SIGTERM before SIGKILL (default: 5)")
    p.add_argument("--silence-timeout", type=_seconds(positive=False), default=None,
                   metavar="S", help="a rank that stops answering (stopped, cut off) for S "
                   "seconds makes the others fail, naming it; on several machines a launcher "
                   "silent for S + 5 s ends the job too; 0: off (default: 60, or "
                   "$FULLSHARD_SILENCE_TIMEOUT)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run `script` as a module, like `python -m`")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments passed on to the script")
    # Errors found after parsing go through `run`'s parser too: one line, exit 2.
    p.set_defaults(handler=lambda args, _top: _run(args, p))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fullshard.launch.torchrun import run_with_torchrun, torchrun_argv

    try:
        argv = torchrun_argv(
            args.script,
            args.script_args,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            shutdown_timeout=args.shutdown_timeout,
            module=args.module,
        )
    except ValueError as e:
        parser.error(str(e))
    if not args.module and not os.path.exists(args.script):
        parser.error(f"the script {args.script!r} does not exist (from {os.getcwd()}); give a "
                     f"path to a Python file, or -m and a module name")
    from fullshard.launch.heartbeat import SILENCE_VAR, silence_timeout

    env = {}
    if args.silence_timeout is not None:  # the workers (and the launchers) read it
        env[SILENCE_VAR] = f"{args.silence_timeout:g}"
    else:
        try:
            silence_timeout()  # a bad $FULLSHARD_SILENCE_TIMEOUT: one line, before any worker
        except ValueError as e:
            parser.error(str(e))
    return run_with_torchrun(argv, env=env)


_CONSOLIDATE_EPILOG = """\
examples:
  fullshard consolidate runs/ckpt-1000 runs/ckpt-1000.pt           # everything, torch.save
  fullshard consolidate runs/ckpt-1000 model.safetensors            # model weights only

The .pt file is what save_checkpoint(..., state_dict_type='full') writes: torch.load it and
model.load_state_dict(ckpt['model']) into the unwrapped model, or load_checkpoint it anywhere.
Lightning Fabric's sharded checkpoints consolidate too (the same layout). The checkpoint is
read without running code from it; --unsafe-load lifts that, for files you trust only.
"""


def _add_consolidate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into one full file (no process group needed)",
        description="Turn a sharded checkpoint directory into one full checkpoint file: a "
        "torch.save file (model, optimizer keyed by parameter name, the rest of the state), "
        "or, for OUT ending in .safetensors, the model weights in safetensors format.",
        epilog=_CONSOLIDATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="the sharded checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the file to write (.safetensors: weights only)")
    p.add_argument("--unsafe-load", action="store_true",
                   help="unpickle the checkpoint's files fully (weights_only=False), which can "
                   "run arbitrary code from them: only for files you trust. By default only "
                   "tensors and plain Python values are read.")
    p.set_defaults(handler=_consolidate)


def _consolidate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fullshard.checkpoint import CheckpointError, consolidate

    try:
        out = consolidate(args.ckpt_dir, args.out, weights_only=not args.unsafe_load)
    except (ValueError, CheckpointError, IsADirectoryError, ImportError) as e:
        print(f"fullshard consolidate: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    from fullshard.demo import add_parser

    add_parser(subparsers)


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    from fullshard.planner.api import add_plan_parser

    add_plan_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullshard",
        description="fullshard: fully sharded data parallel training for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_run(subparsers)
    _add_consolidate(subparsers)
    _add_demo(subparsers)
    _add_plan(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args, parser) or 0)


if __name__ == "__main__":
    sys.exit(main())
