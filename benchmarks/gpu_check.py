"""The measuring half of `gpu_check.sh`: one variant's step time, tokens/s and peak memory on
GPUs, and the table of all of them.

    python benchmarks/gpu_check.py run --variant bare --out results.jsonl        # one GPU
    python benchmarks/gpu_check.py run --variant fullshard --out results.jsonl   # world size 1
    torchrun --standalone --nproc-per-node 8 benchmarks/gpu_check.py run --variant fsdp2 ...
    python benchmarks/gpu_check.py table results.jsonl                           # the table
    python benchmarks/gpu_check.py run --variant fullshard --dry-run ...         # CPU, tiny

The model is the benchmarks' GPT (`gpt.py`) at about 1B parameters (`G1B`: 18 blocks x 2048,
vocab 32000, sequence 1024), built directly on the GPU after `torch.manual_seed(1234)`, fp32
master weights computing in bf16:
- `bare`: the model itself under `torch.autocast("cuda", torch.bfloat16)` (one GPU only);
- `fullshard`: `fullshard.fsdp(model, sharding_strategy="FULL_SHARD", bucketing "BLOCK",
  mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))`, each Block a unit;
- `fsdp2`: `fully_shard(block, mp_policy=MixedPrecisionPolicy(bf16, fp32))` per block, then the
  root, `reshard_after_forward=True` (what FULL_SHARD does).
All take AdamW(lr=1e-4, fused on CUDA) and `--micro-batch` rows per rank of random tokens.

Without torchrun a variant runs at world size 1 (fullshard and FSDP2 on an NCCL group of one:
their hooks and bookkeeping with nothing to send); under torchrun on one rank per GPU.
Per step (after `--warmup`): CUDA-synchronized wall time; tokens/s = global tokens / step;
peak memory = `torch.cuda.max_memory_allocated()` over the measured steps (max over ranks);
MFU = (6 * matmul params + 12 * layers * dim * seq) * tokens/s / (GPUs * peak bf16 FLOP/s),
the peak from the device name (`PEAK_TFLOPS`, or `$GPU_PEAK_TFLOPS`), none when unknown.

`--dry-run` runs the same code on CPU with gloo and a tiny config (`dry`, bf16 autocast on CPU)
so everything but CUDA is exercised without a GPU. A failing variant exits non-zero; `table`
exits non-zero when any expected record is missing or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt import GPTConfig, build_model, lm_loss, param_count

CONFIGS = {
    "G1B": GPTConfig("G1B", layers=18, dim=2048, vocab=32000, seq=1024, global_batch=4),
    "dry": GPTConfig("dry", layers=2, dim=64, vocab=256, seq=32, global_batch=2),
}
PEAK_TFLOPS = {  # dense bf16 tensor-core peaks (no sparsity), by a substring of the name
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 756.0,
    "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0,
    "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0, "RTX 6000 Ada": 364.0,
    "A6000": 155.0, "V100": 125.0, "T4": 65.0,
}
VARIANTS = ("bare", "fullshard", "fsdp2")


def peak_flops(device_name: str) -> float | None:
    env = os.environ.get("GPU_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 SXM" before "H100"
        if key.lower() in device_name.lower():
            return PEAK_TFLOPS[key] * 1e12
    return None


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 x the parameters that multiply (not the embedding lookups)
    plus the attention scores and values, 12 * L * D * seq (PaLM's appendix B)."""
    matmul = param_count(cfg) - cfg.vocab * cfg.dim - cfg.seq * cfg.dim
    return 6 * matmul + 12 * cfg.layers * cfg.dim * cfg.seq


def _wrap(variant: str, model: torch.nn.Module, device: torch.device, world: int) -> Any:
    from gpt import Block

    bf16, fp32 = torch.bfloat16, torch.float32
    if variant == "bare":
        if world != 1:
            raise ValueError(f"variant 'bare' runs on one device only, got world size {world}")
        return model
    if variant == "fullshard":
        import fullshard

        return fullshard.fsdp(model, device=device, sharding_strategy="FULL_SHARD",
                              bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                              mixed_precision=fullshard.MixedPrecision(param_dtype=bf16,
                                                                       reduce_dtype=fp32))
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        return model
    raise ValueError(f"--variant must be one of {VARIANTS}, got {variant!r}")


def _setup(dry_run: bool) -> tuple[torch.device, int, int]:
    """Device, rank, world; a process group for the sharded variants (of one without torchrun)."""
    cuda = not dry_run
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (torch.cuda.is_available() is False); "
                           "use --dry-run to exercise this script on CPU")
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if cuda else None)
    else:
        rank, world = 0, 1
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, rank, world


