"""Precision strings through FSDPStrategy / Lightning's Fabric, on 2 real gloo ranks.

- for each of '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true': the dtypes of the
  shards, of the parameters gathered inside forward, of activations, buffers, gradients and
  outputs, and the init dtype of `module_init_context`;
- bytes all-gathered (and reduce-scattered) per step under 'bf16-mixed' are exactly half of
  '32-true' (`fullshard.comm_stats()`);
- a 'bf16-mixed' run tracks the fp32 single-process loss curve loosely and a single-process
  run with the same casts (and the same per-rank split) almost exactly;
- '16-mixed': an inf injected on one rank only makes *both* ranks skip the step and back off
  the scale, with and without clipping; a plain `loss.backward()` under the scaler is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fullshard
from fullshard import FSDPStrategy
from fullshard.api.precision import Precision
from fullshard.testing import DistributedGroup
from fullshard.testing.models import Block, OddMLP, TinyGPT

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


def _strategy(**kwargs) -> FSDPStrategy:
    s = FSDPStrategy(accelerator="cpu", **kwargs)
    s.setup_environment()
    return s


class Scaled(nn.Module):
    """A unit: Linear + a floating buffer added to its output."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + self.shift)


class Net(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(dim) for _ in range(2))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# -- no processes ---------------------------------------------------------------------------
def test_aliases_and_table() -> None:
    assert [Precision(a).precision for a in (None, 32, "32", 16, "16", "bf16")] == [
        "32-true", "32-true", "32-true", "16-mixed", "16-mixed", "bf16-mixed"
    ]
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported.*bf16-true"):
        Precision("64-true")
    for p, dtype, true in (("32-true", F32, True), ("16-mixed", F16, False),
                           ("bf16-mixed", BF16, False), ("16-true", F16, True),
                           ("bf16-true", BF16, True)):
        plugin = Precision(p)
        assert (plugin.dtype, plugin.is_true) == (dtype, true), p
        assert (plugin.scaler is not None) == (p == "16-mixed"), p
        mp = plugin.mixed_precision
        if p == "32-true":
            assert mp is None
        else:
            assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (dtype,) * 3
        with plugin.module_init_context():
            assert nn.Linear(2, 2).weight.dtype == (dtype if true else F32), p
        assert torch.get_default_dtype() == F32


def test_explicit_mixed_precision_wins_over_the_string() -> None:
    mp = fullshard.MixedPrecision(param_dtype=BF16, reduce_dtype=F32)
    s = FSDPStrategy(precision="16-mixed", mixed_precision=mp)
    assert s.mixed_precision_config is mp
    assert FSDPStrategy(precision="16-mixed").mixed_precision_config.param_dtype == F16


