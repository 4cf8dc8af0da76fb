"""The memory, communication and time planner: `fullshard.plan(model)` and `fullshard plan MODEL`.

For each sharding strategy and world size it reports per-rank bytes of parameters, gradients
and optimizer state (exact, from the engine's layout), the transient unsharded working set
(a replay of the engine's schedule over the actual units and buckets), an activation estimate
from a meta-device forward, and the bytes communicated per step. With a budget it searches the
configurations a user could pick (strategy and mesh, activation checkpointing, CPU offload,
precision, prefetch, micro-batch and accumulation) and recommends the fastest that fits, with
its predicted step time on a given hardware.

Files, each importing only those before it (and the engine below them): `models.py` (what
model, which units; the Llama configs), `sizes.py` (units and buckets as the engine builds
them, persistent bytes, communication, byte strings), `profile.py` (the meta forward:
activations, per-unit inputs and work), `timing.py` (`Hardware` and what each unit costs on
it), `schedule.py` (the engine's step replayed: the working set and the step time),
`hardware.py` (`--hardware local`: this machine measured), `presets.py` (data-sheet presets,
JSON files, and which of them `--hardware` names), `search.py` (the search and its
configurations as `fsdp()` keyword arguments), `table.py` (the result and its text), `api.py`
(`plan()`, `predict()`, the CLI subcommand).
"""

from fullshard.planner.api import plan, predict
from fullshard.planner.models import BUILTIN_CONFIGS
from fullshard.planner.presets import PRESETS
from fullshard.planner.search import CheckpointEvery, Evaluated, SearchResult, SearchSpace
from fullshard.planner.sizes import format_bytes, parse_bytes
from fullshard.planner.table import PlanRow, PlanTable
from fullshard.planner.timing import Hardware

__all__ = [
    "BUILTIN_CONFIGS",
    "PRESETS",
    "CheckpointEvery",
    "Evaluated",
    "Hardware",
    "PlanRow",
    "PlanTable",
    "SearchResult",
    "SearchSpace",
    "format_bytes",
    "parse_bytes",
    "plan",
    "predict",
]
