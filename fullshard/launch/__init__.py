"""Starting the ranks: `fullshard run` on torch's elastic launcher, and `Fabric.launch()`'s
in-process start of the local ranks (with rank-death handling in both)."""

from fullshard.launch.subprocess_script import SubprocessScriptLauncher, install_rank_hooks
from fullshard.launch.torchrun import run_with_torchrun, torchrun_argv

__all__ = ["SubprocessScriptLauncher", "install_rank_hooks", "run_with_torchrun", "torchrun_argv"]
