"""`fullshard.fsdp()` rejects bad input with an error that names the problem (design §2.6).

No rank processes: the checks that need `torch.distributed` initialized use a one-rank gloo
group created in this process (an in-memory HashStore), torn down after each test, so the
plain-process check (no process group at all) holds whatever order the tests run in.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.config import valid_strategy_names


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))



def test_fsdp_before_init_process_group_says_how_to_fix_it():
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"torch\.distributed to be initialized.*"
        r"init_process_group",
    ):
        fullshard.fsdp(_model(), device="cpu")


@pytest.mark.parametrize("not_a_module", [lambda x: x, [nn.Linear(2, 2)], "model"])
def test_non_module_is_a_type_error(not_a_module):
    # checked first, with or without a process group
    with pytest.raises(TypeError, match=r"fsdp\(\) expects an nn\.Module, got"):
        fullshard.fsdp(not_a_module)


def test_non_module_is_a_type_error_with_a_process_group(world1):
    with pytest.raises(TypeError, match=r"expects an nn\.Module, got dict"):
        fullshard.fsdp({"w": torch.zeros(2)}, device="cpu")


def test_unknown_strategy_lists_the_valid_ones(world1):
    with pytest.raises(ValueError, match=r"Unknown sharding strategy 'ZERO4'") as info:
        fullshard.fsdp(_model(), device="cpu", sharding_strategy="ZERO4")
    for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ZERO2", "ZERO3"):
        assert name in str(info.value)
    assert set(valid_strategy_names()) <= set(
        str(info.value).replace(",", " ").replace(".", " ").split()
    )


def test_strategy_of_the_wrong_type(world1):
    with pytest.raises(TypeError, match=r"sharding_strategy must be .* got int"):
        fullshard.fsdp(_model(), device="cpu", sharding_strategy=3)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_reshard_after_forward_takes_a_bool_or_none(world1, bad):
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False or None"):
        fullshard.fsdp(_model(), device="cpu", reshard_after_forward=bad)
    with pytest.raises(TypeError, match=r"FSDPStrategy\(reshard_after_forward=\.\.\.\) must"):
        fullshard.FSDPStrategy(reshard_after_forward=bad)


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "ZERO2", "NO_SHARD"])
def test_reshard_after_forward_true_contradicts_a_keeping_strategy(world1, strategy):
    match = rf"reshard_after_forward=True .* sharding_strategy '{strategy}' keeps them"
    with pytest.raises(ValueError, match=match):
        fullshard.fsdp(_model(), device="cpu", sharding_strategy=strategy,
                       reshard_after_forward=True)
    with pytest.raises(ValueError, match=match):
        fullshard.FSDPStrategy(sharding_strategy=strategy, reshard_after_forward=True)


@pytest.mark.parametrize(
    ("strategy", "reshard", "expected"),  # (other units, root) released after forward
    [("FULL_SHARD", None, (True, False)), ("FULL_SHARD", True, (True, True)),
     ("FULL_SHARD", False, (False, False)), ("HYBRID_SHARD", None, (True, False)),
     ("SHARD_GRAD_OP", None, (False, False)), ("SHARD_GRAD_OP", False, (False, False))],
)
def test_reshard_after_forward_reaches_the_engine(world1, strategy, reshard, expected):
    model = fullshard.fsdp(_model(), device="cpu", sharding_strategy=strategy,
                           reshard_after_forward=reshard,
                           device_mesh=(1, 1) if strategy == "HYBRID_SHARD" else None)
    plan = model.fullshard_runtime.plan
    assert (plan.reshard_after_forward, plan.reshard_root_after_forward) == expected


def test_unknown_bucketing_lists_the_valid_ones(world1):
    with pytest.raises(
        ValueError,
        match=r"Unknown bucketing strategy 'PER_TENSOR'.*"
        r"NONE, LAYER, BLOCK",
    ):
        fullshard.fsdp(_model(), device="cpu", bucketing_strategy="PER_TENSOR")


def test_already_wrapped(world1):
    model = fullshard.fsdp(_model(), device="cpu")
    with pytest.raises(ValueError, match=r"already wrapped by fullshard.*exactly once"):
        fullshard.fsdp(model, device="cpu")
    # a new model that contains a wrapped one is refused too
    outer = nn.Sequential(model, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Sequential \(or one of its submodules\) is already"):
        fullshard.fsdp(outer, device="cpu")


def test_meta_model_with_broadcast_from(world1):
    with torch.device("meta"):
        model = _model()
    with pytest.raises(
        ValueError,
        match=r"broadcast_from=0 needs real values.*meta device.*"
        r"'0\.weight'",
    ):
        fullshard.fsdp(model, device="cpu", broadcast_from=0)


def test_broadcast_from_outside_the_world(world1):
    with pytest.raises(
        ValueError,
        match=r"broadcast_from must be a global rank in \[0, 1\), "
        r"got 1",
    ):
        fullshard.fsdp(_model(), device="cpu", broadcast_from=1)


@pytest.mark.parametrize("strategy", ["ZERO3", "ZERO2", "FULL_SHARD", "NO_SHARD"])
def test_device_mesh_needs_hybrid(world1, strategy):
    with pytest.raises(
        ValueError,
        match=rf"sharding strategy {strategy}; a \(replicate, shard\) "
        r"mesh only applies to HYBRID_SHARD",
    ):
        fullshard.fsdp(_model(), device="cpu", sharding_strategy=strategy, device_mesh=(1, 1))


@pytest.mark.parametrize("mesh", [(1, 2), (2, 1), (3, 3)])
def test_mesh_product_must_equal_world_size(world1, mesh):
    with pytest.raises(
        ValueError,
        match=rf"The device mesh \({mesh[0]}, {mesh[1]}\) has "
        rf"{mesh[0] * mesh[1]} ranks but the world size is 1",
    ):
        fullshard.fsdp(_model(), device="cpu", sharding_strategy="HYBRID_SHARD", device_mesh=mesh)


@pytest.mark.parametrize(("mesh", "error"), [((1, 1, 1), ValueError), ("2x2", TypeError)])
def test_mesh_of_the_wrong_form(world1, mesh, error):
    with pytest.raises(error, match=r"device_mesh must be a \(replicate, shard\) tuple"):
        fullshard.fsdp(_model(), device="cpu", sharding_strategy="HYBRID_SHARD", device_mesh=mesh)


@pytest.mark.parametrize("policy", [3, "Linear", {"Linear": True}])
def test_bad_auto_wrap_policy_type(world1, policy):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        TypeError,
        match=r"auto_wrap_policy must be None, a set of nn\.Module "
        r"classes.*got (int|str|dict)",
    ):
        fullshard.fsdp(model, device="cpu", auto_wrap_policy=policy)
    # refused before anything was converted: the model can still be wrapped
    assert not isinstance(model, fullshard.FullyShardedModule)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fullshard.fsdp(model, device="cpu")


def test_wrap_policy_collection_of_non_modules(world1):
    with pytest.raises(TypeError, match=r"must hold nn\.Module subclasses; got \[<class 'int'>\]"):
        fullshard.fsdp(_model(), device="cpu", auto_wrap_policy={nn.Linear, int})


@pytest.mark.parametrize(
    ("name", "value"),
    [("prefetch_limit", -1), ("prefetch_limit", 1.5), ("max_pending_reductions", True)],
)
def test_bad_int_options(world1, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 0, got {value!r}"):
        fullshard.fsdp(_model(), device="cpu", **{name: value})


def test_max_pending_reductions_zero(world1):
    with pytest.raises(ValueError, match=r"max_pending_reductions must be >= 1"):
        fullshard.fsdp(_model(), device="cpu", max_pending_reductions=0)


def _replace_data(model: nn.Module) -> None:
    model[0].weight.data = model[0].weight.data.clone()


def _assign_new_parameter(model: nn.Module) -> None:
    model[2].bias = nn.Parameter(model[2].bias.detach().clone())


@pytest.mark.parametrize(
    "replace",
    [lambda m: m.double(), _replace_data, _assign_new_parameter],
    ids=["double", "param.data", "new Parameter"],
)
def test_replacing_a_parameter_after_wrapping_is_caught(world1, replace):
    model = fullshard.fsdp(_model(), device="cpu")
    model(torch.randn(2, 4)).sum().backward()  # fine before
    replace(model)
    with pytest.raises(RuntimeError, match=r"Parameter '.*' was replaced after fullshard.fsdp"):
        model(torch.randn(2, 4, dtype=next(model.parameters()).dtype))


def test_strategy_passes_reshard_after_forward_to_the_engine(world1):
    strategy = fullshard.FSDPStrategy(accelerator="cpu", reshard_after_forward=True)
    model = strategy.setup_module(_model())
    plan = model.fullshard_runtime.plan
    assert (plan.reshard_after_forward, plan.reshard_root_after_forward) == (True, True)
