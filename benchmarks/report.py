"""Turn the workers' raw records into the benchmark's numbers, table, JSON and markdown record.

Everything is computed from the records `bench_worker.py` emits (one per implementation,
config and repetition); the formulas are spelled out in `benchmarks/README.md`:

- step time of a run: median over the steps after warmup of the per-step max over ranks;
  across reps we report the median of the runs' medians, [min-max] of them, and the median
  of the runs' IQRs;
- ratios: a run's step time over the reference's (its FSDP2 counterpart `Impl.fsdp2`, DDP) in
  the same rep,
  median [min-max] over reps;
- model state per rank (max over ranks) against 16*Psi/N, N = the distributed world size;
- communication per step (rank 0, the last step): ring bytes from the logical bytes by kind,
  the backend's wire bytes, and the analytic ring volume `analytic_comm_words * Psi * (N-1)/N
  * 4`;
- losses: max over steps and reps of |loss - reference loss| (single process, same rep);
- the issue's targets: each fullshard variant's ratio to the target's reference, median
  [min-max] over reps, "met" when the median is within the bound.
"""

from __future__ import annotations

import statistics
from typing import Any

from comm_count import ring_bytes
from gpt import CONFIGS
from impls import DDP_REFERENCE, IMPLS_BY_NAME, LOSS_REFERENCES, analytic_comm_words

MB = 1e6
LOSS_TOLERANCE = 1e-4
TARGETS = (  # (implementations, reference, bound, configs): issue 14's targets
    ("fullshard-full_shard-", "fsdp2-default", 0.80, "ABS"),  # like with like: defaults
    ("fullshard-full_shard_reshard-", "fsdp2-reshard", 0.80, "ABS"),
    ("fullshard-full_shard-", "ddp", 1.05, "B"),
    ("fullshard-full_shard-", "ddp", 2.00, "S"),
    ("fullshard-shard_grad_op-", "ddp", 1.00, "AB"),
    ("fullshard-ws1-", "single-t1", 1.05, "AB"),
)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def _spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": _median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_step_time(record: dict[str, Any]) -> float:
    return _median(record["step_s"][record["warmup"]:])


def _comm_summary(record: dict[str, Any], world: int) -> dict[str, Any] | None:
    """Rank 0's last-step traffic: fullshard's own counters if present, else the c10d ones."""
    source = "fullshard" if record.get("comm_fullshard") else "c10d"
    ranks = record.get("comm_fullshard") or record.get("comm_c10d")
    if not ranks:
        return None
    stats = ranks[0]
    by_kind = {k: v for k, v in stats.items() if v["calls"]}
    out = {
        "source": source,
        "by_kind": by_kind,
        "ring_bytes": sum(ring_bytes(k, v["bytes"], world) for k, v in by_kind.items()),
        "wire_bytes": sum(v["wire_bytes"] for v in by_kind.values()),
        # fullshard's divergence headers (16 B each): sent, but not collectives' data
        "header_bytes": ((record.get("comm_headers") or [None])[0] or {}).get("bytes", 0),
    }
    c10d = (record.get("comm_c10d") or [None])[0]
    if c10d is not None:
        out["c10d_wire_bytes"] = sum(v["wire_bytes"] for v in c10d.values())
        out["c10d_call_s"] = sum(v["call_s"] for v in c10d.values())
        p2p = c10d.get("p2p_send")
        out["c10d_p2p"] = p2p if p2p and p2p["calls"] else None
    return out


def summarize(records: list[dict[str, Any]], world: int = 2) -> dict[str, list[dict[str, Any]]]:
    """Per config, one row per implementation (in run order) with every derived number."""
    summary: dict[str, list[dict[str, Any]]] = {}
    for config in CONFIGS:
        recs = [r for r in records if r["config"] == config]
        if not recs:
            continue
        by_rep: dict[int, dict[str, dict[str, Any]]] = {}
        for r in recs:
            by_rep.setdefault(r["rep"], {})[r["impl"]] = r
        order = list(dict.fromkeys(r["impl"] for r in recs))
        summary[config] = [_row(name, recs, by_rep, world) for name in order]
    return summary


def _ratio(name: str, ref: str, by_rep: dict[int, dict[str, dict[str, Any]]]) -> dict | None:
    ratios = [run_step_time(reps[name]) / run_step_time(reps[ref])
              for reps in by_rep.values() if name in reps and ref in reps]
    return _spread(ratios)


def _loss_diff(name: str, by_rep: dict[int, dict[str, dict[str, Any]]]) -> tuple[str, float]:
    ref = next((n for n in LOSS_REFERENCES if any(n in reps for reps in by_rep.values())), None)
    if ref is None:
        return "", float("nan")
    fallback = next(reps[ref] for reps in by_rep.values() if ref in reps)
    worst = 0.0
    for reps in by_rep.values():
        if name not in reps:
            continue
        ref_losses = reps.get(ref, fallback)["losses"]
        worst = max(worst, max(abs(a - b) for a, b in zip(reps[name]["losses"], ref_losses)))
    return ref, worst


