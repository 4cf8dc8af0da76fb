"""Lightning's own Fabric with fullshard's strategy on 2 real gloo ranks (one group for the
module): all_gather (with gradients), rank_zero_first, setup twice, model.module /
mark_forward_method on a sharded model, load_raw, init_tensor, and Lightning's
ThroughputMonitor / measure_flops."""

from __future__ import annotations

import argparse
import copy
import csv
import time
from pathlib import Path

import pytest
import torch

import fullshard
from fullshard.checkpoint import UnsafeCheckpointError
from fullshard.testing import DistributedGroup
from fullshard.testing.models import Block, TinyGPT


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


pytest.importorskip("lightning")


def _fabric(**kwargs):
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2,
                      strategy=fullshard.FSDPStrategy(auto_wrap_policy={Block}), **kwargs)
    fabric.launch()
    return fabric


# -- collectives ------------------------------------------------------------------------------
def _gather() -> dict:
    fabric = _fabric()
    rank = fabric.global_rank
    x = torch.tensor([rank + 1.0], requires_grad=True)
    g = fabric.all_gather(x, sync_grads=True)
    weights = torch.tensor([1.0, 2.0]) * (rank + 1)
    (g.squeeze(1) * weights).sum().backward()
    nested = fabric.all_gather({"a": torch.full((2,), float(rank))})
    return {"g": g.detach().tolist(), "grad": x.grad.tolist(), "a": nested["a"].tolist()}


def test_all_gather_stacks_and_carries_gradients(group2: DistributedGroup) -> None:
    for rank, r in enumerate(group2.run(_gather)):
        assert r["g"] == [[1.0], [2.0]]
        # d/dx_r of sum_q sum_s (q+1) * s' * x_s, with s' = 1, 2: (1 + 2) * (r + 1).
        assert r["grad"] == [3.0 * (rank + 1)]
        assert r["a"] == [[0.0, 0.0], [1.0, 1.0]]


def _rank_zero_first(tmp: str) -> list:
    fabric = _fabric()
    seen = []
    for local in (False, True):
        marker = Path(tmp) / f"marker-{local}"
        with fabric.rank_zero_first(local=local):
            if fabric.global_rank == 0:
                time.sleep(0.5)  # rank 1 would see no marker if it did not wait
                marker.write_text("done")
            seen.append(marker.exists())
    return seen


def test_rank_zero_first_runs_rank_zero_before_the_others(group2: DistributedGroup,
                                                          tmp_path: Path) -> None:
    assert group2.run(_rank_zero_first, str(tmp_path)) == [[True, True], [True, True]]


# -- models -----------------------------------------------------------------------------------
class GPTWithEmbed(TinyGPT):
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Uses the root's own (tied) embedding directly, outside forward."""
        return self.tok(idx) * 2


