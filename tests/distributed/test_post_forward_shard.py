"""hpZ: an int `reshard_after_forward` keeps each unit sharded over a node after its forward.

4 gloo ranks as 2 "nodes" of 2 (`reshard_after_forward=2`): parity with one process every
step (plain, activation checkpointing, Adam), the bytes each gather moves (forward over all 4
ranks, backward over the node only), what stays between forward and backward (half of every
unit but the root), nothing between steps, and the errors that name the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.testing import DistributedGroup, check_parity
from fullshard.testing.models import Block, TinyGPT


@pytest.fixture(scope="module")
def group4():
    with DistributedGroup(4) as g:
        yield g


def _tiny_gpt() -> TinyGPT:
    return TinyGPT(vocab=37, dim=16, layers=4, heads=2, seq=8)


def _parity(checkpointed: bool, optimizer: str) -> dict:
    report = check_parity(
        _tiny_gpt, steps=3, optimizer=optimizer, lr=0.05, sharding_strategy="FULL_SHARD",
        bucketing_strategy="BLOCK", auto_wrap_policy={Block}, reshard_after_forward=2,
        activation_checkpointing_policy={Block} if checkpointed else None,
        check_params=optimizer == "sgd",
    )
    return {"losses": report.losses, "gathers": [c["all_gather"] for c in report.calls_per_step]}


@pytest.mark.parametrize(("checkpointed", "optimizer"),
                         [(False, "sgd"), (True, "sgd"), (False, "adamw")])
def test_parity_with_one_process(group4, checkpointed, optimizer):
    results = group4.run(_parity, checkpointed, optimizer)
    assert all(r == results[0] for r in results[1:])
    # root (1) + 4 blocks gathered in forward and again in backward: 1 + 2 * 4
    assert results[0]["gathers"] == [9, 9, 9]


def _int8_losses(hpz: int | None) -> list[float]:
    torch.manual_seed(0)
    model = fullshard.fsdp(_tiny_gpt(), device="cpu", sharding_strategy="FULL_SHARD",
                           bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                           reshard_after_forward=hpz, compression="int8")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(dist.get_rank() + 1)
    losses = []
    for _ in range(3):
        loss = model.loss(*model.make_batch(2, gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_with_int8_weights_backward_reuses_the_decoded_weights_of_forward(group4):
    """The kept half holds the decoded weights forward computed with, as a full int8
    re-gather decodes them again: the losses are bitwise those of plain resharding."""
    assert group4.run(_int8_losses, 2) == group4.run(_int8_losses, None)


def _skipped_backward_then_edited_weights() -> list[int]:
    """A forward whose backward is skipped (its loss dropped) leaves every block's half kept;
    weights edited in place afterwards make those halves stale: the next step must gather the
    new shards, not the kept copies (parity checks it), and nothing is left between steps."""
    kept = []

    def skip_then_edit(step: int, model: torch.nn.Module, ref: torch.nn.Module) -> None:
        if step != 1:
            return
        model.loss(*ref.make_batch(2, torch.Generator().manual_seed(7)))  # no backward
        kept.append(fullshard.memory_stats()["unsharded_param_bytes"])
        with torch.no_grad():
            for p in [*model.parameters(), *ref.parameters()]:
                p.mul_(0.9)

    check_parity(_tiny_gpt, steps=3, sharding_strategy="FULL_SHARD", bucketing_strategy="BLOCK",
                 auto_wrap_policy={Block}, reshard_after_forward=2, on_step=skip_then_edit)
    return [*kept, fullshard.memory_stats()["unsharded_param_bytes"]]


def test_a_skipped_backward_and_edited_weights_drop_the_kept_halves(group4):
    for kept, between_steps in group4.run(_skipped_backward_then_edited_weights):
        assert kept > 0
        assert between_steps == 0


def _bytes_and_memory() -> dict:
    torch.manual_seed(0)
    ref = _tiny_gpt()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy="FULL_SHARD",
                           bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                           reshard_after_forward=2)
    runtime = model.fullshard_runtime
    x, y = ref.make_batch(2, torch.Generator().manual_seed(1))
    fullshard.reset_comm_stats()
    loss = model.loss(x, y)
    after_forward = fullshard.memory_stats()["unsharded_param_bytes"]
    forward_bytes = fullshard.comm_stats()["all_gather"]["wire_bytes"]
    loss.backward()
    blocks, root = runtime.units[1:], runtime.units[0]
    return {
        "group": runtime.mesh.post_forward.ranks,
        "states": [u.state.value for u in runtime.units],
        "after_forward": after_forward,
        # the root whole, each block's half and, for the last block, whose backward gather
        # is already in flight (the turn from forward to backward), its gathered buffer too
        "expected_after_forward": root.unsharded_nbytes + blocks[-1].unsharded_nbytes
        + sum(u.unsharded_nbytes // 2 for u in blocks),
        "forward_bytes": forward_bytes,
        "all_bytes": fullshard.comm_stats()["all_gather"]["wire_bytes"],
        "gather_nbytes": [u.gather_nbytes for u in runtime.units],
        "between_steps": fullshard.memory_stats()["unsharded_param_bytes"],
    }


def test_backward_gathers_over_the_node_from_half_of_each_unit(group4):
    results = group4.run(_bytes_and_memory)
    assert [r["group"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for r in results:
        assert r["after_forward"] == r["expected_after_forward"]
        root, *blocks = r["gather_nbytes"]
        # Sent by this rank. Forward: each unit's shard to 3 peers; backward: each block's
        # half (2 shards) to the one node peer -- 2/3 of a full re-gather, none of it across
        # nodes. The last block's backward gather starts as forward ends.
        assert r["forward_bytes"] == 3 * (root + sum(blocks)) + 2 * blocks[-1]
        assert r["all_bytes"] == 3 * (root + sum(blocks)) + 2 * sum(blocks)
        assert r["states"] == ["sharded"] * 5
        assert r["between_steps"] == 0


def _hybrid_device_mesh() -> dict:
    """HYBRID_SHARD on a 2-D DeviceMesh (1, 4): the runs come from the mesh's own layout."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    runs = []
    report = check_parity(_tiny_gpt, steps=2, sharding_strategy="HYBRID_SHARD", device_mesh=mesh,
                          bucketing_strategy="BLOCK", auto_wrap_policy={Block},
                          reshard_after_forward=2, on_step=lambda step, model, ref: runs.append(
                              model.fullshard_runtime.mesh.post_forward.ranks))
    return {"losses": report.losses, "run": runs[0]}


def test_a_hybrid_device_mesh_splits_its_shard_groups_into_runs(group4):
    results = group4.run(_hybrid_device_mesh)
    assert all(r["losses"] == results[0]["losses"] for r in results[1:])
    assert [r["run"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]


def _wrap(**kwargs: object) -> str:
    kwargs.setdefault("sharding_strategy", "FULL_SHARD")
    fullshard.fsdp(_tiny_gpt(), device="cpu", auto_wrap_policy={Block}, **kwargs)
    return "wrapped"


def test_a_size_that_does_not_divide_the_shard_axis_names_the_fix(group4):
    with pytest.raises(Exception, match=r"reshard_after_forward=3 must divide the 4 ranks"):
        group4.run(_wrap, reshard_after_forward=3)


def test_bad_sizes_and_keeping_strategies_are_refused(group4):
    with pytest.raises(Exception, match=r"reshard_after_forward=0 must be >= 1"):
        group4.run(_wrap, reshard_after_forward=0)
    with pytest.raises(Exception, match=r"reshard_after_forward=2 asks to release .* "
                                        r"'SHARD_GRAD_OP' keeps them"):
        group4.run(_wrap, reshard_after_forward=2, sharding_strategy="SHARD_GRAD_OP")
