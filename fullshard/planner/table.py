"""The planner's result as data (`PlanRow`, `PlanTable`) and as an aligned plain-text table.

One row per (world size, strategy). All byte figures are per rank:

    param_bytes, grad_bytes, optimizer_bytes   persistent model state (exact, see estimate.py)
    working_set_bytes                           transient unsharded buffers (working_set.py)
    backward_scratch_bytes                      autograd's unsharded gradients in backward
    activation_bytes                            saved activations (None: no batch shape given)
    total_bytes                                 the sum of all of the above
    comm_bytes                                  wire bytes sent per step (by kind in
                                                `comm_bytes_by_kind`)

`fits` is None without a budget. The recommendation (per world size, and overall) is the row
that fits and sends the fewest bytes per step, ties going to the smaller total memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from fullshard.planner.sizes import format_bytes, format_count

if TYPE_CHECKING:
    from fullshard.planner.recommendation import Evaluated
    from fullshard.planner.search import SearchResult

STRATEGY_ORDER = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class PlanRow:
    world_size: int
    strategy: str
    mesh: tuple[int, int] | None
    """(replicate, shard); None where the strategy does not apply."""
    applicable: bool = True
    note: str = ""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    working_set_bytes: int = 0
    backward_scratch_bytes: int = 0
    activation_bytes: int | None = None
    comm_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    fits: bool | None = None
    recommended: bool = False

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return (self.model_state_bytes + self.working_set_bytes + self.backward_scratch_bytes
                + (self.activation_bytes or 0))

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm_bytes_by_kind.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mesh"] = list(self.mesh) if self.mesh else None
        d.update(model_state_bytes=self.model_state_bytes, total_bytes=self.total_bytes,
                 comm_bytes=self.comm_bytes)
        return d


@dataclass
class PlanTable:
    model: str
    num_params: int
    units: str
    policy: str
    precision: str
    dtypes: str
    optimizer: str
    bucketing: str
    prefetch_limit: int
    backend: str
    batch: int | None
    seq: int | None
    budget: int | None
    rows: list[PlanRow]
    search: SearchResult | None = None
    """The configuration search (`search.py`), when one ran."""

    @property
    def recommendation(self) -> Evaluated | None:
        """The fastest searched configuration that fits; `.fsdp_kwargs()` /
        `.strategy_kwargs()` pass it to `fsdp()` / `FSDPStrategy()`."""
        return None if self.search is None else self.search.best

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        return self.render()

    def row(self, world_size: int, strategy: str) -> PlanRow:
        key = strategy.upper()
        for r in self.rows:
            if r.world_size == world_size and r.strategy == key:
                return r
        raise KeyError(f"No row for world size {world_size} and strategy {strategy!r}")

    @property
    def world_sizes(self) -> list[int]:
        return sorted({r.world_size for r in self.rows})

    def recommend(self, world_size: int | None = None) -> PlanRow | None:
        """The row that fits and communicates least (at `world_size`, or over all rows;
        ties: less memory, then fewer ranks). None when nothing fits."""
        if world_size is not None and world_size not in self.world_sizes:
            raise ValueError(f"world size {world_size} is not in this plan "
                             f"({', '.join(map(str, self.world_sizes))})")
        candidates = [
            r for r in self.rows
            if r.applicable and r.fits is not False
            and (world_size is None or r.world_size == world_size)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.comm_bytes, r.total_bytes, r.world_size,
                                              _order(r.strategy)))

    def recommendations(self) -> dict[int, PlanRow | None]:
        return {n: self.recommend(n) for n in self.world_sizes}

    def to_dict(self) -> dict:
        best = self.recommend()
        return {
            "model": self.model,
            "num_params": self.num_params,
            "units": self.units,
            "policy": self.policy,
            "precision": self.precision,
            "dtypes": self.dtypes,
            "optimizer": self.optimizer,
            "bucketing": self.bucketing,
            "prefetch_limit": self.prefetch_limit,
            "backend": self.backend,
            "batch": self.batch,
            "seq": self.seq,
            "budget": self.budget,
            "rows": [r.to_dict() for r in self.rows],
            "recommended": None if best is None else
            {"world_size": best.world_size, "strategy": best.strategy},
            "search": None if self.search is None else self.search.to_dict(),
        }

    # -- text -------------------------------------------------------------------------------
    def render(self) -> str:
        lines = [
            f"fullshard plan: {self.model}, {format_count(self.num_params)} parameters "
            f"({self.num_params:,}), units: {self.units}",
            f"  wrap {self.policy}; bucketing {self.bucketing}; prefetch {self.prefetch_limit};"
            f" backend {self.backend}",
            f"  precision {self.precision} ({self.dtypes}); optimizer {self.optimizer}",
        ]
        head = ("N", "strategy", "mesh", "params", "grads", "optim", "state", "working",
                "total", "comm/step", "fits")
        body = []
        for r in self.rows:
            if not r.applicable:
                body.append((str(r.world_size), r.strategy, "-", f"n/a: {r.note}"))
                continue
            fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
            body.append((
                str(r.world_size), r.strategy, f"{r.mesh[0]}x{r.mesh[1]}" if r.mesh else "-",
                *(format_bytes(x) for x in (r.param_bytes, r.grad_bytes, r.optimizer_bytes,
                                            r.model_state_bytes, r.working_set_bytes,
                                            r.total_bytes, r.comm_bytes)),
                fits + ("  <- recommended" if r.recommended else ""),
            ))
        widths = [max(len(head[i]), *(len(b[i]) for b in body if len(b) == len(head)))
                  for i in range(len(head))]
        left = {1, 2, 10}

        def fmt(cells: tuple[str, ...]) -> str:
            if len(cells) != len(head):  # an n/a row: the note runs across
                return "  ".join(c.rjust(widths[i]) if i not in left else c.ljust(widths[i])
                                 for i, c in enumerate(cells[:3])) + "  " + cells[3]
            return "  ".join(c.ljust(widths[i]) if i in left else c.rjust(widths[i])
                             for i, c in enumerate(cells)).rstrip()

        lines += ["", fmt(head), "  ".join("-" * w for w in widths)]
        previous = None
        for cells in body:
            if previous is not None and cells[0] != previous:
                lines.append("")
            previous = cells[0]
            lines.append(fmt(cells))
        lines.append("")
        lines += self._footer()
        if self.search is not None:
            from fullshard.planner.search import variants
            from fullshard.planner.search_report import render_search

            best = self.search.best
            alternatives = variants(self.search, best) if best is not None else {}
            lines += ["", render_search(self.search, alternatives=alternatives)]
        return "\n".join(lines)

    def _footer(self) -> list[str]:
        sample = next((r for r in self.rows if r.applicable), None)
        out = ["per rank. state = params + grads + optimizer (padding included); working = "
               "unsharded params/grads in flight;"]
        scratch = format_bytes(sample.backward_scratch_bytes) if sample else "-"
        if self.batch is not None and sample is not None:
            act = (f"activations {format_bytes(sample.activation_bytes)} (batch {self.batch} "
                   f"x seq {self.seq})")
        else:
            act = "activations not included (give batch and seq)"
        out.append(f"total = state + working + autograd's unsharded grads ({scratch}) + {act}.")
        out.append("comm/step = bytes each rank sends per training step.")
        if self.budget is None:
            out.append("No budget given: every configuration counts as fitting.")
        else:
            out.append(f"fits: total <= budget {format_bytes(self.budget)}.")
        for n, best in self.recommendations().items():
            if best is None:
                out.append(f"N={n}: nothing fits.")
        best = self.recommend()
        if best is not None:
            out.append(f"Recommended overall: {best.strategy} on {best.world_size} rank(s) "
                       f"({format_bytes(best.total_bytes)} per rank, "
                       f"{format_bytes(best.comm_bytes)} sent per step).")
        return out


def _order(strategy: str) -> int:
    return STRATEGY_ORDER.index(strategy) if strategy in STRATEGY_ORDER else len(STRATEGY_ORDER)
