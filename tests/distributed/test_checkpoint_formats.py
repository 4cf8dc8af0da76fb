"""Checkpoint formats and semantics on 2 gloo ranks (issue 4, acceptance 3 and 5).

- full <-> sharded: a full checkpoint loads into a sharded model, each rank reading only its
  own rows of the memory-mapped file; a sharded one consolidates (in this process, no process
  group) into exactly what a full save writes, which plain `torch.load` and
  `safetensors.torch.load_file` load into the unwrapped model;
- `strict`, `filter`, the returned remainder, stateful objects restored in place, optimizers
  with empty state (SGD without momentum), several param groups, Adam step counts;
- `save_checkpoint` called on rank 0 only fails clearly instead of hanging.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.checkpoint import full, load_checkpoint, save_checkpoint
from fullshard.cli import main as cli_main
from fullshard.testing import DistributedGroup
from fullshard.testing.models import OddMLP, TinyGPT
from tests.distributed import ckpt_common as cc

FORMATS = ("sharded", "full")


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=5.0) as g:
        yield g


# -- full <-> sharded ---------------------------------------------------------------------------
def _full_and_sharded(root: str) -> dict:
    s = cc.strategy()
    model, opt, sched = cc.build("gpt", s)
    cc.train(model, opt, sched, 2)
    state = cc.state_of(model, opt, sched)
    save_checkpoint(f"{root}/full.pt", state, state_dict_type="full")
    save_checkpoint(f"{root}/sharded", state)
    expected = fullshard.full_state_dict(model)

    # Full -> a differently initialized sharded model: each rank takes its own rows.
    fresh, fresh_opt, fresh_sched = cc.build("gpt", s, seed=5)
    fresh_state = cc.state_of(fresh, fresh_opt, fresh_sched)
    s.load_checkpoint(f"{root}/full.pt", fresh_state)
    got = fullshard.full_state_dict(fresh)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        for k, v in opt.state[a].items():
            assert torch.equal(v, fresh_opt.state[b][k]), (name, k)
    return {"model": expected, "mapped": _mapped_fraction(root, s)}


def _mapped_fraction(root: str, s) -> float:
    """Load a full checkpoint of one 16 MB weight into a sharded Linear and return how much
    of the memory-mapped file this rank touched (its rows are half of it)."""
    torch.manual_seed(0)
    big = s.setup_module(nn.Linear(1024, 4096, bias=False))
    save_checkpoint(f"{root}/big.pt", {"model": big}, state_dict_type="full")
    path = Path(f"{root}/big.pt")
    ckpt = full.read(path)
    weight = ckpt["model"]["weight"]  # keeps the mapping alive after the load
    full.load(ckpt, {"model": big}, True, path)
    rss = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            if line[0] in "0123456789abcdef" and " " in line:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    del weight
    return rss / path.stat().st_size


def test_full_into_sharded_and_consolidate(group2: DistributedGroup, tmp_path, capsys) -> None:
    outs = group2.run(_full_and_sharded, str(tmp_path))
    expected = outs[0]["model"]
    for out in outs:  # each rank mapped about its half of the file, not all of it
        assert 0.3 < out["mapped"] < 0.7, out["mapped"]

    # Consolidate in this process (no process group) through the command line.
    assert cli_main(["consolidate", str(tmp_path / "sharded"), str(tmp_path / "c.pt")]) == 0
    assert cli_main(["consolidate", str(tmp_path / "sharded"),
                     str(tmp_path / "c.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out
    consolidated = torch.load(tmp_path / "c.pt", weights_only=True)
    plain = TinyGPT(layers=2)
    plain.load_state_dict(consolidated["model"])
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # One implementation: consolidating gives exactly what the full save wrote.
    cc.assert_same_full(torch.load(tmp_path / "full.pt", weights_only=True), consolidated,
                        keys=("model", "optimizer", "scheduler", "rng", "note"))
    assert consolidated["note"] == "hi"
    assert sorted(consolidated["optimizer"]["state"])[:2] == [
        "blocks.0.attn.proj.bias", "blocks.0.attn.proj.weight"]

    from safetensors.torch import load_file

    plain = TinyGPT(layers=2)
    plain.load_state_dict(load_file(tmp_path / "c.safetensors"))
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k

    assert cli_main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 1
    assert "is not a sharded checkpoint" in capsys.readouterr().err


# -- strict, filter, remainder, stateful objects, optimizer state ---------------------------------
def _two_groups(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": weights, "lr": 0.1}, {"params": others, "lr": 0.01}]
    if kind == "sgd":  # no momentum: the optimizer has no state at all
        return torch.optim.SGD(groups, lr=0.1)
    return torch.optim.AdamW(groups, lr=0.1)


def _semantics(root: str, fmt: str) -> dict:
    s = cc.strategy(state_dict_type=fmt)
    out: dict = {}
    for kind in ("sgd", "adamw"):
        torch.manual_seed(0)
        model = s.setup_module(OddMLP())
        opt = _two_groups(model, kind)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(3):
            x, y = model.make_batch(4, torch.Generator().manual_seed(dist.get_rank()))
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        path = f"{root}/{fmt}-{kind}"
        s.save_checkpoint(path, {"model": model, "optimizer": opt, "sched": sched, "step": 3,
                                 "extra": {"a": 1}})
        torch.manual_seed(1)
        fresh = s.setup_module(OddMLP())
        fresh_opt = _two_groups(fresh, kind)
        for g in fresh_opt.param_groups:
            g["lr"] = 7.0
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
        state = {"model": fresh, "optimizer": fresh_opt, "sched": fresh_sched}
        rest = s.load_checkpoint(path, state)
        assert state["sched"] is fresh_sched and fresh_sched.last_epoch == 3  # in place
        assert [g["lr"] for g in fresh_opt.param_groups] == [0.1 / 8, 0.01 / 8]
        assert fresh_opt.state_dict()["state"] == {} if kind == "sgd" else True
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
            for k, v in opt.state[a].items():
                assert torch.equal(v, fresh_opt.state[b][k]), k
        if kind == "adamw":
            steps = {float(st["step"]) for st in fresh_opt.state.values()}
            assert steps == {3.0}, steps
        out[kind] = {"rest": rest}

    # strict: a requested key the checkpoint lacks; the module's keys must match.
    path = f"{root}/{fmt}-sgd"
    try:
        s.load_checkpoint(path, {"model": fresh, "coconut": 11})
    except KeyError as e:
        out["strict_key"] = str(e)
    state = {"model": fresh, "coconut": 11}
    s.load_checkpoint(path, state, strict=False)
    out["coconut"] = state["coconut"]
    torch.manual_seed(2)
    bigger = s.setup_module(OddMLP(dims=(6, 7, 13, 5, 1, 2)))  # one more layer
    try:
        s.load_checkpoint(path, {"model": bigger})
    except (ValueError, RuntimeError) as e:
        out["strict_module"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.load_checkpoint(path, {"model": bigger}, strict=False)
    out["warned"] = [str(w.message) for w in caught if "strict=False" in str(w.message)]
    out["partial_equal"] = all(
        torch.equal(a, b) for (n, a), b in zip(fresh.named_parameters(), bigger.parameters())
        if n.startswith(("layers.0", "layers.1", "layers.2", "layers.3")))

    # filter: only the biases of the model, only the param groups of the optimizer.
    fpath = f"{root}/{fmt}-filtered"
    s.save_checkpoint(fpath, {"model": model, "optimizer": opt, "step": 3},
                      filter={"model": lambda k, v: k.endswith("bias"),
                              "optimizer": lambda k, v: k == "param_groups"})
    torch.manual_seed(3)
    third = s.setup_module(OddMLP())
    try:
        s.load_checkpoint(fpath, {"model": third})
    except (ValueError, RuntimeError) as e:
        out["filtered_strict"] = str(e)
    s.load_checkpoint(fpath, {"model": third}, strict=False)
    out["filtered"] = [(n, torch.equal(a, b)) for (n, a), b  # (a rank may own no rows)
                       in zip(model.named_parameters(), third.parameters()) if a.numel()]
    out["whole"] = s.load_checkpoint(fpath) if fmt == "full" or dist.get_rank() == 0 else None
    if fmt == "sharded" and dist.get_rank() != 0:
        s.load_checkpoint(fpath)  # collective: keep the ranks in step
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_filter_remainder_stateful_optimizers(group2: DistributedGroup, tmp_path,
                                                     fmt: str) -> None:
    outs = group2.run(_semantics, str(tmp_path), fmt)
    for out in outs:
        for kind in ("sgd", "adamw"):
            assert out[kind]["rest"] == {"step": 3, "extra": {"a": 1}}
        assert "'coconut' that does not exist in the loaded checkpoint" in out["strict_key"]
        assert out["coconut"] == 11
        assert "layers.4.weight" in out["strict_module"] and "strict=False" in out[
            "strict_module"]
        assert out["partial_equal"]
        assert out["filtered_strict"] and "weight" in out["filtered_strict"]
        assert all(same == n.endswith("bias") for n, same in out["filtered"]), out["filtered"]
        whole = out["whole"]
        if whole is not None:
            assert sorted(whole["model"]) == ["layers.0.bias", "layers.1.bias", "layers.2.bias",
                                              "layers.3.bias"]
            assert set(whole["optimizer"]) == {"param_groups"} and whole["step"] == 3
    assert outs[0]["warned"], "strict=False must say what it skipped (on rank 0)"
    if fmt == "full":  # the file: optimizer state keyed by name, plain torch.load works
        ckpt = torch.load(tmp_path / "full-adamw", weights_only=True)
        assert sorted(ckpt["optimizer"]["state"])[:2] == ["layers.0.bias", "layers.0.weight"]
        assert ckpt["optimizer"]["state"]["out_scale"]["exp_avg"].shape == ()
        assert sorted(ckpt["optimizer"]["param_groups"][1]["params"]) == [
            "layers.0.bias", "layers.1.bias", "layers.2.bias", "layers.3.bias", "out_scale"]
        assert torch.load(tmp_path / "full-sgd", weights_only=True)["optimizer"]["state"] == {}


# -- saving is collective -------------------------------------------------------------------------
def _save_on_rank0_only(root: str) -> dict:
    s = cc.strategy(timeout=3)
    model = s.setup_module(OddMLP())
    if dist.get_rank() != 0:
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            s.save_checkpoint(f"{root}/rank0", {"model": model})
        except TimeoutError as e:
            error = str(e)
    return {"error": error, "warned": [str(w.message) for w in caught]}


def test_save_on_rank0_only_raises_instead_of_hanging(group2: DistributedGroup,
                                                      tmp_path) -> None:
    out = group2.run(_save_on_rank0_only, str(tmp_path), timeout=60)[0]
    assert "rank(s) 1, which never called it" in out["error"]
    assert "collective" in out["error"] and "if rank == 0" in out["error"]
    assert any("collective: every rank must call it" in w for w in out["warned"])
    assert not (tmp_path / "rank0").exists()


def test_bad_paths_and_arguments(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        load_checkpoint(tmp_path / "absent", {"model": OddMLP()})
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="has no meta.pt"):
        load_checkpoint(tmp_path / "dir", {"model": OddMLP()})
    with pytest.raises(ValueError, match="Unknown state_dict_type 'zip'"):
        save_checkpoint(tmp_path / "x", {"model": OddMLP()}, state_dict_type="zip")
    with pytest.raises(ValueError, match=r"filter keys \['nope'\] are not keys of the state"):
        save_checkpoint(tmp_path / "x", {"model": OddMLP()}, filter={"nope": lambda k, v: 1})
    model = OddMLP()
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="belongs to none of the modules in the state"):
        save_checkpoint(tmp_path / "x", {"model": model, "optimizer": stray})
