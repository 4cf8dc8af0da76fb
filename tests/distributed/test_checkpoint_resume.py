"""Resume parity (issue 4, acceptance 1): training 2K steps straight through and training K
steps, saving, exiting the processes, loading in new ones and training K more give
bit-identical losses and final weights -- FULL_SHARD and SHARD_GRAD_OP, both formats, with an
LR scheduler and the RNG state (the data is drawn from it) in the checkpoint."""

from __future__ import annotations

import pytest
import torch

import fullshard
from fullshard.testing import DistributedGroup
from tests.distributed import ckpt_common as cc

K = 3
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
FORMATS = ("sharded", "full")


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


def _first_half(root: str) -> dict:
    """Per strategy: 2K steps straight; then K steps from the same start, saved in both
    formats."""
    out = {}
    for sharding in STRATEGIES:
        s = cc.strategy(sharding)
        model, opt, sched = cc.build("gpt", s)
        losses = cc.train(model, opt, sched, 2 * K)
        out[sharding] = {"losses": losses, "final": fullshard.full_state_dict(model)}
        model, opt, sched = cc.build("gpt", s)
        out[sharding]["first"] = cc.train(model, opt, sched, K)
        state = cc.state_of(model, opt, sched)
        for fmt in FORMATS:
            cc.strategy(sharding, state_dict_type=fmt).save_checkpoint(
                f"{root}/{sharding}-{fmt}", state)
    return out


def _second_half(root: str) -> dict:
    """In fresh processes: a differently initialized model, load, K more steps."""
    out = {}
    for sharding in STRATEGIES:
        for fmt in FORMATS:
            s = cc.strategy(sharding)
            model, opt, sched = cc.build("gpt", s, seed=123)
            torch.manual_seed(999)  # the RNG must come from the checkpoint
            state = cc.state_of(model, opt, sched)
            state["note"] = None
            rest = s.load_checkpoint(f"{root}/{sharding}-{fmt}", state)
            assert rest == {} and state["note"] == "hi", (rest, state["note"])
            assert sched.last_epoch == K and opt.state_dict()["state"][0]["step"] == K
            losses = cc.train(model, opt, sched, K)
            out[sharding, fmt] = {"losses": losses, "final": fullshard.full_state_dict(model)}
    return out


def test_resume_parity_bit_identical(group2: DistributedGroup, tmp_path) -> None:
    first = group2.run(_first_half, str(tmp_path))[0]
    group2.close()  # exit the processes: nothing survives in memory
    second = group2.run(_second_half, str(tmp_path))
    for sharding in STRATEGIES:
        straight = first[sharding]
        assert straight["first"] == straight["losses"][:K]
        for fmt in FORMATS:
            resumed = second[0][sharding, fmt]
            assert resumed["losses"] == straight["losses"][K:], (sharding, fmt)
            assert second[1][sharding, fmt]["losses"] == resumed["losses"]
            assert resumed["final"].keys() == straight["final"].keys()
            for k, v in straight["final"].items():
                assert torch.equal(v, resumed["final"][k]), (sharding, fmt, k)
