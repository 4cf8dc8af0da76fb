"""The planner's result as data (`PlanRow`, `PlanTable`) and as aligned plain text: the table,
and below it the search's answer (the few fastest configurations that fit, why the others
lose, and for the recommendation the exposed communication and what would hide it).

One row per (world size, strategy). All byte figures are per rank:

    param_bytes, grad_bytes, optimizer_bytes   persistent model state (exact, see sizes.py)
    working_set_bytes                           transient unsharded buffers (schedule.py)
    backward_scratch_bytes                      autograd's unsharded gradients in backward
    activation_bytes                            saved activations (None: no batch shape given)
    total_bytes                                 the sum of all of the above
    comm_bytes                                  wire bytes sent per step (by kind in
                                                `comm_bytes_by_kind`)

`fits` is None without a budget. The recommendation (per world size, and overall) is the row
that fits and sends the fewest bytes per step, ties going to the smaller total memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from fullshard.planner.search import STRATEGIES, Evaluated, SearchResult, variants
from fullshard.planner.sizes import format_bytes, format_count

STRATEGY_ORDER = STRATEGIES
"""The order of the table's rows (and of ties between equal rows)."""


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
                out.append(self._nothing_fits(n))
        best = self.recommend()
        if best is not None:
            out.append(f"Recommended overall: {best.strategy} on {best.world_size} rank(s) "
                       f"({format_bytes(best.total_bytes)} per rank, "
                       f"{format_bytes(best.comm_bytes)} sent per step).")
        return out

    def _nothing_fits(self, world_size: int) -> str:
        """Under the table: no row at `world_size` fits as it stands. The search below may
        still find a configuration there that fits (checkpointing, offload, a smaller
        micro-batch): then say so rather than "nothing fits"."""
        found = None if self.search is None else self.search.best_at(world_size)
        if found is None:
            return f"N={world_size}: nothing fits."
        return (f"N={world_size}: no row fits as is; it fits only with what the search adds: "
                f"{found.config.describe()} (below).")


def _order(strategy: str) -> int:
    return STRATEGY_ORDER.index(strategy) if strategy in STRATEGY_ORDER else len(STRATEGY_ORDER)


# -- the search's answer as text ----------------------------------------------------------------
TOP = 5


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def _row(e: Evaluated, note: str) -> tuple[str, ...]:
    t = e.time
    return (str(e.config.world_size), e.config.describe(), format_bytes(e.memory.total),
            format_bytes(e.memory.activations), _ms(t.step), f"{t.tokens_per_s:,.0f}",
            _ms(t.exposed), note)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    head = ("N", "configuration", "memory", "activations", "step", "tok/s/rank", "exposed",
            "")
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    left = {1, 7}

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(widths[i]) if i in left else c.rjust(widths[i])
                         for i, c in enumerate(cells)).rstrip()

    return [fmt(head), "  ".join("-" * w for w in widths[:-1]), *map(fmt, rows)]


