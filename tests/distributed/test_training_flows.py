"""What real training loops do between and around steps, on real gloo ranks.

docs/architecture.md, invariant 7.

Each flow runs the wrapped model beside the unwrapped reference in every rank and compares
losses, every local shard of every gradient (None where the reference has None) and, after
SGD steps, every parameter (fullshard.testing.parity.compare, fp32 rtol=1e-5, atol=1e-6):

- a backward that raised, then the next good step (issue 13 item 1);
- `requires_grad` changed after wrapping: freeze then unfreeze (item 2);
- a `no_sync` window abandoned by `zero_grad` (optimizer's or model's, set_to_none either
  way) (item 3);
- a parameter no rank used (`.grad` None), one used on some ranks only (item 4);
- `torch.autograd.grad(loss, model.parameters())` (item 5);
- writes to the shards while units are gathered: `load_state_dict`, an in-place edit (item 6);
- an exception mid-forward; ZeRO-3 frozen units released after their backward (item 9);
- a unit called twice per forward under ZeRO-3: reduced once (item 10);
- `fullshard.reset_step(model)` after exceptions the user caught mid-step (issue 37).

One rank group per world size for the whole module (2 ranks; 3 where uneven rows matter).
Functions run on the ranks are at module top level so they pickle by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fullshard
from fullshard.distributed import comm
from fullshard.testing import DistributedGroup, check_parity, local_rows
from fullshard.testing.parity import compare

F32 = 4


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


@pytest.fixture(scope="module")
def group3():
    with DistributedGroup(3) as g:
        yield g


# -- models -----------------------------------------------------------------------------------
class Boom(RuntimeError):
    """The failure a flow injects (a bad batch, an OOM)."""


def _boom(grad: torch.Tensor) -> torch.Tensor:
    raise Boom("injected failure in backward")


class Sub(nn.Module):
    """A unit: Linear + tanh; raises in forward while `fail` is set."""

    def __init__(self, dim: int = 6, depth: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise Boom("injected failure in forward")
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Net(nn.Module):
    """Root (`inp`, `head`; with `unused`, also `extra`, used only on rows marked so, and
    `spare`, never used) around a stack of `Sub` units. Uneven first dims (7, 5) pad
    differently on 2 and 3 ranks."""

    in_dim = 7

    def __init__(self, blocks: int = 3, dim: int = 5, depth: int = 1, unused: bool = False):
        super().__init__()
        self.in_dim = dim + 2
        self.inp = nn.Linear(self.in_dim, dim)
        self.blocks = nn.ModuleList(Sub(dim, depth) for _ in range(blocks))
        self.extra = nn.Linear(dim, dim) if unused else None
        self.spare = nn.Linear(dim, 3) if unused else None
        self.head = nn.Linear(dim, 1)
        self.fail_backward = False
        self.twice = False
        self.skip_last = False

    def make_batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.in_dim, generator=generator)
        x[:, 0] = x[:, 0].clamp(-1.0, 1.0)  # `extra` stays unused unless a flow marks a row
        return x, x.sum(dim=1, keepdim=True).sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.extra is not None and x[0, 0] > 1.0:  # data dependent: some ranks' rows only
            h = h + self.extra(h)
        for i, block in enumerate(self.blocks):
            if self.skip_last and i == len(self.blocks) - 1:
                continue  # e.g. an early exit, the same on every rank
            h = block(h)
            if self.twice and i == 0:
                h = block(h)
            if i == 0 and self.fail_backward and h.requires_grad:
                h.register_hook(_boom)  # runs after the later units' backward
        return self.head(h)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(inputs), targets)


def _net() -> Net:
    return Net()


def _unused_net() -> Net:
    return Net(unused=True)


def _twice_net() -> Net:
    model = Net(blocks=2)
    model.twice = True
    return model


def _deep_net() -> Net:
    """Four bigger units, for the ZeRO-3 memory check."""
    return Net(blocks=4, dim=16, depth=2)


# -- helpers run on the ranks -----------------------------------------------------------------
def _wrap(make, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    ref = make()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", **kwargs)
    return ref, model


def _sgd(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    # weight decay and momentum move a parameter with a zero gradient, not one with None
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)


def _rows(x: torch.Tensor, b: int) -> torch.Tensor:
    r = dist.get_rank()
    return x[r * b : (r + 1) * b]


def _batch(ref: Net, gen: torch.Generator, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.make_batch(b * dist.get_world_size(), gen)


def _global_loss(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _step(model, ref, x, y, step: int, b: int = 2, per_rank: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Forward + backward on both models; compare loss and gradients."""
    loss = model.loss(_rows(x, b), _rows(y, b))
    loss.backward()
    if per_rank:  # per-rank control flow: the reference averages per-rank losses, like DDP
        chunks = zip(x.split(b), y.split(b))
        ref_loss = torch.stack([ref.loss(xi, yi) for xi, yi in chunks]).mean()
    else:
        ref_loss = ref.loss(x, y)
    ref_loss.backward()
    got = _global_loss(loss)
    assert torch.allclose(got, ref_loss.detach(), rtol=1e-5, atol=1e-6), (
        f"step {step}: loss {got.item()} != reference {ref_loss.item()}"
    )
    compare("grad", step, model, ref)


