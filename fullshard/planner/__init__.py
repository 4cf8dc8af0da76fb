"""The memory and communication planner: `fullshard.plan(model)` and `fullshard plan MODEL`.

For each sharding strategy and world size it reports per-rank bytes of parameters, gradients
and optimizer state (exact, from the engine's layout), the transient unsharded working set
(a replay of the engine's schedule over the actual units and buckets), an activation estimate
from a meta-device forward, and the bytes communicated per step; then which configurations fit
a memory budget and which of those communicates least.

Files: `model_spec.py` (what model, which units), `models.py` (the Llama-style configs),
`structure.py` (units and buckets as the engine builds them), `estimate.py` (persistent bytes
and communication), `working_set.py` (transient bytes), `activations.py`, `sizes.py` (byte
strings), `table.py` (the result), `api.py` (`plan()`), `command.py` (the CLI subcommand).
"""

from fullshard.planner.api import plan
from fullshard.planner.model_spec import BUILTIN_CONFIGS, build_demo_model
from fullshard.planner.sizes import format_bytes, parse_bytes
from fullshard.planner.table import PlanRow, PlanTable

__all__ = [
    "BUILTIN_CONFIGS",
    "PlanRow",
    "PlanTable",
    "build_demo_model",
    "format_bytes",
    "parse_bytes",
    "plan",
]
