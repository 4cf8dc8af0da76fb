"""`Fabric(...)`'s arguments resolved into an `FSDPStrategy` (the work of Lightning's connector).

`accelerator`, `strategy`, `devices` and `plugins` are checked and turned into the
strategy's settings here; `Fabric.__init__` combines them with the launcher's environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fullshard.api.precision import Precision, precision_from_plugin
from fullshard.api.strategy import FSDPStrategy
from fullshard.distributed.environment import ClusterEnvironment, launched_world_size

STRATEGIES = ("fsdp", "ddp", "fsdp_cpu_offload")


def resolve_plugins(plugins: object) -> tuple[Precision | None, ClusterEnvironment | None]:
    """`Fabric(plugins=...)`: at most one precision plugin (ours, a precision string, or a
    Lightning precision plugin with the same meaning) and at most one cluster environment."""
    if plugins is None:
        return None, None
    items = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
    precision: Precision | None = None
    env: ClusterEnvironment | None = None
    for plugin in items:
        if isinstance(plugin, str | int) and not isinstance(plugin, bool):
            found: Any = Precision(plugin)
        elif isinstance(plugin, ClusterEnvironment):
            if env is not None:
                raise ValueError("Fabric(plugins=...) holds two cluster environments; pass one.")
            env = plugin
            continue
        else:
            found = precision_from_plugin(plugin)
        if found is None:
            raise TypeError(
                f"Fabric(plugins=...) got {type(plugin).__name__}, which fullshard does not "
                f"support: plugins are a precision plugin (fullshard's Precision, a precision "
                f"string, or Lightning's FSDPPrecision / MixedPrecision / HalfPrecision) or a "
                f"fullshard ClusterEnvironment."
            )
        if precision is not None:
            raise ValueError("Fabric(plugins=...) holds two precision plugins; pass one.")
        precision = found
    return precision, env


def resolve_strategy(strategy: str | FSDPStrategy) -> FSDPStrategy:
    if isinstance(strategy, FSDPStrategy):
        return strategy
    if isinstance(strategy, str) and strategy.lower() in STRATEGIES:
        key = strategy.lower()
        if key == "ddp":
            return FSDPStrategy(sharding_strategy="NO_SHARD")
        if key == "fsdp_cpu_offload":
            return FSDPStrategy(cpu_offload=True)
        return FSDPStrategy()
    raise ValueError(
        f"Fabric(strategy={strategy!r}) is not supported. Use one of {', '.join(STRATEGIES)}"
        f" or an FSDPStrategy(...) instance."
    )


def resolve_accelerator(accelerator: str, from_strategy: str | None) -> str:
    if not isinstance(accelerator, str) or accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise ValueError(
            f"Fabric(accelerator={accelerator!r}) is not supported. Use 'auto', 'cpu', 'cuda' "
            f"or 'gpu'."
        )
    if accelerator == "auto":
        if from_strategy is not None:
            return from_strategy
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"Fabric(accelerator={accelerator!r}) but CUDA is not available here. Use "
                f"accelerator='cpu' (or 'auto')."
            )
        return "cuda"
    return "cpu"


def resolve_devices(devices: int | str | Sequence[int], device_type: str) -> list[torch.device]:
    if devices == "auto":
        n = launched_world_size()
        if n is None:
            n = torch.cuda.device_count() if device_type == "cuda" else 1
        devices = n
    if isinstance(devices, str):
        text = devices.strip()
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if text.lstrip("-").isdigit():
            devices = int(text)
        elif parts and all(x.isdigit() for x in parts):
            devices = [int(x) for x in parts]
        else:
            raise ValueError(
                f"Fabric(devices={devices!r}) is not a device count: pass an int (e.g. 2), "
                f"'auto', -1 (every GPU), or CUDA device indices as a list or a string such as "
                f"'0,1'."
            )
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1 and device_type == "cuda":
            devices = torch.cuda.device_count()
        if devices < 1:
            raise ValueError(f"Fabric(devices={devices!r}) must be >= 1 (or 'auto').")
        if device_type == "cuda":
            return [torch.device("cuda", i) for i in range(devices)]
        return [torch.device("cpu")] * devices
    if isinstance(devices, Sequence) and devices and all(isinstance(i, int) for i in devices):
        if device_type != "cuda":
            raise ValueError(
                f"Fabric(devices={list(devices)}) lists device indices, which only applies to "
                f"CUDA; on CPU pass the number of processes."
            )
        return [torch.device("cuda", i) for i in devices]
    raise ValueError(
        f"Fabric(devices={devices!r}) must be an int, 'auto', or a list of CUDA device indices."
    )
