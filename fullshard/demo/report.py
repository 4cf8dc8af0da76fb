"""The demo's closing report (text) and figure (PNG, when matplotlib is installed)."""

from __future__ import annotations

from pathlib import Path

from fullshard.demo.train import DemoResult


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def planner_prediction(result: DemoResult) -> tuple[int, int]:
    """(model-state bytes, unsharded working-set bytes) per rank that `fullshard.plan`
    predicts for this run."""
    from fullshard import plan
    from fullshard.demo.config import build_model

    cfg = result.config
    table = plan(
        lambda: build_model(cfg),
        world_sizes=(result.world_size,),
        strategies=(cfg.strategy,),
        optimizer="adamw",
        bucketing=cfg.bucketing,
        backend="nccl" if result.device.startswith("cuda") else "gloo",
    )
    row = table.rows[0]
    return row.model_state_bytes, row.working_set_bytes


def predicted_step_seconds(result: DemoResult) -> tuple[float, str] | None:
    """The planner's step time for this run on this machine (`--hardware local`, measured
    now; a preset GPU on CUDA), and the hardware's name; None if it cannot be predicted."""
    from fullshard.demo.config import build_model
    from fullshard.planner.api import predict

    cfg = result.config
    per_rank = -(-cfg.batch // result.world_size)  # the rank with the most rows sets the pace
    hardware: object = "h100-sxm"
    if not result.device.startswith("cuda"):
        from fullshard.planner.hardware import measure_local

        hardware = measure_local(link=result.link)
    try:
        e = predict(lambda: build_model(cfg), world_size=result.world_size,
                    strategy=cfg.strategy, precision=cfg.precision, batch=per_rank,
                    seq=cfg.seq, bucketing=cfg.bucketing, hardware=hardware)
    except (ValueError, TypeError, RuntimeError):  # never let it break the demo's report
        return None
    return e.time.step, getattr(hardware, "name", str(hardware))


def _sent(comm: dict[str, dict[str, int]] | None) -> int:
    return sum(stats["wire_bytes"] for stats in (comm or {}).values())


def _compression_lines(result: DemoResult) -> list[str]:
    """With `--compression`: the exact run's loss and bytes beside the compressed run's."""
    cfg = result.config
    if not cfg.compression:
        return []
    if result.exact_losses is None:
        return ["exact run beside: not run (a resumed run; it trains from step 0)"]
    got, exact = result.losses[-1], result.exact_losses[-1]
    diffs = [abs(a - b) for a, b in zip(result.losses, result.exact_losses)]
    tail = max(1, len(result.exact_losses) // 10)  # one step's loss is noisy: also a mean
    got_tail = sum(result.losses[-tail:]) / tail
    exact_tail = sum(result.exact_losses[-tail:]) / tail
    sent, sent_exact = _sent(result.comm_per_step), _sent(result.exact_comm_per_step)
    return [
        f"exact run beside ({len(result.exact_losses)} steps, same seed and batches): loss "
        f"{exact:.3f} (last); {cfg.compression} ends {(got - exact) / exact:+.2%} from it "
        f"(mean of the last {tail} steps: {(got_tail - exact_tail) / exact_tail:+.2%}), "
        f"largest per-step difference {max(diffs):.3f}",
        f"sent per step: {_mb(sent)} with {cfg.compression}, {_mb(sent_exact)} exact "
        f"({sent / sent_exact:.2f}x)" if sent_exact else "sent per step: -",
    ]


def format_report(result: DemoResult, figure: str | None) -> str:
    cfg = result.config
    steps = len(result.losses) - result.first_step
    per_step = result.seconds / max(steps, 1)
    tokens = cfg.batch * cfg.seq / per_step
    single = 16 * result.params  # fp32 params + grads + AdamW's two moments, one process
    lines = [
        "",
        f"fullshard demo: {result.world_size} ranks on {result.device}, {cfg.strategy}, "
        f"bucketing {cfg.bucketing}, precision {cfg.precision}"
        + (f", weights and gradients {cfg.compression} on the wire" if cfg.compression else ""),
        f"model: byte-level GPT, {result.params / 1e6:.2f}M parameters ({cfg.layers} blocks, "
        f"width {cfg.dim}), batch {cfg.batch} x {cfg.seq} bytes, AdamW lr {cfg.lr}",
        f"steps {result.first_step} -> {len(result.losses)} in {result.seconds:.1f} s "
        f"({per_step * 1e3:.0f} ms/step, {tokens:,.0f} tokens/s)",
        f"loss: {result.losses[result.first_step]:.3f} (first step of this run) -> "
        f"{result.losses[-1]:.3f} (last)"
        + (f"; {result.losses[0]:.3f} at step 0" if result.first_step else ""),
        *_compression_lines(result),
        "",
        "sample (temperature 0.8):",
        "  " + result.sample.replace("\n", "\n  "),
        "",
        "model state per rank (parameters + gradients + AdamW state):",
    ]
    for rank, nbytes in enumerate(result.state_bytes_per_rank):
        lines.append(f"  rank {rank}: {_mb(nbytes)} ({nbytes / single:.2f} of one process)")
    lines.append(f"  one process: {_mb(single)} (16 bytes x {result.params:,} parameters)")
    state, working = planner_prediction(result)
    lines.append(f"  `fullshard plan` predicted: {_mb(state)} per rank")
    lines.append(
        f"  peak unsharded working set in a step: {_mb(result.peak_unsharded_bytes)} "
        f"(predicted {_mb(working)})"
    )
    predicted = predicted_step_seconds(result)
    if predicted is not None:
        lines.append(f"step time: measured {per_step * 1e3:.0f} ms, `fullshard plan` predicted "
                     f"{predicted[0] * 1e3:.0f} ms (hardware {predicted[1]})")
    lines.append("communication per step (this rank):")
    for kind, stats in result.comm_per_step.items():
        if stats["calls"]:
            lines.append(
                f"  {kind:<15} {stats['calls']:4d} calls  {_mb(stats['bytes'])} "
                f"(sent {_mb(stats['wire_bytes'])})"
            )
    lines.append(f"checkpoint: {result.checkpoint} (sharded; continue with --resume)")
    lines.append(f"figure: {figure}" if figure else "figure: skipped (pip install matplotlib)")
    return "\n".join(lines)


def write_figure(result: DemoResult, path: Path) -> str | None:
    """Loss curve and per-rank model state; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    compression = result.config.compression
    ax_loss.plot(range(len(result.losses)), result.losses, lw=1.2,
                 label=f"{compression} on the wire" if compression else None)
    if result.exact_losses is not None:
        ax_loss.plot(range(len(result.exact_losses)), result.exact_losses, lw=1.0,
                     ls="--", color="tab:orange", label="exact")
        ax_loss.legend()
    if result.first_step:
        ax_loss.axvline(result.first_step, color="grey", ls="--", lw=0.8, label="resumed")
        ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="loss (mean over ranks)", title="training loss")
    names = [f"rank {r}" for r in range(len(result.state_bytes_per_rank))] + ["one process"]
    values = [b / 2**20 for b in result.state_bytes_per_rank] + [16 * result.params / 2**20]
    colors = ["tab:blue"] * len(result.state_bytes_per_rank) + ["tab:grey"]
    ax_mem.bar(names, values, color=colors)
    ax_mem.set(ylabel="MiB", title="model state (params + grads + AdamW)")
    fig.suptitle(
        f"fullshard {result.config.strategy}, {result.world_size} ranks"
        + (f", {compression} on the wire beside exact" if compression else ""), fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