def _opt_step(model, ref, opt, ref_opt, step: int) -> None:  # type: ignore[no-untyped-def]
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    compare("param", step, model, ref)


def _unsharded_now() -> tuple[int, int]:
    m = fullshard.memory_stats()
    return m["unsharded_param_bytes"], m["unsharded_grad_bytes"]


# == item 1: a backward that raised ============================================================
def _failed_backward(strategy: str, bucketing: str, recover: str) -> None:
    ref, model = _wrap(
        _net, sharding_strategy=strategy, bucketing_strategy=bucketing, auto_wrap_policy={Sub}
    )
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = _batch(ref, gen)
        if step == 1:  # every rank (and the reference) hits the same bad batch
            for m, xs, ys in ((model, _rows(x, 2), _rows(y, 2)), (ref, x, y)):
                m.fail_backward = True
                with pytest.raises(Boom):
                    m.loss(xs, ys).backward()
                m.fail_backward = False
            ref_opt.zero_grad()
            if recover == "optimizer.zero_grad":
                opt.zero_grad()
            elif recover == "model.zero_grad":
                model.zero_grad()
                assert _unsharded_now() == (0, 0), "zero_grad left units gathered"
            else:  # "retry": no zero_grad; the same batch again (its partial .grad dropped)
                for p in ref.parameters():
                    p.grad = None
                for p in model.parameters():
                    p.grad = None
        _step(model, ref, x, y, step)
        assert _unsharded_now() == (0, 0), f"step {step}: unsharded memory left after backward"
        _opt_step(model, ref, opt, ref_opt, step)


@pytest.mark.parametrize(
    ("strategy", "bucketing", "recover"),
    [
        ("ZERO3", "BLOCK", "optimizer.zero_grad"),
        ("ZERO2", "NONE", "model.zero_grad"),
        ("ZERO3", "LAYER", "retry"),
    ],
)
def test_failed_backward_leaves_no_trace(group2, strategy, bucketing, recover):
    group2.run(_failed_backward, strategy, bucketing, recover)


def test_failed_backward_leaves_no_trace_three_ranks(group3):
    group3.run(_failed_backward, "ZERO3", "BLOCK", "optimizer.zero_grad")


# == item 2: requires_grad followed at every step ==============================================
def _freeze_then_unfreeze(step: int, model: nn.Module, ref: nn.Module) -> None:
    """Steps 0-1: `inp` and the first block frozen (the backbone), 2-3: all trainable, 4: only
    block 1's weight frozen (a bucket half frozen)."""
    for m in (model, ref):
        for name, p in m.named_parameters():
            frozen = (step < 2 and name.startswith(("inp.", "blocks.0."))) or (
                step == 4 and name == "blocks.1.layers.0.weight"
            )
            p.requires_grad_(not frozen)


