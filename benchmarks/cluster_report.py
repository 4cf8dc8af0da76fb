"""The numbers and the markdown record of `cluster.py`'s runs.

    python benchmarks/cluster_report.py benchmarks/results/2026-12-03-cluster.json   # re-render

Formulas (README.md, "On an emulated cluster"):
- a run's step time: median over the measured steps (after warmup) of the per-step max over
  ranks; over reps: median [min-max];
- link bytes per step: over the measured window, the busiest direction of the busiest host's
  veth (max over hosts of max(tx, rx)), divided by the measured steps;
- counted bytes: fullshard `comm_stats()` wire bytes plus its divergence headers; for the
  others the c10d wrapper's wire estimate (`comm_count.py`);
- compute = the implementation's unshaped step time; comm = link bytes per step / rate;
  overlap efficiency = (compute + comm - step) / min(compute, comm): 1 when the shorter of the
  two is hidden entirely, 0 when nothing overlaps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
BYTES_BAND = (0.99, 1.05)
"""carried / counted for fullshard must fall in this band (TCP/IP headers and ACKs add ~0.2%)."""
TARGET_EFF, TARGET_LIMIT = 0.8, 1.15


def measured(rec: dict[str, Any]) -> list[float]:
    return rec["step_s"][rec["warmup"]:]


def step_time(rec: dict[str, Any]) -> float:
    return statistics.median(measured(rec))


def counted_wire(window: dict[str, Any], kinds: tuple[str, ...] | None = None) -> int:
    """What this rank says it sent in the window (fullshard's own counters, else c10d's)."""
    stats = window.get("fullshard") or window.get("c10d") or {}
    total = sum(v["wire_bytes"] for k, v in stats.items() if kinds is None or k in kinds)
    if window.get("fullshard") and kinds is None:
        total += (window.get("headers") or {}).get("bytes", 0)
    return int(total)


def c10d_wire(window: dict[str, Any]) -> int:
    return int(sum(v["wire_bytes"] for v in (window.get("c10d") or {}).values()))


def _host_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in rec["ranks"]:
        w = r["window"]
        if r["local_rank"] == 0 and w.get("link_start"):
            rows.append({"host": r["host"],
                         "tx": w["link_end"]["tx_bytes"] - w["link_start"]["tx_bytes"],
                         "rx": w["link_end"]["rx_bytes"] - w["link_start"]["rx_bytes"]})
    return rows


def link_bytes_per_step(rec: dict[str, Any]) -> float:
    steps = rec["steps"] - rec["warmup"]
    return max(max(h["tx"], h["rx"]) for h in _host_rows(rec)) / steps


def carried_over_counted(rec: dict[str, Any]) -> float:
    """Sum over hosts of veth tx / sum of what the ranks counted as crossing hosts."""
    hybrid = "hybrid" in rec["impl"]
    counted = 0
    for r in rec["ranks"]:
        # HYBRID: only the replicate-axis all-reduce leaves the host; the shard axis is local
        counted += counted_wire(r["window"], ("all_reduce",) if hybrid else None)
    tx = sum(h["tx"] for h in _host_rows(rec))
    return tx / counted if counted else float("nan")


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def loss_diff(rec: dict[str, Any], ref: dict[str, Any] | None) -> tuple[float, bool]:
    if ref is None:
        return float("nan"), False
    diffs = [abs(a - b) for a, b in zip(rec["losses"], ref["losses"])]
    ok = len(rec["losses"]) == len(ref["losses"]) and all(
        d <= LOSS_ATOL + LOSS_RTOL * abs(b) for d, b in zip(diffs, ref["losses"]))
    return max(diffs), ok


def _fsdp2_row(impls: list[str]) -> str:
    """The FSDP2 row "/ FSDP2" is taken against: its default (`reshard_after_forward=None`,
    the root kept gathered, like fullshard's default) where it ran, else the first FSDP2 row
    (records before 2026-12-03's second run have `fsdp2-reshard` only)."""
    fsdp2 = [i for i in impls if i.startswith("fsdp2")]
    return "fsdp2-default" if "fsdp2-default" in fsdp2 else (fsdp2[0] if fsdp2 else "")


def summarize_overlap(ov: dict[str, Any]) -> dict[str, Any]:
    rate = ov["rate_mbit"]
    recs = ov["records"]
    refs = {int(k): v for k, v in (ov.get("references") or {}).items()}
    rows = []
    flat = [r for r in recs if r.get("nproc_per_host", 1) == 1]
    impls = list(dict.fromkeys(r["impl"] for r in flat))
    by = {(r["impl"], r["link"], r["rep"]): r for r in flat}
    for impl in impls:
        un = [step_time(r) for r in flat if r["impl"] == impl and r["link"] == "unshaped"]
        sh_recs = [r for r in flat if r["impl"] == impl and r["link"] == "shaped"]
        if not un or not sh_recs:
            continue
        sh = [step_time(r) for r in sh_recs]
        per_step = statistics.median(link_bytes_per_step(r) for r in sh_recs)
        compute = statistics.median(un)
        comm = per_step * 8 / (rate * 1e6)
        step = statistics.median(sh)
        fsdp2 = _fsdp2_row(impls)
        vs_fsdp2 = [step_time(r) / step_time(by[(fsdp2, "shaped", r["rep"])])
                    for r in sh_recs if (fsdp2, "shaped", r["rep"]) in by]
        diffs = [loss_diff(r, refs.get(r["world"])) for r in sh_recs]
        per_rep = []  # the same formula within each rep: the machine's load drifts between reps
        for r in sh_recs:
            u = by.get((impl, "unshaped", r["rep"]))
            if u is not None:
                c, m = step_time(u), link_bytes_per_step(r) * 8 / (rate * 1e6)
                per_rep.append((c + m - step_time(r)) / min(c, m))
        rows.append({
            "overlap_eff_per_rep": _spread(per_rep) if per_rep else None,
            "impl": impl, "compute": _spread(un), "shaped": _spread(sh),
            "link_mb_per_step": per_step / 1e6, "comm_s": comm,
            "limit_s": max(compute, comm), "step_over_limit": step / max(compute, comm),
            "overlap_eff": (compute + comm - step) / min(compute, comm),
            "vs_fsdp2": _spread(vs_fsdp2) if vs_fsdp2 else None,
            "carried_over_counted": statistics.median(carried_over_counted(r) for r in sh_recs),
            "max_dloss": max(d for d, _ in diffs), "losses_ok": all(ok for _, ok in diffs),
        })
    hybrid = [r for r in recs if r.get("nproc_per_host", 1) == 2]
    hrows = []
    hby = {(r["impl"], r["rep"]): r for r in hybrid}
    for impl in dict.fromkeys(r["impl"] for r in hybrid):
        rs = [r for r in hybrid if r["impl"] == impl]
        ratio = [step_time(r) / step_time(hby[("fullshard-full_shard-block", r["rep"])])
                 for r in rs if ("fullshard-full_shard-block", r["rep"]) in hby]
        diffs = [loss_diff(r, refs.get(r["world"])) for r in rs]
        per_step = statistics.median(link_bytes_per_step(r) for r in rs)
        hrows.append({"impl": impl, "shaped": _spread([step_time(r) for r in rs]),
                      "link_mb_per_step": per_step / 1e6,
                      "comm_s": per_step * 8 / (rate * 1e6),
                      "vs_full_shard": _spread(ratio) if ratio else None,
                      "carried_over_counted": statistics.median(
                          carried_over_counted(r) for r in rs),
                      "max_dloss": max(d for d, _ in diffs),
                      "losses_ok": all(ok for _, ok in diffs)})
    return {"rows": rows, "hybrid": hrows}


# -- rendering ---------------------------------------------------------------------------------
def _s(sp: dict[str, float] | None, d: int = 3) -> str:
    if not sp:
        return "-"
    return f"{sp['median']:.{d}f} [{sp['min']:.{d}f}-{sp['max']:.{d}f}]"


def _table(cols: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    return [f"- command: `{meta['command']}`, {meta['date']}, wall {meta['wall_s']} s",
            f"- commit {meta['git_commit']}{' (uncommitted changes)' if meta['git_dirty'] else ''}"
            f", torch {meta['torch']}, python {meta['python']}, {meta['cpu_count']} CPUs, "
            f"{meta['platform']}",
            f"- load: start `{meta['uptime_start']}`; end `{meta['uptime_end']}`"]


def render_check(section: dict[str, Any]) -> str:
    out = ["## Checks: losses, bytes, a rank killed", "", *_meta_lines(section["meta"]), ""]
    rows = []
    for e in section["results"]:
        n = e["net"]
        bytes_ = "; ".join(f"h{b['host']} {b['tx_bytes'] / 1e6:.2f}/{b['counted'] / 1e6:.2f} MB "
                           f"= {b['carried_over_counted']:.4f}x" for b in e["bytes"])
        k = e["kill"]
        exits = ", ".join(f"h{h} {'still running after 120 s' if t is None else f'{t:.2f} s'}"
                          f" (exit {c})" for h, (t, c) in enumerate(
                              zip(k["launcher_exit_after_s"], k["exit_codes"])))
        rows.append([str(n["hosts"]), f"{n['rate_mbit']:g} (TCP {e['link_mbit_measured']})",
                     f"{e['losses']['max_abs_diff']:.1e} {'ok' if e['losses']['ok'] else 'DIFFER'}",
                     bytes_, f"{exits}: {'ok' if k['ok'] else 'FAILED'}"])
    out.append(_table(["hosts", "link Mbit/s", "losses vs 1 process (max abs diff)",
                       "veth tx / counted, per host",
                       f"rank on the last host SIGKILLed: each launcher out after (bound "
                       f"{section['results'][0]['kill']['bound_s']:g} s)"],
                      rows))
    for e in section["results"]:
        for line in e["kill"]["messages"]:
            out.append(f"\n{e['net']['hosts']} hosts, kill: `{line}`")
    return "\n".join(out) + "\n"



def describe_config(name: str) -> str:
    """'A (4 blocks x 256, Psi = 7,386,624; the root 57% of it)', from `gpt.py` itself."""
    from gpt import CONFIGS, param_count
    from impls import root_numel

    cfg = CONFIGS[name]
    psi = param_count(cfg)
    return (f"{name} ({cfg.layers} blocks x {cfg.dim}, Psi = {psi:,}; the root, embeddings and "
            f"head, {root_numel(cfg) / psi:.0%} of it)")


def render_overlap(section: dict[str, Any]) -> str:
    s = summarize_overlap(section)
    rate = section["rate_mbit"]
    out = ["## Overlap near the limit (2 hosts, 1 rank each)", "", *_meta_lines(section["meta"]),
           f"- link: {section['net']['shaping']}; TCP measured {section['link_mbit_measured']} "
           f"Mbit/s; sysctls in the hosts: {', '.join(section.get('sysctl') or ()) or 'defaults'}",
           ""]
    if section.get("calibration"):
        c = section["calibration"]
        out.append(f"Rate chosen from a calibration run: FULL_SHARD unshaped "
                   f"{c['compute_s']:.3f} s/step and {c['bytes_per_step'] / 1e6:.1f} MB per "
                   f"step on the busiest link direction -> {rate} Mbit/s.\n")
    rows = [[r["impl"], _s(r["compute"]), f"{r['link_mb_per_step']:.1f}", f"{r['comm_s']:.3f}",
             _s(r["shaped"]), f"{r['step_over_limit']:.2f}", f"{r['overlap_eff']:.2f}",
             _s(r["overlap_eff_per_rep"], 2),
             _s(r["vs_fsdp2"], 2), f"{r['carried_over_counted']:.3f}",
             f"{r['max_dloss']:.1e}{'' if r['losses_ok'] else ' !'}"] for r in s["rows"]]
    out.append(_table(["implementation", "compute s (unshaped)", "link MB/step", "comm s",
                       f"step s @ {rate:g} Mbit/s", "step / max(compute, comm)",
                       "overlap eff.", "eff. within each rep", "/ FSDP2 (same rep)",
                       "carried / counted", "max dloss"], rows))
    if s["hybrid"]:
        out += ["", f"### HYBRID_SHARD vs FULL_SHARD, 2 hosts x 2 ranks, {rate:g} Mbit/s", ""]
        rows = [[r["impl"], _s(r["shaped"]), f"{r['link_mb_per_step']:.1f}",
                 f"{r['comm_s']:.3f}", _s(r["vs_full_shard"], 2),
                 f"{r['carried_over_counted']:.3f}",
                 f"{r['max_dloss']:.1e}{'' if r['losses_ok'] else ' !'}"] for r in s["hybrid"]]
        out.append(_table(["implementation", "step s", "link MB/step", "comm s",
                           "/ FULL_SHARD (same rep)", "carried / counted", "max dloss"], rows))
    if section.get("failures"):
        out += ["", "Failed runs:"] + [f"- rep {f['rep']} {f['link']} {f['impl']}: "
                                       f"`{f['error'].splitlines()[0]}`"
                                       for f in section["failures"]]
    return "\n".join(out) + "\n"


def render(doc: dict[str, Any]) -> str:
    config = next((doc[k]["meta"].get("config", "A") for k in ("overlap", "check") if k in doc),
                  "A")
    parts = ["# fullshard on an emulated cluster (network namespaces, tbf-shaped veth links)\n",
             f"Config {describe_config(config)}, micro-batch 4 per rank, AdamW; "
             "see benchmarks/README.md, \"On an emulated cluster\".\n"]
    if "check" in doc:
        parts.append(render_check(doc["check"]))
    if "overlap" in doc:
        parts.append(render_overlap(doc["overlap"]))
    if doc.get("notes"):  # written by hand into the JSON after a run
        parts.append("## Reading it\n\n" + "\n".join(f"- {n}" for n in doc["notes"]) + "\n")
    return "\n".join(parts)


def passed(doc: dict[str, Any]) -> bool:
    ok = True
    for e in (doc.get("check") or {}).get("results", []):
        ok &= e["losses"]["ok"] and e["kill"]["ok"]
        ok &= all(BYTES_BAND[0] <= b["carried_over_counted"] <= BYTES_BAND[1] for b in e["bytes"])
    if "overlap" in doc:
        ok &= not doc["overlap"].get("failures")
        s = summarize_overlap(doc["overlap"])
        ok &= all(r["losses_ok"] for r in s["rows"] + s["hybrid"])
    return bool(ok)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    doc = json.loads(path.read_text())
    path.with_suffix(".md").write_text(render(doc))
    print(render(doc))
