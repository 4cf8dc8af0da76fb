"""Pretraining loops under `fullshard run` on 2 ranks.

examples/pretrain.py (a litgpt-style loop) logs the losses of one process on the same global
batch; resuming from a checkpoint continues with the losses of the uninterrupted run. Three
launches: one process for steps 1-3 (saving a sharded checkpoint at step 3), two processes for
steps 1-6 uninterrupted, and two processes resuming from the one-process checkpoint for steps
4-6 (a resume that also reshards from 1 to 2 ranks).

litgpt's own `pretrain.py` (litgpt 0.5.13, tests/distributed/litgpt_pretrain.py: only its
`FSDPStrategy` name swapped to fullshard's, Lightning's own Fabric kept, litgpt's own strategy
arguments, `init_module(empty_init=True)`, `initialize_weights`, `torch.compile` before
`fabric.setup`) logs the losses and ends with the weights of the same script on Lightning's
own Fabric with DDP. One launch runs both; compiled with `aot_eager` (dynamo and AOT autograd
as with inductor, without minutes of C++ codegen on a cold cache)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_fabric import ROOT, child_env

pytest.importorskip("lightning")

SCRIPT = str(ROOT / "examples" / "pretrain.py")
COMMON = ["--max-steps", "6", "--save-interval", "3", "--global-batch-size", "8",
          "--seq", "16"]


def launch(cmd: list[str]) -> str:
    """Run `cmd` from the repository root; its stdout (a failure shows both streams)."""
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def read_metrics(path: Path) -> list[dict[str, float | int | None]]:
    """The rows of a Lightning CSV logger's `metrics.csv`, as numbers (None where empty)."""

    def number(text: str) -> float | int | None:
        if text == "":
            return None
        try:
            return int(text)
        except ValueError:
            return float(text)

    with path.open(newline="") as f:
        return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def losses(out_dir: Path) -> dict[int, float]:
    rows = read_metrics(out_dir / "logs" / "version_0" / "metrics.csv")
    return {int(r["step"]): float(r["loss"]) for r in rows if r.get("loss") is not None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pretrain")
    one, two, resumed = tmp / "one", tmp / "two", tmp / "resumed"
    # One process, 4 rows x 2 micro-batches = the global batch of 8; stops after step 3.
    launch([sys.executable, SCRIPT, "--devices", "1", "--micro-batch-size", "4",
            "--out-dir", str(one), *COMMON, "--max-steps", "3"])
    fullshard_run = [sys.executable, "-m", "fullshard.cli", "run", "--nproc", "2",
                     SCRIPT, "--devices", "2", "--micro-batch-size", "2", *COMMON]
    launch([*fullshard_run, "--out-dir", str(two)])
    ckpt = one / "step-00000003" / "lit_model.pth"
    stdout = launch([*fullshard_run, "--out-dir", str(resumed), "--resume", str(ckpt)])
    assert f"Resuming training from {ckpt}" in stdout
    return {"one": one, "two": two, "resumed": resumed}


def test_two_ranks_log_the_losses_of_one_process(runs: dict[str, Path]) -> None:
    one, two = losses(runs["one"]), losses(runs["two"])
    assert sorted(one) == [1, 2, 3] and sorted(two) == [1, 2, 3, 4, 5, 6]
    assert [two[s] for s in (1, 2, 3)] == pytest.approx([one[s] for s in (1, 2, 3)],
                                                        rel=1e-5, abs=1e-6)
    assert two[6] < two[1]  # it learns
    assert sorted(p.name for p in runs["two"].glob("step-*")) == ["step-00000003",
                                                                  "step-00000006"]
    assert (runs["two"] / "step-00000006" / "lit_model.pth" / "meta.pt").exists()


def test_resume_continues_with_the_uninterrupted_losses(runs: dict[str, Path]) -> None:
    two, resumed = losses(runs["two"]), losses(runs["resumed"])
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([two[s] for s in (4, 5, 6)],
                                                            rel=1e-5, abs=1e-6)


def test_throughput_is_logged(runs: dict[str, Path]) -> None:
    rows = read_metrics(runs["two"] / "logs" / "version_0" / "metrics.csv")
    rates = [r["samples_per_sec"] for r in rows if r.get("samples_per_sec") is not None]
    assert rates and all(r > 0 for r in rates)


# -- litgpt's own pretrain.py ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def litgpt_runs(tmp_path_factory) -> Path:
    pytest.importorskip("litgpt")  # the litgpt extra: .venv-litgpt in `make test`
    out = tmp_path_factory.mktemp("litgpt")
    launch([sys.executable, "-m", "fullshard.cli", "run", "--nproc", "2",
            str(ROOT / "tests" / "distributed" / "litgpt_pretrain.py"), str(out),
            "fullshard", "lightning", "--backend=aot_eager"])
    return out


def test_litgpt_pretrain_logs_the_losses_of_lightning_ddp(litgpt_runs: Path) -> None:
    logged = {}
    for fabric in ("fullshard", "lightning"):
        rows = read_metrics(litgpt_runs / fabric / "logs" / "csv" / "version_0" / "metrics.csv")
        logged[fabric] = {
            "loss": {r["iter"]: r["loss"] for r in rows if r.get("loss") is not None},
            "val_loss": [r["val_loss"] for r in rows if r.get("val_loss") is not None],
        }
    assert (litgpt_runs / "fullshard" / "strategy.txt").read_text().split() == [
        "fullshard.api.lightning_strategy.FSDPStrategy"]  # litgpt built ours, by its own names
    assert (litgpt_runs / "lightning" / "strategy.txt").read_text().split() == [
        "lightning.fabric.strategies.ddp.DDPStrategy"]
    ours, ref = logged["fullshard"], logged["lightning"]
    # 4 optimizer steps of 2 accumulated micro-batches, logged every step; a final validation
    assert sorted(ref["loss"]) == sorted(ours["loss"]) == [2, 4, 6, 8]
    assert [ours["loss"][i] for i in (2, 4, 6, 8)] == pytest.approx(
        [ref["loss"][i] for i in (2, 4, 6, 8)], rel=1e-5, abs=1e-6)
    assert len(ref["val_loss"]) == 1
    assert ours["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5, abs=1e-6)


def test_litgpt_pretrain_ends_with_the_weights_of_lightning_ddp(litgpt_runs: Path) -> None:
    # litgpt's final `fabric.save`: fullshard's full checkpoint (state_dict_type="full") and
    # Lightning's DDP file hold the same keys and, after 4 AdamW steps, the same weights (the
    # two differ by at most 1.5e-8 measured: round-off in the sharded reductions).
    ours, ref = (torch.load(litgpt_runs / fabric / "final" / "lit_model.pth",
                            map_location="cpu", weights_only=False)  # both pickle the loader
                 for fabric in ("fullshard", "lightning"))
    assert ours["iter_num"] == ref["iter_num"] == 8 and ours["step_count"] == 4
    assert list(ours["model"]) == list(ref["model"])
    for name, want in ref["model"].items():
        torch.testing.assert_close(ours["model"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
