"""`model.state_dict()` of a wrapped model holds DTensors, as torch FSDP2's does (issue 36,
item 4), so code written for FSDP2 reads and loads it unchanged.

OddMLP's rows split unevenly, one rank owns zero rows of the last layer, and `out_scale` is a
0-dim parameter. Every check compares with the unwrapped model of one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fullshard
from fullshard.checkpoint import save_checkpoint
from fullshard.engine.dtensor_state import local_state_dict
from fullshard.testing import DistributedGroup
from fullshard.testing.models import OddMLP


def _pair(seed: int, **kwargs):
    torch.manual_seed(seed)
    ref = OddMLP()
    torch.manual_seed(seed)
    return ref, fullshard.fsdp(OddMLP(), device="cpu", auto_wrap_policy={torch.nn.Linear},
                               **kwargs)


def _check_values(sharding: str, placements: tuple) -> None:
    ref, model = _pair(0, sharding_strategy=sharding)
    want = ref.state_dict()
    sd = model.state_dict()
    assert list(sd) == list(want)
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert value.shape == want[key].shape and value.stride() == want[key].stride(), key
        assert torch.equal(value.full_tensor(), want[key]), key
        if want[key].dim() == 0:
            continue  # on shard rank 0 only: Partial over the shard axis
        assert value.placements == placements, key
        # the rows torch itself would give this rank (torch.chunk's layout, no padding)
        laid_out = distribute_tensor(want[key], value.device_mesh, placements).to_local()
        assert torch.equal(value.to_local(), laid_out), key
    # fullshard's own readers still see the registered parameters
    local = local_state_dict(model, keep_vars=True)
    assert all(local[n] is p for n, p in model.named_parameters())


def _dcp_round_trip() -> None:
    ref, model = _pair(0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    rank = torch.distributed.get_rank()
    if rank == 0:
        assert full.keys() == ref.state_dict().keys()
        for key, want in ref.state_dict().items():
            assert not isinstance(full[key], DTensor) and full[key].device.type == "cpu"
            assert torch.equal(full[key], want), key
    else:
        assert full == {}

    # full, from rank 0 only, into a differently initialised wrapped model
    _, other = _pair(1)
    set_model_state_dict(other, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    _assert_equals_reference(other, ref)

    # sharded (DTensor values) into another one
    sharded = get_model_state_dict(model)
    assert all(isinstance(v, DTensor) for v in sharded.values())
    _, third = _pair(2)
    set_model_state_dict(third, sharded)
    _assert_equals_reference(third, ref)

    # plain load_state_dict takes DTensors too, also laid out on another mesh (Replicate)
    _, fourth = _pair(3)
    replicated = {k: v.redistribute(placements=[Replicate()]) if v.dim() else v
                  for k, v in model.state_dict().items()}
    fourth.load_state_dict(replicated)
    _assert_equals_reference(fourth, ref)


def _assert_equals_reference(model, ref) -> None:
    for key, want in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key].full_tensor(), want), key
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


def _filtered_full_save(path: str) -> None:
    _, model = _pair(0)
    keep = {"model": lambda name, _: name.startswith("layers.3.") or name == "out_scale"}
    save_checkpoint(path, {"model": model, "step": 4}, state_dict_type="full", filter=keep)


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


def test_state_dict_holds_dtensors_laid_out_as_torch_chunk(group2) -> None:
    group2.run(_check_values, "FULL_SHARD", (Shard(0),))
    group2.run(_check_values, "NO_SHARD", (Replicate(),))


def test_hybrid_state_dict_is_replicate_then_shard_on_the_2d_mesh() -> None:
    with DistributedGroup(4) as g:
        g.run(_check_values_hybrid)


def _check_values_hybrid() -> None:
    ref, model = _pair(0, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    sd = model.state_dict()
    mesh = sd["layers.0.weight"].device_mesh
    assert mesh.shape == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    for key, want in ref.state_dict().items():
        if want.dim():
            assert sd[key].placements == (Replicate(), Shard(0)), key
            laid_out = distribute_tensor(want, mesh, (Replicate(), Shard(0))).to_local()
            assert torch.equal(sd[key].to_local(), laid_out), key
        assert torch.equal(sd[key].full_tensor(), want), key


def test_torch_dcp_full_and_sharded_round_trip(group2) -> None:
    group2.run(_dcp_round_trip)


def test_filtered_full_save_holds_exactly_the_filtered_full_tensors(group2, tmp_path) -> None:
    path = tmp_path / "adapter.pt"
    group2.run(_filtered_full_save, str(path))
    torch.manual_seed(0)
    want = OddMLP().state_dict()
    saved = torch.load(path, weights_only=True)
    assert sorted(saved["model"]) == ["layers.3.bias", "layers.3.weight", "out_scale"]
    for key, value in saved["model"].items():
        assert type(value) is torch.Tensor and torch.equal(value, want[key]), key
    assert saved["step"] == 4
