"""litgpt 0.5.13's fine-tuning scripts with one line changed, against Lightning's DDP.

`finetune/lora.py` (its `ModelParallelStrategy(parallelize_fn=...)` replaced by
`fullshard.FSDPStrategy(...)`: litgpt_lora.py) and `finetune/full.py` / `finetune/adapter.py`
(their `FSDPStrategy` name pointed at fullshard's: litgpt_finetune.py), each on 2 CPU ranks in
Lightning's own Fabric, beside the same script on Lightning's DDP: the same loss at every
logged iteration, the same final validation loss, the same saved files. litgpt's own code
reads the state dict: `save_lora_checkpoint` calls `.full_tensor()` on each entry, which needs
DTensors (before, the adapter file held rank 0's rows only and `merge_lora` refused it).

Needs litgpt: these run in .venv-litgpt (`make test`'s second step).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_fabric import ROOT
from tests.distributed.test_pretrain_example import launch, read_metrics

pytest.importorskip("litgpt")

FABRICS = ("fullshard", "lightning")
HARNESS = {"lora": "litgpt_lora.py", "full": "litgpt_finetune.py",
           "adapter": "litgpt_finetune.py"}
SAVED = {"lora": "lit_model.pth.lora", "full": "lit_model.pth",
         "adapter": "lit_model.pth.adapter"}


def _run(out: Path, script: str, *args: str) -> None:
    harness = str(ROOT / "tests" / "distributed" / HARNESS[script])
    extra = [] if script == "lora" else [script]
    if args == ("--prepare",):
        launch([sys.executable, harness, str(out), *extra, "--prepare"])
    else:
        launch([sys.executable, "-m", "fullshard.cli", "run", "--nproc-per-node", "2",
                harness, str(out), *extra, *args])


@pytest.fixture(scope="module", params=list(HARNESS))
def runs(request, tmp_path_factory) -> tuple[str, Path]:
    script = request.param
    out = tmp_path_factory.mktemp(f"litgpt-{script}")
    _run(out, script, "--prepare")
    for fabric in FABRICS:  # one strategy per launch (see litgpt_lora.py)
        _run(out, script, fabric)
    return script, out if script == "lora" else out / script


def _logged(out: Path, fabric: str) -> dict:
    rows = read_metrics(out / fabric / "logs" / "csv" / "version_0" / "metrics.csv")
    return {"loss": {r["iter"]: r["loss"] for r in rows if r.get("loss") is not None},
            "val_loss": [r["val_loss"] for r in rows if r.get("val_loss") is not None]}


def test_losses_equal_lightning_ddp(runs: tuple[str, Path]) -> None:
    script, out = runs
    ours, ref = (_logged(out, fabric) for fabric in FABRICS)
    assert sorted(ours["loss"]) == sorted(ref["loss"]) == list(range(1, 7)), (ours, ref)
    assert [ours["loss"][i] for i in range(1, 7)] == pytest.approx(
        [ref["loss"][i] for i in range(1, 7)], rel=1e-5, abs=1e-6)
    assert len(ref["val_loss"]) == 1  # the final validation
    assert ours["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5, abs=1e-6)


def test_saved_files_equal_lightning_ddp(runs: tuple[str, Path]) -> None:
    script, out = runs
    ours, ref = (torch.load(out / fabric / "final" / SAVED[script], map_location="cpu",
                            weights_only=False) for fabric in FABRICS)
    ours, ref = ours.get("model", ours), ref.get("model", ref)
    assert list(ours) == list(ref) and ours, (list(ours), list(ref))
    for name, want in ref.items():
        # full tensors, not one rank's rows (lora's lm_head.lora_A rows split 2 + 1)
        assert ours[name].shape == want.shape, name
        torch.testing.assert_close(ours[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_merge_lora_takes_the_saved_adapter(runs: tuple[str, Path]) -> None:
    script, out = runs
    if script != "lora":
        pytest.skip("merge_lora is LoRA's")
    from litgpt.scripts.merge_lora import merge_lora

    merged = {}
    for fabric in FABRICS:
        merge_lora(out / fabric / "final")
        merged[fabric] = torch.load(out / fabric / "final" / "lit_model.pth", map_location="cpu")
    assert list(merged["fullshard"]) == list(merged["lightning"])
    for name, want in merged["lightning"].items():
        torch.testing.assert_close(merged["fullshard"][name], want, rtol=1e-5, atol=1e-6)