def _models(tmp: str) -> dict:
    fabric = _fabric()
    out: dict = {}
    torch.manual_seed(0)
    model = GPTWithEmbed(layers=2)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    view = model.module  # the user's class, sharded in place
    out["module_is_model"] = isinstance(view, GPTWithEmbed) and view.tok is model.tok
    out["device"] = (model.device == fabric.device == torch.device("cpu")
                     and model.blocks is view.blocks)
    try:
        fabric.setup(model)
    except ValueError as e:
        out["twice"] = str(e)
    try:
        fabric.setup_module(model)
    except ValueError as e:
        out["twice_module"] = str(e)
    idx = torch.tensor([[1, 5, 36]])
    try:
        model.embed(idx)  # the root's shard: 19 of 37 rows
        out["unmarked"] = "ran"
    except (IndexError, RuntimeError) as e:
        out["unmarked"] = type(e).__name__
    # Lightning's `_FabricModule.mark_forward_method` routes only through a wrapper module;
    # fullshard shards in place, so the root registers the method itself (as FSDP2's root).
    fullshard.register_fsdp_forward_method(view, "embed")
    out["marked"] = torch.equal(model.embed(idx), reference.embed(idx))
    fullshard.register_fsdp_forward_method(view, view.embed)  # again, by bound method: a no-op
    out["marked_again"] = torch.equal(model.embed(idx), reference.embed(idx))
    out["forward"] = torch.equal(model(idx), reference(idx))
    out["module_forward"] = torch.equal(model.module(idx), reference(idx))

    # load_raw: a plain state dict written without Fabric, into a set-up model.
    path = Path(tmp) / "raw.pt"
    torch.manual_seed(1)
    other = GPTWithEmbed(layers=2)
    if fabric.global_rank == 0:
        torch.save(other.state_dict(), path)
    fabric.barrier()
    fabric.load_raw(path, model)
    full = fullshard.full_state_dict(view)
    out["load_raw"] = all(torch.equal(full[k].cpu(), v) for k, v in other.state_dict().items())
    try:
        fabric.load_raw(path, opt)
    except NotImplementedError as e:  # Lightning's type for it
        out["load_raw_opt"] = str(e)
    # weights_only: a file that also pickles an object is refused with True, read with False.
    with_args = Path(tmp) / "with_args.pt"
    if fabric.global_rank == 0:
        torch.save({"model": reference.state_dict(), "args": argparse.Namespace(lr=0.1)},
                   with_args)
    fabric.barrier()
    try:
        fabric.load_raw(with_args, model, weights_only=True)
    except UnsafeCheckpointError as e:
        out["weights_only"] = str(e)
    fabric.load_raw(with_args, model, weights_only=False)
    full = fullshard.full_state_dict(view)
    out["weights_only_false"] = all(torch.equal(full[k].cpu(), v)
                                    for k, v in reference.state_dict().items())

    with fabric.init_tensor():
        t = torch.empty(2)
    out["init_tensor"] = (t.dtype, t.device.type)
    return out


def test_sharded_model_api(group2: DistributedGroup, tmp_path: Path) -> None:
    for r in group2.run(_models, str(tmp_path)):
        assert r["module_is_model"] and r["device"]
        assert "only once" in r["twice"] and "only once" in r["twice_module"]
        assert r["unmarked"] != "ran"  # the root's embedding is sharded outside forward
        assert r["marked"] and r["marked_again"] and r["forward"] and r["module_forward"]
        assert r["load_raw"] and "fabric.load(path, {'model'" in r["load_raw_opt"]
        assert "weights_only=True (the default) refuses" in r["weights_only"]
        assert r["weights_only_false"]
        assert r["init_tensor"] == (torch.float32, "cpu")


# -- Lightning's utilities that take a Fabric -----------------------------------------------------
def _throughput(tmp: str) -> dict:
    from lightning.fabric.loggers import CSVLogger
    from lightning.fabric.utilities.throughput import ThroughputMonitor, measure_flops

    fabric = _fabric(precision="bf16-mixed", loggers=CSVLogger(tmp, name="tp"))
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    reference = copy.deepcopy(model)
    model = fabric.setup(model)
    idx = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    # The sharded module itself: its _FabricModule refuses a bare loss.backward() (as with
    # Lightning's own FSDPStrategy).
    flops = measure_flops(model.module, lambda: model.module(idx), lambda y: y.sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_flops = measure_flops(reference, lambda: reference(idx), lambda y: y.float().sum())
    monitor = ThroughputMonitor(fabric, window_size=2)
    for i in range(1, 4):
        monitor.update(time=0.1 * i, batches=i, samples=2 * i, lengths=16 * i, flops=flops)
        metrics = monitor.compute_and_log(step=i)
    fabric.logger.finalize("success")
    return {"flops": flops, "ref_flops": ref_flops, "metrics": sorted(metrics),
            "world": monitor.world_size}


def test_lightning_throughput_monitor_and_measure_flops(group2: DistributedGroup,
                                                        tmp_path: Path) -> None:
    pytest.importorskip("lightning.fabric.utilities.throughput")
    r0, r1 = group2.run(_throughput, str(tmp_path))
    assert r0["flops"] == r0["ref_flops"] > 0 and r1["flops"] == r0["flops"]
    assert r0["world"] == 2 and "samples_per_sec" in r0["metrics"]
    assert r1["metrics"] == []  # the monitor computes on rank 0 only, as in Lightning
    with open(tmp_path / "tp" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
