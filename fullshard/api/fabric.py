"""`fullshard.Fabric`: the subset of Lightning Fabric's API a training script needs.

Same names and meanings as `lightning.fabric.Fabric`, so a script ports by changing its
imports. It is thin: it resolves `accelerator` / `strategy` / `devices` / `num_nodes` /
`precision` into an `FSDPStrategy` (the work of Lightning's connector), starts the ranks
(`launch`) and forwards everything else to the strategy. It owns no sharding logic.

Differences from Lightning worth knowing:
- `setup` returns the model object itself (sharded in place) and the optimizers themselves,
  not `_FabricModule` / `_FabricOptimizer` wrappers: the precision's forward context and
  casts are hooks on the model, and under '16-mixed' `optimizer.step()` goes through the
  gradient scaler (see `fullshard.api.precision`). `fabric.backward(loss)` scales the loss
  under '16-mixed' and is otherwise the same as `loss.backward()`.
- strategies: 'fsdp' (FULL_SHARD), 'ddp' (NO_SHARD, i.e. replicated: DDP's numerics), an
  `FSDPStrategy`; accelerators: 'auto', 'cpu', 'cuda'/'gpu'.
- `launch()` also works under `fullshard run` / torchrun / SLURM (it then starts nothing).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from fullshard.api.strategy import FSDPStrategy
from fullshard.config import resolve_precision
from fullshard.distributed.environment import (
    LocalEnvironment,
    detect_environment,
    launched_world_size,
)

_SEED_VAR = "FULLSHARD_GLOBAL_SEED"
_STRATEGIES = ("fsdp", "ddp", "fsdp_cpu_offload")


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed Python's `random`, numpy (when installed) and torch on every device; return the
    seed. `None` reads `FULLSHARD_GLOBAL_SEED` (or `PL_GLOBAL_SEED`), else uses 0. With
    `workers`, DataLoaders set up by `Fabric.setup_dataloaders` seed their workers from it."""
    if seed is None:
        env = os.environ.get(_SEED_VAR) or os.environ.get("PL_GLOBAL_SEED")
        seed = int(env) if env else 0
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    os.environ[_SEED_VAR] = str(seed)
    os.environ["FULLSHARD_SEED_WORKERS"] = "1" if workers else "0"
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def _seed_worker(worker_id: int) -> None:
    base = int(os.environ.get(_SEED_VAR, "0"))
    rank = int(os.environ.get("RANK", "0"))
    seed = (base + 1000 * rank + worker_id) % 2**32
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, _move(v, device)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move(v, device) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_move(v, device) for v in obj)
    return obj


