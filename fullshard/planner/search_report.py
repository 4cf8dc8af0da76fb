"""The search's answer as text: the few fastest configurations that fit, why the others lose,
and for the recommendation, the exposed communication and what would hide it."""

from __future__ import annotations

import dataclasses

from fullshard.planner.recommendation import Evaluated
from fullshard.planner.search import SearchResult
from fullshard.planner.sizes import format_bytes

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
