"""`fullshard.FSDPStrategy`: fullshard's strategy as a strategy of Lightning's own Fabric.

    fabric = L.Fabric(strategy=fullshard.FSDPStrategy(auto_wrap_policy={Block}), devices=2)
    fabric = L.Fabric(strategy="fullshard", devices=2)          # after `import fullshard`

This module needs Lightning (`pip install "fullshard[lightning]"`); the engine and
`fullshard.fsdp()` do not. The strategy's logic is `fullshard.api.strategy.FSDPStrategy`'s
(which needs torch only); this class puts Lightning's
`ParallelStrategy` and `_Sharded` under it and adds only what Lightning's `Fabric` and its
connector expect of a strategy object:

- the attributes the connector reads on a strategy instance: `_accelerator` (Lightning's
  `CPUAccelerator` / `CUDAAccelerator`, or a name), `_precision` (the precision set on the
  strategy, as a Lightning plugin; None lets `Fabric(precision=...)` decide), `_checkpoint_io`;
- Lightning's `FSDPPrecision`, which the connector builds for any `FSDPStrategy`, becomes
  fullshard's `Precision` for the same string (the same dtypes: see `_precision_setter`); a
  '16-mixed' plugin's gradient scaler is replaced by fullshard's, whose inf check spans ranks;
- `_backward_sync_control` (`fabric.no_backward_sync`), Lightning's rank-zero utilities'
  rank, `reset_seed()` in every rank (`PL_GLOBAL_SEED`), and the accelerator's `setup_device` /
  `teardown`, as Lightning's own strategies do;
- the launcher stays fullshard's (`launch.subprocess_script`): a dead rank ends the job fast and
  is named, a killed launcher leaves no orphans;
- registration: the name "fullshard" in Lightning's strategy registry, and a virtual subclass
  of Lightning's `FSDPStrategy`, so code that asks `isinstance(strategy, FSDPStrategy)`
  (Lightning's connector and `Fabric`, litgpt) takes its FSDP path.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from lightning.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins.precision import FSDPPrecision as LightningFSDPPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.strategies import FSDPStrategy as LightningFSDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import nn

from fullshard.api.precision import Precision, as_lightning_plugin
from fullshard.api.strategy import FSDPStrategy as EngineStrategy
from fullshard.config import MixedPrecision

try:  # the sharded-strategy marker `Fabric.sharded_model()` looks for (Lightning >= 2.1)
    from lightning.fabric.strategies.strategy import _Sharded
except ImportError:  # pragma: no cover - older Lightning
    _Sharded = object  # type: ignore[assignment,misc]

REGISTERED_NAME = "fullshard"


class _NoBackwardSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the strategy's own `no_backward_sync`."""

    def __init__(self, strategy: FSDPStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module,
                         enabled: bool = True) -> contextlib.AbstractContextManager:
        return self._strategy.no_backward_sync(module, enabled)


def _precision_setter(self: FSDPStrategy, value: Any) -> None:
    """A Lightning `FSDPPrecision` (what the connector builds) stands for its precision string:
    fullshard's `Precision` for it applies the same dtypes (`mixed_precision_for(name)` has
    the dtypes of Lightning's `mixed_precision_config` for every string). A subclass of it
    that overrides `mixed_precision_config` has that config's dtypes translated into the
    engine's `MixedPrecision` (unless the strategy was given `mixed_precision=`, which wins,
    as in Lightning)."""
    if isinstance(value, LightningFSDPPrecision) and not isinstance(value, Precision):
        overridden = (type(value).mixed_precision_config
                      is not LightningFSDPPrecision.mixed_precision_config)
        if overridden and self.mixed_precision is None:
            config = value.mixed_precision_config  # torch's; its dtypes are what it means
            self._mixed_precision = MixedPrecision(
                param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
                buffer_dtype=config.buffer_dtype)
            self.mixed_precision = config
        value = value.precision
    EngineStrategy.precision.fset(self, value)  # type: ignore[attr-defined]


class FSDPStrategy(EngineStrategy, ParallelStrategy, _Sharded):  # type: ignore[misc]
    __doc__ = (
        "Fully sharded data parallel training: a Lightning Fabric strategy on fullshard's "
        "engine (`L.Fabric(strategy=FSDPStrategy(...))`).\n"
        + (EngineStrategy.__doc__ or "").split("\n", 1)[1]
    )

    _checkpoint_io = None  # the connector reads it; checkpoints are written by the strategy

    precision = property(EngineStrategy.precision.fget, _precision_setter,  # type: ignore[attr-defined]
                         doc=EngineStrategy.precision.__doc__)

    @property
    def _precision(self) -> Any:
        """What Lightning's connector takes as the strategy's own precision plugin: the one set
        on this strategy (a Lightning `FSDPPrecision` for a string), or None when unset so that
        `Fabric(precision=...)` decides. The connector hands it back to the setter."""
        if self._precision_name is None:
            return None
        if self._precision_plugin is not None:
            return as_lightning_plugin(self._precision_plugin)
        with warnings.catch_warnings():  # '16-mixed' off CUDA: torch's scaler says it is off
            warnings.simplefilter("ignore")
            return LightningFSDPPrecision(self._precision_name)  # type: ignore[arg-type]

    @property
    def _backward_sync_control(self) -> _BackwardSyncControl:
        return _NoBackwardSync(self)

    @staticmethod
    def _checked_accelerator(accelerator: object) -> Any:
        if isinstance(accelerator, Accelerator):
            _device_type_of(accelerator)  # a ValueError for accelerators fullshard cannot use
            return accelerator
        return EngineStrategy._checked_accelerator(accelerator)

    def _accelerator_type(self) -> str:
        if isinstance(self.accelerator, Accelerator):
            return _device_type_of(self.accelerator)
        return super()._accelerator_type()

    def _set_world_ranks(self) -> None:
        super()._set_world_ranks()
        # Lightning's `rank_zero_*` helpers (its warnings, loggers, `fabric.print`) read these.
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, Accelerator):
            self.accelerator.setup_device(self.root_device)
        reset_seed()  # each rank re-seeds from `seed_everything`'s PL_GLOBAL_SEED, if set
        super().setup_environment()

    def teardown(self) -> None:
        super().teardown()
        self.precision_plugin.teardown()
        if isinstance(self.accelerator, Accelerator):
            self.accelerator.teardown()
        env = self.cluster_environment
        if env is not None and hasattr(env, "teardown"):
            env.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if REGISTERED_NAME not in strategy_registry:
            strategy_registry.register(
                REGISTERED_NAME, cls,
                description="fullshard: fully sharded data parallel training on CPU or CUDA",
            )


def _device_type_of(accelerator: Accelerator) -> str:
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    raise ValueError(
        f"fullshard.FSDPStrategy runs on CPU or CUDA, got accelerator "
        f"{type(accelerator).__name__}. Use Fabric(accelerator='cpu') or 'cuda'/'gpu'."
    )


# `isinstance(strategy, lightning.fabric.strategies.FSDPStrategy)` is True for ours.
LightningFSDPStrategy.register(FSDPStrategy)
FSDPStrategy.register_strategies(STRATEGY_REGISTRY)
