"""Helpers shared by the checkpoint tests: a deterministic training loop whose data comes from
the global torch RNG (so resuming needs the RNG state), run sharded on any world size or in
one process on the unwrapped model, plus comparisons of full checkpoints."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FSDPStrategy
from fullshard.testing.models import OddMLP, TinyGPT

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: the same global batch on every world size


class RNG:
    """A stateful object holding the global torch RNG (what the data is drawn from)."""

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["torch"])


def make_model(kind: str) -> nn.Module:
    return TinyGPT(layers=2) if kind == "gpt" else OddMLP()


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def strategy(sharding: str = "FULL_SHARD", mesh: tuple[int, int] | None = None,
             state_dict_type: str = "sharded", **kwargs) -> FSDPStrategy:
    s = FSDPStrategy(sharding_strategy=sharding, device_mesh=mesh,
                     state_dict_type=state_dict_type, **kwargs)
    s.setup_environment()
    return s


def build(kind: str, s: FSDPStrategy | None, seed: int = 0):
    """(model, optimizer, scheduler): sharded by `s`, or plain when `s` is None."""
    torch.manual_seed(seed)
    model = make_model(kind)
    if s is not None:
        model = s.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model: nn.Module, opt, sched, steps: int) -> list[float]:
    """`steps` steps on batches drawn from the global RNG (the same on every rank); each rank
    trains on its slice of the global batch. Returns the global mean losses."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
    per = GLOBAL_BATCH // world
    losses = []
    for _ in range(steps):
        x, y = model.make_batch(GLOBAL_BATCH, None)
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def state_of(model, opt, sched) -> dict:
    return {"model": model, "optimizer": opt, "scheduler": sched, "rng": RNG(), "note": "hi"}


def assert_same_full(a: dict, b: dict, keys=("model", "optimizer")) -> None:
    """Two full-format checkpoint dicts hold bit-identical model and optimizer state."""
    for key in keys:
        assert set(a[key]) == set(b[key]), key
    ma, mb = a["model"], b["model"]
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"model {k}"
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for name, entry in oa["state"].items():
        assert entry.keys() == ob["state"][name].keys(), name
        for k, v in entry.items():
            w = ob["state"][name][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (name, k)
