"""Eager vs torch.compile'd fullshard: step time on the benchmark GPT (`gpt.py`, config A/B)
and on Hugging Face's GPT-2 (`--config gpt2`: `GPT2LMHeadModel` with config A's sizes, its
loss computed inside the model's forward from `labels`, as HF training does).

    python benchmarks/compile_step_time.py --config A                  # record a run
    python benchmarks/compile_step_time.py --config gpt2
    python benchmarks/compile_step_time.py --config A --steps 4 --warmup 2 --reps 1 --no-record

Each variant runs in its own group of `--nproc` gloo ranks (spawned with
`fullshard.testing.DistributedGroup`), on the same seeded model and data as `step_time.py`,
with the model's default units (its blocks), AdamW, `--strategy` (FULL_SHARD) and
`--bucketing` (BLOCK, issue 22's case):

- `eager`: `fullshard.fsdp(model)`;
- `compiled`: `fullshard.fsdp(torch.compile(model, backend=--backend))` (litgpt's order: the
  compiled model is unwrapped and sharded, each unit's forward compiled in place with the
  same options and the root compiled again with them, its own frame eager:
  `fullshard.api.compile_units`);
- `compiled-root-eager`: `fullshard.fsdp(model)`, then `compile_units(model, backend=...)`:
  the same per-unit compile with the root's own code left eager;
- `compiled-root-again`: `compile_units` as above, then `torch.compile(model)`: the units
  compiled and the root's frames traced by dynamo (what `compiled` was before the root's
  frame ran eagerly);
- `compiled-after`: `torch.compile(fullshard.fsdp(model))`: the root compiled alone (what
  `compiled` was before per-unit compile, and what a model compiled after wrapping gets);
- `compiled-units`: each block `torch.compile`d, then sharded (torchtitan's order);
- `fsdp2-eager` / `fsdp2-compiled`: torch's FSDP2 (`fully_shard` on each block and the root,
  its defaults), then `torch.compile(model)`: FSDP2's hooks are dynamo-disabled too, so it
  shows what the same mechanism gains in torch's own engine;
- `ddp-eager` / `ddp-compiled`: torch DDP on the same model, eager and
  `torch.compile(DDP(model))` (what Fabric does with a compiled model): the gain compile gives
  a model whose code all compiles, against which fullshard's gain is measured (issue 22: the
  ratio compiled / eager within 5% of DDP's);
- `ddp-compiled-units`: each block `torch.compile`d, then DDP: what DDP gains when the root's
  own code (embeddings, HF's mask and loss code, head) runs eagerly, as it does under any
  FSDP with eager hooks (a frame that loops over units cannot compile).

Per step each rank times forward + loss + backward + optimizer step; the first `--warmup`
steps (which include compilation) are not timed; a step's time is the max over ranks, and a
variant's figure is the median over steps and `--reps` interleaved repetitions. Also
recorded: compiled graphs (`unique_graphs`) after warm-up and at the end (equal: nothing
recompiles per step), graph breaks dynamo counted, and the losses (which must agree with
eager's to round-off). Timings on a contended machine mean little: run it on a quiet one.
Writes `results/<date>-compile_step_time.{json,md}` unless `--no-record`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

VARIANTS = ("eager", "compiled", "compiled-root-eager", "compiled-root-again",
            "compiled-after", "compiled-units",
            "ddp-eager", "ddp-compiled", "ddp-compiled-units", "fsdp2-eager", "fsdp2-compiled")


def _hf_configs() -> dict[str, Any]:
    from gpt import CONFIGS, GPTConfig

    # `gpt2`: config A's sizes; `gpt2-tiny`: overhead-bound (as config S), where the Python
    # of the root's forward (HF's mask and loss code) weighs most; `gpt2-micro`: the sizes of
    # the HF tests (tests/distributed/test_hf_models.py), nothing but overhead
    return {"gpt2": CONFIGS["A"],
            "gpt2-tiny": GPTConfig("gpt2-tiny", layers=4, dim=64, vocab=512, seq=32,
                                   global_batch=4),
            "gpt2-micro": GPTConfig("gpt2-micro", layers=2, dim=16, vocab=64, seq=8,
                                    global_batch=4)}


def _hf_gpt2(cfg: Any) -> Any:
    """HF GPT-2 with `cfg`'s sizes (dropout off, so runs are deterministic)."""
    import torch
    import transformers

    torch.manual_seed(1234)
    hf = transformers.GPT2Config(
        n_layer=cfg.layers, n_embd=cfg.dim, n_head=max(1, cfg.heads), vocab_size=cfg.vocab,
        n_positions=cfg.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(hf)


def _train(variant: str, config: str, strategy: str, bucketing: str, backend: str, steps: int,
           warmup: int, threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gpt import CONFIGS, build_model, data_pool, lm_loss, rank_rows
    from torch._dynamo.utils import counters

    import fullshard

    hf_configs = _hf_configs()

    torch.set_num_threads(threads)
    torch._dynamo.reset()
    counters.clear()
    hf = config.startswith("gpt2")
    cfg = hf_configs[config] if hf else CONFIGS[config]
    model = _hf_gpt2(cfg) if hf else build_model(cfg)
    blocks = model.transformer.h if hf else model.blocks
    if variant == "compiled":
        model = torch.compile(model, backend=backend)
    elif variant in ("compiled-units", "ddp-compiled-units"):
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=backend)
    if variant.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if variant == "ddp-compiled":
            model = torch.compile(model, backend=backend)
    elif variant.startswith("fsdp2"):  # torch's FSDP2, its hooks as dynamo-disabled as ours
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if variant == "fsdp2-compiled":
            model = torch.compile(model, backend=backend)
    else:
        model = fullshard.fsdp(model, device="cpu", sharding_strategy=strategy,
                               bucketing_strategy=bucketing)
        if variant in ("compiled-root-eager", "compiled-root-again"):
            from fullshard.api.compile_units import compile_units

            compile_units(model, backend=backend)
            if variant == "compiled-root-again":
                model = torch.compile(model, backend=backend)
        elif variant == "compiled-after":
            model = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = data_pool(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    times, losses, graphs = [], [], []
    for step in range(steps):
        rows = rank_rows(pool[step % len(pool)], rank, world)
        t0 = time.perf_counter()
        if hf:  # HF shifts the labels itself
            loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss
        else:
            loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"times": times[warmup:], "losses": losses, "graphs_after_warmup": graphs[warmup - 1]
            if warmup else 0, "graphs_at_end": graphs[-1],
            "graph_breaks": sum(counters["graph_break"].values()),
            # why dynamo broke (first line of each reason): "graph break in loop" is a frame
            # it skipped and ran eagerly
            "graph_break_reasons": {k.split("\n")[0][:120]: v
                                    for k, v in counters["graph_break"].items()}}


def _spread(xs: list[float]) -> tuple[float, float, float] | None:
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def _fmt(s: tuple[float, float, float] | None) -> str:
    return "-" if s is None else f"{s[0]:.3f} [{s[1]:.3f}-{s[2]:.3f}]"


def _gains(runs: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[Any, Any, Any]]:
    """Per compiled variant, within each rep: compiled / eager median step time, that over
    DDP's compiled / eager, and the milliseconds compile saved per step (eager - compiled)."""
    def med(variant: str, rep: int) -> float:
        return statistics.median(runs[variant][rep]["step_times"])

    reps = min(len(v) for v in runs.values()) if runs else 0
    out: dict[str, tuple[Any, Any, Any]] = {}
    ddp = None
    pairs = [("compiled", "eager"), ("compiled-root-eager", "eager"),
             ("compiled-root-again", "eager"),
             ("compiled-after", "eager"), ("compiled-units", "eager"),
             ("ddp-compiled-units", "ddp-eager"), ("fsdp2-compiled", "fsdp2-eager")]
    if "ddp-eager" in runs and "ddp-compiled" in runs:
        ddp = [med("ddp-compiled", i) / med("ddp-eager", i) for i in range(reps)]
        pairs.insert(0, ("ddp-compiled", "ddp-eager"))
    for variant, base in pairs:
        if variant in runs and base in runs:
            gain = [med(variant, i) / med(base, i) for i in range(reps)]
            saved = [1e3 * (med(base, i) - med(variant, i)) for i in range(reps)]
            over = ([g / d for g, d in zip(gain, ddp)]
                    if ddp and variant != "ddp-compiled" else [])
            out[variant] = (_spread(gain), _spread(over), _spread(saved))
    return out


def run_variant(variant: str, config: str, args: argparse.Namespace) -> dict[str, Any]:
    from fullshard.testing import DistributedGroup

    with DistributedGroup(args.nproc) as group:
        per_rank = group.run(_train, variant, config, args.strategy, args.bucketing,
                             args.backend, args.steps[config], args.warmup[config], args.threads,
                             timeout=args.timeout)
    step_times = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    return {**per_rank[0], "step_times": step_times}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["A"],
                   choices=("A", "B", "gpt2", "gpt2-tiny", "gpt2-micro"))
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--bucketing", default="BLOCK")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, nargs="+", default=[20],
                   help="steps per run: one value, or one per --config")
    p.add_argument("--warmup", type=int, nargs="+", default=[5],
                   help="untimed leading steps (compile): one value, or one per --config")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--record-name", default=None, help="file stem under --results-dir")
    args = p.parse_args()
    for name in ("steps", "warmup"):
        values = getattr(args, name)
        if len(values) not in (1, len(args.config)):
            p.error(f"--{name}: one value or one per --config ({len(args.config)}), got {values}")
        setattr(args, name, dict(zip(args.config, values * len(args.config))))
    if not all(0 < args.warmup[c] < args.steps[c] for c in args.config):
        p.error("need 0 < --warmup < --steps")
    return args


