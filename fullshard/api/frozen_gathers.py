"""`keep_frozen_gathered=`: whether frozen units stay gathered across micro-batches.

The engine keeps a unit with nothing trainable gathered for a whole optimizer step when told
to ([Note: frozen units stay gathered] in engine/kept_frozen.py); this file decides whether to
tell it, once at wrap, from the user's option:

- True: always. False: never (every unit follows the strategy's schedule).
- None (auto): on when the units frozen at wrap, gathered together, fit in a quarter of the
  memory free for them: on CUDA the device's free memory (`torch.cuda.mem_get_info`), on
  the CPU the host's available memory (`MemAvailable`) shared by the ranks on this host
  (`LOCAL_WORLD_SIZE`, else all ranks). The quarter leaves the rest for activations, the
  trainable units' gathers and the allocator's slack. Off when nothing is frozen at wrap
  (units frozen later are then not kept: pass True for that), when nothing is trainable
  (a frozen teacher: no optimizer step would release them) or when the free memory cannot
  be read. The ranks agree (one all-reduce of the verdict, MIN), so all of them gather alike.

The verdict and why are `model.fullshard_runtime.kept_frozen.enabled` / `.reason`, and auto
logs it in one line on the `fullshard` logger (INFO) on rank 0.

When on, fullshard sees the optimizer step: a global `torch.optim` step post-hook releases
the kept copies right after any optimizer that holds one of the model's shards steps (plain
loops and Fabric alike), so nothing unsharded outlives the step. The engine's own fallback
(the next root forward finds the trainable shards written) covers updates made without a
`torch.optim.Optimizer`.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fullshard.distributed import comm
from fullshard.engine.hooks import Runtime

_LOG = logging.getLogger("fullshard")
BUDGET_FRACTION = 4  # auto keeps frozen units within 1/4 of the free memory


def check_keep_frozen_gathered(value: object, where: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"{where}(keep_frozen_gathered=...) must be True (keep units whose parameters are "
            f"all frozen gathered for the whole optimizer step), False (gather them in every "
            f"micro-batch, as the strategy does) or None (auto: True when they fit in memory), "
            f"got {type(value).__name__}: {value!r}"
        )
    return value


def _free_bytes(device: torch.device, world_size: int) -> tuple[int | None, str]:
    """Memory this rank may count as free for kept units, and where the figure comes from."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory of {device}"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, "host memory (unreadable)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "") or world_size)
    return available // max(local, 1), f"available host memory / {local} rank(s) on this host"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def decide_keep_frozen_gathered(
    runtime: Runtime, option: bool | None, device: torch.device
) -> None:
    """Resolve `option` for the model `runtime` drives and hand the engine its bool."""
    kept = runtime.kept_frozen
    kept.enable(*_decide(runtime, option, device))
    if option is None and kept.frozen_unsharded_bytes() and runtime.mesh.world.rank == 0:
        _LOG.info("fullshard keep_frozen_gathered %s", kept.reason)
    if kept.enabled:
        _release_after_optimizer_steps(runtime)


def _release_after_optimizer_steps(runtime: Runtime) -> None:
    """Release `runtime`'s kept frozen units after every step of an optimizer that holds one
    of its shards (the hook holds the runtime weakly and goes with it)."""
    ref = weakref.ref(runtime)
    shard_ids = {id(p.param) for u in runtime.units for p in u.params}

    def release(optimizer: Any, args: Any, kwargs: Any) -> None:
        rt = ref()
        if rt is None or not rt.kept_frozen.kept():
            return
        if any(id(p) in shard_ids for g in optimizer.param_groups for p in g["params"]):
            rt.kept_frozen.release()

    weakref.finalize(runtime, register_optimizer_step_post_hook(release).remove)


def _decide(runtime: Runtime, option: bool | None, device: torch.device) -> tuple[bool, str]:
    """(on, why) for `option`; auto as the module docstring says."""
    if option is not None:
        return option, f"{'on' if option else 'off'}: keep_frozen_gathered={option}"
    need = runtime.kept_frozen.frozen_unsharded_bytes()
    if need == 0:
        return False, "off (auto): no unit has all its parameters frozen at wrap"
    if not any(u.trainable_params for u in runtime.units):
        # e.g. a teacher sharded to save memory: no optimizer step would ever release them
        return False, "off (auto): nothing is trainable at wrap (no optimizer step)"
    free, source = _free_bytes(device, runtime.mesh.world.size)
    fits = free is not None and need <= free // BUDGET_FRACTION
    verdict = torch.tensor([int(fits)], dtype=torch.int64, device=device)
    comm.all_reduce(verdict, runtime.mesh.world, op=torch.distributed.ReduceOp.MIN)
    agreed = bool(verdict.item())
    budget = "unknown" if free is None else _mib(free // BUDGET_FRACTION)
    return agreed, (
        f"{'on' if agreed else 'off'} (auto): frozen units need {_mib(need)} gathered, "
        f"budget 1/{BUDGET_FRACTION} of {source} = {budget} on this rank"
        + ("" if agreed == fits else ", but another rank's does not fit")
    )
