"""`fullshard.Fabric`: Lightning Fabric's API for training scripts, on the fullshard engine.

Same names and meanings as `lightning.fabric.Fabric`, so a script ports by changing its
imports (the README's porting section lists every name, what is the same and what differs).
It is thin: `api.connector` resolves `accelerator` / `strategy` / `devices` / `num_nodes` /
`precision` / `plugins` into an `FSDPStrategy`, `launch` starts the ranks, and everything else
is forwarded to the strategy or to one module per concern: `api.data` (dataloaders and
samplers), `api.batches` (moving batches), `api.collectives` (`all_gather` / `all_reduce`),
`api.loggers` (`log`, `log_dict`, the CSV logger), `api.seed`, `api.forward_methods`
(`model.module`, `mark_forward_method`). It owns no sharding logic.

Differences from Lightning worth knowing (the README's "Lightning differences" table has all):
- `setup` returns the model object itself (sharded in place) and the optimizers themselves,
  not `_FabricModule` / `_FabricOptimizer` wrappers: the precision's forward context and
  casts are hooks on the model, and under '16-mixed' `optimizer.step()` goes through the
  gradient scaler (see `fullshard.api.precision`). What scripts use of `_FabricModule` is
  there: `model.module` (the model as its own class), `model.device` (`fabric.device`) and
  `model.mark_forward_method`; every other attribute is the model's own, as it is the model.
  `fabric.backward(loss)` scales the loss under '16-mixed' and is otherwise the same as
  `loss.backward()`.
- strategies: 'fsdp' (FULL_SHARD), 'ddp' (NO_SHARD, i.e. replicated: DDP's numerics), an
  `FSDPStrategy`; accelerators: 'auto', 'cpu', 'cuda'/'gpu'.
- `launch()` also works under `fullshard run` / torchrun / SLURM (it then starts nothing).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fullshard.api import collectives, forward_methods
from fullshard.api.batches import move_to_device
from fullshard.api.connector import (
    resolve_accelerator,
    resolve_devices,
    resolve_plugins,
    resolve_strategy,
)
from fullshard.api.data import DeviceDataLoader, distributed_sampler, with_sampler
from fullshard.api.loggers import check_loggers, to_scalars
from fullshard.api.precision import Precision
from fullshard.api.seed import seed_everything as _seed_everything
from fullshard.api.strategy import FSDPStrategy
from fullshard.config import resolve_precision
from fullshard.distributed.environment import (
    LocalEnvironment,
    detect_environment,
    launched_world_size,
)
from fullshard.engine.module import FullyShardedModule

_SET_UP = "_fullshard_set_up_by_fabric"


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """See `fullshard.api.seed.seed_everything` (module-level default: `workers=False`, as
    Lightning's function; `Fabric.seed_everything` defaults to `workers=True`)."""
    return _seed_everything(seed, workers, verbose)


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
        plugins: a precision plugin (`fullshard.api.precision.Precision`, a precision string,
            or Lightning's `FSDPPrecision` / `MixedPrecision` / `HalfPrecision`) and/or a
            `ClusterEnvironment`; one or a list.
        callbacks: objects whose methods `fabric.call(name, ...)` runs; one or a list.
        loggers: objects with Lightning's logger methods (`fullshard.CSVLogger`, Lightning's
            loggers); one or a list.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str | FSDPStrategy = "fsdp",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        plugins: Any = None,
        callbacks: Any = None,
        loggers: Any = None,
    ) -> None:
        self._strategy = resolve_strategy(strategy)
        self._strategy.accelerator = resolve_accelerator(accelerator, self._strategy.accelerator)
        device_type = self._strategy.accelerator
        plugin_precision, plugin_env = resolve_plugins(plugins)
        if plugin_env is not None:
            self._strategy.cluster_environment = plugin_env
        env = self._strategy.cluster_environment or detect_environment()
        self._strategy.cluster_environment = env
        explicit = devices != "auto" or num_nodes != 1
        parallel = resolve_devices(devices, device_type)
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        external = env.creates_processes_externally and not isinstance(env, LocalEnvironment)
        if external or "WORLD_SIZE" in os.environ:
            world = env.world_size()
            if not explicit:  # take the launcher's shape
                per_node = launched_world_size() or world
                num_nodes = max(1, world // per_node)
                parallel = resolve_devices(per_node, device_type)
            env.validate_settings(len(parallel), num_nodes)
        self._strategy.parallel_devices = parallel
        self._strategy.num_nodes = num_nodes
        if precision is not None and plugin_precision is not None:
            raise ValueError(
                f"Fabric(precision={precision!r}) and a precision plugin in plugins= both set the "
                f"precision; set it in one place."
            )
        wanted = plugin_precision if plugin_precision is not None else precision
        if wanted is not None:
            name = wanted.precision if isinstance(wanted, Precision) else resolve_precision(wanted)
            own = self._strategy._precision_name
            if own is not None and own != name:
                raise ValueError(
                    f"Fabric(precision={name!r}) conflicts with the strategy's "
                    f"precision={own!r}; set it in one place."
                )
            # The name, not the object: the strategy builds the plugin for its own device.
            self._strategy.precision = name
        self._strategy.validate_world(len(parallel) * num_nodes)
        self._strategy._set_world_ranks()
        self._strategy._configure_launcher()
        self._launched = False
        if callbacks is None:
            callbacks = []
        self._callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        self._loggers = check_loggers(loggers)

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

    @property
    def loggers(self) -> list[Any]:
        return self._loggers

    @property
    def logger(self) -> Any:
        """The first logger."""
        if not self._loggers:
            raise IndexError("This Fabric has no loggers; pass Fabric(loggers=CSVLogger(...)).")
        return self._loggers[0]

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
    def _check_not_set_up(self, module: nn.Module, what: str) -> None:
        self._validate_launched()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what}() takes an nn.Module, got {type(module).__name__}")
        if module.__dict__.get(_SET_UP):
            raise ValueError(
                f"{type(module).__name__} was already set up by Fabric; a model is passed to "
                f"setup()/setup_module() only once. Use the model it returned (to add an "
                f"optimizer later, use fabric.setup_optimizers(optimizer))."
            )

    def _finish_setup(self, module: nn.Module) -> nn.Module:
        object.__setattr__(module, _SET_UP, True)
        forward_methods.attach(module)
        # `_FabricModule.device`: where the model computes. Not set over a `device` the
        # model's class already has (a Hugging Face model's property, a user attribute).
        if not _has_attribute(module, "device"):
            object.__setattr__(module, "device", self.device)
        return module

    def setup(self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None,
              move_to_device: bool = True, _reapply_compile: bool = True) -> Any:
        """Shard `module`; point optimizers built on its parameters at the shards.

        Returns `module` alone, or `(module, *optimizers)` (plus `scheduler` when given).
        Setting up the same model twice is a `ValueError`. A `torch.compile`d model is
        always unwrapped, sharded, each unit's forward compiled in place and the root compiled
        again, all with its options (`fullshard.api.compile_units`: Lightning compiles the
        wrapper alone, which gains less here); `_reapply_compile` is accepted for Lightning's
        signature, False changes nothing.
        """
        self._check_not_set_up(module, "setup")
        module, opts, scheduler = self._strategy.setup_module_and_optimizers(
            module, optimizers, scheduler
        )
        self._finish_setup(module)
        if not opts and scheduler is None:
            return module
        out = (module, *opts)
        return (*out, scheduler) if scheduler is not None else out

    def setup_module(self, module: nn.Module, move_to_device: bool = True,
                     _reapply_compile: bool = True) -> nn.Module:
        """Shard `module`; create the optimizer from its parameters afterwards (a compiled
        module as in `setup`)."""
        self._check_not_set_up(module, "setup_module")
        return self._finish_setup(self._strategy.setup_module(module))

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Check optimizers created from the parameters of a model set up before."""
        if not optimizers:
            raise ValueError("setup_optimizers() needs at least one optimizer.")
        self._validate_launched()
        out = [self._strategy.setup_optimizer(o) for o in optimizers]
        return out[0] if len(out) == 1 else tuple(out)

    def setup_dataloaders(self, *dataloaders: DataLoader, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Give each loader its share of the data (`api.data`: a `DistributedSampler`, or a
        custom sampler kept and wrapped) and move its batches to `fabric.device`."""
        if not dataloaders:
            raise ValueError("setup_dataloaders() needs at least one DataLoader.")
        self._validate_launched()
        out = []
        for loader in dataloaders:
            if isinstance(loader, DeviceDataLoader):
                raise ValueError("This DataLoader was already set up by setup_dataloaders().")
            if not isinstance(loader, DataLoader):
                raise TypeError(f"setup_dataloaders() takes DataLoaders, got {type(loader)!r}")
            kwargs = self._strategy.distributed_sampler_kwargs
            sampler = (distributed_sampler(loader, kwargs["num_replicas"], kwargs["rank"])
                       if use_distributed_sampler else None)
            loader = with_sampler(loader, sampler, self.global_rank)
            device = self.device if move_to_device and self.device.type != "cpu" else None
            out.append(DeviceDataLoader(loader, device))
        return out[0] if len(out) == 1 else tuple(out)

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build the model in; `empty_init=True` builds it on the meta device
        (materialized and sharded unit by unit at setup)."""
        self._validate_launched()
        return self._strategy.module_init_context(empty_init)

    def init_tensor(self) -> contextlib.AbstractContextManager:
        """Context in which new tensors are created on `fabric.device` with the precision's
        default dtype (the low dtype for '*-true')."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device(self.device))
        stack.enter_context(self._strategy.precision_plugin.tensor_init_context())
        return stack

    def sharded_model(self) -> contextlib.AbstractContextManager:
        """Deprecated (as in Lightning): use `init_module()`."""
        warnings.warn("Fabric.sharded_model() is deprecated; use Fabric.init_module().",
                      DeprecationWarning, stacklevel=2)
        self._validate_launched()
        return self._strategy.module_sharded_context()

    def mark_forward_method(self, module: nn.Module, method: str | Callable[..., Any]) -> None:
        """Make `module.<method>(...)` run as a forward (see `api.forward_methods`); the same
        as `module.mark_forward_method(method)` on a model returned by `setup`."""
        if not isinstance(module, FullyShardedModule):
            raise TypeError(f"mark_forward_method needs a model set up by fabric.setup(); got "
                            f"an unwrapped {type(module).__name__}.")
        forward_methods.mark_forward_method(module, method)

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
             filter: dict[str, Callable[[str, Any], bool]] | None = None, *,
             async_save: bool = False) -> Any:
        """Save a checkpoint; every rank must call it (it is collective). `async_save=True`
        returns a handle as soon as the state is copied and writes the files in the
        background: `handle.wait()` returns when it is in place; the next save or load waits
        for it (see `fullshard.checkpoint.background`)."""
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
        handle = self._strategy.save_checkpoint(path, state, filter=filter,
                                                async_save=async_save)
        self.barrier()
        return handle

    def load(self, path: str | os.PathLike, state: dict[str, Any] | None = None,
             strict: bool = True, *, weights_only: bool | None = None,
             allow_symlinks: bool = False) -> dict[str, Any]:
        """Load a checkpoint into `state` in place (models, optimizers, stateful objects and
        plain values); return the checkpoint's entries `state` did not ask for (with
        `state=None` or `{}`: the whole checkpoint, as one full-format dict).
        `weights_only=False` unpickles objects other than tensors and plain values, which can
        run code from the file: only for files you trust (None, the default, means True).
        `allow_symlinks=True` lets a sharded checkpoint follow symlinks inside its directory
        (refused by default, so a load reads nothing outside it)."""
        remainder = self._strategy.load_checkpoint(path, state, strict=strict,
                                                   weights_only=_weights_only(weights_only),
                                                   allow_symlinks=allow_symlinks)
        self.barrier()
        return remainder

    def load_raw(self, path: str | os.PathLike, obj: nn.Module | Optimizer, strict: bool = True,
                 *, weights_only: bool | None = None) -> None:
        """Load a plain state-dict file (`torch.save(model.state_dict(), path)`, or a full
        checkpoint with one model) into the module `obj` -- set up or not -- on every rank."""
        if isinstance(obj, Optimizer):
            raise NotImplementedError(
                "load_raw(path, optimizer) is not supported: the optimizer state of a sharded "
                "model is keyed by parameter name and restored with its model; save and load "
                "them together with fabric.save(path, {'model': ..., 'optimizer': ...}) and "
                "fabric.load(path, state)."
            )
        if not isinstance(obj, nn.Module):
            raise TypeError(f"load_raw(path, obj) takes an nn.Module, got {type(obj).__name__}")
        self._strategy.load_checkpoint(path, obj, strict=strict,
                                       weights_only=_weights_only(weights_only))
        self.barrier()

    # -- collectives, printing, callbacks, logging ------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on local rank 0 only (one line per machine, as Lightning)."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        self._strategy.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._strategy.broadcast(obj, src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's tensor(s), stacked along a new first dim (see `api.collectives`)."""
        self._validate_launched()
        return collectives.all_gather(data, group, sync_grads, self.device)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor, or every tensor in a (nested) collection, over the ranks."""
        self._validate_launched()
        return collectives.all_reduce(data, group, reduce_op, self.device,
                                      self._strategy.all_reduce)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Run the block on rank 0 first (local rank 0 of each machine with `local`), then on
        the others, e.g. to download or preprocess data once. Every rank must enter it."""
        rank = self.local_rank if local else self.global_rank
        if rank > 0:
            self.barrier()
        yield
        if rank == 0:
            self.barrier()

    def to_device(self, obj: Any) -> Any:
        """A module (not set up yet) moved to `fabric.device`, or a batch with every tensor
        and every object with `.to()` moved (`api.batches`); a set-up model is already there."""
        if isinstance(obj, nn.Module):
            if not isinstance(obj, FullyShardedModule):
                obj.to(self.device)
            return obj
        return move_to_device(obj, self.device)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook_name(*args, **kwargs)` on every callback that has it; keyword arguments
        its signature does not take are left out (unless it takes `**kwargs`)."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                warnings.warn(f"Skipping {type(callback).__name__}.{hook_name}: not callable.",
                              stacklevel=2)
                continue
            method(*args, **_accepted_kwargs(method, kwargs))

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one number (a one-element tensor is converted) to every logger."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log several numbers to every logger (`logger.log_metrics(metrics=..., step=...)`)."""
        scalars = to_scalars(metrics)
        for logger in self._loggers:
            logger.log_metrics(metrics=scalars, step=step)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None,
                        verbose: bool = True) -> int:
        """`seed_everything`, with `workers=True` by default (as Lightning's Fabric)."""
        return _seed_everything(seed, True if workers is None else workers, verbose)


def _weights_only(weights_only: bool | None) -> bool | None:
    """`weights_only`, checked: True (tensors and plain containers only), False, or None (the
    checkpoint reader's default)."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"weights_only must be True, False or None, got {weights_only!r}")
    return weights_only


def _has_attribute(obj: object, name: str) -> bool:
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True


def _accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}