def _frozen_at_wrap() -> Net:
    model = Net()
    for p in (*model.inp.parameters(), *model.blocks[0].parameters()):
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("strategy", "bucketing", "make"),
    [("ZERO3", "BLOCK", _net), ("ZERO2", "LAYER", _frozen_at_wrap), ("NO_SHARD", "NONE", _net)],
)
def test_requires_grad_is_followed_every_step(group2, strategy, bucketing, make):
    group2.run(
        check_parity,
        make,
        steps=5,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Sub},
        on_step=_freeze_then_unfreeze,
    )


def test_requires_grad_is_followed_three_ranks(group3):
    group3.run(
        check_parity,
        _frozen_at_wrap,
        steps=5,
        sharding_strategy="ZERO3",
        bucketing_strategy="BLOCK",
        auto_wrap_policy={Sub},
        on_step=_freeze_then_unfreeze,
    )


# == item 3: an abandoned no_sync window =======================================================
def _abandoned_no_sync(strategy: str, bucketing: str, how: str) -> None:
    ref, model = _wrap(
        _net, sharding_strategy=strategy, bucketing_strategy=bucketing, auto_wrap_policy={Sub}
    )
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        if step == 1:  # two micro-batches, then the window is skipped (a NaN loss, say)
            with model.no_sync():
                for _ in range(2):
                    x, y = _batch(ref, gen)
                    model.loss(_rows(x, 2), _rows(y, 2)).backward()
                    ref.loss(x, y).backward()
            set_to_none = how != "optimizer.zero_grad(set_to_none=False)"
            ref_opt.zero_grad(set_to_none=set_to_none)
            if how == "model.zero_grad":
                model.zero_grad()
                assert _unsharded_now() == (0, 0), "zero_grad left the window's units gathered"
            else:
                opt.zero_grad(set_to_none=set_to_none)
        # a full window: one no_sync micro-batch, then the synced one
        x, y = _batch(ref, gen)
        with model.no_sync():
            model.loss(_rows(x, 2), _rows(y, 2)).backward()
        ref.loss(x, y).backward()
        x, y = _batch(ref, gen)
        _step(model, ref, x, y, step)
        assert _unsharded_now() == (0, 0), f"step {step}: unsharded memory left"
        _opt_step(model, ref, opt, ref_opt, step)


@pytest.mark.parametrize(
    ("strategy", "bucketing", "how"),
    [
        ("ZERO3", "BLOCK", "optimizer.zero_grad"),
        ("ZERO2", "NONE", "optimizer.zero_grad(set_to_none=False)"),
        ("ZERO3", "LAYER", "model.zero_grad"),
    ],
)
def test_zero_grad_drops_an_abandoned_no_sync_window(group2, strategy, bucketing, how):
    group2.run(_abandoned_no_sync, strategy, bucketing, how)


# == item 4: unused parameters =================================================================
def _unused(strategy: str, bucketing: str) -> dict:
    ref, model = _wrap(
        _unused_net,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Sub},
    )
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(3)
    out = {}
    for step in range(3):
        x, y = _batch(ref, gen)
        if step == 1:
            x[0, 0] = 2.0  # rank 0's rows use `extra`; the other ranks' do not
        _step(model, ref, x, y, step, per_rank=True)
        out[step] = {n: p.grad is not None for n, p in model.named_parameters()}
        _opt_step(model, ref, opt, ref_opt, step)
    return out


@pytest.mark.parametrize(("strategy", "bucketing"), [("ZERO3", "BLOCK"), ("ZERO2", "NONE")])
def test_a_parameter_no_rank_used_has_no_grad(group2, strategy, bucketing):
    has_grad = group2.run(_unused, strategy, bucketing)
    for step in range(3):
        assert has_grad[0][step] == has_grad[1][step], "ranks disagree on which grads are None"
    assert not has_grad[0][0]["spare.weight"] and not has_grad[0][0]["extra.weight"]
    assert has_grad[0][1]["extra.weight"]  # used on rank 0 only: every rank's shard gets one
    assert has_grad[0][1]["head.weight"]