def _row(name: str, recs: list[dict[str, Any]], by_rep: dict, world: int) -> dict[str, Any]:
    impl = IMPLS_BY_NAME[name]
    runs = [r for r in recs if r["impl"] == name]
    psi = runs[0]["psi"]
    medians = [run_step_time(r) for r in runs]
    loss_ref, loss_diff = _loss_diff(name, by_rep)
    state = max(runs[0]["state_bytes"])
    engine = [max(m["peak_unsharded_bytes"] for m in r["engine_memory"])
              for r in runs if r.get("engine_memory")]
    shard_state = 16 * psi / world
    return {
        "impl": name,
        "label": impl.label,
        "reps": len(runs),
        "psi": psi,
        "step_s": _spread(medians),
        "iqr_s": _median([_iqr(r["step_s"][r["warmup"]:]) for r in runs]),
        "phases_s": {p: _median([_median(r[f"{p}_s"][r["warmup"]:]) for r in runs])
                     for p in ("fwd", "bwd", "opt")},
        "tokens_per_s": CONFIGS[runs[0]["config"]].global_batch * CONFIGS[runs[0]["config"]].seq
        / _median(medians),
        "ratio_fsdp2": _ratio(name, impl.fsdp2, by_rep),
        "fsdp2_ref": impl.fsdp2,
        "ratio_ddp": _ratio(name, DDP_REFERENCE, by_rep),
        "target_ratios": {ref: _ratio(name, ref, by_rep) for prefix, ref, _, _ in TARGETS
                          if name.startswith(prefix)},
        "state_bytes": state,
        "state_over_shard": state / shard_state,
        "analytic_state_bytes": shard_state if impl.sharded_state else 16 * psi,
        "comm": _comm_summary(runs[-1], world) if impl.nproc > 1 else None,
        "analytic_comm_bytes": analytic_comm_words(impl, CONFIGS[runs[0]["config"]])
        * psi * (world - 1) / world * 4,
        "peak_unsharded_bytes": max(engine) if engine else None,
        "peak_rss_bytes": _median([max(r["peak_rss_bytes"]) for r in runs]),
        "loss_ref": loss_ref,
        "max_loss_diff": loss_diff,
        "loss_flag": loss_diff > LOSS_TOLERANCE,
        "final_loss": runs[0]["losses"][-1],
    }


# ---------------------------------------------------------------------------- formatting

def _fmt_spread(s: dict | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _mb(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x / MB:.{digits}f}"


MAIN_COLUMNS = ("impl", "step s", "spread [min-max]", "IQR", "/ FSDP2", "/ DDP", "state MB",
                "/ (16Psi/N)", "comm MB", "analytic", "wire MB", "unsh. peak MB", "RSS MB",
                "max abs dloss")


def main_table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        step, comm = r["step_s"], r["comm"]
        spread = "-" if step["n"] == 1 else f"{step['min']:.3f}-{step['max']:.3f}"
        loss = "-" if r["loss_ref"] == "" else f"{r['max_loss_diff']:.1e}"
        if r["loss_flag"]:
            loss += " !"
        out.append([
            r["impl"], f"{step['median']:.3f}", spread, f"{r['iqr_s']:.3f}",
            _fmt_spread(r["ratio_fsdp2"]), _fmt_spread(r["ratio_ddp"]),
            _mb(r["state_bytes"]), f"{r['state_over_shard']:.3f}",
            _mb(comm and comm["ring_bytes"], 2), _mb(r["analytic_comm_bytes"], 2),
            _mb(comm and comm["wire_bytes"], 2), _mb(r["peak_unsharded_bytes"]),
            _mb(r["peak_rss_bytes"], 0), loss,
        ])
    return out


DETAIL_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DETAIL_COLUMNS = ("impl", "fwd s", "bwd s", "opt s", "tokens/s", "final loss", *DETAIL_KINDS,
                  "counted by", "c10d wire MB", "c10d p2p sends", "s in c10d calls")


def _calls(stats: dict | None) -> str:
    """`calls x average logical MB` of one kind."""
    if stats is None:
        return "-"
    return f"{stats['calls']} x {stats['bytes'] / stats['calls'] / MB:.2f} MB"


def detail_table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        comm = r["comm"] or {}
        kinds = comm.get("by_kind", {})
        calls = [_calls(kinds.get(k)) for k in DETAIL_KINDS]
        ph = r["phases_s"]
        out.append([
            r["impl"], f"{ph['fwd']:.3f}", f"{ph['bwd']:.3f}", f"{ph['opt']:.3f}",
            f"{r['tokens_per_s']:.0f}", f"{r['final_loss']:.6f}", *calls, comm.get("source", "-"),
            _mb(comm.get("c10d_wire_bytes"), 2), _calls(comm.get("c10d_p2p")),
            "-" if "c10d_call_s" not in comm else f"{comm['c10d_call_s']:.3f}",
        ])
    return out


TARGET_COLUMNS = ("impl", "reference", "ratio [min-max]", "target", "met")


def target_table_rows(rows: list[dict[str, Any]], config: str) -> list[list[str]]:
    out = []
    for prefix, ref, bound, configs in TARGETS:
        if config not in configs:
            continue
        for r in rows:
            ratio = r.get("target_ratios", {}).get(ref) if r["impl"].startswith(prefix) else None
            if ratio is None:
                continue
            met = "yes" if ratio["median"] <= bound else "no"
            if met == "yes" and ratio["max"] > bound:
                met = "yes (median; not every rep)"
            out.append([r["impl"], ref, _fmt_spread(ratio), f"<= {bound:.2f}", met])
    return out


def text_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in rows)])


