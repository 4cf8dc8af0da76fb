"""Engine behaviour on real gloo ranks, beyond plain numerical parity (see test_parity.py).

What is checked here, each with its own numbers:

- collectives per step, by kind, count and bytes, against the analytic algorithm (§2.4):
  ZeRO-3 = 2 all-gathers + 1 reduce-scatter per bucket of every unit but the root, which stays
  gathered into backward (1 + 1; `reshard_after_forward=True` releases it too: 2 + 1),
  ZeRO-2 = 1 + 1, NO_SHARD = 1 all-reduce; BLOCK < LAYER < NONE;
- unsharded memory (§2.5): nothing between steps, ZeRO-3 holds about one unit (plus prefetch),
  ZeRO-2 everything; each rank stores ceil(d0/N) rows per parameter;
- frozen, unused, twice-called and tied parameters; buffers; `no_sync` accumulation;
  `broadcast_from`; full state dicts; a world of one rank.

Two rank groups are started for the whole module (2 ranks, 1 rank); every function run on the
ranks is at module top level so it pickles by name. Tensor comparisons happen on the ranks (an
AssertionError there comes back as a RankFailure with the remote traceback); counts and sizes
come back to the test to be asserted with readable diffs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fullshard
from fullshard.distributed import comm
from fullshard.testing import DistributedGroup, check_parity, local_rows
from fullshard.testing.models import Block, ConvBNNet, TinyGPT

STRATEGIES = ("ZERO3", "ZERO2", "NO_SHARD")
BUCKETINGS = ("NONE", "LAYER", "BLOCK")
F32 = 4  # bytes per element


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


@pytest.fixture(scope="module")
def group1():
    with DistributedGroup(1) as g:
        yield g


# -- models -----------------------------------------------------------------------------------
class Sub(nn.Module):
    """A small unit: one Linear + tanh."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Regression(nn.Module):
    """`make_batch` / `loss` as in fullshard.testing.models, for (batch, in_dim) inputs."""

    in_dim = 6

    def make_batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.in_dim, generator=generator)
        return x, x.sum(dim=1, keepdim=True).sin()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(inputs), targets)