# -- dtypes per precision string --------------------------------------------------------------
def _dtypes(precision: str) -> dict:
    s = _strategy(precision=precision, auto_wrap_policy={Scaled})
    seen: dict[str, object] = {}

    def record(module: nn.Module, args, output) -> None:  # inside forward: gathered params
        seen.setdefault("gathered", module.weight.dtype)
        seen.setdefault("activation", output.dtype)

    with s.module_init_context(empty_init=False):
        torch.manual_seed(0)
        model = Net()
    seen["init"] = model.head.weight.dtype
    model = s.setup_module(model)
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(record)
    fullshard.reset_comm_stats()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x)
    loss = out.square().mean()
    s.backward(loss)
    stats = fullshard.comm_stats()
    seen.update(
        shards={p.dtype for p in model.parameters()},
        grads={p.grad.dtype for p in model.parameters()},
        buffers={b.dtype for b in model.buffers()},
        output=out.dtype,
        loss=loss.dtype,
        gathered_bytes=stats["all_gather"]["bytes"],
        reduced_bytes=stats["reduce_scatter"]["bytes"],
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    seen["stepped"] = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    seen["finite"] = all(torch.isfinite(p).all().item() for p in model.parameters())
    return seen


# precision -> (init dtype, shards and their grads, gathered/activations/buffers)
EXPECTED = {
    "32-true": (F32, F32, F32),
    "16-mixed": (F32, F32, F16),
    "bf16-mixed": (F32, F32, BF16),
    "16-true": (F16, F16, F16),
    "bf16-true": (BF16, BF16, BF16),
}


def test_dtypes_for_each_precision_string(group2: DistributedGroup) -> None:
    results = {p: group2.run(_dtypes, p) for p in PRECISIONS}
    for p, ranks in results.items():
        init, shard, compute = EXPECTED[p]
        for seen in ranks:
            assert seen["init"] == init, p
            assert seen["shards"] == {shard} and seen["grads"] == {shard}, (p, seen)
            assert seen["gathered"] == compute and seen["activation"] == compute, (p, seen)
            assert seen["buffers"] == {compute}, (p, seen)
            # Outputs come back in the default dtype, as Lightning's convert_output does.
            assert seen["output"] == F32 and seen["loss"] == F32, (p, seen)
            assert seen["stepped"] and seen["finite"], (p, seen)
    fp32 = results["32-true"][0]
    for p in ("16-mixed", "bf16-mixed", "16-true", "bf16-true"):
        assert results[p][0]["gathered_bytes"] * 2 == fp32["gathered_bytes"], p
        assert results[p][0]["reduced_bytes"] * 2 == fp32["reduced_bytes"], p


# -- bytes per step -----------------------------------------------------------------------------
def _bytes_per_step(precision: str) -> dict:
    s = _strategy(precision=precision, auto_wrap_policy={Block}, bucketing_strategy="BLOCK")
    torch.manual_seed(0)
    model = s.setup_module(TinyGPT(layers=2))
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out = []
    for step in range(2):
        x, y = model.make_batch(2, torch.Generator().manual_seed(step))
        fullshard.reset_comm_stats()
        s.backward(model.loss(x, y))
        opt.step()
        opt.zero_grad()
        out.append({k: (v["calls"], v["bytes"]) for k, v in fullshard.comm_stats().items()})
    return out[-1]


def test_bf16_gathers_exactly_half_the_bytes_of_fp32(group2: DistributedGroup) -> None:
    fp32 = group2.run(_bytes_per_step, "32-true")[0]
    bf16 = group2.run(_bytes_per_step, "bf16-mixed")[0]
    # ZeRO-3, 3 units (2 blocks + root), BLOCK buckets: 2 gathers and 1 reduction per unit,
    # the root gathered once (it stays gathered into backward).
    assert fp32["all_gather"][0] == bf16["all_gather"][0] == 5
    assert fp32["reduce_scatter"][0] == bf16["reduce_scatter"][0] == 3
    assert bf16["all_gather"][1] * 2 == fp32["all_gather"][1] > 0
    assert bf16["reduce_scatter"][1] * 2 == fp32["reduce_scatter"][1] > 0


# -- bf16-mixed loss curve --------------------------------------------------------------------
STEPS, BATCH, LR = 12, 4, 0.5


def _sgd_step(model: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def _bf16_curve() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    master = TinyGPT(layers=2)
    fp32_ref = copy.deepcopy(master)
    cast_ref = copy.deepcopy(master)  # fp32 master weights of the same-casts reference
    s = _strategy(precision="bf16-mixed", auto_wrap_policy={Block})
    model = s.setup_module(copy.deepcopy(master))
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    gen = torch.Generator().manual_seed(1)
    pool = [master.make_batch(BATCH * world, gen) for _ in range(2)]  # cycled: the loss falls
    losses: dict[str, list[float]] = {"fsdp": [], "fp32": [], "cast": []}
    for step in range(STEPS):
        x, y = pool[step % len(pool)]
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = model.loss(x[mine], y[mine])
        s.backward(loss)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        s.all_reduce(total, reduce_op="mean")
        losses["fsdp"].append(total.item())

        ref_loss = fp32_ref.loss(x, y)
        ref_loss.backward()
        _sgd_step(fp32_ref, LR)
        losses["fp32"].append(ref_loss.item())

        # One process, the same casts: bf16 weights from the fp32 master, each rank's rows
        # forward/backward under bf16 autocast with the output cast back to fp32 (what the
        # precision hooks do), gradients summed in bf16 in rank order and averaged, as the
        # bf16 reduce-scatter does, then handed to the fp32 master.
        grads, chunk_losses = None, []
        for r in range(world):
            low = copy.deepcopy(cast_ref).to(BF16)
            rows = slice(r * BATCH, (r + 1) * BATCH)
            with torch.autocast("cpu", dtype=BF16):
                logits = low(x[rows])
            chunk = F.cross_entropy(logits.float().flatten(0, 1), y[rows].flatten())
            chunk.backward()
            chunk_losses.append(chunk.item())
            g = [p.grad for p in low.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(cast_ref.parameters(), grads):
            p.grad = (g / world).float()
        _sgd_step(cast_ref, LR)
        losses["cast"].append(sum(chunk_losses) / world)
    return losses


def test_bf16_mixed_tracks_fp32_and_matches_the_same_casts(group2: DistributedGroup) -> None:
    losses = group2.run(_bf16_curve)[0]
    fsdp = torch.tensor(losses["fsdp"])
    vs_fp32 = (fsdp - torch.tensor(losses["fp32"])).abs().max().item()
    vs_cast = (fsdp - torch.tensor(losses["cast"])).abs().max().item()
    drop = losses["fp32"][0] - losses["fp32"][-2]  # the same batch, 10 steps later
    assert drop > 0.1, losses  # it trains
    # Against fp32: bf16 keeps 8 significant bits, a relative rounding of 2**-9 ~ 2e-3 per
    # op. The logits are O(1) and pass through ~10 rounded ops (2 blocks), so each step's loss
    # (~3.5) moves by ~1e-3 from round-off alone, and SGD compounds it from step to step. We
    # measured at most ~2e-3 over 12 steps; 1e-2 (0.3% of the loss) leaves room for other
    # CPU kernels while staying far below the run's loss drop (> 0.2): a run that does not
    # train in bf16, or trains in fp32, still fails the pair of checks below.
    assert vs_fp32 < 1e-2, (vs_fp32, losses)
    # Same casts, same per-rank split, same bf16 reduction: the per-step losses agree to fp32
    # round-off of averaging the two ranks' losses (measured ~2e-7).
    assert vs_cast < 1e-5, (vs_cast, losses)
    assert vs_cast * 100 < vs_fp32


# -- 16-mixed: a global inf check ----------------------------------------------------------------
def _scaler_skips() -> dict:
    rank = dist.get_rank()
    s = _strategy(precision="16-mixed")
    torch.manual_seed(0)
    model = s.setup_module(OddMLP())
    opt = s.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = s.precision_plugin.scaler
    out: dict[str, list] = {"stepped": [], "scale": [], "local_finite": [], "all_reduces": []}
    for step, (inject_on, clip) in enumerate(((None, False), (0, False), (None, True), (1, True))):
        x, y = model.make_batch(4, torch.Generator().manual_seed(10 * step + rank))
        fullshard.reset_comm_stats()
        s.backward(model.loss(x, y))
        if inject_on == rank:  # an overflow in this rank's shard only
            next(p for p in model.parameters() if p.numel()).grad.view(-1)[0] = float("inf")
        out["local_finite"].append(all(torch.isfinite(p.grad).all().item()
                                       for p in model.parameters()))
        if clip:  # unscales first; an overflow step is not an error, it is skipped
            s.clip_gradients_norm(model, opt, max_norm=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        after = list(model.parameters())
        out["stepped"].append(any(not torch.equal(a, p) for a, p in zip(before, after)))
        out["scale"].append(scaler.get_scale())
        out["all_reduces"].append(fullshard.comm_stats()["all_reduce"]["calls"])
    # A plain loss.backward() under the scaler is refused before anything is unscaled.
    model.loss(*model.make_batch(4, torch.Generator().manual_seed(99))).backward()
    try:
        opt.step()
    except RuntimeError as e:
        out["plain_backward"] = str(e)
    try:
        s.clip_gradients_norm(model, None, 1.0)
    except ValueError as e:
        out["clip_without_optimizer"] = str(e)
    return out


def test_16_mixed_skips_an_inf_step_on_every_rank(group2: DistributedGroup) -> None:
    r0, r1 = group2.run(_scaler_skips)
    assert r0["local_finite"] == [True, False, True, True]
    assert r1["local_finite"] == [True, True, True, False]
    for r in (r0, r1):
        assert r["stepped"] == [True, False, True, False]
        assert r["scale"] == [2.0**16, 2.0**15, 2.0**15, 2.0**14]
        # One found-inf all-reduce per step; clipping adds its own norm reduction.
        assert r["all_reduces"] == [1, 1, 2, 2]
        assert "Call `fabric.backward(loss)` instead" in r["plain_backward"]
        assert "Pass the optimizer" in r["clip_without_optimizer"]


# -- through Lightning's Fabric -----------------------------------------------------------------
def _fabric_true(precision: str) -> dict:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2, precision=precision,
                      strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyGPT(layers=2)
    init = (model.head.weight.dtype, model.head.weight.is_meta)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = model.make_batch(2, torch.Generator().manual_seed(fabric.global_rank))
    logits = model(x)
    with fabric.autocast():
        inside = torch.ones(1).dtype
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    fabric.backward(loss)
    fabric.clip_gradients(model, opt, max_norm=1.0)  # under 16-mixed: may be an overflow step
    opt.step()
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return {"init": init, "shards": {p.dtype for p in model.parameters()},
            "logits": logits.dtype, "finite": finite, "inside": inside,
            "precision": fabric.strategy.precision.precision}


@pytest.mark.parametrize("precision,dtype", [("bf16-true", BF16), ("16-mixed", F32)])
def test_fabric_init_module_and_training_step(group2: DistributedGroup, precision, dtype) -> None:
    pytest.importorskip("lightning")
    for r in group2.run(_fabric_true, precision):
        assert r["precision"] == precision
        assert r["init"] == (dtype, True)
        assert r["shards"] == {dtype} and r["logits"] == F32 and r["finite"]
        assert r["inside"] == (BF16 if precision == "bf16-true" else F32)
