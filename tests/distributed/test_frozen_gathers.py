"""`keep_frozen_gathered`: a frozen base gathered once per optimizer step, on 2 real gloo ranks.

A LoRA-like tiny model (each block: a frozen base Linear that is a unit of its own, plus a
trainable low-rank adapter in the block's unit; the root's input and head trainable) trains
with 4 accumulated micro-batches (backward 4 times, each reducing, then `optimizer.step`)
for 3 optimizer steps, under FULL_SHARD and SHARD_GRAD_OP, with the option on and off:

- gathers per frozen unit per optimizer step: 1 on; 2 per micro-batch (ZeRO-3: forward and
  backward) or 1 per micro-batch (ZeRO-2) off -- counted per bucket and in `comm_stats`;
- frozen parameters are never reduced: reduce-scatters are the trainable buckets' only;
- the same under HYBRID_SHARD, NO_SHARD and activation checkpointing;
- losses every micro-batch, the trainable gradients and parameters every step equal one
  process training the unwrapped model (fp32, rtol=1e-5, atol=1e-6);
- a base unfrozen between micro-batches is released there, then follows the strategy's rule,
  is reduced and trains;
- release points: an optimizer step (its post-hook) or, for an update made by hand, the next
  forward (the trainable shards were written); `reset_step`;
- unsharded memory balances: at the end of backward exactly the kept frozen units are held,
  nothing once they are released; auto is on for this model, and a bad value is a TypeError.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.distributed import comm
from fullshard.testing import DistributedGroup, local_rows

MICRO = 4  # micro-batches per optimizer step
STEPS = 3
ROWS = 2  # rows per rank per micro-batch
F32 = 4


class FrozenBase(nn.Linear):
    """The pretrained weight: a unit of its own, all frozen."""


class LoRABlock(nn.Module):
    def __init__(self, d: int, rank: int = 2) -> None:
        super().__init__()
        self.base = FrozenBase(d, d)
        self.lora_a = nn.Linear(d, rank, bias=False)
        self.lora_b = nn.Linear(rank, d, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class TinyLoRA(nn.Module):
    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(LoRABlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(x), y)


def _count_gathers(model: nn.Module) -> dict[str, list[int]]:
    """Observe each unit's gathers (a counter around each bucket's `_prepare_gather`, which
    every gather of it calls once): unit name -> [count]."""
    counts: dict[str, list[int]] = {}
    for unit in model.fullshard_runtime.units:
        counter = counts.setdefault(unit.name, [0])
        for bucket in unit.buckets:
            original = bucket._prepare_gather

            def counted(original=original, counter=counter):  # type: ignore[no-untyped-def]
                counter[0] += 1
                return original()

            bucket._prepare_gather = counted
    return counts


def _sgd_by_hand(model: nn.Module) -> None:
    """An update without a torch.optim optimizer (no step hook runs): plain SGD in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)
                p.grad = None