def render_search(result: SearchResult, *, alternatives: dict[str, Evaluated] | None = None
                  ) -> str:
    hw = result.hardware
    batch = (f"global batch {result.global_batch}" if result.global_batch is not None
             else "per-rank batch as given")
    lines = [
        f"search: {len(result.ranked)} configurations on {hw.name} "
        f"(matmuls at {hw.matmul_efficiency:.0%} of {hw.peak_flops / 1e12:.4g} TFLOP/s, "
        f"{hw.ranks_per_node} per node), seq {result.seq}, {batch}, budget "
        f"{format_bytes(result.budget)}; {len(result.fitting)} fit.",
    ]
    best = result.best
    rows: list[tuple[str, ...]] = []
    top: list[Evaluated] = []
    for e in result.fitting:  # the fastest few, one per choice that matters (not prefetch)
        c = e.config
        key = (c.world_size, c.strategy, c.checkpoint_every, c.cpu_offload, c.micro_batch)
        if len(top) < TOP and all(key != (t.config.world_size, t.config.strategy,
                                          t.config.checkpoint_every, t.config.cpu_offload,
                                          t.config.micro_batch) for t in top):
            top.append(e)
    for i, e in enumerate(top):
        rows.append(_row(e, "<- recommended" if i == 0 else result.why_not(e)))
    sizes = sorted({e.config.world_size for e in result.ranked})
    for n in sizes:  # the best at each world size, when not already shown
        b = result.best_at(n)
        if b is not None and all(b is not e for e in top):
            rows.append(_row(b, f"best at N={n}: {result.why_not(b)}"))
    faster = [e for e in result.ranked if not e.fits
              and (best is None or e.time.step < best.time.step)]
    shown: set[tuple] = set()
    for e in faster:  # the fastest few that do not fit, one per strategy
        key = (e.config.strategy, e.config.world_size)
        if key in shown or len(shown) >= 3:
            continue
        shown.add(key)
        rows.append(_row(e, f"faster, but {result.why_not(e)}"))
    if rows:
        lines += ["", *_table(rows)]
    lines.append("")
    for n in sizes:
        if result.best_at(n) is None:
            smallest = min((e for e in result.ranked if e.config.world_size == n),
                           key=lambda e: e.memory.total, default=None)
            if smallest is not None:
                lines.append(f"N={n}: nothing fits; the smallest ({smallest.config.describe()})"
                             f" needs {format_bytes(smallest.memory.total)}.")
    lines += result.skipped[:3]
    if best is None:
        lines.append("Nothing fits the budget: more ranks, checkpointing, offload or a smaller "
                     "micro-batch were all tried.")
        return "\n".join(lines)
    m, t = best.memory, best.time
    lines += [
        f"Recommended: {best.config.describe()} on {best.config.world_size} rank(s).",
        f"  memory per rank {format_bytes(m.total)} = state {format_bytes(m.state)} + working "
        f"{format_bytes(m.working)} + grad scratch {format_bytes(m.scratch)} + activations "
        f"{format_bytes(m.activations)}"
        + (f" + accumulated grads {format_bytes(m.accumulation)}" if m.accumulation else "")
        + (f"; host {format_bytes(m.host)}" if m.host else ""),
        f"  step {_ms(t.step)} = compute {_ms(t.compute)} + exposed comm {_ms(t.exposed)} + "
        f"optimizer {_ms(t.optimizer)}; {t.tokens_per_s:,.0f} tokens/s per rank; comm "
        f"{_ms(t.comm)} per step, {_ms(t.comm - min(t.comm, t.exposed))} hidden.",
    ]
    lines += _exposure(best, alternatives or {})
    lines.append(f"  fsdp(model, **plan.recommendation.fsdp_kwargs()): "
                 f"{_kwargs_text(best.fsdp_kwargs())}")
    return "\n".join(lines)


def _exposure(best: Evaluated, alternatives: dict[str, Evaluated]) -> list[str]:
    t = best.time
    if t.exposed <= 0.01 * t.step:
        return ["  communication is hidden behind compute (exposed < 1% of the step)."]
    out = [f"  exposed: first gather {_ms(t.first_gather)}, last reduction "
           f"{_ms(t.last_reduce)}"
           + (f", units whose gather outlasts the compute before them: "
              f"{', '.join(t.starved_units[:4])}{'...' if len(t.starved_units) > 4 else ''}"
              if t.starved_units else "") + "."]
    for label, alt in alternatives.items():
        change = alt.time.exposed - t.exposed
        out.append(f"  {label}: exposed {_ms(alt.time.exposed)} ({'+' if change >= 0 else ''}"
                   f"{_ms(change)}), step {_ms(alt.time.step)}, memory "
                   f"{format_bytes(alt.memory.total)}{'' if alt.fits else ' (over budget)'}.")
    if t.starved_units:
        out.append("  larger units (fewer, bigger blocks per unit) send fewer, larger messages "
                   "and give each gather more compute to hide behind.")
    return out


def _kwargs_text(kwargs: dict) -> str:
    def short(v: object) -> str:
        if isinstance(v, set):
            return "{" + ", ".join(sorted(c.__name__ for c in v)) + "}"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return type(v).__name__ + "(...)"
        return repr(v)

    return ", ".join(f"{k}={short(v)}" for k, v in kwargs.items() if v is not None)