def config_heading(config: str, rows: list[dict[str, Any]], world: int = 2) -> str:
    cfg, psi = CONFIGS[config], rows[0]["psi"]
    return (f"config {config}: {cfg.describe()}, Psi = {psi:,}; 16Psi/N = "
            f"{16 * psi / world / MB:.1f} MB, 16Psi = {16 * psi / MB:.1f} MB; analytic comm "
            f"ZeRO-3 3Psi(N-1)/N*4 = {3 * psi * (world - 1) / world * 4 / MB:.2f} MB, "
            f"ZeRO-2/DDP 2Psi(N-1)/N*4 = {2 * psi * (world - 1) / world * 4 / MB:.2f} MB")


def warnings_for(rows: list[dict[str, Any]]) -> list[str]:
    """Things a reader must not miss: loss mismatches, counters that disagree."""
    notes = []
    for r in rows:
        if r["loss_flag"]:
            notes.append(f"{r['impl']}: losses differ from {r['loss_ref']} by "
                         f"{r['max_loss_diff']:.2e} (> {LOSS_TOLERANCE:g})")
        comm = r["comm"]
        if comm and comm["source"] == "fullshard" and "c10d_wire_bytes" in comm \
                and comm["c10d_wire_bytes"] != comm["wire_bytes"] + comm["header_bytes"]:
            notes.append(f"{r['impl']}: fullshard.comm_stats() wire bytes "
                         f"{comm['wire_bytes']:,} + header bytes {comm['header_bytes']:,} "
                         f"!= c10d-observed {comm['c10d_wire_bytes']:,}")
    return notes


def print_summary(summary: dict[str, list[dict[str, Any]]]) -> None:
    for config, rows in summary.items():
        print("\n" + config_heading(config, rows))
        print(text_table(MAIN_COLUMNS, main_table_rows(rows)))
        print()
        print(text_table(DETAIL_COLUMNS, detail_table_rows(rows)))
        targets = target_table_rows(rows, config)
        if targets:
            print()
            print(text_table(TARGET_COLUMNS, targets))
        for note in warnings_for(rows):
            print("WARNING: " + note)


def markdown(summary: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [
        f"# step_time benchmark, {meta['date']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['cpu_count']} CPUs, {meta['platform']}, python {meta['python']}, "
        f"torch {meta['torch']}; fullshard at git {meta['git_commit']}"
        f"{' (uncommitted changes)' if meta['git_dirty'] else ''}.",
        f"Load average at start {meta['loadavg_start']}, at end {meta.get('loadavg_end')}; "
        f"wall time {meta.get('wall_s', 0):.0f} s.",
        f"Reps: {meta['reps']} (interleaved: every rep runs every implementation in turn); "
        f"steps {meta['steps']}, warmup {meta['warmup']}.",
        "",
        "Columns and formulas: see `benchmarks/README.md`. Step time = median over measured "
        "steps of the max over ranks; spread = min-max of the reps' medians; IQR within a run "
        "(median over reps); ratios are to the reference measured in the same rep, median "
        "[min-max] over reps. MB = 1e6 bytes. comm MB = ring bytes sent per rank in the last "
        "step; wire MB counts gloo's reduce-scatter as the all-reduce it is.",
    ]
    for config, rows in summary.items():
        lines += ["", f"## {config_heading(config, rows)}", "",
                  markdown_table(MAIN_COLUMNS, main_table_rows(rows)), "",
                  markdown_table(DETAIL_COLUMNS, detail_table_rows(rows))]
        targets = target_table_rows(rows, config)
        if targets:
            lines += ["", "Targets (issue 14), ratio of step times measured in the same rep:", "",
                      markdown_table(TARGET_COLUMNS, targets)]
        notes = warnings_for(rows)
        if notes:
            lines += ["", *(f"- **warning:** {n}" for n in notes)]
    if meta.get("skipped") or meta.get("failures"):
        lines += ["", "## Skipped and failed runs", ""]
        lines += [f"- skipped {name}: {why}" for name, why in meta.get("skipped", {}).items()]
        lines += [f"- failed {f['config']} {f['impl']} rep {f['rep']} (attempt {f['attempt']}): "
                  f"{f['error']} (stderr tail in the JSON)" for f in meta.get("failures", [])]
    return "\n".join(lines) + "\n"
