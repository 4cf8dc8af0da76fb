"""`fullshard.fsdp()` rejects bad input with an error that names the problem.

docs/architecture.md, invariant 6.

No rank processes: the checks that need `torch.distributed` initialized use a one-rank gloo
group created in this process (an in-memory HashStore), torn down after each test, so the
plain-process check (no process group at all) holds whatever order the tests run in.
"""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("bad", ["yes", 2.0, 0.0])
def test_reshard_after_forward_takes_a_bool_an_int_or_none(world1, bad):
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False, None or an"):
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


def test_an_int_reshard_after_forward_is_checked_by_both_doors(world1):
    for bad, error, match in [(0, ValueError, r"reshard_after_forward=0 must be >= 1"),
                              (-2, ValueError, r"must be >= 1"), (2.0, TypeError, r"an int")]:
        with pytest.raises(error, match=match):
            fullshard.fsdp(_model(), device="cpu", sharding_strategy="FULL_SHARD",
                           reshard_after_forward=bad)
        with pytest.raises(error, match=match):
            fullshard.FSDPStrategy(sharding_strategy="FULL_SHARD", reshard_after_forward=bad)
    match = r"reshard_after_forward=2 asks to release .* 'SHARD_GRAD_OP' keeps them"
    with pytest.raises(ValueError, match=match):
        fullshard.FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=2)
    # one rank: a run of 1 holds the whole unit, i.e. False; the shard axis itself, True's
    # schedule for every unit but the root (as None)
    for k, expected in ((1, False), (None, True)):
        model = fullshard.fsdp(_model(), device="cpu", sharding_strategy="FULL_SHARD",
                               reshard_after_forward=k)
        assert model.fullshard_runtime.mesh.post_forward is None
        assert all(u.reshard_after_forward is expected for u in model.fullshard_runtime.units[1:])


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


# -- bad calls (issue 25): each a ValueError/TypeError naming the argument ---------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda", 0)])
def test_cuda_device_without_cuda_says_so(world1, device):
    model = _model()
    with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))} asks for CUDA, "
                       r"but torch\.cuda\.is_available\(\) is False.*Pass device='cpu'"):
        fullshard.fsdp(model, device=device)
    assert not isinstance(model, fullshard.FullyShardedModule)  # refused before converting


@pytest.mark.parametrize(("device", "error", "message"), [
    ("meta", ValueError, r"device='meta': fullshard keeps the shards on 'cpu' or a 'cuda'"),
    (1.5, TypeError, r"device must be a torch\.device, a string .* got float 1\.5"),
    (True, TypeError, r"device must be .* got bool True"),
])
def test_device_that_cannot_hold_shards(world1, device, error, message):
    with pytest.raises(error, match=message):
        fullshard.fsdp(_model(), device=device)


@pytest.mark.parametrize("option", ["auto_wrap_policy", "activation_checkpointing_policy"])
def test_a_bare_module_class_is_a_policy_of_that_class(world1, option):
    # Lightning and torch take a set of classes; a class alone means the same set (it used to
    # be called as a (module, recurse, nonwrapped_numel) policy and failed inside torch).
    torch.manual_seed(0)
    bare = fullshard.fsdp(_model(), device="cpu", **{option: nn.Linear})
    torch.manual_seed(0)
    as_set = fullshard.fsdp(_model(), device="cpu", **{option: {nn.Linear}})
    runtime, ref = bare.fullshard_runtime, as_set.fullshard_runtime
    assert [u.name for u in runtime.units] == [u.name for u in ref.units]
    assert runtime.units_description == ref.units_description
    x = torch.randn(2, 4)
    bare(x).sum().backward()
    as_set(x).sum().backward()
    for p, q in zip(bare.parameters(), as_set.parameters()):
        assert torch.equal(p.grad, q.grad)
    if option == "auto_wrap_policy":
        assert runtime.units_description.startswith("root + 2 x Linear")


@pytest.mark.parametrize(("option", "policy", "shown"), [
    ("activation_checkpointing_policy", "x", r"str 'x'"),  # it named auto_wrap_policy
    ("auto_wrap_policy", int, r"\[<class 'int'>\]"),  # a class: it was called as a policy
    ("activation_checkpointing_policy", int, r"\[<class 'int'>\]"),
])
def test_a_bad_policy_names_its_own_argument(world1, option, policy, shown):
    model = _model()
    with pytest.raises(TypeError, match=rf"^{option}(:| must be).*{shown}") as info:
        fullshard.fsdp(model, device="cpu", **{option: policy})
    other = {"auto_wrap_policy": "activation_checkpointing_policy",
             "activation_checkpointing_policy": "auto_wrap_policy"}[option]
    assert other not in str(info.value)
    assert not isinstance(model, fullshard.FullyShardedModule)
    with pytest.raises(TypeError, match=rf"^{option}(:| must be)"):
        fullshard.FSDPStrategy(**{option: policy})


@pytest.mark.parametrize("value", [5, "blocks", 2.0])
def test_ignored_states_must_be_modules_or_parameters(world1, value):
    with pytest.raises(TypeError, match=r"^ignored_states must be None, an nn\.Module or "
                       rf"nn\.Parameter, or an iterable of them; got {type(value).__name__}"):
        fullshard.fsdp(_model(), device="cpu", ignored_states=value)
    for name in ("ignored_states", "ignored_modules"):
        with pytest.raises(TypeError, match=rf"FSDPStrategy\({name}=\.\.\.\) must be None"):
            fullshard.FSDPStrategy(**{name: value})