class BigBlock(nn.Module):
    """A unit much larger than the root: a stack of square Linears."""

    def __init__(self, dim: int, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class StackNet(_Regression):
    """Four equal big blocks; the root owns only a LayerNorm and a (dim -> 1) head."""

    def __init__(self, dim: int = 48, blocks: int = 4) -> None:
        super().__init__()
        self.in_dim = dim
        self.blocks = nn.ModuleList(BigBlock(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class OddNet(_Regression):
    """First dims 7, 13, 5, 1 and a 0-dim parameter: uneven rows and padding on 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.sub = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
        self.out = nn.Linear(5, 1)
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.sub(torch.tanh(self.a(x))))) * self.scale


class BranchyNet(_Regression):
    """Unused parameters three ways: a Linear of the root never called, a unit never called,
    and a unit that runs but whose output does not reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.used = Sub()
        self.never_called = Sub()
        self.dead_end = Sub()
        self.unused_linear = nn.Linear(6, 4)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.used(x)
        self.dead_end(h)  # runs, result discarded
        return self.head(h)


class TwiceNet(_Regression):
    """The same unit applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.block = Sub()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.inp(x))))


class TiedAcrossUnits(_Regression):
    """Two units (`a`, `b`) share a weight: `b.fc.weight is a.fc.weight` (biases separate).
    With `share_module`, they share the whole `fc` Linear module instead."""

    def __init__(self, share_module: bool = False) -> None:
        super().__init__()
        self.a = Sub()
        self.b = Sub()
        if share_module:
            self.b.fc = self.a.fc
        else:
            self.b.fc.weight = self.a.fc.weight
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _tiny_gpt4() -> TinyGPT:
    return TinyGPT(layers=4)


def _tiny_gpt2() -> TinyGPT:
    return TinyGPT(layers=2)


def _frozen_gpt() -> TinyGPT:
    """Block 0 frozen entirely, block 1's first LayerNorm frozen, the position embedding too."""
    model = TinyGPT(layers=2)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    for p in model.blocks[1].ln1.parameters():
        p.requires_grad_(False)
    model.pos.weight.requires_grad_(False)
    return model


def _shared_module_net() -> TiedAcrossUnits:
    return TiedAcrossUnits(share_module=True)


# -- helpers run on the ranks -----------------------------------------------------------------
def _calls() -> dict[str, int]:
    return {k: v["calls"] for k, v in fullshard.comm_stats().items()}


def _buckets(model: nn.Module) -> list[dict]:
    """Every bucket with its unit, parameter names and analytic padded size."""
    out = []
    runtime = model.fullshard_runtime
    for unit in runtime.units:
        for b in unit.buckets:
            out.append(
                {
                    "unit": unit.name,
                    "root": unit is runtime.root,
                    "params": [p.fqn for p in b.params],
                    "padded_numel": sum(p.layout.padded_numel for p in b.params),
                    "numel": sum(p.layout.numel for p in b.params),
                    "requires_grad": b.requires_grad,
                }
            )
    return out


def _wrap(make, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    ref = make()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", **kwargs)
    return ref, model


def _local(x: torch.Tensor, b: int) -> torch.Tensor:
    r = dist.get_rank()
    return x[r * b : (r + 1) * b]


def _one_step(model, x, y, b):  # type: ignore[no-untyped-def]
    """Forward + backward on this rank's rows; returns calls, bytes and memory of the step."""
    fullshard.reset_comm_stats()
    fullshard.reset_memory_stats()
    model.loss(_local(x, b), _local(y, b)).backward()
    return {
        "stats": fullshard.comm_stats(),
        "memory": fullshard.memory_stats(),
    }


def _assert_close_to_ref(model: nn.Module, ref: nn.Module, what: str = "grad") -> None:
    mesh = model.fullshard_runtime.mesh
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        theirs = ref_params[name].grad if what == "grad" else ref_params[name].detach()
        mine = p.grad if what == "grad" else p.detach()
        assert theirs is not None and mine is not None, f"{what} of {name}: {mine} vs {theirs}"
        expected = local_rows(theirs, mesh.shard.size, mesh.shard.rank)
        assert mine.shape == expected.shape, name
        assert torch.allclose(mine, expected, rtol=1e-5, atol=1e-6), (
            f"{what} of {name} differs by {(mine - expected).abs().max().item():.3e}"
        )


# == 1. collectives per step =================================================================
def _gathers(strategy: str, bucket: dict, reshard: bool | None = None) -> int:
    """All-gathers per step of one bucket: ZeRO-3 gathers it in forward and again for
    backward, except the root's (kept gathered into backward) unless reshard=True."""
    if strategy != "ZERO3" or reshard is False:
        return 1
    return 1 if bucket["root"] and reshard is None else 2


def _count_step(strategy: str, bucketing: str, reshard: bool | None = None) -> dict:
    ref, model = _wrap(
        _tiny_gpt4,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Block},
        reshard_after_forward=reshard,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):  # step 0 records the order; later steps prefetch by it
        x, y = ref.make_batch(2 * dist.get_world_size(), gen)
        steps.append(_one_step(model, x, y, 2))
        ref.loss(x, y).backward()
        _assert_close_to_ref(model, ref)  # whichever units stay gathered
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    n_leaf_modules_with_params = (
        sum(1 for m in ref.modules() if any(True for _ in m.parameters(recurse=False))) - 1
    )  # `head` holds only the weight tied to `tok`, which LAYER buckets with `tok`
    return {
        "buckets": _buckets(model),
        "steps": steps,
        "n_params": len(list(ref.parameters())),
        "n_leaf_modules": n_leaf_modules_with_params,
        "n_units": len(model.fullshard_runtime.units),
        "shard_size": model.fullshard_runtime.mesh.shard.size,
    }


_COUNTS_CACHE: dict[tuple[str, str, bool | None], dict] = {}


def _counts(
    group2: DistributedGroup, strategy: str, bucketing: str, reshard: bool | None = None
) -> dict:
    key = (strategy, bucketing, reshard)
    if key not in _COUNTS_CACHE:
        _COUNTS_CACHE[key] = group2.run(_count_step, strategy, bucketing, reshard)[0]
    return _COUNTS_CACHE[key]


@pytest.mark.parametrize("bucketing", BUCKETINGS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_step_match_the_algorithm(group2, strategy, bucketing):
    info = _counts(group2, strategy, bucketing)
    buckets = info["buckets"]
    n = len(buckets)
    # The bucket structure itself, independently of the runtime: TinyGPT(layers=4) has 52
    # distinct parameters in 27 leaf modules (the head's weight is the embedding's) and 5 units.
    assert info["n_units"] == 5
    assert (
        n
        == {
            "NONE": info["n_params"],
            "LAYER": info["n_leaf_modules"],
            "BLOCK": info["n_units"],
        }[bucketing]
    )
    assert (info["n_params"], info["n_leaf_modules"]) == (52, 27)
    assert all(b["requires_grad"] for b in buckets)
    s = info["shard_size"]
    padded_bytes = sum(b["padded_numel"] for b in buckets) * F32
    for step, got in enumerate(info["steps"]):
        stats = got["stats"]
        calls = {k: v["calls"] for k, v in stats.items()}
        nbytes = {k: v["bytes"] for k, v in stats.items()}
        if strategy == "NO_SHARD":
            assert s == 1
            expected_calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": n}
            assert nbytes["all_reduce"] == sum(b["numel"] for b in buckets) * F32
            # ring all-reduce on 2 ranks: each rank sends 2 * (N-1)/N of the buffer
            assert stats["all_reduce"]["wire_bytes"] == nbytes["all_reduce"]
        else:
            assert s == 2
            gathers = sum(_gathers(strategy, b) for b in buckets)
            gathered = sum(_gathers(strategy, b) * b["padded_numel"] for b in buckets) * F32
            expected_calls = {"all_gather": gathers, "reduce_scatter": n, "all_reduce": 0}
            assert nbytes["all_gather"] == gathered, f"step {step}"
            assert nbytes["reduce_scatter"] == padded_bytes, f"step {step}"
            # each rank sends (N-1)/N of an all-gather (the ring optimum); a reduce-scatter
            # sends each peer its real rows straight from the gradients: rank 0 sends rank
            # 1's rows, i.e. everything but its own ceil(d0/2) rows, no padding
            assert stats["all_gather"]["wire_bytes"] == nbytes["all_gather"] // 2
            numel = sum(b["numel"] for b in buckets) * F32
            assert stats["reduce_scatter"]["wire_bytes"] == numel - padded_bytes // 2
            assert numel - padded_bytes // 2 < padded_bytes // 2  # TinyGPT has padding
        assert {k: calls[k] for k in expected_calls} == expected_calls, f"step {step}"
        assert calls["broadcast"] == calls["scatter"] == 0
        assert got["memory"]["unsharded_param_bytes"] == 0
        assert got["memory"]["unsharded_grad_bytes"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bucketing_orders_collective_counts(group2, strategy):
    total = {}
    for bucketing in BUCKETINGS:
        calls = _counts(group2, strategy, bucketing)["steps"][-1]["stats"]
        total[bucketing] = sum(v["calls"] for v in calls.values())
    assert total["BLOCK"] < total["LAYER"] < total["NONE"], total


def test_counts_table(group2):
    """The per-step table (printed; run with -s to see it), asserted as a whole so a
    regression shows the full table in the diff. Bytes: 13,872 fp32 elements, 13,888 padded
    to 2 ranks (the 37-row embedding gets one zero row of 16). The root (tok 38 x 16, pos
    8 x 16, ln_f 2 x 16: 768 padded elements, 3,072 bytes, in 4 parameters / 3 leaf modules)
    is gathered once under ZeRO-3 by default, twice with reshard_after_forward=True."""
    table = {}
    cases = [(s, b, None) for s in STRATEGIES for b in BUCKETINGS]
    cases += [("ZERO3", b, True) for b in BUCKETINGS] + [("ZERO3", "BLOCK", False)]
    for strategy, bucketing, reshard in cases:
        info = _counts(group2, strategy, bucketing, reshard)
        stats = info["steps"][-1]["stats"]
        label = strategy if reshard is None else f"{strategy}/{reshard}"
        table[(label, bucketing)] = (
            len(info["buckets"]),
            stats["all_gather"]["calls"],
            stats["reduce_scatter"]["calls"],
            stats["all_reduce"]["calls"],
            stats["all_gather"]["bytes"],
            stats["reduce_scatter"]["bytes"] + stats["all_reduce"]["bytes"],
        )
    print("\nTinyGPT(layers=4), {Block} units, 2 ranks, one step:")
    print(
        "strategy  bucketing buckets  all_gather  reduce_scatter  all_reduce  AG bytes"
        "  reduce bytes"
    )
    for (strategy, bucketing), row in table.items():
        print(
            f"{strategy:9} {bucketing:9} {row[0]:7} {row[1]:11} {row[2]:15} {row[3]:11}"
            f" {row[4]:9} {row[5]:13}"
        )
    root = 3072
    z3, z3_root, z2 = (2 * 55552 - root, 55552), (2 * 55552, 55552), (55552, 55552)
    ddp = (0, 55488)
    assert table == {
        ("ZERO3", "NONE"): (52, 104 - 4, 52, 0, *z3),
        ("ZERO3", "LAYER"): (27, 54 - 3, 27, 0, *z3),
        ("ZERO3", "BLOCK"): (5, 10 - 1, 5, 0, *z3),
        ("ZERO3/True", "NONE"): (52, 104, 52, 0, *z3_root),
        ("ZERO3/True", "LAYER"): (27, 54, 27, 0, *z3_root),
        ("ZERO3/True", "BLOCK"): (5, 10, 5, 0, *z3_root),
        ("ZERO3/False", "BLOCK"): (5, 5, 5, 0, *z2),
        ("ZERO2", "NONE"): (52, 52, 52, 0, *z2),
        ("ZERO2", "LAYER"): (27, 27, 27, 0, *z2),
        ("ZERO2", "BLOCK"): (5, 5, 5, 0, *z2),
        ("NO_SHARD", "NONE"): (52, 0, 0, 52, *ddp),
        ("NO_SHARD", "LAYER"): (27, 0, 0, 27, *ddp),
        ("NO_SHARD", "BLOCK"): (5, 0, 0, 5, *ddp),
    }


def _per_unit_step(strategy: str, which: int, choice: bool, checkpointed: bool = False) -> dict:
    """Three steps with `reshard_after_forward` given per unit: `choice` for block `which`,
    the strategy's default for every other unit; parity with the reference every step.
    `checkpointed`: every block's activations recomputed in backward too."""
    torch.manual_seed(0)
    ref = _tiny_gpt4()
    model = copy.deepcopy(ref)
    chosen = model.blocks[which]
    model = fullshard.fsdp(model, device="cpu", sharding_strategy=strategy,
                           bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                           activation_checkpointing_policy={Block} if checkpointed else None,
                           reshard_after_forward=lambda m: choice if m is chosen else None)
    runtime = model.fullshard_runtime
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    steps, gathered_after_forward = [], []
    for _ in range(3):
        x, y = ref.make_batch(2 * dist.get_world_size(), gen)
        fullshard.reset_comm_stats()
        loss = model.loss(_local(x, 2), _local(y, 2))
        gathered_after_forward.append([u.name for u in runtime.units if u.is_gathered])
        loss.backward()
        steps.append(fullshard.comm_stats())
        assert all(not u.is_gathered for u in runtime.units)  # nothing survives the step
        ref.loss(x, y).backward()
        _assert_close_to_ref(model, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"gathers": [s["all_gather"]["calls"] for s in steps],
            "reduce_scatters": [s["reduce_scatter"]["calls"] for s in steps],
            "gathered_after_forward": gathered_after_forward,
            "flags": [u.reshard_after_forward for u in runtime.units]}


@pytest.mark.parametrize(
    ("strategy", "which", "choice", "checkpointed", "gathers", "kept"),
    [  # ZeRO-3 (5 units, BLOCK): 10 - 1 all-gathers by default (the root once)
        ("ZERO3", 3, False, False, 10 - 2, ["", "blocks.3"]),  # the last block, as torchtitan
        ("ZERO3", 0, False, False, 10 - 2, ["", "blocks.0"]),  # any unit: gathered once
        ("ZERO3", 3, False, True, 10 - 2, ["", "blocks.3"]),  # recomputed: nothing gathered twice
        ("ZERO2", 1, True, False, 5 + 1, ["", "blocks.0", "blocks.2", "blocks.3"]),  # resharded
    ],
)
def test_reshard_after_forward_per_unit(group2, strategy, which, choice, checkpointed, gathers,
                                        kept):
    """FSDP2's per-module `reshard_after_forward`, as a callable of each unit's module: the
    chosen unit follows its own choice, the others the strategy; losses and gradients equal
    the single process's, the collective counts move by exactly the chosen unit's gathers,
    and nothing stays gathered after backward."""
    info = group2.run(_per_unit_step, strategy, which, choice, checkpointed)[0]
    assert info["gathers"] == [gathers] * 3
    assert info["reduce_scatters"] == [5] * 3
    assert info["gathered_after_forward"] == [kept] * 3
    expected = [False] + [strategy == "ZERO3"] * 4
    expected[1 + which] = choice
    assert info["flags"] == expected


def test_reshard_after_forward_per_unit_must_answer_a_bool(group1):
    group1.run(_per_unit_bad_answer)


def _per_unit_bad_answer() -> None:
    model = _tiny_gpt4()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"for unit 'blocks.0' it returned str: 'no'"):
        fullshard.fsdp(model, device="cpu", sharding_strategy="ZERO3",
                       auto_wrap_policy={Block},
                       reshard_after_forward=lambda m: "no" if m is model.blocks[0] else None)
    # checked before anything is changed: the model is not wrapped and can be wrapped now
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    fullshard.fsdp(model, device="cpu", auto_wrap_policy={Block},
                   reshard_after_forward=lambda m: None)


# == 2. memory ===============================================================================
def _memory_profile(
    strategy: str, bucketing: str, prefetch_limit: int, coalesce_bytes: int = 0
) -> dict:
    """Memory over three steps; by default with one exchange per unit (small units' gathers
    batched together, comm.COALESCE_BYTES, hold the units of a batch together)."""
    previous, comm.COALESCE_BYTES = comm.COALESCE_BYTES, coalesce_bytes
    try:
        return _memory_steps(strategy, bucketing, prefetch_limit)
    finally:
        comm.COALESCE_BYTES = previous


def _memory_steps(strategy: str, bucketing: str, prefetch_limit: int) -> dict:
    ref, model = _wrap(
        StackNet,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={BigBlock},
        prefetch_limit=prefetch_limit,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(2)
    runtime = model.fullshard_runtime
    unit_bytes = {u.name: sum(p.layout.padded_numel for p in u.params) * F32 for u in runtime.units}
    bucket_bytes = [
        sum(p.layout.padded_numel for p in b.params) * F32 for u in runtime.units for b in u.buckets
    ]
    steps = []
    between = []
    for _ in range(3):
        x, y = ref.make_batch(4 * dist.get_world_size(), gen)
        steps.append(_one_step(model, x, y, 4)["memory"])
        ref.loss(x, y).backward()
        _assert_close_to_ref(model, ref)  # the memory savings do not cost exactness
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        between.append(fullshard.memory_stats())
    return {
        "unit_bytes": unit_bytes,
        "bucket_bytes": bucket_bytes,
        "steps": steps,
        "between": between,
    }


@pytest.mark.parametrize("bucketing", ["NONE", "BLOCK"])
def test_zero3_holds_about_one_unit_zero2_everything(group2, bucketing):
    z3 = group2.run(_memory_profile, "ZERO3", bucketing, 1)[0]
    z3_no_prefetch = group2.run(_memory_profile, "ZERO3", bucketing, 0)[0]
    z2 = group2.run(_memory_profile, "ZERO2", bucketing, 1)[0]
    units = z3["unit_bytes"]
    root = units[""]
    block = max(v for k, v in units.items() if k)
    assert {v for k, v in units.items() if k} == {block}  # four equal blocks
    assert len(units) == 5 and root * 10 < block  # the root is small
    # A multi-parameter bucket briefly holds the rank-major all-gather output beside its
    # parameter-major copy (bucket.py), so one extra bucket can be in flight.
    transient = max(z3["bucket_bytes"]) if bucketing == "BLOCK" else 0
    for profile in (z3, z3_no_prefetch, z2):
        for mem in profile["between"]:
            assert mem["unsharded_param_bytes"] == 0 and mem["unsharded_grad_bytes"] == 0
    for step, mem in enumerate(z3["steps"]):
        peak = mem["peak_unsharded_param_bytes"]
        # Root (gathered for the whole forward / backward) + the running unit + prefetch_limit
        # units gathered ahead.
        assert root + block <= peak <= root + 2 * block + transient, (step, peak, units)
    for step, mem in enumerate(z3_no_prefetch["steps"]):
        peak = mem["peak_unsharded_param_bytes"]
        assert root + block <= peak <= root + block + transient, (step, peak, units)
    for profile in (z3, z3_no_prefetch, z2):
        for mem in profile["steps"]:
            # Reduce inputs: the reductions of at most max_pending_reductions (2) units in
            # flight plus the unit being reduced, each at most the largest unit.
            assert 0 < mem["peak_unsharded_grad_bytes"] <= 3 * max(units.values())
    everything = sum(units.values())
    for step, mem in enumerate(z2["steps"]):
        # ZeRO-2 keeps every unit from its forward to its backward: the whole model.
        assert everything <= mem["peak_unsharded_param_bytes"] <= everything + transient
        assert z3["steps"][step]["peak_unsharded_param_bytes"] < mem["peak_unsharded_param_bytes"]


@contextlib.contextmanager
def _counting_sends(coalesce_bytes: int):  # type: ignore[no-untyped-def]
    """With `comm.COALESCE_BYTES` set to `coalesce_bytes`, yield a list that gets one entry
    per point-to-point send (what gloo.py calls)."""
    previous, comm.COALESCE_BYTES = comm.COALESCE_BYTES, coalesce_bytes
    sends: list[int] = []
    isend = dist.isend
    dist.isend = lambda *a, **k: sends.append(1) or isend(*a, **k)
    try:
        yield sends
    finally:
        dist.isend = isend
        comm.COALESCE_BYTES = previous


def _batched_exchanges(coalesce_blocks: int) -> dict:
    """Three ZeRO-3 steps with small units' exchanges batched up to `coalesce_blocks` blocks'
    bytes per rank (1: one unit per exchange): point-to-point sends, counted collectives and
    the gathered peak of each step."""
    probe = _wrap(StackNet, sharding_strategy="ZERO3", auto_wrap_policy={BigBlock})[1]
    block_bytes = probe.fullshard_runtime.units[1].gather_nbytes  # per rank
    with _counting_sends(coalesce_blocks * block_bytes) as sends:
        ref, model = _wrap(StackNet, sharding_strategy="ZERO3", bucketing_strategy="BLOCK",
                           auto_wrap_policy={BigBlock}, prefetch_limit=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(5)
        steps = []
        for _ in range(3):
            x, y = ref.make_batch(4 * dist.get_world_size(), gen)
            sends.clear()
            got = _one_step(model, x, y, 4)
            ref.loss(x, y).backward()
            _assert_close_to_ref(model, ref)
            steps.append({"sends": len(sends),
                          "calls": {k: v["calls"] for k, v in got["stats"].items()},
                          "peak": got["memory"]["peak_unsharded_param_bytes"]})
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        units = model.fullshard_runtime.units
        gathered = [u.gather_nbytes * dist.get_world_size() for u in units]
        return {"steps": steps, "root": gathered[0], "block": gathered[1]}


def test_small_units_exchange_together_with_the_same_collectives(group2):
    """Units below comm.COALESCE_BYTES are gathered (and reduced) several per exchange: the
    counted collectives stay the algorithm's (2 all-gathers + 1 reduce-scatter per unit
    under ZeRO-3, the root gathered once), far fewer messages go out, and the gathered peak
    follows the budget."""
    alone = group2.run(_batched_exchanges, 1)[0]  # one unit per exchange
    batched = group2.run(_batched_exchanges, 3)[0]
    root, block = batched["root"], batched["block"]
    for one, many in zip(alone["steps"][1:], batched["steps"][1:]):  # warm steps
        assert many["calls"] == one["calls"]
        assert one["calls"]["all_gather"] == 9 and one["calls"]["reduce_scatter"] == 5
        # one message per unit and peer for each of 14 collectives, folded headers included
        assert one["sends"] == 14
        # forward: root + 2 blocks, then 2 blocks; backward the same; reductions: 2 batches
        assert many["sends"] <= 8, many
        # the running block and a window of 3 blocks' bytes per rank, beside the root
        assert root + 2 * block < many["peak"] <= root + 3 * block, (many, root, block)
        assert one["peak"] <= root + 2 * block, (one, root, block)


def _no_shard_sums(coalesce_bytes: int) -> list[dict]:
    """Three NO_SHARD steps: point-to-point sends and counted collectives of each."""
    with _counting_sends(coalesce_bytes) as sends:
        ref, model = _wrap(StackNet, sharding_strategy="NO_SHARD", bucketing_strategy="BLOCK",
                           auto_wrap_policy={BigBlock})
        gen = torch.Generator().manual_seed(6)
        steps = []
        for _ in range(3):
            x, y = ref.make_batch(4 * dist.get_world_size(), gen)
            sends.clear()
            got = _one_step(model, x, y, 4)
            ref.loss(x, y).backward()
            _assert_close_to_ref(model, ref)
            steps.append({"sends": len(sends),
                          "calls": {k: v["calls"] for k, v in got["stats"].items()}})
            model.zero_grad()
            ref.zero_grad()
        return steps


def test_no_shard_sums_small_units_in_one_exchange(group2):
    """NO_SHARD on gloo: the all-reduces of units that together stay within the batching
    budget travel as one message per peer (each still counted as one all-reduce); with
    packing off, each is gloo's all-reduce with a header message of its own."""
    for packed, native in zip(group2.run(_no_shard_sums, 1 << 20)[0],
                              group2.run(_no_shard_sums, 0)[0]):
        assert packed["calls"] == native["calls"]
        assert packed["calls"]["all_reduce"] == 5 and packed["calls"]["reduce_scatter"] == 0
        assert packed["sends"] == 1  # StackNet's 5 units: ~0.1 MB, one exchange
        assert native["sends"] == 5  # one header message per unit, the data through gloo


def _retained_after_forward(
    strategy: str, bucketing: str, reshard: bool | None = None, prefetch_limit: int = 1
) -> tuple:
    """How many of the unsharded buffers gathered during forward, and of the tensors the
    modules were handed in place of their parameters, are still alive (held by anyone: the
    engine, or autograd's saved tensors) once forward has returned. By default the root
    stays gathered into backward (by design): its buffers are not watched, and the tracked
    bytes come back beside the root's gathered bytes."""
    ref, model = _wrap(
        StackNet,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={BigBlock},
        reshard_after_forward=reshard,
        prefetch_limit=prefetch_limit,
    )
    runtime = model.fullshard_runtime
    seen: list[weakref.ref] = []
    installed: list[weakref.ref] = []

    def grab(unit):  # type: ignore[no-untyped-def]
        def hook(module, args):  # type: ignore[no-untyped-def]
            # runs after the engine's pre-hook (which is prepended): the unit is gathered and
            # its modules see the unsharded tensors (plain tensors, not the shard Parameters)
            seen.extend(weakref.ref(b.unsharded) for b in unit.buckets)
            for m in module.modules():
                for name in m._parameters:
                    t = getattr(m, name)
                    if not isinstance(t, nn.Parameter):
                        installed.append(weakref.ref(t))

        return hook

    watched = runtime.units[1:] if reshard is None and strategy == "ZERO3" else runtime.units
    for unit in watched:
        unit.module.register_forward_pre_hook(grab(unit))
    x, y = ref.make_batch(4 * dist.get_world_size(), torch.Generator().manual_seed(2))
    loss = model.loss(_local(x, 4), _local(y, 4))
    alive = sum(r() is not None for r in seen)
    alive_installed = sum(r() is not None for r in installed)
    # The engine's accounting follows buffer lifetimes, so it must agree with the weakrefs.
    tracked = fullshard.memory_stats()["unsharded_param_bytes"]
    root = runtime.root
    root_gathered = sum(b.unsharded.nbytes for b in root.buckets if b.unsharded is not None)
    # ZeRO-3's backward prefetch, issued once the root's forward is done (see [Note: the turn
    # from forward to backward] in fullshard/engine/hooks.py): the units in flight now, and
    # what they gather.
    ahead = [u for u in runtime.units[1:] if u.in_flight]
    ahead_bytes = sum(p.layout.padded_numel * F32 for u in ahead for p in u.params)
    loss.backward()
    return (alive, len(seen), alive_installed, len(installed), tracked, root_gathered,
            [u.name for u in ahead], ahead_bytes)


@pytest.mark.parametrize("bucketing", ["NONE", "BLOCK"])
def test_zero3_keeps_no_unsharded_buffer_alive_for_backward(group2, bucketing):
    """The "silent ZeRO-2" pitfall (docs/architecture.md, "Pitfalls"): if autograd kept the gathered
    parameters it saved for backward, ZeRO-3 would hold every unit until backward with identical
    numbers. A tensor stays alive while anything references it, so a weak reference to each gathered
    buffer tells, after forward, whether autograd (or the engine) still holds it."""
    n_params = 2 * 2 + 4 * 3 * 2  # root: LayerNorm + head; 4 blocks of 3 Linears
    n_buckets = {"NONE": n_params, "BLOCK": 5}[bucketing]
    root_buckets = {"NONE": 4, "BLOCK": 1}[bucketing]
    # reshard_after_forward=True: every unit, the root included, is released after forward.
    # Without backward prefetch nothing is gathered once forward has returned.
    z3 = group2.run(_retained_after_forward, "ZERO3", bucketing, True, 0)[0]
    alive, gathered, alive_views, views, tracked, root, ahead, _ = z3
    assert (gathered, views) == (n_buckets, n_params)  # each gathered once in forward
    assert alive == 0, f"{alive} of {gathered} gathered buffers outlive forward"
    # also catches handing modules *copies* (then the buffers die but the copies live on)
    assert alive_views == 0, f"{alive_views} of {views} unsharded parameters outlive forward"
    assert tracked == root == 0, f"memory_stats counts {tracked} unsharded bytes after forward"
    assert ahead == []
    # With it (prefetch_limit=1), the one unit backward needs first is on its way already:
    # a fresh gather (the forward's buffers are all dead), counted, and nothing else.
    z3 = group2.run(_retained_after_forward, "ZERO3", bucketing, True)[0]
    alive, gathered, alive_views, views, tracked, root, ahead, ahead_bytes = z3
    assert alive == alive_views == 0 and root == 0, z3
    assert ahead == ["blocks.3"] and tracked == ahead_bytes > 0, z3
    # The default: the same for every unit but the root, which alone stays gathered.
    z3 = group2.run(_retained_after_forward, "ZERO3", bucketing)[0]
    alive, gathered, alive_views, views, tracked, root, ahead, ahead_bytes = z3
    assert (gathered, views) == (n_buckets - root_buckets, n_params - 4)
    assert alive == alive_views == 0, z3
    assert ahead == ["blocks.3"] and tracked == root + ahead_bytes and root > 0, z3
    alive, gathered, *_, tracked, _, _, _ = group2.run(
        _retained_after_forward, "ZERO2", bucketing)[0]
    assert alive == gathered == n_buckets  # ZeRO-2 keeps them, by design
    assert tracked > 0


def _storage_per_rank(bucketing: str) -> dict:
    _, model = _wrap(
        OddNet,
        sharding_strategy="ZERO3",
        bucketing_strategy=bucketing,
        auto_wrap_policy={nn.Sequential},
    )
    runtime = model.fullshard_runtime
    n = runtime.mesh.shard.size
    rank = runtime.mesh.shard.rank
    expected_total = 0
    storages = {}
    for unit in runtime.units:
        for b in unit.buckets:
            flat = b.shard_flat
            bucket_expected = 0
            for sp in b.params:
                shape = sp.layout.shape
                d0 = shape[0] if len(shape) else 1
                row = math.prod(shape[1:])
                c = math.ceil(d0 / n)
                assert sp.layout.chunk_rows == c
                bucket_expected += c * row * F32
                # the user-visible parameter: this rank's real rows, a view into the bucket
                start = min(rank * c, d0)
                stop = min(start + c, d0)
                assert tuple(sp.param.shape) == (stop - start, *shape[1:]), sp.fqn
                assert sp.param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                # padding rows after the real ones are zeros
                padded = b.padded_shard(sp)
                assert padded.shape[0] == c
                assert not padded[stop - start :].any(), sp.fqn
            assert flat.untyped_storage().nbytes() == bucket_expected
            storages[flat.untyped_storage().data_ptr()] = flat.untyped_storage().nbytes()
            expected_total += bucket_expected
    # Everything model.parameters() refers to lives in exactly those storages.
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert param_storages == set(storages)
    return {"total": sum(storages.values()), "expected": expected_total}


@pytest.mark.parametrize("bucketing", ["NONE", "BLOCK"])
def test_each_rank_stores_ceil_d0_over_n_rows(group2, bucketing):
    out = group2.run(_storage_per_rank, bucketing)
    # (7*6+7 + 13*7+13 + 5*13+5 + 1*5+1 + 1) elements in total; per rank ceil(d0/2) rows each
    rows = {
        (7, 6): 4,
        (7,): 4,
        (13, 7): 7,
        (13,): 7,
        (5, 13): 3,
        (5,): 3,
        (1, 5): 1,
        (1,): 1,
        (): 1,
    }
    expected = sum(c * math.prod(s[1:]) for s, c in rows.items()) * F32
    for r in out:
        assert r["total"] == r["expected"] == expected


# == 3. frozen parameters =====================================================================
def _frozen(strategy: str, bucketing: str) -> dict:
    # the strategy's schedule for frozen units too (test_frozen_gathers.py: kept gathered)
    ref, model = _wrap(
        _frozen_gpt,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Block},
        keep_frozen_gathered=False,
    )
    gen = torch.Generator().manual_seed(3)
    x, y = ref.make_batch(2 * dist.get_world_size(), gen)
    got = _one_step(model, x, y, 2)
    frozen = [n for n, p in ref.named_parameters() if not p.requires_grad]
    for name, p in model.named_parameters():
        if name in frozen:
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.grad is not None, name
    buckets = _buckets(model)
    for b in buckets:  # frozen and trainable parameters never share a bucket
        assert {n in frozen for n in b["params"]} == {not b["requires_grad"]}
    return {
        "stats": got["stats"],
        "memory": got["memory"],
        "buckets": buckets,
        "n_frozen": len(frozen),
    }


@pytest.mark.parametrize(("strategy", "bucketing"), [("ZERO3", "BLOCK"), ("ZERO2", "NONE")])
def test_frozen_params_get_no_grad_and_no_reduction(group2, strategy, bucketing):
    group2.run(
        check_parity,
        _frozen_gpt,
        steps=3,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Block},
    )
    info = group2.run(_frozen, strategy, bucketing)[0]
    assert info["n_frozen"] == 12 + 2 + 1
    buckets = info["buckets"]
    trainable = [b for b in buckets if b["requires_grad"]]
    assert len(trainable) < len(buckets)
    stats = info["stats"]
    # frozen buckets are gathered (the forward needs them) but never reduced
    assert stats["all_gather"]["calls"] == sum(_gathers(strategy, b) for b in buckets)
    assert stats["reduce_scatter"]["calls"] == len(trainable)
    assert stats["reduce_scatter"]["bytes"] == sum(b["padded_numel"] for b in trainable) * F32
    assert info["memory"]["unsharded_param_bytes"] == info["memory"]["unsharded_grad_bytes"] == 0


# == 4. unused parameters ====================================================================
def _unused(strategy: str) -> dict:
    ref, model = _wrap(BranchyNet, sharding_strategy=strategy, auto_wrap_policy={Sub})
    gen = torch.Generator().manual_seed(4)
    out = {}
    for _ in range(2):
        x, y = ref.make_batch(2 * dist.get_world_size(), gen)
        got = _one_step(model, x, y, 2)
        assert got["memory"]["unsharded_param_bytes"] == 0
        assert got["memory"]["unsharded_grad_bytes"] == 0
        for name, p in model.named_parameters():
            # None, or whether any element is nonzero ("empty": this rank owns no rows)
            out[name] = None if p.grad is None else bool(p.grad.any()) if p.numel() else "empty"
        model.zero_grad()
    return out


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_unused_params_do_not_hang_and_match_the_reference(group2, strategy):
    group2.run(
        check_parity,
        BranchyNet,
        steps=3,
        sharding_strategy=strategy,
        auto_wrap_policy={Sub},
        timeout=60,
    )
    grads = group2.run(_unused, strategy, timeout=60)
    # None on one rank means None on all (rank 1 owns no rows of the 1-row head)
    is_none = [{k: v is None for k, v in g.items()} for g in grads]
    assert is_none[0] == is_none[1]
    assert grads[1]["head.weight"] == "empty"
    g = grads[0]
    # The root unit ran, but no rank used this Linear: no gradient, as in one process.
    assert g["unused_linear.weight"] is None and g["unused_linear.bias"] is None
    # A unit that never ran gets no gradient.
    assert g["never_called.fc.weight"] is None and g["never_called.fc.bias"] is None
    # A unit whose output is discarded: zeros or None, but not a nonzero gradient.
    assert g["dead_end.fc.weight"] in (None, False)
    assert g["used.fc.weight"] is True and g["head.weight"] is True


# == 5. a unit called twice ==================================================================
@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
@pytest.mark.parametrize("bucketing", ["NONE", "BLOCK"])
def test_unit_called_twice_in_one_forward(group2, strategy, bucketing):
    reports = group2.run(
        check_parity,
        TwiceNet,
        steps=4,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Sub},
    )
    assert all(r.losses for r in reports)


# == 6. tied weights =========================================================================
def _names(make, **kwargs) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    ref, model = _wrap(make, **kwargs)
    return [n for n, _ in ref.named_parameters()], [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_tied_embedding_and_tie_across_units(group2, strategy):
    group2.run(
        check_parity, _tiny_gpt2, steps=3, sharding_strategy=strategy, auto_wrap_policy={Block}
    )
    group2.run(
        check_parity, TiedAcrossUnits, steps=3, sharding_strategy=strategy, auto_wrap_policy={Sub}
    )
    ref_names, names = group2.run(
        _names, _tiny_gpt2, sharding_strategy=strategy, auto_wrap_policy={Block}
    )[0]
    assert names == ref_names and "tok.weight" in names and "head.weight" not in names
    ref_names, names = group2.run(
        _names, TiedAcrossUnits, sharding_strategy=strategy, auto_wrap_policy={Sub}
    )[0]
    assert names == ref_names and "a.fc.weight" in names and "b.fc.weight" not in names
    assert "b.fc.bias" in names


# == 7. buffers ==============================================================================
def _buffers(strategy: str) -> None:
    ref, model = _wrap(ConvBNNet, sharding_strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_buffers = dict(ref.named_buffers())
    assert [n for n, _ in model.named_buffers()] == list(ref_buffers)
    sharded = {id(sp.param) for u in model.fullshard_runtime.units for sp in u.params}
    initial = {n: b.clone() for n, b in model.named_buffers()}
    gen = torch.Generator().manual_seed(5)
    b = 3
    for _ in range(3):
        x, y = ref.make_batch(b * dist.get_world_size(), gen)
        # Expected running stats: BatchNorm on this rank's rows only (no buffer sync, as in
        # torch FSDP), with the reference's (= the wrapped model's) weights.
        shadow = copy.deepcopy(ref)
        for (_, mine), (_, theirs) in zip(model.named_buffers(), shadow.named_buffers()):
            theirs.copy_(mine)
        shadow(_local(x, b))
        model.loss(_local(x, b), _local(y, b)).backward()
        chunks = zip(x.split(b), y.split(b))
        torch.stack([ref.loss(xi, yi) for xi, yi in chunks]).mean().backward()
        _assert_close_to_ref(model, ref)
        for (name, mine), (_, expected) in zip(model.named_buffers(), shadow.named_buffers()):
            assert id(mine) not in sharded
            assert mine.shape == ref_buffers[name].shape, name  # full shape on every rank
            assert torch.allclose(mine, expected, rtol=1e-5, atol=1e-6), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state = model.state_dict()
    for name, buf in model.named_buffers():
        assert not torch.equal(buf, initial[name]), f"{name} did not update"
        assert torch.equal(state[name], buf)
    assert model.bn.num_batches_tracked.item() == 3


@pytest.mark.parametrize("strategy", ["ZERO3", "NO_SHARD"])
def test_buffers_stay_replicated_and_update(group2, strategy):
    group2.run(_buffers, strategy)


# == 8. no_sync ==============================================================================
def _no_sync(strategy: str, bucketing: str) -> dict:
    ref, model = _wrap(
        _tiny_gpt2,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
        auto_wrap_policy={Block},
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(6)
    world, b, micro = dist.get_world_size(), 2, 3
    per_step = []
    for _ in range(2):
        # One global batch of micro * world * b rows; micro-batch i on rank r gets its rows.
        x, y = ref.make_batch(micro * world * b, gen)
        xs, ys = x.view(micro, world * b, -1), y.view(micro, world * b, -1)
        calls = []
        with model.no_sync():
            for i in range(micro - 1):
                fullshard.reset_comm_stats()
                (model.loss(_local(xs[i], b), _local(ys[i], b)) / micro).backward()
                calls.append(_calls())
                # nothing reduced yet: `.grad` is None or the window's zero placeholder
                assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        fullshard.reset_comm_stats()
        (model.loss(_local(xs[-1], b), _local(ys[-1], b)) / micro).backward()
        calls.append(_calls())
        # The mean over micro-batches of per-micro-batch means (equal sizes, equal tokens per
        # row) is the mean over the whole batch: one big batch for the reference.
        ref.loss(x, y).backward()
        _assert_close_to_ref(model, ref)
        mem = fullshard.memory_stats()
        assert mem["unsharded_param_bytes"] == mem["unsharded_grad_bytes"] == 0
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_close_to_ref(model, ref, "param")
        per_step.append(calls)
    # A plain step afterwards communicates as usual.
    x, y = ref.make_batch(world * b, gen)
    after = _one_step(model, x, y, b)
    return {
        "per_step": per_step,
        "after": {k: v["calls"] for k, v in after["stats"].items()},
        "buckets": len(_buckets(model)),
        "root_buckets": sum(b["root"] for b in _buckets(model)),
    }


@pytest.mark.parametrize(
    ("strategy", "bucketing"),
    [("ZERO3", "NONE"), ("ZERO3", "BLOCK"), ("ZERO2", "LAYER"), ("NO_SHARD", "NONE")],
)
def test_no_sync_accumulation_equals_one_big_batch(group2, strategy, bucketing):
    info = group2.run(_no_sync, strategy, bucketing)[0]
    n, root = info["buckets"], info["root_buckets"]
    sharded = strategy != "NO_SHARD"
    for calls in info["per_step"]:
        first, second, synced = calls
        # 1st micro-batch: only the gathers (none without sharding), no reduction
        assert first == {
            "all_gather": n if sharded else 0,
            "reduce_scatter": 0,
            "all_reduce": 0,
            "broadcast": 0,
            "scatter": 0,
        }
        # 2nd: everything is still gathered, nothing is reduced: no collective at all
        assert sum(second.values()) == 0, second
        # synced: one reduction per bucket; ZeRO-3 re-gathers once for backward (forward found
        # the units still gathered) every unit but the root, ZeRO-2 needs no gather
        assert synced == {
            "all_gather": n - root if strategy == "ZERO3" else 0,
            "reduce_scatter": n if sharded else 0,
            "all_reduce": 0 if sharded else n,
            "broadcast": 0,
            "scatter": 0,
        }
    after = info["after"]
    if strategy == "ZERO3":
        assert (after["all_gather"], after["reduce_scatter"]) == (2 * n - root, n)


# == 9. broadcast_from ========================================================================
def _source_model(rank: int) -> ConvBNNet:
    """Every rank builds the same model; rank 1 changes every parameter (p -> -p - 0.5: BN's
    bias starts at 0) and sets its buffers."""
    torch.manual_seed(0)
    model = ConvBNNet()
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.neg_().sub_(0.5)
            model.bn.running_mean.copy_(torch.arange(5.0))
            model.bn.running_var.fill_(3.0)
            model.bn.num_batches_tracked.fill_(7)
    return model


def _broadcast(strategy: str, bucketing: str) -> dict:
    model = _source_model(dist.get_rank())
    expected = _source_model(1)  # what rank 1 holds, rebuilt locally
    before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    fullshard.reset_comm_stats()
    fullshard.fsdp(
        model,
        device="cpu",
        broadcast_from=1,
        sharding_strategy=strategy,
        bucketing_strategy=bucketing,
    )
    stats = fullshard.comm_stats()
    mesh = model.fullshard_runtime.mesh
    for name, p in model.named_parameters():
        want = local_rows(
            dict(expected.named_parameters())[name].detach(), mesh.shard.size, mesh.shard.rank
        )
        assert torch.equal(p.detach(), want), name
        if dist.get_rank() == 0 and p.numel():
            assert not torch.equal(
                p.detach(), local_rows(before_params[name], mesh.shard.size, mesh.shard.rank)
            ), name
    for (name, buf), (_, want) in zip(model.named_buffers(), expected.named_buffers()):
        assert torch.equal(buf, want), name
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(9))
    model.eval()
    expected.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), expected(x), rtol=1e-5, atol=1e-6)
    buffer_bytes = sum(b.numel() * b.element_size() for b in expected.buffers())
    param_bytes = sum(p.numel() * p.element_size() for p in expected.parameters())
    return {
        "stats": stats,
        "buckets": _buckets(model),
        "n_buffers": len(list(model.buffers())),
        "buffer_bytes": buffer_bytes,
        "param_bytes": param_bytes,
    }


@pytest.mark.parametrize(("strategy", "bucketing"), [("ZERO3", "NONE"), ("ZERO2", "BLOCK")])
def test_broadcast_from_scatters_each_bucket_once(group2, strategy, bucketing):
    out = group2.run(_broadcast, strategy, bucketing)
    for info in out:
        stats, buckets = info["stats"], info["buckets"]
        assert stats["scatter"]["calls"] == len(buckets) == (6 if bucketing == "NONE" else 1)
        # a scatter hands out the padded rows once in total, not the model to every rank
        assert stats["scatter"]["bytes"] == sum(b["padded_numel"] for b in buckets) * F32
        # buffers are not sharded: each is broadcast (they are far smaller than the params)
        assert stats["broadcast"]["calls"] == info["n_buffers"] == 3
        assert stats["broadcast"]["bytes"] == info["buffer_bytes"]
        assert stats["all_gather"]["bytes"] == 0  # only the tiny object exchange of ranks
        assert stats["reduce_scatter"]["calls"] == stats["all_reduce"]["calls"] == 0


# == 10. full state dict =====================================================================
def _state_dicts(strategy: str) -> None:
    ref, model = _wrap(_tiny_gpt2, sharding_strategy=strategy, auto_wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        x, y = ref.make_batch(2 * dist.get_world_size(), gen)
        model.loss(_local(x, 2), _local(y, 2)).backward()
        ref.loss(x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    mesh = model.fullshard_runtime.mesh
    rank = dist.get_rank()
    expected = ref.state_dict()

    # full_state_dict: names (incl. both tied keys), shapes and values of the reference
    full = fullshard.full_state_dict(model)
    assert list(full) == list(expected)
    assert "tok.weight" in full and "head.weight" in full
    for k, v in expected.items():
        assert full[k].shape == v.shape, k
        assert full[k].device.type == "cpu", k
        assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k
    assert torch.equal(full["tok.weight"], full["head.weight"])
    on_device = fullshard.full_state_dict(model, cpu_offload=False)
    assert all(torch.equal(on_device[k], full[k]) for k in full)

    only0 = fullshard.full_state_dict(model, rank0_only=True)
    if rank == 0:
        assert list(only0) == list(expected)
        assert all(torch.equal(only0[k], full[k]) for k in full)
    else:
        assert only0 == {}

    # model.state_dict(): DTensors over the local shards, original names, no communication
    fullshard.reset_comm_stats()
    local = model.state_dict()
    assert sum(v["calls"] for v in fullshard.comm_stats().values()) == 0
    assert list(local) == list(expected)
    for k, v in expected.items():
        want = local_rows(v, mesh.shard.size, mesh.shard.rank)
        assert local[k].shape == v.shape and local[k].to_local().shape == want.shape, k
        assert torch.allclose(local[k].to_local(), want, rtol=1e-5, atol=1e-6), k

    # load into a freshly wrapped, differently initialized model: same outputs
    _, other = _wrap(_tiny_gpt2, seed=123, sharding_strategy=strategy, auto_wrap_policy={Block})
    inputs = ref.make_batch(3, gen)[0]
    with torch.no_grad():
        assert not torch.allclose(other(inputs), model(inputs))
        missing, unexpected = fullshard.load_full_state_dict(other, full)
        assert (missing, unexpected) == ([], [])
        assert torch.allclose(other(inputs), model(inputs), rtol=1e-5, atol=1e-6)
        assert torch.allclose(other(inputs), ref(inputs), rtol=1e-5, atol=1e-5)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    # ... and it trains on from there exactly like the original
    x, y = ref.make_batch(2 * dist.get_world_size(), gen)
    other.loss(_local(x, 2), _local(y, 2)).backward()
    ref.loss(x, y).backward()
    _assert_close_to_ref(other, ref)
    other.zero_grad()

    # strictness: missing / unexpected keys and shape mismatches name the key
    broken = dict(full)
    del broken["blocks.1.mlp.fc1.bias"]
    with pytest.raises(ValueError, match=r"Missing keys: \['blocks\.1\.mlp\.fc1\.bias'\]"):
        fullshard.load_full_state_dict(other, broken)
    broken = {**full, "blocks.9.bogus": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected keys: \['blocks\.9\.bogus'\]"):
        fullshard.load_full_state_dict(other, broken)
    assert fullshard.load_full_state_dict(other, broken, strict=False) == ([], ["blocks.9.bogus"])
    broken = dict(full)
    del broken["ln_f.bias"]
    assert fullshard.load_full_state_dict(other, broken, strict=False) == (["ln_f.bias"], [])
    broken = {**full, "ln_f.weight": torch.zeros(17)}
    with pytest.raises(ValueError, match=r"'ln_f\.weight' has shape \(17,\)"):
        fullshard.load_full_state_dict(other, broken)
    with pytest.raises(ValueError, match=r"'ln_f\.weight' has shape \(17,\)"):
        fullshard.load_full_state_dict(other, broken, strict=False)


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_full_state_dict_round_trip(group2, strategy):
    group2.run(_state_dicts, strategy)


# == 12. a world of one rank ==================================================================
def _world_one() -> tuple[list[dict[str, int]], dict]:
    report = check_parity(
        _tiny_gpt2,
        steps=3,
        sharding_strategy="ZERO3",
        bucketing_strategy="LAYER",
        auto_wrap_policy={Block},
    )
    return report.calls_per_step, fullshard.memory_stats()


def test_world_size_one_zero3(group1):
    calls, mem = group1.run(_world_one)[0]
    assert len(calls) == 3
    for step in calls:
        assert sum(step.values()) == 0, step  # nothing to communicate, nothing counted
    assert mem["unsharded_param_bytes"] == mem["unsharded_grad_bytes"] == 0


# == a module shared by two units ==================================================
def _shared_module(strategy: str) -> str | None:
    ref, model = _wrap(_shared_module_net, sharding_strategy=strategy, auto_wrap_policy={Sub})
    x, y = ref.make_batch(4 * dist.get_world_size(), torch.Generator().manual_seed(8))
    # An error is returned, not raised, so the ranks survive for the next test, and whatever a
    # failed forward left gathered is released so later memory checks start from zero.
    try:
        model.loss(_local(x, 4), _local(y, 4)).backward()
        ref.loss(x, y).backward()
        _assert_close_to_ref(model, ref)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        model.fullshard_runtime.release_all()
    return None


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2"])
def test_module_shared_across_units(group2, strategy):
    assert group2.run(_shared_module, strategy, timeout=30) == [None, None]
