"""The memory, communication and time planner: `fullshard.plan(model)` and `fullshard plan MODEL`.

For each sharding strategy and world size it reports per-rank bytes of parameters, gradients
and optimizer state (exact, from the engine's layout), the transient unsharded working set
(a replay of the engine's schedule over the actual units and buckets), an activation estimate
from a meta-device forward, and the bytes communicated per step. With a budget it searches the
configurations a user could pick (strategy and mesh, activation checkpointing, CPU offload,
precision, prefetch, micro-batch and accumulation) and recommends the fastest that fits, with
its predicted step time on a given hardware.

Files: `model_spec.py` (what model, which units), `models.py` (the Llama-style configs),
`structure.py` (units and buckets as the engine builds them), `estimate.py` (persistent bytes
and communication), `working_set.py` (transient bytes), `activations.py`, `profile.py` (the
per-unit meta forward: saved bytes, inputs, FLOPs), `hardware.py` (presets, files),
`measure.py` (`--hardware local`), `timing.py` (step time), `search.py` (the search),
`recommendation.py` (a configuration as `fsdp()` keyword arguments), `search_report.py`
(its text), `predict.py` (one configuration), `sizes.py` (byte strings), `table.py` (the
result), `api.py` (`plan()`), `command.py` (the CLI subcommand).
"""

from fullshard.planner.api import plan
from fullshard.planner.hardware import PRESETS, Hardware
from fullshard.planner.model_spec import BUILTIN_CONFIGS, build_demo_model
from fullshard.planner.predict import predict
from fullshard.planner.recommendation import CheckpointEvery, Evaluated
from fullshard.planner.search import SearchResult, SearchSpace
from fullshard.planner.sizes import format_bytes, parse_bytes
from fullshard.planner.table import PlanRow, PlanTable

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
    "build_demo_model",
    "format_bytes",
    "parse_bytes",
    "plan",
    "predict",
]