@pytest.mark.parametrize(("strategy", "bucketing"), [("ZERO3", "LAYER"), ("NO_SHARD", "BLOCK")])
def test_unused_params_three_ranks(group3, strategy, bucketing):
    has_grad = group3.run(_unused, strategy, bucketing)
    for step in range(3):
        assert has_grad[0][step] == has_grad[1][step] == has_grad[2][step]
    assert not has_grad[2][0]["spare.weight"] and not has_grad[2][0]["extra.weight"]
    assert has_grad[2][1]["extra.bias"] and not has_grad[2][1]["spare.bias"]


# == item 5: torch.autograd.grad ===============================================================
def _autograd_grad(strategy: str, bucketing: str) -> None:
    ref, model = _wrap(
        _net, sharding_strategy=strategy, bucketing_strategy=bucketing, auto_wrap_policy={Sub}
    )
    mesh = model.fullshard_runtime.mesh
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        x, y = _batch(ref, gen)
        params = list(model.parameters())
        grads = torch.autograd.grad(model.loss(_rows(x, 2), _rows(y, 2)), params, allow_unused=True)
        ref_grads = torch.autograd.grad(ref.loss(x, y), list(ref.parameters()), allow_unused=True)
        for (name, p), g, rg in zip(model.named_parameters(), grads, ref_grads):
            assert p.grad is None, f"autograd.grad wrote {name}.grad"
            if rg is None:
                assert g is None, f"{name}: a gradient where the reference has None"
                continue
            assert g is not None, f"{name}: None from autograd.grad"
            expected = local_rows(rg, mesh.shard.size, mesh.shard.rank)
            assert torch.allclose(g, expected, rtol=1e-5, atol=1e-6), name
        assert _unsharded_now() == (0, 0)
    # and a normal step afterwards is untouched by it
    x, y = _batch(ref, gen)
    _step(model, ref, x, y, 2)


@pytest.mark.parametrize(("strategy", "bucketing"), [("ZERO3", "BLOCK"), ("ZERO2", "NONE")])
def test_autograd_grad_returns_reduced_local_shards(group2, strategy, bucketing):
    group2.run(_autograd_grad, strategy, bucketing)


# == item 6: writes to the shards invalidate gathered copies ===================================
def _writes_invalidate(strategy: str) -> None:
    ref, model = _wrap(_net, sharding_strategy=strategy, auto_wrap_policy={Sub})
    gen = torch.Generator().manual_seed(5)
    # (a) a forward with grad and no backward keeps ZeRO-2 units gathered; then a load
    x, y = _batch(ref, gen)
    model.loss(_rows(x, 2), _rows(y, 2))
    with torch.no_grad():
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        ref.load_state_dict({k: v * 0.5 for k, v in ref.state_dict().items()})
    assert _unsharded_now()[0] == 0, "load_state_dict left units gathered"
    x, y = _batch(ref, gen)
    _step(model, ref, x, y, 0)
    for m in (model, ref):
        m.zero_grad()
    # (b) an in-place edit under no_grad inside a no_sync window (units kept gathered)
    x, y = _batch(ref, gen)
    with model.no_sync():
        model.loss(_rows(x, 2), _rows(y, 2)).backward()
    ref.loss(x, y).backward()
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            p.mul_(0.9)
    x, y = _batch(ref, gen)
    _step(model, ref, x, y, 1)
    # (c) the same after fullshard.load_full_state_dict
    x, y = _batch(ref, gen)
    with model.no_sync():
        model.loss(_rows(x, 2), _rows(y, 2)).backward()
    full = {k: v * 1.5 for k, v in ref.state_dict().items()}
    fullshard.load_full_state_dict(model, full)
    ref.load_state_dict(full)
    for m in (model, ref):
        m.zero_grad()
    x, y = _batch(ref, gen)
    _step(model, ref, x, y, 2)


