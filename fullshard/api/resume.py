"""Resuming after a restart: where the checkpoints of a run live and which one to load.

A job restarted by `fullshard run --max-restarts K` (or by a scheduler) starts the script from
the top. The pattern that loses nothing past the last checkpoint:

    from fullshard.api.resume import checkpoint_path, latest_checkpoint

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if (last := latest_checkpoint("runs/ckpt")) is not None:
        fabric.load(last, state)                    # restores state["step"] too
    for step in range(state["step"], total_steps):
        train_one_step(step)                        # the batch is a function of `step`
        if (step + 1) % every == 0:
            state["step"] = step + 1
            fabric.save(checkpoint_path("runs/ckpt", step + 1), state)

Checkpoints are named `step-<N>` (zero-padded, so they also sort by name). A save is placed
under its name only once every rank has written its part (`fullshard.checkpoint.atomic`), so
a name that exists is a complete checkpoint: a save cut short by the kill left a temporary
`.step-<N>.fullshard-tmp-*` sibling, which is skipped here and removed by the next save to
that name. Sharded checkpoints reshard on load, so the world size may change between attempts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fullshard.checkpoint.sharded import is_checkpoint_dir

_NAME = re.compile(r"step-(\d+)")
_DIGITS = 8


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """`directory/step-<step>`: where the checkpoint taken after `step` steps goes."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint_path(step=...) takes an int >= 0, got {step!r}")
    return Path(directory) / f"step-{step:0{_DIGITS}d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a path made by `checkpoint_path`."""
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(
            f"{os.fspath(path)!r} is not named like a checkpoint of checkpoint_path() "
            f"('step-<N>')"
        )
    return int(match.group(1))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `directory`, or None when there is
    none yet (or `directory` does not exist): the first attempt of a run starts fresh."""
    root = Path(directory)
    if not root.is_dir():
        if root.exists():
            raise ValueError(f"latest_checkpoint() takes a directory, got the file {root}")
        return None
    found: list[tuple[int, Path]] = []
    for entry in root.iterdir():
        match = _NAME.fullmatch(entry.name)
        # A full checkpoint is one file; a sharded one a directory with its index.
        if match and (entry.is_file() or is_checkpoint_dir(entry)):
            found.append((int(match.group(1)), entry))
    return max(found, default=(0, None))[1]
