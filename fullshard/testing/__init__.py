"""Test helpers: a multi-process harness on real gloo ranks, reference-parity checks, models."""

from fullshard.testing.harness import DistributedGroup, RankFailure, run_distributed
from fullshard.testing.parity import ParityReport, check_parity, local_rows

__all__ = [
    "DistributedGroup",
    "ParityReport",
    "RankFailure",
    "check_parity",
    "local_rows",
    "run_distributed",
]
