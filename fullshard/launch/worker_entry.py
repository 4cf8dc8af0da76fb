"""What each worker of `fullshard run` runs: the rank's launch machinery, then the script.

`fullshard run` has torchrun start `python -m fullshard.launch.worker_entry [-m] script
args...`. Before the script runs, `install_rank_hooks` (subprocess_script.py) records an
uncaught exception for the launcher's report and makes the worker die with its launcher;
the failure board and the heartbeat start as soon as the script has created its process
group. The script then runs as `python script.py` (or `python -m module`) would run it:
`__main__`, its own `sys.argv`, its directory first on `sys.path`.
"""

from __future__ import annotations

import os
import runpy
import sys

from fullshard.launch.subprocess_script import install_rank_hooks


def main() -> None:
    args = sys.argv[1:]
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    install_rank_hooks(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))
    sys.argv = list(args)
    if as_module:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
