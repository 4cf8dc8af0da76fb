"""lightning-thunder is refused in either order, with the fix, and nothing trains wrong (2 ranks).

thunder traces a module's whole forward into one program over the parameters it collected at
`thunder.jit`, so fullshard's per-unit hooks cannot run inside it (engine/thunder_refusal.py):

- `fsdp(thunder.jit(model))`, or a model holding a `thunder.jit` submodule: a TypeError
  naming it and the fix, before anything is sharded;
- `thunder.jit(fsdp(model))` (blocks as units, or the whole model one unit), or `thunder.jit`
  of one unit inside it: a TypeError at the first forward, from the unit's pre-hook, instead
  of a failure deep in the engine; the sharded model then still trains in parity with one
  process, eagerly (the refusal leaves nothing behind).

Only where thunder is importable (its own environment: lightning-thunder 0.2.6 needs
torch >= 2.7.1; the refusal was checked on torch 2.9.1):

    python -m venv .venv-thunder
    .venv-thunder/bin/pip install torch==2.9.1 lightning-thunder==0.2.6 pytest -e .
    .venv-thunder/bin/python -m pytest -q tests/distributed/test_thunder.py

The first test runs everywhere: the detection never imports thunder itself.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullshard
from fullshard.engine.runtime_lookup import is_wrapped
from fullshard.testing import DistributedGroup
from fullshard.testing.models import TinyGPT
from tests.distributed.model_parity import train_and_compare

FIX = r"thunder\.distributed\.fsdp\(model\)"


def test_detection_never_imports_thunder() -> None:
    # In a fresh process: wrapping and running a model looks thunder up in sys.modules only.
    code = (
        "import sys, torch, torch.distributed as dist, fullshard\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "m = fullshard.fsdp(torch.nn.Sequential(torch.nn.Linear(4, 4)), device='cpu')\n"
        "m(torch.ones(2, 4)).sum().backward()\n"
        "assert not any(n == 'thunder' or n.startswith('thunder.') for n in sys.modules)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    # (some torch versions' gloo prints its connection to stdout first)
    said = done.stdout.strip().splitlines()
    assert done.returncode == 0 and said[-1:] == ["ok"], (done.stdout + done.stderr)[-3000:]


needs_thunder = pytest.mark.skipif(
    importlib.util.find_spec("thunder") is None, reason="lightning-thunder is not installed"
)


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2) as g:
        yield g


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]).flatten(0, 1), batch["y"].flatten())


def _batches(ref: TinyGPT, steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [dict(zip(("x", "y"), ref.make_batch(4, g))) for _ in range(steps)]


def _fsdp_of_thunder_module() -> list[str]:
    import thunder

    torch.manual_seed(0)
    model = TinyGPT()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    messages = []
    given = f"fsdp\\(\\) was given a thunder ThunderModule.*{FIX}"
    with pytest.raises(TypeError, match=given) as e:
        fullshard.fsdp(thunder.jit(model), device="cpu")
    messages.append(str(e.value))
    model.blocks[1] = thunder.jit(model.blocks[1])
    with pytest.raises(TypeError, match=f"submodule 'blocks.1' is a thunder ThunderModule.*{FIX}"):
        fullshard.fsdp(model, device="cpu")
    # refused before anything changed: nothing is sharded or marked
    assert not is_wrapped(model)
    assert {n: p.shape for n, p in model.blocks[1]._model.named_parameters()} == {
        n[len("blocks.1."):]: s for n, s in shapes.items() if n.startswith("blocks.1.")
    }
    return messages


def _thunder_jit_of_sharded(what: str) -> str:
    """`what`: 'model' (blocks as units), 'root-unit' (the whole model one unit) or 'block'
    (`thunder.jit` of one unit inside the sharded model)."""
    import thunder

    torch.manual_seed(0)
    ref = TinyGPT()
    policy = "root" if what == "root-unit" else None
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy="FULL_SHARD",
                           auto_wrap_policy=policy)
    batches = _batches(ref, 3)
    first = {k: v[:2] for k, v in batches[0].items()}
    where = "its unit 'blocks.0'" if what == "block" else "its root"
    refused = f"thunder.jit\\(\\) is tracing a model sharded by fullshard \\({where}\\).*{FIX}"
    if what == "block":
        block = model.blocks[0]
        model.blocks[0] = thunder.jit(block)
        with pytest.raises(TypeError, match=refused) as e:
            _loss(model, first)
        model.blocks[0] = block
    else:
        with pytest.raises(TypeError, match=refused) as e:
            _loss(thunder.jit(model), first)
    # the refusal left nothing behind: the sharded model itself trains as one process does
    train_and_compare(model, ref, batches, _loss)
    return str(e.value)


@needs_thunder
def test_fsdp_refuses_a_thunder_module(group2: DistributedGroup) -> None:
    for messages in group2.run(_fsdp_of_thunder_module, timeout=300):
        print(messages[0])


@needs_thunder
@pytest.mark.parametrize("what", ["model", "root-unit", "block"])
def test_thunder_jit_of_a_sharded_model_is_refused(group2: DistributedGroup, what: str) -> None:
    for message in group2.run(_thunder_jit_of_sharded, what, timeout=300):
        print(message)
