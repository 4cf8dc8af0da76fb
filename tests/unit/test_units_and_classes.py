"""Which modules become units by default, and foreign classes that inspect theirs.

- `auto_wrap_policy=None` picks the classes in `_no_split_modules` (Hugging Face's
  convention), else the repeated blocks (children of an `nn.ModuleList` / `nn.Sequential` of
  >= 2 same-class modules with parameters; outermost containers only), else the root alone;
  `"root"` or an empty set asks for the root alone; the planner predicts the same units.
- `fsdp(device=None)` is `cuda:LOCAL_RANK` when CUDA is available (thunder's default).
- `fsdp()` on a class whose `__init_subclass__` evaluates type hints (as transformers'
  `PreTrainedModel` does) or whose metaclass records subclasses works, keeps the class name,
  and the repr names the units.
"""

from __future__ import annotations

import typing

import pytest
import torch
from torch import nn

import fullshard
from fullshard.engine.wrap import choose_units
from fullshard.planner.sizes import model_structure
from fullshard.testing.models import Block, ConvBNNet, OddMLP, TinyGPT


def _describe(model: nn.Module, policy: object = None) -> str:
    return choose_units(model, policy).describe()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # inside a block: not units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(x)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 2)
        self.layers = nn.ModuleList(_Inner() for _ in range(3))
        self.norms = nn.ModuleList([nn.LayerNorm(2)])  # one module: not repeated
        self.acts = nn.Sequential(nn.ReLU(), nn.ReLU())  # no parameters: not blocks
        self.mixed = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))  # two classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _NoSplit(_Nested):
    _no_split_modules = ["LayerNorm"]


def test_default_units():
    assert _describe(TinyGPT()) == "root + 2 x Block (default: repeated blocks)"
    assert _describe(OddMLP()) == "root + 4 x Linear (default: repeated blocks)"
    assert _describe(ConvBNNet()) == "root (default: root only, no repeated blocks found)"
    assert _describe(_Nested()) == "root + 3 x _Inner (default: repeated blocks)"
    assert _describe(_NoSplit()) == "root + 2 x LayerNorm (default: _no_split_modules)"
    seq = nn.Sequential(*(Block(8, 2) for _ in range(3)))  # the root itself is the container
    assert _describe(seq) == "root + 3 x Block (default: repeated blocks)"


def test_explicit_policies():
    assert _describe(TinyGPT(), "root") == "root (root only)"
    assert _describe(TinyGPT(), set()) == "root (root only)"
    assert _describe(TinyGPT(), {Block}) == "root + 2 x Block (auto_wrap_policy)"
    with pytest.raises(TypeError, match=r"or 'root' \(the root as the only unit\); got str"):
        choose_units(TinyGPT(), "Block")


@pytest.mark.parametrize("make", [TinyGPT, OddMLP, _Nested, _NoSplit])
def test_planner_predicts_the_engine_units(make):
    model = make()
    for policy in (None, "root"):
        engine = [(n or "", type(m).__name__) for m in choose_units(model, policy).modules
                  for n in [next(k for k, v in model.named_modules() if v is m)]]
        planned = [(u.name, u.class_name)
                   for u in model_structure(model, policy, fullshard.FSDPBucketingStrategy.BLOCK)
                   .units]
        assert planned == engine
    table = fullshard.plan(make, world_sizes=(2,))
    assert table.units == _describe(model).rsplit(" (", 1)[0]


# -- foreign classes ------------------------------------------------------------------------

_SEEN: list[type] = []


class _Registry(type(nn.Module)):  # type: ignore[misc]
    def __init__(cls, name, bases, ns, **kw):  # type: ignore[no-untyped-def]
        super().__init__(name, bases, ns, **kw)
        _SEEN.append(cls)


class _Inspecting(nn.Module, metaclass=_Registry):
    """Like transformers' PreTrainedModel: every subclass's type hints are evaluated."""

    config: dict

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.hints = typing.get_type_hints(cls)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x



def test_class_that_inspects_its_subclasses(world1):
    model = fullshard.fsdp(_Inspecting(), device="cpu")
    cls = type(model)
    assert cls in _SEEN and cls is not _Inspecting and issubclass(cls, _Inspecting)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (
        "_Inspecting", _Inspecting.__qualname__, _Inspecting.__module__)
    assert "config" in cls.hints
    assert isinstance(model, fullshard.FullyShardedModule)
    assert repr(model).splitlines()[1].strip() == (
        "fullshard: ZERO2 over 1 rank(s) (mesh 1x1), units: root + 2 x Linear "
        "(default: repeated blocks)"
    )
    x = torch.randn(3, 4)
    assert model(x).shape == (3, 4)


# -- thunder's device default ----------------------------------------------------------------


def test_default_device_is_cuda_local_rank(monkeypatch):
    from fullshard.api.functional import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)  # not the current device (0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"LOCAL_RANK='2' is not one of this machine's 2 CUDA"):
        default_device()
    monkeypatch.delenv("LOCAL_RANK")
    assert default_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
