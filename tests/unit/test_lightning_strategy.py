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


# Where Lightning's own tests of its FSDPStrategy (tests_fabric/strategies/test_fsdp.py, 2.6),
# run with only the import pointed at fullshard's, fail by design: each behaviour we keep.
def test_choices_lightnings_strategy_refuses_are_accepted_when_built() -> None:
    # Hybrid sharding without a wrap policy or process groups: fullshard builds the
    # (nodes, ranks per node) mesh itself, so a model that is one unit is fine (Lightning,
    # on torch's FSDP1: RuntimeError "requires you to pass at least one of ...").
    for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        assert fullshard.FSDPStrategy(sharding_strategy=name).sharding_strategy.name == name
    # use_orig_params=False: the optimizer always sees the original parameters (this rank's
    # rows), so there is nothing to refuse at setup; a warning says it has no effect
    # (Lightning: ValueError at setup_module_and_optimizers).
    from fullshard.api import strategy_args

    strategy_args._WARNED.clear()  # once per process: another test may have had it
    with pytest.warns(UserWarning, match=r"use_orig_params=False\) has no effect"):
        fullshard.FSDPStrategy(use_orig_params=False)
    # An unknown state_dict_type is refused when the strategy is built (Lightning: at the
    # first save, after training).
    with pytest.raises(ValueError, match="state_dict_type='invalid'"):
        fullshard.FSDPStrategy(state_dict_type="invalid")


def test_checkpoint_choices_that_differ_from_lightnings(world1, tmp_path) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      strategy=fullshard.FSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(4, 3))
    # A sharded save refuses a non-empty folder that is not a checkpoint, and a file in the
    # way, leaving both as they were (Lightning writes into the folder, deletes the file).
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    with pytest.raises(IsADirectoryError, match="not a checkpoint; saving would replace it"):
        fabric.save(folder, {"model": model})
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    file = tmp_path / "file.pt"
    file.write_text("keep")
    with pytest.raises(FileExistsError, match="saving would delete the file"):
        fabric.save(file, {"model": model})
    assert file.read_text() == "keep"
    # A module the strategy did not set up is saved as it is (Lightning: "Could not find a
    # FSDP model"); a checksum file is written beside the shards and checked when loading.
    path = tmp_path / "ckpt"
    aux = torch.nn.Linear(2, 2)
    fabric.save(path, {"model": model, "aux": aux, "step": 3})
    assert (path / ".fullshard-checksums.json").is_file()
    # Loading with no state (None or {}) returns the whole checkpoint (Lightning: ValueError).
    for state in (None, {}):
        loaded = fabric.strategy.load_checkpoint(path, state=state)
        assert set(loaded) == {"model", "aux", "step"} and loaded["step"] == 3
    # A module not set up by the strategy is refused by its backward-sync control, as
    # Lightning's refuses one not wrapped in torch's FullyShardedDataParallel (a module
    # torch's FSDP wrapped is refused too: the strategy drives only its own).
    control = fabric.strategy._backward_sync_control
    with pytest.raises(TypeError, match="only possible if the module passed to it is wrapped"):
        with control.no_backward_sync(torch.nn.Linear(2, 2), True):
            pass
