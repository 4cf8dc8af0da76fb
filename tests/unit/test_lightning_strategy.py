"""`fullshard.FSDPStrategy` as Lightning's connector sees it (no process is started here: the
2-rank runs are tests/distributed/test_lightning_fabric.py), and without Lightning."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

import fullshard  # noqa: E402  (after Lightning: it registers "fullshard" at import)
from fullshard.api.precision import Precision  # noqa: E402
from fullshard.config import MixedPrecision, mixed_precision_for  # noqa: E402


def _cpu_fabric(**kwargs) -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=2, **kwargs)


def test_lightnings_fabric_takes_the_strategy_by_instance_and_by_name() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import FSDPStrategy as LightningFSDPStrategy

    assert "fullshard" in STRATEGY_REGISTRY.available_strategies()
    ours = fullshard.FSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    by_instance = _cpu_fabric(strategy=ours)
    assert by_instance.strategy is ours
    for fabric in (by_instance, _cpu_fabric(strategy="fullshard")):
        strategy = fabric.strategy
        assert isinstance(strategy, fullshard.FSDPStrategy)
        assert isinstance(strategy, LightningFSDPStrategy)
        assert type(strategy.accelerator).__name__ == "CPUAccelerator"
        assert strategy.root_device == torch.device("cpu")
        assert strategy.num_processes == 2 and fabric.world_size == 2
        assert strategy.precision == "32-true" and isinstance(strategy.precision, Precision)
        assert type(strategy.launcher).__module__ == "fullshard.launch.subprocess_script"


@pytest.mark.parametrize("name", ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_precision_from_lightnings_connector_becomes_fullshards(name: str) -> None:
    from lightning.fabric.plugins.precision import FSDPPrecision

    with warnings.catch_warnings():  # '16-mixed' off CUDA; '*-true' FSDP notes
        warnings.simplefilter("ignore")
        strategy = _cpu_fabric(strategy=fullshard.FSDPStrategy(), precision=name).strategy
        # Lightning's plugin for the string means the dtypes fullshard applies for it.
        config = FSDPPrecision(name).mixed_precision_config
    assert strategy.precision == name and isinstance(strategy.precision, Precision)
    assert isinstance(strategy.precision, FSDPPrecision)  # Lightning's own checks hold
    assert strategy.precision.device == torch.device("cpu")
    ours = mixed_precision_for(name) or MixedPrecision(
        param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    dtypes = ("param_dtype", "reduce_dtype", "buffer_dtype")
    assert [getattr(config, d) for d in dtypes] == [getattr(ours, d) for d in dtypes]
    assert (strategy.precision.scaler is not None) == (name == "16-mixed")


def test_a_precision_set_on_the_strategy_is_kept_by_lightnings_fabric() -> None:
    strategy = _cpu_fabric(strategy=fullshard.FSDPStrategy(precision="bf16-mixed")).strategy
    assert strategy.precision == "bf16-mixed"


def test_accelerators_fullshard_cannot_use_are_refused() -> None:
    from lightning.fabric.accelerators import CPUAccelerator, MPSAccelerator

    assert fullshard.FSDPStrategy(accelerator=CPUAccelerator()).root_device.type == "cpu"
    with pytest.raises(ValueError, match="runs on CPU or CUDA, got accelerator MPSAccelerator"):
        fullshard.FSDPStrategy(accelerator=MPSAccelerator())


def test_without_lightning_the_engine_imports_and_the_strategy_says_how_to_get_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None  # as if Lightning were not installed\n"
        "import fullshard\n"
        "assert callable(fullshard.fsdp) and 'lightning' not in str(fullshard.__all__)\n"
        "try:\n"
        "    fullshard.FSDPStrategy\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'pip install "fullshard[lightning]"' in proc.stdout


def test_importing_fullshard_before_lightning_registers_it_too() -> None:
    code = (
        "import fullshard, sys\n"
        "assert 'lightning' not in sys.modules\n"
        "import lightning as L\n"
        "print(L.Fabric(strategy='fullshard', accelerator='cpu', devices=2).strategy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "FSDPStrategy(" in proc.stdout


def test_a_lightning_precision_plugin_with_its_own_config_has_its_dtypes_translated() -> None:
    from lightning.fabric.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    class ReduceInFp32(FSDPPrecision):
        @property
        def mixed_precision_config(self) -> TorchMixedPrecision:
            return TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16)

    strategy = fullshard.FSDPStrategy(precision=ReduceInFp32("bf16-mixed"))
    assert strategy.precision == "bf16-mixed"
    engine = strategy._engine_mixed_precision()
    assert (engine.param_dtype, engine.reduce_dtype, engine.buffer_dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16)
    assert strategy.mixed_precision_config.reduce_dtype == torch.float32