def _train(strategy: str, keep: bool | None, unfreeze_at: tuple[int, int] | None = None,
           by_hand: bool = False, **fsdp_kwargs: object) -> dict:
    """STEPS optimizer steps of MICRO micro-batches; `unfreeze_at` (step, micro-batch):
    make blocks.1.base trainable before that micro-batch (model and reference alike)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyLoRA()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy=strategy,
                           bucketing_strategy="BLOCK", auto_wrap_policy={FrozenBase, LoRABlock},
                           keep_frozen_gathered=keep, **fsdp_kwargs)
    runtime = model.fullshard_runtime
    counts = _count_gathers(model)
    # every parameter in the optimizers: SGD skips those without a gradient (frozen ones)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"steps": [], "reason": runtime.kept_frozen.reason,
                 "enabled": runtime.kept_frozen.enabled}
    for step in range(STEPS):
        fullshard.reset_comm_stats()
        for c in counts.values():
            c[0] = 0
        for micro in range(MICRO):
            if (step, micro) == unfreeze_at:
                for m in (model, ref):
                    m.blocks[1].base.requires_grad_(True)
            x = torch.randn(ROWS * world, 4, generator=gen)
            y = torch.randn(ROWS * world, 1, generator=gen)
            loss = model.loss(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])
            loss.backward()
            ref_loss = ref.loss(x, y)
            ref_loss.backward()
            global_loss = loss.detach().clone()
            comm.all_reduce(global_loss, runtime.mesh.world)
            torch.testing.assert_close(global_loss / world, ref_loss.detach(), rtol=1e-5,
                                       atol=1e-6)
        stats = fullshard.comm_stats()
        # (a shard axis of size 1 keeps no copy: the shards are the data, counted nowhere)
        copies = keep and runtime.mesh.shard.size > 1
        kept_bytes = runtime.kept_frozen.frozen_unsharded_bytes() if copies else 0
        memory = fullshard.memory_stats()
        # at the end of backward exactly the kept frozen units are held (by this rule)
        assert memory["unsharded_param_bytes"] == kept_bytes, (memory, kept_bytes)
        assert memory["unsharded_grad_bytes"] == 0, memory
        _compare(model, ref, "grad")
        if by_hand:
            _sgd_by_hand(model)
            _sgd_by_hand(ref)
        else:
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        _compare(model, ref, "param")
        # the optimizer's step released them (its post-hook); an update by hand leaves them
        # to the next forward, which sees the trainable shards written
        held = kept_bytes if by_hand else 0
        assert fullshard.memory_stats()["unsharded_param_bytes"] == held
        out["steps"].append({
            "gathers": {name: c[0] for name, c in counts.items()},
            "all_gather": (stats["all_gather"]["calls"], stats["all_gather"]["bytes"]),
            "reduce_scatter": (stats["reduce_scatter"]["calls"],
                               stats["reduce_scatter"]["bytes"]),
        })
    fullshard.reset_step(model)  # a plain loop frees the kept copies so (or zero_grad)
    out["after_release"] = fullshard.memory_stats()["unsharded_param_bytes"]
    out["units"] = {u.name: (u.unsharded_nbytes, bool(u.trainable_params))
                    for u in runtime.units}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
    return out


def _compare(model: nn.Module, ref: nn.Module, what: str) -> None:
    mesh = model.fullshard_runtime.mesh
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        theirs = ref_params[name].grad if what == "grad" else ref_params[name].detach()
        mine = p.grad if what == "grad" else p.detach()
        if theirs is None:
            assert mine is None, f"{what} of {name}"
            continue
        expected = local_rows(theirs, mesh.shard.size, mesh.shard.rank)
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6, msg=f"{what} {name}")


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


BASES = [f"blocks.{i}.base" for i in range(3)]
BLOCKS = [f"blocks.{i}" for i in range(3)]


def _per_micro(strategy: str) -> int:
    """Gathers per micro-batch of a non-root unit the strategy releases: ZeRO-3 gathers it
    in forward and again for backward, ZeRO-2 once."""
    return 2 if strategy == "FULL_SHARD" else 1


@pytest.mark.parametrize(("strategy", "by_hand"),
                         [("FULL_SHARD", False), ("SHARD_GRAD_OP", False), ("FULL_SHARD", True)])
def test_frozen_base_gathered_once_per_optimizer_step(group2, strategy, by_hand):
    on, off = (group2.run(_train, strategy, keep, None, by_hand)[0] for keep in (True, False))
    units = on["units"]
    assert on["enabled"] and not off["enabled"], (on["reason"], off["reason"])
    trainable = [n for n, (_, t) in units.items() if t]
    assert sorted(trainable) == sorted(["", *BLOCKS])
    trainable_bytes = sum(units[n][0] for n in trainable)
    frozen_bytes = sum(units[n][0] for n in BASES)
    per = _per_micro(strategy)
    for step_on, step_off in zip(on["steps"], off["steps"]):
        for name in BASES:
            assert step_on["gathers"][name] == 1, (name, step_on)
            assert step_off["gathers"][name] == per * MICRO, (name, step_off)
        for name in ["", *BLOCKS]:  # trainable units keep the strategy's schedule
            assert step_on["gathers"][name] == step_off["gathers"][name]
        # comm_stats agrees: the gathers, their bytes; reductions: trainable buckets only
        # (the root stays gathered into backward: once per micro-batch under either)
        trainable_gathered = MICRO * units[""][0] + per * MICRO * sum(units[n][0] for n in BLOCKS)
        assert step_on["all_gather"] == (MICRO + per * MICRO * len(BLOCKS) + len(BASES),
                                         trainable_gathered + frozen_bytes)
        assert step_off["all_gather"] == (MICRO + per * MICRO * (len(BLOCKS) + len(BASES)),
                                          trainable_gathered + per * MICRO * frozen_bytes)
        assert step_on["reduce_scatter"] == step_off["reduce_scatter"] == (
            MICRO * len(trainable), MICRO * trainable_bytes)
    for run in (on, off):
        assert run["after_release"] == 0


def test_unfrozen_base_is_released_and_trains(group2):
    """blocks.1.base made trainable before micro-batch 2 of step 1: its kept copy is dropped
    there (else that micro-batch would use it and gather once, not twice), then it follows
    ZeRO-3's schedule and is reduced; the other bases stay kept."""
    steps = group2.run(_train, "FULL_SHARD", True, (1, 2))[0]["steps"]
    assert [s["gathers"]["blocks.1.base"] for s in steps] == [1, 1 + 2 * 2, 2 * MICRO]
    for s in steps:
        assert s["gathers"]["blocks.0.base"] == s["gathers"]["blocks.2.base"] == 1
    trainable_units = 1 + len(BLOCKS)
    assert [s["reduce_scatter"][0] for s in steps] == [
        MICRO * trainable_units, 2 * trainable_units + 2 * (trainable_units + 1),
        MICRO * (trainable_units + 1)]


