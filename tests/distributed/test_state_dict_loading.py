"""`load_state_dict` on a wrapped model, the way modules expect it (issue: join Lightning).

A sharded model's `load_state_dict` takes full (unsharded) tensors as well as this rank's
shards, and runs the modules' own `_load_from_state_dict` overrides and load pre-hooks, which
may remap keys (litgpt's LoRA models map `attn.qkv.weight` to `attn.qkv.linear.weight`; HF
models rename legacy keys in pre-hooks). Each check compares against the unwrapped model
loading the same dict: the same missing and unexpected keys, the same weights, the same
outputs. The parameters have odd row counts, so the two ranks hold uneven shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fullshard
from fullshard.engine.dtensor_state import local_state_dict
from fullshard.testing import DistributedGroup, local_rows


class Projection(nn.Module):
    """A layer that moved under `.linear`: old checkpoints say `qkv.weight`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = Projection()
        self.proj = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.qkv(x)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # litgpt's pattern: map the old names, then let torch load (children read the new keys)
        for name in ("weight", "bias"):
            old, new = f"{prefix}qkv.{name}", f"{prefix}qkv.linear.{name}"
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.blocks = nn.ModuleList([Attention(), Attention()])
        self.head = nn.Linear(6, 7)
        # HF's pattern: a pre-hook registered at construction renames a legacy key
        self.register_load_state_dict_pre_hook(_rename_legacy_embedding)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _rename_legacy_embedding(module, state_dict, prefix, *_):  # type: ignore[no-untyped-def]
    if f"{prefix}embed.weight" in state_dict:
        state_dict[f"{prefix}emb.weight"] = state_dict.pop(f"{prefix}embed.weight")


def _legacy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` under the names an old checkpoint used."""
    out = {k.replace("qkv.linear.", "qkv."): v for k, v in sd.items()}
    out["embed.weight"] = out.pop("emb.weight")
    return out


def _wrapped(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return fullshard.fsdp(Net(), device="cpu", auto_wrap_policy={Attention})


def _reference(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def _assert_holds(model: nn.Module, ref: nn.Module) -> None:
    """`model`'s shards are this rank's rows of `ref`'s weights, and the outputs agree."""
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shards = model.state_dict()  # DTensors, as FSDP2's (test_dtensor_state_dict.py)
    for key, want in ref.state_dict().items():
        assert torch.equal(shards[key].to_local(), local_rows(want, size, rank)), key
    idx = torch.tensor([[1, 2, 3, 6]])
    with torch.no_grad():
        assert torch.allclose(model(idx), ref(idx), rtol=1e-5, atol=1e-6)


def _loads() -> None:
    source = _reference(0).state_dict()
    legacy = _legacy(source)

    # full tensors under legacy names, remapped by the modules' own override and pre-hook
    ref, model = _reference(1), _wrapped(1)
    assert ref.load_state_dict(legacy) == model.load_state_dict(legacy)
    _assert_holds(model, ref)

    # strict=False reports what torch reports for the unwrapped model, after the remapping
    partial = {**legacy, "blocks.0.bogus": torch.zeros(2)}
    del partial["head.bias"]
    ref, model = _reference(2), _wrapped(2)
    want = ref.load_state_dict(partial, strict=False)
    assert want.missing_keys == ["head.bias"] and want.unexpected_keys == ["blocks.0.bogus"]
    assert model.load_state_dict(partial, strict=False) == want
    _assert_holds(model, ref)
    with pytest.raises(RuntimeError, match="Missing key"):
        _wrapped(2).load_state_dict(partial)

    # fullshard.load_full_state_dict goes the same way (and so do load_raw and full checkpoints)
    ref, model = _reference(3), _wrapped(3)
    ref.load_state_dict(partial, strict=False)
    assert fullshard.load_full_state_dict(model, partial, strict=False) == (
        ["head.bias"], ["blocks.0.bogus"]
    )
    _assert_holds(model, ref)
    with pytest.raises(ValueError, match=r"Missing keys: \['head\.bias'\]"):
        fullshard.load_full_state_dict(_wrapped(3), partial)

    # model.state_dict() (DTensors) loads, and so do this rank's rows as plain tensors
    other = _wrapped(4)
    other.load_state_dict(model.state_dict())
    _assert_holds(other, ref)
    other = _wrapped(4)
    other.load_state_dict(local_state_dict(model))
    _assert_holds(other, ref)

    # a shape that is neither the full one nor this rank's names both
    bad = {**legacy, "head.weight": torch.zeros(8, 6)}
    with pytest.raises(ValueError, match=r"'head\.weight' has shape \(8, 6\) .* is \(7, 6\) "
                                         r"\(unsharded; this rank holds rows"):
        _wrapped(5).load_state_dict(bad)


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


def test_load_state_dict_takes_full_tensors_and_runs_the_modules_hooks(group2):
    group2.run(_loads)