def run(args: argparse.Namespace) -> int:
    cfg = CONFIGS["dry" if args.dry_run else args.config]
    device, rank, world = _setup(args.dry_run)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    with torch.device(device):  # built in place: a 1B model on the host would take minutes
        model = build_model(cfg)
    psi = param_count(cfg)
    model = _wrap(args.variant, model, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
    gen = torch.Generator(device=device).manual_seed(rank)
    batch = torch.randint(0, cfg.vocab, (args.micro_batch, cfg.seq + 1), device=device,
                          generator=gen)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    autocast = args.variant == "bare"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    times, losses = [], []
    for step in range(args.steps):
        if step == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(inputs)
        loss = lm_loss(logits.float(), targets)
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    result = {"step_s": times, "loss": losses[-1], "peak_bytes": peak}
    gathered = [result]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
    if rank == 0:
        per_step = [max(c) for c in zip(*(g["step_s"] for g in gathered))]
        step_s = statistics.median(per_step[args.warmup:])
        tokens_s = args.micro_batch * cfg.seq * world / step_s
        name = torch.cuda.get_device_name(device) if cuda else "cpu (dry run)"
        peak_f = peak_flops(name) if cuda else None
        record = {
            "variant": args.variant, "world": world, "config": cfg.name, "psi": psi,
            "device": name, "micro_batch": args.micro_batch, "seq": cfg.seq,
            "steps": args.steps, "warmup": args.warmup, "step_s": step_s,
            "tokens_s": tokens_s, "peak_mib": max(g["peak_bytes"] for g in gathered) / 2**20,
            "final_loss": sum(g["loss"] for g in gathered) / world,
            "mfu": (flops_per_token(cfg) * tokens_s / (world * peak_f)) if peak_f else None,
            "ok": all(x == x for x in losses),  # NaN-free
        }
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()
    return 0


def table(paths: list[Path], expect_world: int) -> int:
    """Print the table; 1 when a (variant, world) that should be there is missing or failed."""
    recs = []
    for p in paths:
        if p.exists():
            recs += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    by = {(r["variant"], r["world"]): r for r in recs}
    expected = [(v, 1) for v in VARIANTS]
    if expect_world > 1:
        expected += [("fullshard", expect_world), ("fsdp2", expect_world)]
    cols = ("variant", "GPUs", "step s", "tokens/s", "peak MiB", "MFU", "vs bare / FSDP2",
            "final loss")
    rows = []
    for v, w in expected:
        r = by.get((v, w))
        if r is None:
            rows.append([v, str(w), "MISSING", "", "", "", "", ""])
            continue
        ref = by.get(("bare", 1) if w == 1 and v != "bare" else ("fsdp2", w))
        vs = "" if ref is None or ref is r else (
            f"{r['step_s'] / ref['step_s']:.3f}x {'bare' if w == 1 else 'FSDP2'} step")
        if w == 1 and v == "fullshard" and ("fsdp2", 1) in by:
            vs += f", {r['step_s'] / by[('fsdp2', 1)]['step_s']:.3f}x FSDP2"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        rows.append([v, str(w), f"{r['step_s']:.4f}", f"{r['tokens_s']:,.0f}",
                     f"{r['peak_mib']:,.0f}", mfu, vs,
                     f"{r['final_loss']:.4f}{'' if r['ok'] else ' NaN!'}"])
    first = next(iter(by.values()), {})
    print(f"\nGPT {first.get('config', '?')} (Psi = {first.get('psi', 0):,}), micro-batch "
          f"{first.get('micro_batch', '?')} x seq {first.get('seq', '?')} per GPU, bf16 "
          f"compute / fp32 master, on {first.get('device', '?')}")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    for row in [list(cols), ["-" * w for w in widths], *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))
    missing = [r for r in rows if r[2] == "MISSING" or r[-1].endswith("NaN!")]
    return 1 if missing else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure one variant (under torchrun: on every GPU)")
    r.add_argument("--variant", required=True, choices=VARIANTS)
    r.add_argument("--config", default="G1B", choices=sorted(CONFIGS))
    r.add_argument("--micro-batch", type=int, default=4)
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--out", default=None)
    r.add_argument("--dry-run", action="store_true", help="CPU, gloo, the tiny 'dry' config")
    t = sub.add_parser("table", help="print the table of the records in FILE...")
    t.add_argument("files", nargs="+", type=Path)
    t.add_argument("--world", type=int, default=1, help="the multi-GPU world size expected")
    args = p.parse_args()
    if args.command == "table":
        return table(args.files, args.world)
    if args.micro_batch < 1 or not 0 <= args.warmup < args.steps:
        p.error(f"need --micro-batch >= 1 and 0 <= --warmup < --steps, got {args.micro_batch}, "
                f"{args.warmup}, {args.steps}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