@pytest.mark.parametrize("strategy", ["ZERO2", "ZERO3"])
def test_writes_to_the_shards_invalidate_gathered_copies(group2, strategy):
    group2.run(_writes_invalidate, strategy)


# == item 9: exceptions mid-forward; frozen units under ZeRO-3 =================================
def _failed_forward(strategy: str) -> None:
    ref, model = _wrap(_net, sharding_strategy=strategy, auto_wrap_policy={Sub}, prefetch_limit=2)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        x, y = _batch(ref, gen)
        if step == 1:  # block 1 raises: block 0 ran, blocks 1 and 2 were prefetched
            model.blocks[1].fail = True
            with pytest.raises(Boom):
                model.loss(_rows(x, 2), _rows(y, 2))
            model.blocks[1].fail = False
            assert _unsharded_now() == (0, 0), "a failed forward left units gathered"
        _step(model, ref, x, y, step)
        _opt_step(model, ref, opt, ref_opt, step)


def _unused_prefetch() -> None:
    ref, model = _wrap(_net, sharding_strategy="ZERO3", auto_wrap_policy={Sub}, prefetch_limit=2)
    gen = torch.Generator().manual_seed(9)
    x, y = _batch(ref, gen)
    _step(model, ref, x, y, 0)  # records the order: root, blocks 0, 1, 2
    model.skip_last = ref.skip_last = True
    with torch.no_grad():  # evaluation: blocks.2 is prefetched but never runs
        model.loss(_rows(x, 2), _rows(y, 2))
    assert _unsharded_now() == (0, 0), "an unused prefetch stayed gathered"
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            p.mul_(0.5)
    model.skip_last = ref.skip_last = False
    for m in (model, ref):
        m.zero_grad()
    _step(model, ref, x, y, 1)


def test_unused_prefetch_is_released_and_never_stale(group2):
    group2.run(_unused_prefetch)


@pytest.mark.parametrize("strategy", ["ZERO2", "ZERO3"])
def test_failed_forward_releases_units_and_prefetches(group2, strategy):
    group2.run(_failed_forward, strategy)


def _freeze_middle(step: int, model: nn.Module, ref: nn.Module) -> None:
    """Blocks 1-3 frozen, `inp` and block 0 below them trainable: gradients flow through
    the frozen blocks, which ZeRO-3 re-gathers in backward."""
    for m in (model, ref):
        for name, p in m.named_parameters():
            p.requires_grad_(not name.startswith(("blocks.1.", "blocks.2.", "blocks.3.")))


def _frozen_backward_peak() -> dict:
    # One exchange per unit: batching small units' gathers (comm.COALESCE_BYTES) holds the
    # units of a batch together by design, which is not what this test is about.
    coalesce, comm.COALESCE_BYTES = comm.COALESCE_BYTES, 0
    try:
        return _frozen_backward_peaks()
    finally:
        comm.COALESCE_BYTES = coalesce


def _frozen_backward_peaks() -> dict:
    ref, model = _wrap(
        _deep_net,
        sharding_strategy="ZERO3",
        bucketing_strategy="BLOCK",
        auto_wrap_policy={Sub},
        prefetch_limit=1,
    )
    _freeze_middle(0, model, ref)
    gen = torch.Generator().manual_seed(7)
    peaks = []
    for _ in range(3):
        x, y = _batch(ref, gen)
        loss = model.loss(_rows(x, 2), _rows(y, 2))
        fullshard.reset_memory_stats()
        loss.backward()
        peaks.append(fullshard.memory_stats()["peak_unsharded_param_bytes"])
        model.zero_grad()
    units = model.fullshard_runtime.units
    sizes = {u.name: sum(b.numel * b.mesh.shard.size for b in u.buckets) * F32 for u in units}
    return {"peaks": peaks, "sizes": sizes}


