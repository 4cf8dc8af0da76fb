"""`import fullshard` does not import `torch._dynamo` (~3 s of CPU per process); wrapping a
model before dynamo is imported, then compiling it, still keeps the engine's hooks out of
dynamo's graphs (engine/eager.py). Each check runs in a fresh interpreter: this one has long
imported dynamo."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_fullshard_leaves_dynamo_unimported():
    _run("""
        import sys
        import fullshard, fullshard.cli, fullshard.api.strategy
        loaded = [m for m in sys.modules if m.startswith("torch._dynamo")]
        assert not loaded, loaded
    """)


def test_hooks_registered_before_dynamo_are_disabled_when_it_arrives():
    out = _run("""
        import sys
        import torch, torch.distributed as dist
        import fullshard
        from fullshard.testing.models import TinyGPT

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        ref = TinyGPT(layers=2)
        model = fullshard.fsdp(TinyGPT(layers=2), device="cpu", sharding_strategy="FULL_SHARD")
        model.load_state_dict(ref.state_dict())
        units = [u.module for u in model.fullshard_runtime.units]
        hooks = [h for m in units for h in (*m._forward_pre_hooks.values(),
                                              *m._forward_hooks.values())]
        assert "torch._dynamo" not in sys.modules
        assert len(hooks) == 2 * len(units)
        assert not any(hasattr(h, "_torchdynamo_disable") for h in hooks)
        compiled = torch.compile(model, backend="eager")  # imports dynamo: the hooks swap
        hooks = [h for m in units for h in (*m._forward_pre_hooks.values(),
                                              *m._forward_hooks.values())]
        assert len(hooks) == 2 * len(units)
        assert all(getattr(h, "_torchdynamo_disable", False) for h in hooks), hooks
        from torch._dynamo.utils import counters
        x, y = ref.make_batch(2, torch.Generator().manual_seed(1))
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
            loss.backward()
        want = ref.loss(x, y)
        assert torch.allclose(loss, want, rtol=1e-5, atol=1e-6), (loss, want)
        assert counters["stats"]["unique_graphs"] >= 1
        print("graph breaks:", dict(counters["graph_break"]))
        dist.destroy_process_group()
    """)
    # torch 2.8's gloo writes its own connection line to stdout: read only ours
    breaks = [line for line in out.splitlines() if line.startswith("graph breaks:")]
    assert breaks == ["graph breaks: {}"], out  # nothing of the engine was traced
