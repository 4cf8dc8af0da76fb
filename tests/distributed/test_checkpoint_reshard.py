"""World size and strategy changes (issue 4, acceptance 2): a sharded checkpoint saved by 2
FULL_SHARD ranks loads into 3 ranks, into HYBRID (2, 2) on 4 ranks and into one process without
a process group, with the same model and optimizer (bit for bit, compared through full
checkpoints keyed by name), and training continues with the uninterrupted run's losses.

OddMLP has rows that split unevenly, ranks owning zero rows, and a 0-dim parameter."""

from __future__ import annotations

import pytest
import torch

from fullshard.checkpoint import load_checkpoint, save_checkpoint
from fullshard.testing import DistributedGroup
from tests.distributed import ckpt_common as cc

K = 3
TOL = dict(rtol=1e-5, atol=1e-6)  # docs/architecture.md, invariant 3: losses to fp32 round-off


@pytest.fixture(scope="module")
def groups():
    with DistributedGroup(2) as g2, DistributedGroup(3) as g3, DistributedGroup(4) as g4:
        yield {2: g2, 3: g3, 4: g4}


def _save_on_two(root: str) -> dict:
    s = cc.strategy("FULL_SHARD")
    model, opt, sched = cc.build("odd", s)
    straight = cc.train(model, opt, sched, 2 * K)
    model, opt, sched = cc.build("odd", s)
    cc.train(model, opt, sched, K)
    state = cc.state_of(model, opt, sched)
    s.save_checkpoint(f"{root}/sharded", state)
    save_checkpoint(f"{root}/full-2.pt", state, state_dict_type="full")
    return {"straight": straight}


def _resume(root: str, sharding: str, mesh, tag: str) -> list[float]:
    s = cc.strategy(sharding, mesh)
    model, opt, sched = cc.build("odd", s, seed=7)
    state = cc.state_of(model, opt, sched)
    s.load_checkpoint(f"{root}/sharded", state)
    # The same model and optimizer: a full checkpoint written from here equals the original's.
    save_checkpoint(f"{root}/full-{tag}.pt", state, state_dict_type="full")
    save_checkpoint(f"{root}/sharded-{tag}", state)  # HYBRID: replicas must not write twice
    return cc.train(model, opt, sched, K)


def _shard_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".distcp")


def test_two_ranks_to_three_hybrid_and_one_process(groups, tmp_path) -> None:
    root = str(tmp_path)
    straight = groups[2].run(_save_on_two, root)[0]["straight"]
    reference = torch.load(f"{root}/full-2.pt", weights_only=True)

    losses3 = groups[3].run(_resume, root, "FULL_SHARD", None, "3")
    losses4 = groups[4].run(_resume, root, "HYBRID_SHARD", (2, 2), "hybrid")
    for tag in ("3", "hybrid"):
        cc.assert_same_full(reference, torch.load(f"{root}/full-{tag}.pt", weights_only=True))
    # Four HYBRID (2, 2) ranks hold every shard twice but write it once: the same bytes as the
    # two FULL_SHARD ranks (4 files, 2 of them with only what nobody else holds: nothing).
    assert _shard_bytes(tmp_path / "sharded-hybrid") == _shard_bytes(tmp_path / "sharded")

    # One process, no process group, the unwrapped model and a plain optimizer.
    model, opt, sched = cc.build("odd", None, seed=7)
    state = cc.state_of(model, opt, sched)
    load_checkpoint(f"{root}/sharded", state)
    save_checkpoint(f"{root}/full-1.pt", state, state_dict_type="full")
    cc.assert_same_full(reference, torch.load(f"{root}/full-1.pt", weights_only=True))
    losses1 = cc.train(model, opt, sched, K)

    for losses in (losses3[0], losses4[0], losses1):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(straight[K:]), **TOL)