def test_zero3_frozen_units_released_after_their_backward(group2):
    group2.run(
        check_parity,
        _deep_net,
        steps=3,
        sharding_strategy="ZERO3",
        bucketing_strategy="BLOCK",
        auto_wrap_policy={Sub},
        on_step=_freeze_middle,
    )
    info = group2.run(_frozen_backward_peak)[0]
    sizes = info["sizes"]
    block = sizes["blocks.1"]
    # In backward: the root (head) or one block, plus one prefetched unit -- never all three
    # frozen blocks at once (which is what holding them until the end of backward costs).
    bound = sizes[""] + 2 * block
    assert max(info["peaks"][1:]) <= bound, (info["peaks"], sizes)


# == item 10: a unit called twice in one forward ===============================================
def _twice_counts(strategy: str) -> dict:
    ref, model = _wrap(
        _twice_net, sharding_strategy=strategy, bucketing_strategy="BLOCK", auto_wrap_policy={Sub}
    )
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(8)
    calls = []
    for step in range(3):
        x, y = _batch(ref, gen)
        fullshard.reset_comm_stats()
        _step(model, ref, x, y, step)
        calls.append({k: v["calls"] for k, v in fullshard.comm_stats().items()})
        _opt_step(model, ref, opt, ref_opt, step)
    return {"calls": calls, "units": len(model.fullshard_runtime.units)}


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_unit_called_twice_is_reduced_once(group2, strategy):
    info = group2.run(_twice_counts, strategy)[0]
    assert info["units"] == 3  # root, blocks.0 (called twice), blocks.1
    for calls in info["calls"][1:]:
        # every unit: one reduce-scatter per step, however often it ran
        assert calls["reduce_scatter"] == 3
        if strategy == "ZERO3":
            # blocks.1: forward + backward; blocks.0: 2 forwards + 1 backward; the root
            # once (it stays gathered into backward)
            assert calls["all_gather"] == 1 + 2 + 3
        else:
            assert calls["all_gather"] == 3


# == issue 37: fullshard.reset_step after an exception the user caught ========================
def _raise_after_forward(model: Net, x: torch.Tensor, y: torch.Tensor) -> None:
    """The forward completes (ZeRO-3 keeps the root and the first units backward needs
    gathered), then the loop's own code raises before backward: nothing will release them."""
    out = model(x)
    assert _unsharded_now()[0] > 0 or model.fullshard_runtime.plan.name == "ZERO2"
    raise Boom(f"injected failure after forward ({out.shape})")


def _fail(step: int, model: Net, xs: torch.Tensor, ys: torch.Tensor) -> None:
    if step == 1:  # after the forward, before backward
        _raise_after_forward(model, xs, ys)
    elif step == 2:  # mid-forward: block 1 raises, blocks 1 and 2 prefetched
        model.blocks[1].fail = True
        try:
            model.loss(xs, ys)
        finally:
            model.blocks[1].fail = False
    else:  # mid-backward: some reductions done, others in flight
        model.fail_backward = True
        try:
            model.loss(xs, ys).backward()
        finally:
            model.fail_backward = False


def _reset_step_flow(strategy: str) -> None:
    ref, model = _wrap(_net, sharding_strategy=strategy, auto_wrap_policy={Sub}, prefetch_limit=2)
    runtime = model.fullshard_runtime
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    gen = torch.Generator().manual_seed(11)
    for step in range(5):
        x, y = _batch(ref, gen)
        xs, ys = _rows(x, 2), _rows(y, 2)
        if step in (1, 2, 3):
            with pytest.raises(Boom):
                _fail(step, model, xs, ys)
        fullshard.reset_step(model)  # also harmless between good steps (0, 4)
        assert runtime.state.value == "idle", (step, runtime.state)
        assert all(u.state.value == "sharded" for u in runtime.units), (step, runtime.units)
        assert _unsharded_now() == (0, 0), f"step {step}: reset_step left units gathered"
        opt.zero_grad()  # a failed backward may have written some `.grad`s already
        _step(model, ref, x, y, step)
        _opt_step(model, ref, opt, ref_opt, step)


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_reset_step_after_a_caught_exception(group2, strategy):
    group2.run(_reset_step_flow, strategy)