def run_config(config: str, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The interleaved reps of every variant on one config: its table lines and raw runs."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for rep in range(args.reps):  # interleaved, so drifting load hits every variant alike
        for variant in args.variants:
            runs[variant].append(run_variant(variant, config, args))
            print(f"{config} rep {rep} {variant}: median step "
                  f"{statistics.median(runs[variant][-1]['step_times']):.4f} s", flush=True)
    rows = []
    eager = runs.get("eager")
    for variant, reps in runs.items():
        steps = [t for r in reps for t in r["step_times"]]
        row = {
            "variant": variant,
            "median_step_s": statistics.median(steps),
            "graphs_after_warmup": reps[0]["graphs_after_warmup"],
            "graphs_at_end": reps[0]["graphs_at_end"],
            "graph_breaks": reps[0]["graph_breaks"],
            "graph_break_reasons": reps[0]["graph_break_reasons"],
            "max_loss_diff_vs_eager": None if eager is None else max(
                abs(a - b) for r, e in zip(reps, eager) for a, b in zip(r["losses"], e["losses"])
            ),
        }
        rows.append(row)
    base = next((r["median_step_s"] for r in rows if r["variant"] == "eager"), None)
    medians = {r["variant"]: r["median_step_s"] for r in rows}
    gains = _gains(runs)
    lines = [
        f"## config {config}", "",
        f"{args.strategy}, bucketing {args.bucketing}, {args.nproc} ranks x {args.threads} "
        f"thread(s), backend {args.backend}, {args.steps[config]} steps "
        f"({args.warmup[config]} untimed) x "
        f"{args.reps} reps, load average at start of this config {os.getloadavg()[0]:.2f}", "",
        "| variant | median step s | / its eager | graphs after warm-up / at end | graph breaks |"
        " max loss diff vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        own = (medians.get("ddp-eager") if r["variant"].startswith("ddp") else
               medians.get("fsdp2-eager") if r["variant"].startswith("fsdp2") else base)
        ratio = f"{r['median_step_s'] / own:.2f}" if own else "-"
        diff = "-" if r["max_loss_diff_vs_eager"] is None else f"{r['max_loss_diff_vs_eager']:.1e}"
        lines.append(f"| {r['variant']} | {r['median_step_s']:.4f} | {ratio} | "
                     f"{r['graphs_after_warmup']} / {r['graphs_at_end']} | {r['graph_breaks']} |"
                     f" {diff} |")
    lines += ["", "Compile gain (compiled / eager, each against its own eager; per rep, "
              "median [min-max]), fullshard's gain over DDP's (target <= 1.05) and the "
              "milliseconds compile saved per step (eager - compiled):", "",
              "| variant | compiled / eager | / DDP's compiled / eager | ms saved per step |",
              "|---|---|---|---|"]
    for variant, (gain, over_ddp, saved) in gains.items():
        ms = "-" if saved is None else f"{saved[0]:.1f} [{saved[1]:.1f} to {saved[2]:.1f}]"
        lines.append(f"| {variant} | {_fmt(gain)} | {_fmt(over_ddp)} | {ms} |")
    return lines, {"rows": rows, "runs": runs}


def main() -> None:
    args = parse_args()
    lines = [f"# fullshard eager vs torch.compile ({datetime.date.today().isoformat()})", ""]
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for config in args.config:
        config_lines, record[config] = run_config(config, args)
        lines += config_lines + [""]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        stem = args.results_dir / (args.record_name or
                                   f"{datetime.date.today().isoformat()}-compile_step_time")
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
        print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