@pytest.mark.parametrize("value", [5, "Linear", [nn.Linear, 3]])
def test_activation_checkpointing_classes(value):
    with pytest.raises(TypeError, match=r"FSDPStrategy\(activation_checkpointing=\.\.\.\) must "
                       r"be an nn\.Module subclass or a list of them, got"):
        fullshard.FSDPStrategy(activation_checkpointing=value)


def test_strings_are_not_taken_for_true(world1):
    from torch.distributed.fsdp import CPUOffload as TorchCPUOffload

    from fullshard.checkpoint.api import load_checkpoint

    def refused(name, call):
        with pytest.raises(TypeError,
                           match=rf"{re.escape(name)} must be True(,| or) False.*got str 'no'"):
            call()

    refused("move_state_dict_to_cpu",
            lambda: fullshard.fsdp(_model(), device="cpu", move_state_dict_to_cpu="no"))
    refused("cpu_offload", lambda: fullshard.fsdp(_model(), device="cpu", cpu_offload="no"))
    refused("cpu_offload.offload_params",  # torch's dataclass takes anything
            lambda: fullshard.fsdp(_model(), device="cpu",
                                   cpu_offload=TorchCPUOffload(offload_params="no")))
    refused("cpu_offload", lambda: fullshard.FSDPStrategy(cpu_offload="no"))
    model = fullshard.fsdp(_model(), device="cpu")
    full = fullshard.full_state_dict(model)
    refused("rank0_only", lambda: fullshard.full_state_dict(model, rank0_only="no"))
    refused("cpu_offload", lambda: fullshard.full_state_dict(model, cpu_offload="no"))
    refused("strict", lambda: fullshard.load_full_state_dict(model, full, strict="no"))
    refused("strict", lambda: model.load_original_state_dict(full, strict="no"))
    refused("strict", lambda: load_checkpoint("no-such-checkpoint", model, strict="no"))
    model(torch.randn(2, 4)).sum().backward()
    refused("error_if_nonfinite",
            lambda: fullshard.clip_grad_norm_(model, 1.0, error_if_nonfinite="no"))
    refused("foreach", lambda: fullshard.clip_grad_norm_(model, 1.0, foreach="no"))


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_norm": -1.0}, ValueError, r"max_norm must be >= 0 \(inf: .*\), got -1\.0"),
    ({"max_norm": float("nan")}, ValueError, r"max_norm must be >= 0 .*got nan"),
    ({"max_norm": 1.0, "norm_type": float("nan")}, ValueError,
     r"norm_type must be a number >= 0 or inf .*got nan"),
    ({"max_norm": 1.0, "norm_type": "fro"}, TypeError,
     r"norm_type must be a real number, got str 'fro'"),
    ({"max_norm": "1"}, TypeError, r"max_norm must be a real number, got str '1'"),
])
def test_clip_grad_norm_refuses_what_would_flip_or_nan_the_gradients(world1, kwargs, error,
                                                                     message):
    model = fullshard.fsdp(_model(), device="cpu")
    model(torch.randn(2, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(error, match=message):
        fullshard.clip_grad_norm_(model, **kwargs)
    assert all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters()))
    # max_norm=inf measures without clipping (torch's idiom): the unsharded norm, grads kept
    norm = fullshard.clip_grad_norm_(model, float("inf"))
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in before])))
    assert all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters()))


def test_strategy_passes_reshard_after_forward_to_the_engine(world1):
    strategy = fullshard.FSDPStrategy(accelerator="cpu", reshard_after_forward=True)
    model = strategy.setup_module(_model())
    plan = model.fullshard_runtime.plan
    assert (plan.reshard_after_forward, plan.reshard_root_after_forward) == (True, True)


def test_strategy_passes_a_per_unit_reshard_after_forward(world1):
    def keep_the_root(module):  # type: ignore[no-untyped-def]
        return False if isinstance(module, nn.Sequential) else True

    strategy = fullshard.FSDPStrategy(accelerator="cpu", sharding_strategy="SHARD_GRAD_OP",
                                      auto_wrap_policy={nn.Linear},
                                      reshard_after_forward=keep_the_root)
    model = strategy.setup_module(_model())
    flags = [u.reshard_after_forward for u in model.fullshard_runtime.units]
    assert flags == [False] + [True] * (len(flags) - 1) and len(flags) > 1


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("int4", ValueError, r"compression='int4' is not a wire format; use 'int8', 'bf16'"),
        (8, TypeError, r"compression must be a Compression, .* got int 8"),
        ({"weights": "int8"}, TypeError, r"compression must be a Compression, .* got dict"),
    ],
)
def test_compression_names_what_was_found_and_the_fix(world1, bad, error, match):
    with pytest.raises(error, match=match):
        fullshard.fsdp(_model(), device="cpu", compression=bad)
    with pytest.raises(error, match=match):
        fullshard.FSDPStrategy(compression=bad)


def test_compression_is_exported_and_reaches_the_strategy():
    assert fullshard.Compression(weights="int8").wire_for("gradients") == "exact"
    assert fullshard.FSDPStrategy(compression="int8").compression == fullshard.Compression(
        weights="int8", gradients="int8", frozen_weights="int8")
    assert fullshard.FSDPStrategy().compression is None


def test_compression_on_one_rank_is_accepted_nothing_travels(world1):
    # the counterpart of NO_SHARD's refusal (tests/distributed/test_compression.py): with
    # one rank there is no traffic to leave uncompressed
    model = fullshard.fsdp(_model(), device="cpu", compression="int8")
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