def test_kept_through_activation_checkpointing(group2):
    """Each LoRA block recomputed in backward (what fine-tuning scripts switch on): the base
    inside it is recomputed from its kept copy, still gathered once per optimizer step."""
    got = group2.run(_train, "FULL_SHARD", True,
                     activation_checkpointing_policy={LoRABlock})[0]
    for step in got["steps"]:
        assert [step["gathers"][name] for name in BASES] == [1] * len(BASES), step


@pytest.mark.parametrize(("strategy", "mesh"),
                         [("HYBRID_SHARD", (1, 2)), ("HYBRID_SHARD", (2, 1)), ("NO_SHARD", None)])
def test_kept_under_hybrid_and_no_shard(group2, strategy, mesh):
    """The same rule where gradients are also all-reduced over a replicate axis, and where
    the shard axis has size 1 (nothing to gather: the "gather" is the shards themselves)."""
    kwargs = {} if mesh is None else {"device_mesh": mesh}
    got = group2.run(_train, strategy, True, **kwargs)[0]
    for step in got["steps"]:
        assert [step["gathers"][name] for name in BASES] == [1] * len(BASES), step


def test_strategy_checks_the_keyword():
    lightning_strategy = pytest.importorskip("fullshard.api.lightning_strategy")
    strategy = lightning_strategy.FSDPStrategy(keep_frozen_gathered=False)
    assert strategy._engine_kwargs["keep_frozen_gathered"] is False
    with pytest.raises(TypeError, match=r"FSDPStrategy\(keep_frozen_gathered=...\).*int: 1"):
        lightning_strategy.FSDPStrategy(keep_frozen_gathered=1)


def _auto_and_errors() -> dict:
    model = fullshard.fsdp(TinyLoRA(), device="cpu", auto_wrap_policy={FrozenBase, LoRABlock})
    trainable = fullshard.fsdp(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    teacher = fullshard.fsdp(TinyLoRA().requires_grad_(False), device="cpu",
                             auto_wrap_policy={FrozenBase, LoRABlock})
    with pytest.raises(TypeError, match="keep_frozen_gathered"):
        fullshard.fsdp(TinyLoRA(), device="cpu", keep_frozen_gathered="yes")
    kept, plain = model.fullshard_runtime.kept_frozen, trainable.fullshard_runtime.kept_frozen
    teacher_kept = teacher.fullshard_runtime.kept_frozen
    return {"auto": (kept.enabled, kept.reason), "none": (plain.enabled, plain.reason),
            "teacher": (teacher_kept.enabled, teacher_kept.reason)}


def test_auto_decides_and_says_why(group2):
    got = group2.run(_auto_and_errors)
    for r in got:
        assert r["auto"][0] is True and r["auto"][1].startswith("on (auto)"), r
        assert "budget 1/4 of available host memory" in r["auto"][1], r
        assert r["none"] == (False, "off (auto): no unit has all its parameters frozen at wrap")
        assert r["teacher"] == (False, "off (auto): nothing is trainable at wrap (no optimizer "
                                       "step)")
