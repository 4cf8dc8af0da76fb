"""FSDPStrategy: validation messages, global-norm clipping against the unsharded reference,
user collectives, and the minimal checkpoint round trip -- on 2 real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard import FSDPStrategy
from fullshard.testing import DistributedGroup, RankFailure, local_rows
from fullshard.testing.models import OddMLP, TinyGPT


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


# -- validation (no processes needed) ---------------------------------------------------------
def test_bad_strategy_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown sharding strategy 'BOGUS'.*FULL_SHARD.*"
                                         r"SHARD_GRAD_OP.*NO_SHARD.*HYBRID_SHARD"):
        FSDPStrategy(sharding_strategy="BOGUS")


def test_strategy_names_any_case_and_torch_enum() -> None:
    from torch.distributed.fsdp import ShardingStrategy as TorchSharding

    # Reported as torch's enum, as Lightning does (more: tests/unit/test_fabric_api_units.py).
    assert FSDPStrategy(sharding_strategy="no_shard").sharding_strategy is TorchSharding.NO_SHARD
    assert FSDPStrategy(sharding_strategy=TorchSharding.SHARD_GRAD_OP).sharding_strategy is (
        TorchSharding.SHARD_GRAD_OP
    )
    assert FSDPStrategy().sharding_strategy.name == "FULL_SHARD"


def test_mesh_without_hybrid() -> None:
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\)\) only applies to "
                                         r"sharding_strategy='HYBRID_SHARD'.*'FULL_SHARD'"):
        FSDPStrategy(device_mesh=(2, 2))


def test_malformed_mesh() -> None:
    with pytest.raises(ValueError, match=r"\(replicate, shard\) tuple of two positive ints"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 0))


def test_mesh_product_not_world_size() -> None:
    import lightning as L

    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=1)
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\)\) has 4 ranks but the world "
                                         r"size is 1.*replicate \* shard == 1"):
        fabric.launch()  # before any process group exists


def test_unknown_keyword_is_named() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'bogus_option'.*"
                                        r"bucketing_strategy"):
        FSDPStrategy(bogus_option=1)
    # torch FSDP's keywords are accepted (tests/distributed/test_torch_fsdp_options.py).
    FSDPStrategy(limit_all_gathers=True, use_orig_params=True, forward_prefetch=True,
                 sync_module_states=True)


def test_options_are_validated_and_stored() -> None:
    from torch.distributed.fsdp import CPUOffload as TorchOffload
    from torch.distributed.fsdp import MixedPrecision as TorchMP

    s = FSDPStrategy(cpu_offload=True, mixed_precision=TorchMP(param_dtype=torch.bfloat16),
                     precision="bf16-mixed", bucketing_strategy="block", prefetch_limit=2)
    assert s.cpu_offload == TorchOffload(offload_params=True)
    assert s._cpu_offload == fullshard.CPUOffload(offload_params=True)  # what the engine gets
    assert s.mixed_precision_config.param_dtype == torch.bfloat16
    assert s.precision == "bf16-mixed"
    assert FSDPStrategy(cpu_offload=TorchOffload(offload_params=False))._cpu_offload == (
        fullshard.CPUOffload(False)
    )
    assert FSDPStrategy(precision="16-true").mixed_precision_config.param_dtype == torch.float16
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported.*bf16-mixed"):
        FSDPStrategy(precision="64-true")
    with pytest.raises(ValueError, match=r"state_dict_type='bogus'"):
        FSDPStrategy(state_dict_type="bogus")
    with pytest.raises(ValueError, match=r"Unknown bucketing strategy"):
        FSDPStrategy(bucketing_strategy="nope")
    with pytest.raises(ValueError, match=r"cannot set both"):
        FSDPStrategy(activation_checkpointing=nn.Linear,
                     activation_checkpointing_policy={nn.Linear})
    with pytest.warns(DeprecationWarning, match="activation_checkpointing_policy"):
        s = FSDPStrategy(activation_checkpointing=[nn.Linear])
    assert s.activation_checkpointing_policy == {nn.Linear}
    with pytest.raises(TypeError, match=r"auto_wrap_policy must be"):
        FSDPStrategy(auto_wrap_policy=3)


# -- on 2 ranks ---------------------------------------------------------------------------
def _strategy(**kwargs) -> FSDPStrategy:
    s = FSDPStrategy(**kwargs)
    s.setup_environment()
    return s


def _clip_parity(strategy_kwargs: dict, norm_type: float) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = OddMLP()
    s = _strategy(**strategy_kwargs)
    model = s.setup_module(copy.deepcopy(ref))
    x, y = ref.make_batch(4 * world, torch.Generator().manual_seed(1))
    model.loss(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward()
    ref.loss(x, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
    got = s.clip_gradients_norm(model, None, 0.05, norm_type=norm_type)
    mesh = model.fullshard_runtime.mesh
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        want = local_rows(rp.grad, mesh.shard.size, mesh.shard.rank)
        assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-7), name
    return got.item(), expected.item()


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_gradients_norm_is_the_global_norm(group2: DistributedGroup, norm_type) -> None:
    for kwargs in (
        {"sharding_strategy": "FULL_SHARD"},
        {"sharding_strategy": "NO_SHARD"},
        {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)},
        {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (1, 2)},
    ):
        for got, expected in group2.run(_clip_parity, kwargs, norm_type):
            assert got == pytest.approx(expected, rel=1e-5), kwargs


def _clip_nan() -> tuple[str, float]:
    s = _strategy(sharding_strategy="FULL_SHARD")
    torch.manual_seed(0)
    model = s.setup_module(OddMLP())
    x, y = model.make_batch(4, torch.Generator().manual_seed(1))
    model.loss(x, y).backward()
    if dist.get_rank() == 0:  # a NaN in one rank's shard only
        next(p for p in model.parameters() if p.numel()).grad.view(-1)[0] = float("nan")
    quiet = s.clip_gradients_norm(model, None, 1.0, error_if_nonfinite=False)
    try:
        s.clip_gradients_norm(model, None, 1.0, norm_type="inf", error_if_nonfinite=True)
    except RuntimeError as e:
        return str(e), quiet.item()
    return "no error", quiet.item()


def test_clip_gradients_nan_raises_on_every_rank(group2: DistributedGroup) -> None:
    for message, quiet in group2.run(_clip_nan):
        assert "non-finite" in message and "error_if_nonfinite=False" in message
        assert quiet != quiet  # NaN without the check


def _optimizer_checks() -> list[str]:
    s = _strategy()
    torch.manual_seed(0)
    messages = []
    model = OddMLP()
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # built before setup
    wrapped = s.setup_module(model)
    try:
        s.setup_optimizer(early)
    except ValueError as e:
        messages.append(str(e))
    s.setup_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))  # fine
    # Joint setup points a fresh optimizer at the shards; a stepped one is refused.
    other = OddMLP()
    joint = torch.optim.AdamW(other.parameters())
    other, (joint,), _ = s.setup_module_and_optimizers(other, [joint])
    assert [id(p) for p in joint.param_groups[0]["params"]] == [id(p) for p in other.parameters()]
    stepped_model = OddMLP()
    stepped = torch.optim.SGD(stepped_model.parameters(), lr=0.1, momentum=0.9)
    stepped_model.loss(*stepped_model.make_batch(2, torch.Generator())).backward()
    stepped.step()
    try:
        s.setup_module_and_optimizers(stepped_model, [stepped])
    except ValueError as e:
        messages.append(str(e))
    with torch.device("meta"):
        meta_model = OddMLP()
    try:
        s.setup_module_and_optimizers(meta_model, [torch.optim.SGD(meta_model.parameters(), 0.1)])
    except RuntimeError as e:
        messages.append(str(e))
    try:
        s.clip_gradients_norm(nn.Linear(2, 2), None, 1.0)
    except TypeError as e:
        messages.append(str(e))
    return messages


def test_optimizer_validation(group2: DistributedGroup) -> None:
    for messages in group2.run(_optimizer_checks):
        assert len(messages) == 4, messages
        before, stepped, meta, unwrapped = messages
        assert "not shards of a model set up by this strategy" in before
        assert "fabric.setup_module(model)" in before and "setup_optimizers" in before
        assert "already has state" in stepped
        assert "meta-device parameters" in meta
        assert "a model set up by FSDPStrategy" in unwrapped


def _collectives() -> dict:
    s = _strategy()
    rank = dist.get_rank()
    out = {
        "mean": s.all_reduce(torch.tensor([rank + 1.0])).item(),
        "sum": s.all_reduce(torch.tensor([rank + 1.0]), reduce_op="sum").item(),
        "max": s.all_reduce(torch.tensor([rank + 1]), reduce_op=dist.ReduceOp.MAX).item(),
        "int_mean": s.all_reduce(torch.tensor([rank + 2])).item(),
        "bcast": s.broadcast({"path": f"/ckpt/{rank}", "n": [rank]}, src=1),
        "sampler": s.distributed_sampler_kwargs,
        "passthrough": s.all_reduce("not a tensor"),
    }
    s.barrier("x")
    try:
        s.all_reduce(torch.ones(1), reduce_op="median")
    except ValueError as e:
        out["bad_op"] = str(e)
    return out


def test_user_collectives(group2: DistributedGroup) -> None:
    for rank, out in enumerate(group2.run(_collectives)):
        assert (out["mean"], out["sum"], out["max"], out["int_mean"]) == (1.5, 3.0, 2, 2.5)
        assert out["bcast"] == {"path": "/ckpt/1", "n": [1]}
        assert out["sampler"] == {"num_replicas": 2, "rank": rank}
        assert out["passthrough"] == "not a tensor"
        assert "'median' is not supported" in out["bad_op"]


def _checkpoint_round_trip(root: str, state_dict_type: str) -> dict:
    s = _strategy(state_dict_type=state_dict_type, auto_wrap_policy={nn.Linear})
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = s.setup_module(TinyGPT(layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for _ in range(2):
        x, y = model.make_batch(2, torch.Generator().manual_seed(rank))
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    path = f"{root}/{state_dict_type}"
    s.save_checkpoint(path, {"model": model, "optimizer": opt, "sched": sched, "step": 2,
                             "note": "hi"})
    torch.manual_seed(1)  # a different init, to see the load
    fresh = s.setup_module(TinyGPT(layers=1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1)
    state = {"model": fresh, "optimizer": fresh_opt, "sched": fresh_sched, "step": 0}
    rest = s.load_checkpoint(path, state)
    out = {"rest": rest, "step": state["step"], "epoch": fresh_sched.last_epoch,
           "lr": fresh_opt.param_groups[0]["lr"]}
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
        for k, v in opt.state[a].items():
            assert torch.equal(v, fresh_opt.state[b][k]), (n, k)
    try:
        s.load_checkpoint(path, {"model": fresh, "missing": 1})
    except KeyError as e:
        out["strict"] = str(e)
    extra = {"model": fresh, "missing": 1}
    s.load_checkpoint(path, extra, strict=False)
    out["non_strict"] = extra["missing"]
    if state_dict_type == "full" and rank == 0:  # portable: a plain module loads it
        ckpt = torch.load(path, weights_only=True)
        plain = TinyGPT(layers=1)
        plain.load_state_dict(ckpt["model"])
        full = fullshard.full_state_dict(model)
        out["plain_equal"] = all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())
        out["opt_keys"] = sorted(ckpt["optimizer"]["state"])[:2]
        out["opt_shape"] = tuple(ckpt["optimizer"]["state"]["tok.weight"]["exp_avg"].shape)
    else:
        fullshard.full_state_dict(model)  # collective: keep ranks in step
    return out


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoint_round_trip(group2: DistributedGroup, tmp_path, state_dict_type) -> None:
    outs = group2.run(_checkpoint_round_trip, str(tmp_path), state_dict_type)
    for out in outs:
        assert out["step"] == 2 and out["epoch"] == 2 and out["lr"] == pytest.approx(0.0001)
        assert out["rest"] == {"note": "hi"}
        assert "'missing' that does not exist in the loaded checkpoint" in out["strict"]
        assert out["non_strict"] == 1
    if state_dict_type == "full":
        assert outs[0]["plain_equal"]
        assert outs[0]["opt_keys"] == ["blocks.0.attn.proj.bias", "blocks.0.attn.proj.weight"]
        assert outs[0]["opt_shape"] == (37, 16)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
    else:
        assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == [
            ".fullshard-checksums.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
        ]


def _rank_raises_in_setup() -> None:
    FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 4)).setup_environment()


def test_mesh_product_checked_in_setup_environment(group2: DistributedGroup) -> None:
    with pytest.raises(RankFailure, match=r"has 4 ranks but the world size is 2"):
        group2.run(_rank_raises_in_setup)


def _empty_init() -> tuple[bool, dict]:
    s = _strategy(auto_wrap_policy={nn.Linear})
    torch.manual_seed(0)
    with s.module_init_context(empty_init=True):
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.LayerNorm(5))
    was_meta = all(p.is_meta for p in model.parameters())
    model = s.setup_module(model)
    assert not any(p.is_meta for p in model.parameters())
    return was_meta, fullshard.full_state_dict(model)


def test_module_init_context_empty_init(group2: DistributedGroup) -> None:
    (meta0, full0), (meta1, full1) = group2.run(_empty_init)
    assert meta0 and meta1
    assert full0.keys() == full1.keys() and all(torch.equal(full0[k], full1[k]) for k in full0)