class DeviceDataLoader:
    """A DataLoader that moves each batch to the device and calls `sampler.set_epoch` on
    every new pass (as Lightning's `_FabricDataLoader`). Other attributes pass through."""

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self._loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)  # type: ignore[union-attr]
        self._epoch += 1
        for batch in self._loader:
            yield batch if self._device is None else _move(batch, self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class Fabric:
    """Run a training loop on one or many processes with a fully sharded model.

    Args:
        accelerator: 'auto', 'cpu', 'cuda' or 'gpu'.
        strategy: 'fsdp', 'ddp', 'fsdp_cpu_offload', or an `FSDPStrategy`.
        devices: processes on this machine: an int, 'auto' (the launcher's count when started
            by `fullshard run` / torchrun / SLURM, else all GPUs on CUDA and 1 on CPU), or a
            list of CUDA device indices.
        num_nodes: machines.
        precision: '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' (or 32, 16,
            'bf16').
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str | FSDPStrategy = "fsdp",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
    ) -> None:
        self._strategy = _resolve_strategy(strategy)
        self._strategy.accelerator = _resolve_accelerator(accelerator, self._strategy.accelerator)
        device_type = self._strategy.accelerator
        env = self._strategy.cluster_environment or detect_environment()
        self._strategy.cluster_environment = env
        explicit = devices != "auto" or num_nodes != 1
        parallel = _resolve_devices(devices, device_type)
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        external = env.creates_processes_externally and not isinstance(env, LocalEnvironment)
        if external or "WORLD_SIZE" in os.environ:
            world = env.world_size()
            if not explicit:  # take the launcher's shape
                per_node = launched_world_size() or world
                num_nodes = max(1, world // per_node)
                parallel = _resolve_devices(per_node, device_type)
            env.validate_settings(len(parallel), num_nodes)
        self._strategy.parallel_devices = parallel
        self._strategy.num_nodes = num_nodes
        if precision is not None:
            wanted = resolve_precision(precision)
            own = self._strategy._precision
            if own is not None and own != wanted:
                raise ValueError(
                    f"Fabric(precision={precision!r}) conflicts with the strategy's "
                    f"precision={own!r}; set it in one place."
                )
            self._strategy.precision = wanted
        self._strategy.validate_world(len(parallel) * num_nodes)
        self._strategy._set_world_ranks()
        self._strategy._configure_launcher()
        self._launched = False
        self._models_setup = 0

    # -- facts ------------------------------------------------------------------------------
    @property
    def strategy(self) -> FSDPStrategy:
        return self._strategy

    @property
    def device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def rank(self) -> int:
        return self.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # -- launching --------------------------------------------------------------------------
    def launch(self, function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start the ranks and join the process group.

        From a plain `python script.py` with `devices=N > 1`, this process becomes local rank
        0 and starts ranks 1..N-1 by re-running the script; under `fullshard run`, torchrun or
        SLURM every rank already runs and nothing is started. With `function`, each rank then
        calls `function(fabric, *args, **kwargs)` and `launch` returns its result.
        """
        if self._launched:
            raise RuntimeError("Fabric.launch() was already called in this process.")
        if function is not None:
            if not callable(function):
                raise TypeError(f"Fabric.launch(function) needs a callable, got {function!r}")
            params = inspect.signature(function).parameters
            if not params:
                raise TypeError(
                    "The function passed to Fabric.launch() must take the Fabric object as its "
                    "first argument: def train(fabric): ..."
                )
        self._launched = True
        launcher = self._strategy.launcher
        if launcher is not None:
            return launcher.launch(self._run_with_setup, function, *args, **kwargs)
        return self._run_with_setup(function, *args, **kwargs)

    def _run_with_setup(self, function: Callable[..., Any] | None, *args: Any,
                        **kwargs: Any) -> Any:
        self._strategy.setup_environment()
        if function is None:
            return None
        return function(self, *args, **kwargs)

    def _validate_launched(self) -> None:
        if self._launched:
            return
        if self._strategy.num_processes * self._strategy.num_nodes > 1:
            raise RuntimeError(
                "To use Fabric with more than one device, you must call `.launch()` first, or "
                "start the script with `fullshard run --help`."
            )
        self._launched = True  # one process: nothing to start, just the process group
        self._strategy.setup_environment()

    # -- setting objects up -----------------------------------------------------------------
    def setup(self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None,
              move_to_device: bool = True) -> Any:
        """Shard `module`; point optimizers built on its parameters at the shards.

        Returns `module` alone, or `(module, *optimizers)` (plus `scheduler` when given).
        """
        self._validate_launched()
        module, opts, scheduler = self._strategy.setup_module_and_optimizers(
            module, optimizers, scheduler
        )
        self._models_setup += 1
        if not opts and scheduler is None:
            return module
        out = (module, *opts)
        return (*out, scheduler) if scheduler is not None else out

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        """Shard `module`; create the optimizer from its parameters afterwards."""
        self._validate_launched()
        module = self._strategy.setup_module(module)
        self._models_setup += 1
        return module

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Check optimizers created from the parameters of a model set up before."""
        if not optimizers:
            raise ValueError("setup_optimizers() needs at least one optimizer.")
        self._validate_launched()
        out = [self._strategy.setup_optimizer(o) for o in optimizers]
        return out[0] if len(out) == 1 else tuple(out)

    def setup_dataloaders(self, *dataloaders: DataLoader, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Give each loader a `DistributedSampler` over the data-parallel ranks (shuffling if
        it shuffled before) and move its batches to `fabric.device`."""
        if not dataloaders:
            raise ValueError("setup_dataloaders() needs at least one DataLoader.")
        self._validate_launched()
        out = []
        for loader in dataloaders:
            if not isinstance(loader, DataLoader):
                raise TypeError(f"setup_dataloaders() takes DataLoaders, got {type(loader)!r}")
            if use_distributed_sampler and not isinstance(loader.sampler, DistributedSampler):
                loader = self._with_distributed_sampler(loader)
            device = self.device if move_to_device and self.device.type != "cpu" else None
            out.append(DeviceDataLoader(loader, device))
        return out[0] if len(out) == 1 else tuple(out)

    def _with_distributed_sampler(self, loader: DataLoader) -> DataLoader:
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            return loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is not None and type(batch_sampler) is not torch.utils.data.BatchSampler:
            raise TypeError(
                f"The DataLoader has a custom batch_sampler ({type(batch_sampler).__name__}); "
                f"give it a DistributedSampler yourself and pass use_distributed_sampler=False."
            )
        sampler = DistributedSampler(
            loader.dataset,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=int(os.environ.get(_SEED_VAR, "0")),
            **self._strategy.distributed_sampler_kwargs,
        )
        worker_init_fn = loader.worker_init_fn
        if worker_init_fn is None and os.environ.get("FULLSHARD_SEED_WORKERS") == "1":
            worker_init_fn = _seed_worker
        kwargs: dict[str, Any] = dict(
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=worker_init_fn,
            generator=loader.generator,
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
        return DataLoader(loader.dataset, **kwargs)

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build the model in; `empty_init=True` builds it on the meta device
        (materialized and sharded unit by unit at setup)."""
        self._validate_launched()
        return self._strategy.module_init_context(empty_init)

    # -- training-loop calls ----------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, *args: Any, model: nn.Module | None = None,
                 **kwargs: Any) -> None:
        self._strategy.backward(tensor, model, *args, **kwargs)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip by value (`clip_val`) or by the global norm (`max_norm`, returns the norm)."""
        if clip_val is not None and max_norm is not None:
            raise ValueError(
                "Only one of `clip_val` or `max_norm` can be set as this specifies the "
                "underlying clipping algorithm!"
            )
        if clip_val is not None:
            self._strategy.clip_gradients_value(module, optimizer, clip_val)
            return None
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                module, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        raise ValueError("You have to specify either `clip_val` or `max_norm` to do gradient "
                         "clipping!")

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's forward context (autocast for '*-mixed'), for code that runs
        outside the model's forward, e.g. a loss on the model's outputs."""
        return self._strategy.precision_plugin.forward_context()

    def no_backward_sync(self, module: nn.Module,
                         enabled: bool = True) -> contextlib.AbstractContextManager:
        """Accumulate gradients without communication (all micro-batches but the last)."""
        return self._strategy.no_backward_sync(module, enabled)

    def save(self, path: str | os.PathLike, state: dict[str, Any],
             filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Save a checkpoint; every rank must call it (it is collective)."""
        if filter is not None:
            if not isinstance(filter, dict):
                raise TypeError(f"Filter should be a dictionary, given {filter!r}")
            unknown = set(filter) - set(state)
            if unknown:
                raise ValueError(
                    f"The filter keys {sorted(unknown)} are not present in the state keys "
                    f"{sorted(state)}."
                )
            for k, fn in filter.items():
                if not callable(fn):
                    raise TypeError(
                        f"Expected `fabric.save(filter=...)` for key {k!r} to be a callable, "
                        f"given {fn!r}"
                    )
        self._strategy.save_checkpoint(path, state, filter=filter)
        self.barrier()

    def load(self, path: str | os.PathLike, state: dict[str, Any] | None = None,
             strict: bool = True, *, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint into `state` in place (models, optimizers, stateful objects and
        plain values); return the checkpoint's entries `state` did not ask for.
        `weights_only=False` unpickles objects other than tensors and plain values, which can
        run code from the file: only for files you trust (None, the default, means True)."""
        remainder = self._strategy.load_checkpoint(path, state, strict=strict,
                                                   weights_only=weights_only)
        self.barrier()
        return remainder

    # -- collectives and printing -----------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on local rank 0 only (one line per machine, as Lightning)."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        self._strategy.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._strategy.broadcast(obj, src)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor, or every tensor in a (nested) dict/list/tuple, over the ranks."""
        if isinstance(data, torch.Tensor):
            return self._strategy.all_reduce(data, group, reduce_op)
        if isinstance(data, dict):
            return type(data)((k, self.all_reduce(v, group, reduce_op)) for k, v in data.items())
        if isinstance(data, list | tuple):
            return type(data)(self.all_reduce(v, group, reduce_op) for v in data)
        if isinstance(data, int | float) and dist.is_initialized():
            t = torch.tensor(data, dtype=torch.float64, device=self.device)
            return self._strategy.all_reduce(t, group, reduce_op)
        return data

    def to_device(self, obj: Any) -> Any:
        return _move(obj, self.device)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool = False) -> int:
        return seed_everything(seed, workers)


def _resolve_strategy(strategy: str | FSDPStrategy) -> FSDPStrategy:
    if isinstance(strategy, FSDPStrategy):
        return strategy
    if isinstance(strategy, str) and strategy.lower() in _STRATEGIES:
        key = strategy.lower()
        if key == "ddp":
            return FSDPStrategy(sharding_strategy="NO_SHARD")
        if key == "fsdp_cpu_offload":
            return FSDPStrategy(cpu_offload=True)
        return FSDPStrategy()
    raise ValueError(
        f"Fabric(strategy={strategy!r}) is not supported. Use one of {', '.join(_STRATEGIES)}"
        f" or an FSDPStrategy(...) instance."
    )


def _resolve_accelerator(accelerator: str, from_strategy: str | None) -> str:
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


def _resolve_devices(devices: int | str | Sequence[int], device_type: str) -> list[torch.device]:
    if devices == "auto":
        n = launched_world_size()
        if n is None:
            n = torch.cuda.device_count() if device_type == "cuda" else 1
        devices = n
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            devices = int(text)
        else:
            devices = [int(x) for x in text.split(",") if x.strip()]
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
