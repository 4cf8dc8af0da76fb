"""Loading a checkpoint never runs code from it unless the user opts in (issue 15), on 2 gloo
ranks with sharded models (the one-process cases of every file kind: tests/unit/
test_checkpoint_safety.py).

- Everything fullshard writes -- a sharded model, AdamW state, an LR scheduler, RNG states
  (torch and Python's `random`) and user scalars, in both formats -- loads under the default
  (`weights_only=True`) on every rank, into a fresh sharded model, bit for bit, and its files
  load with plain `torch.load(weights_only=True)`.
- A payload planted in a sharded checkpoint's `meta.pt` or in a full file runs on no rank
  through Lightning's `Fabric.load` (fullshard's strategy in it) or
  `FSDPStrategy.load_checkpoint`: every rank raises the same clear
  error; `weights_only=False` is the opt-in, and then it does run (so the test can fail).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.checkpoint import UnsafeCheckpointError
from fullshard.testing import DistributedGroup
from tests.distributed import ckpt_common as cc


def _touch(path: str) -> str:
    Path(path).write_text("the payload ran")
    return "payload ran"


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


def _state(model, opt, sched) -> dict:
    return {**cc.state_of(model, opt, sched), "python_random": random.getstate(), "step": 7,
            "lr": 0.25, "tokens": torch.tensor(1234), "shape": torch.Size([3, 4]),
            "history": [1.5, 0.75]}


def _round_trip(root: str, fmt: str) -> dict:
    random.seed(5)  # meta.pt holds rank 0's values: make them every rank's
    s = cc.strategy(state_dict_type=fmt)
    model, opt, sched = cc.build("gpt", s)
    cc.train(model, opt, sched, 2)
    path = f"{root}/{fmt}"
    saved = _state(model, opt, sched)
    s.save_checkpoint(path, saved)
    expected = fullshard.full_state_dict(model)

    fresh, fresh_opt, fresh_sched = cc.build("gpt", s, seed=3)
    loaded = {**_state(fresh, fresh_opt, fresh_sched), "python_random": None, "step": 0,
              "shape": None}
    rest = s.load_checkpoint(path, loaded)  # the default: weights_only=True
    got = fullshard.full_state_dict(fresh)
    same_params = all(torch.equal(got[k], v) for k, v in expected.items())
    same_opt = all(torch.equal(v, fresh_opt.state[b][k])
                   for a, b in zip(model.parameters(), fresh.parameters())
                   for k, v in opt.state[a].items())
    raw = None
    if dist.get_rank() == 0:  # plain torch.load with weights_only=True reads our files
        raw = torch.load(path if fmt == "full" else f"{path}/meta.pt", weights_only=True)
    return {"params": same_params and len(got) == len(expected), "opt": same_opt,
            "sched": fresh_sched.state_dict() == sched.state_dict(),
            "python_random": loaded["python_random"] == saved["python_random"],
            "scalars": (loaded["step"], loaded["shape"], loaded["lr"], loaded["history"]),
            "tokens": int(loaded["tokens"]), "rest": sorted(rest),
            "raw_keys": None if raw is None else sorted(raw)}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_everything_fullshard_writes_loads_under_the_default(group2, tmp_path, fmt) -> None:
    for out in group2.run(_round_trip, str(tmp_path), fmt):
        assert out["params"] and out["opt"] and out["sched"] and out["python_random"]
        assert out["scalars"] == (7, torch.Size([3, 4]), 0.25, [1.5, 0.75])
        assert out["tokens"] == 1234 and out["rest"] == []
        if out["raw_keys"] is not None:
            base = ["history", "lr", "note", "python_random", "rng", "scheduler", "shape", "step",
                    "tokens"]
            assert out["raw_keys"] == (base if fmt == "sharded"
                                       else sorted([*base, "model", "optimizer"]))


def _planted(root: str, fmt: str) -> dict:
    import lightning as L

    s = cc.strategy(state_dict_type=fmt)
    model, opt, sched = cc.build("gpt", s)
    path = f"{root}/{fmt}"
    marker = f"{root}/ran-{fmt}"
    s.save_checkpoint(path, cc.state_of(model, opt, sched))
    if dist.get_rank() == 0:  # an attacker edits the file: a payload under a user key
        file = path if fmt == "full" else f"{path}/meta.pt"
        data = torch.load(file, weights_only=True)
        data["evil"] = [Payload(marker)]
        torch.save(data, file)
        if fmt == "sharded":  # and drops the checksums that would give the edit away
            Path(f"{path}/.fullshard-checksums.json").unlink()
    dist.barrier()
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=s)
    fabric.launch()  # LOCAL_RANK is set: joins the existing process group, starts nothing
    out: dict = {}
    for name, call in (("fabric", lambda: fabric.load(path, cc.state_of(model, opt, sched))),
                       ("strategy", lambda: s.load_checkpoint(path, {"model": model}))):
        try:
            call()
            out[name] = "loaded"
        except UnsafeCheckpointError as e:
            out[name] = str(e)
        dist.barrier()
        out[f"{name}_ran"] = Path(marker).exists()
    rest = fabric.load(path, cc.state_of(model, opt, sched), weights_only=False)  # the opt-in
    out["opt_in"] = (rest.get("evil"), Path(marker).exists())
    return out


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_planted_payload_runs_on_no_rank(group2, tmp_path, fmt) -> None:
    pytest.importorskip("lightning")
    for out in group2.run(_planted, str(tmp_path), fmt):
        for name in ("fabric", "strategy"):
            assert not out[f"{name}_ran"], f"{name}: the payload ran on a default load"
            assert "_touch" in out[name] and "['evil'][0]" in out[name], out[name]
            assert "weights_only=False" in out[name] and "Only for files you trust" in out[name]
        assert out["opt_in"] == (["payload ran"], True)
