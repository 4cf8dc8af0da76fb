"""`FSDPStrategy`: Lightning Fabric's FSDP strategy (constructor, methods, meanings) on our engine.

It owns the translation from Lightning's options to `fullshard.fsdp()` and the job-level
duties around it: the process group (`setup_environment`), which launcher starts the ranks
(`_configure_launcher`), wrapping and optimizer checks, user collectives, the global gradient
norm, and checkpoints (delegated to `fullshard.checkpoint`). It owns no sharding logic.

Meanings where Lightning's FSDP and ours differ on purpose:
- `setup_module_and_optimizers` (`fabric.setup(model, optimizer)`) accepts an optimizer built
  on the unwrapped model's parameters if it has no state yet: its parameter references are
  replaced by the shards (torch FSDP's `use_orig_params=True` gives Lightning the same). A
  separate `setup_optimizer` refuses an optimizer that holds anything but the shards.
- `clip_gradients_norm` returns the true global norm and honours `error_if_nonfinite` (except
  on a '16-mixed' overflow step, which the gradient scaler skips on every rank anyway).
- precision strings: see `api.precision` (forward context as hooks on the model, the scaler's
  global inf check).
- a tuple `device_mesh` is checked against the world size by us, on CPU and CUDA alike.
- torch FSDP's keywords are honoured or warned about once where they have no effect
  ([Note: torch FSDP's keywords] in `strategy_args`); other keywords are a `TypeError`.
- `module_sharded_context()` is torch's `enable_wrap`: `wrap()`ped modules become units.
- ignored parameters count in `clip_gradients_norm` with their local gradients, added after
  the reduction of the shards' norms, as torch FSDP does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fullshard.api import collectives
from fullshard.api.compiled import uncompiled, uncompiled_entries, unwrap_compiled
from fullshard.api.functional import fsdp
from fullshard.api.grad_norm import clip_grad_norm
from fullshard.api.optimizer_setup import (
    check_holds_only,
    check_no_meta,
    check_rebindable,
    repoint,
)
from fullshard.api.precision import Precision, as_lightning_plugin
from fullshard.api.strategy_args import (
    as_timeout,
    check_engine_kwargs,
    check_torch_options,
    mark_wrapped_unit,
    merge_checkpointing_arguments,
)
from fullshard.config import (
    CPUOffload,
    MixedPrecision,
    mixed_precision_for,
    resolve_precision,
    resolve_sharding_strategy,
)
from fullshard.distributed import comm
from fullshard.distributed.environment import ClusterEnvironment, detect_environment
from fullshard.distributed.mesh import (
    check_mesh_shape,
    destroy_process_group_at_exit,
    is_device_mesh,
)
from fullshard.engine.module import FullyShardedModule
from fullshard.engine.wrap import normalize_policy


class FSDPStrategy:
    """Fully sharded data parallel training, configured as Lightning Fabric's `FSDPStrategy`.

    Args:
        accelerator: 'cpu', 'cuda'/'gpu' or None (CUDA when available; Fabric sets it).
        parallel_devices: the devices of this node's ranks (Fabric sets it from `devices`).
        cluster_environment: a `fullshard.distributed.environment.ClusterEnvironment`
            (default: detected -- torchelastic, SLURM, else the local environment).
        precision: '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' (None: fp32).
        process_group_backend: default 'nccl' on CUDA, 'gloo' on CPU.
        timeout: the process group's collective timeout.
        cpu_offload: True / `CPUOffload` (ours or torch's).
        mixed_precision: `MixedPrecision` (ours or torch's); wins over `precision`.
        auto_wrap_policy: which modules become units: a set of module classes, torch's
            `ModuleWrapPolicy`, or a callable `(module, recurse, nonwrapped_numel) -> bool`;
            default: `_no_split_modules`, else the repeated blocks; "root": the root alone.
        activation_checkpointing: deprecated; a module class or list of them.
        activation_checkpointing_policy: modules whose activations are recomputed in
            backward (same forms as `auto_wrap_policy`).
        sharding_strategy: 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD' (any
            case) or torch's `ShardingStrategy`.
        state_dict_type: 'sharded' (one file per rank) or 'full' (one file) for checkpoints.
        device_mesh: HYBRID_SHARD only: `(replicate, shard)` with product == world size, or a
            2-D `DeviceMesh`. Default for HYBRID_SHARD: (nodes, ranks per node).
        **kwargs: engine options of `fullshard.fsdp`: bucketing_strategy, prefetch_limit,
            max_pending_reductions, broadcast_from, move_state_dict_to_cpu; and torch
            `FullyShardedDataParallel`'s other keywords (meanings: `strategy_args`, README).
    """

    def __init__(
        self,
        *,
        accelerator: str | None = None,
        parallel_devices: Sequence[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: str | int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(seconds=1800),
        cpu_offload: bool | CPUOffload | object | None = None,
        mixed_precision: MixedPrecision | object | None = None,
        auto_wrap_policy: object = None,
        activation_checkpointing: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
        activation_checkpointing_policy: object = None,
        sharding_strategy: object = "FULL_SHARD",
        state_dict_type: str = "sharded",
        device_mesh: tuple[int, int] | object | None = None,
        **kwargs: Any,
    ) -> None:
        self._engine_kwargs, self._torch_options = check_engine_kwargs(kwargs)

        self._plan = resolve_sharding_strategy(sharding_strategy)
        if device_mesh is not None:
            if not self._plan.hybrid:
                raise ValueError(
                    f"FSDPStrategy(device_mesh={device_mesh!r}) only applies to "
                    f"sharding_strategy='HYBRID_SHARD', but sharding_strategy is "
                    f"{self._plan.name!r}. Drop device_mesh or use HYBRID_SHARD."
                )
            if not is_device_mesh(device_mesh):
                check_mesh_shape(device_mesh)
                device_mesh = tuple(device_mesh)  # type: ignore[arg-type]
        self.device_mesh = device_mesh

        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f"FSDPStrategy(state_dict_type={state_dict_type!r}) must be 'full' (one file "
                f"with the unsharded state) or 'sharded' (a directory with a file per rank)."
            )
        self._state_dict_type = state_dict_type

        activation_checkpointing_policy = merge_checkpointing_arguments(
            activation_checkpointing, activation_checkpointing_policy
        )
        normalize_policy(auto_wrap_policy)  # TypeError early for a malformed policy
        normalize_policy(activation_checkpointing_policy)
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy

        self.cpu_offload = CPUOffload.coerce(cpu_offload)
        self.mixed_precision = MixedPrecision.coerce(mixed_precision)
        self._precision = resolve_precision(precision) if precision is not None else None
        self._precision_plugin: Precision | None = None

        if accelerator is not None and accelerator not in ("cpu", "cuda", "gpu"):
            raise ValueError(
                f"FSDPStrategy(accelerator={accelerator!r}) must be 'cpu', 'cuda' or 'gpu'."
            )
        self.accelerator = "cuda" if accelerator == "gpu" else accelerator
        self.parallel_devices = list(parallel_devices) if parallel_devices is not None else None
        self.cluster_environment = cluster_environment
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise TypeError(
                f"process_group_backend must be a string such as 'gloo' or 'nccl', got "
                f"{process_group_backend!r}"
            )
        self._process_group_backend = process_group_backend
        timeout = as_timeout(timeout)
        self._timeout = timeout
        self._num_nodes = 1
        self._launcher: Any = None
        self._modules: list[weakref.ReferenceType[nn.Module]] = []

    # -- job facts --------------------------------------------------------------------------
    @property
    def sharding_strategy(self) -> str:
        return self._plan.name

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    @property
    def precision(self) -> Precision:
        """The precision plugin (as Lightning's `strategy.precision`); it compares equal to
        its string, and is Lightning's `FSDPPrecision` too when Lightning is imported (see
        `api.precision`). Set it with a string/alias or a `Precision`."""
        return as_lightning_plugin(self.precision_plugin)

    @precision.setter
    def precision(self, value: str | int | Precision | None) -> None:
        if isinstance(value, Precision):
            self._precision, self._precision_plugin = value.precision, value
            return
        self._precision = resolve_precision(value) if value is not None else None

    @property
    def precision_plugin(self) -> Precision:
        """The precision string's contexts, conversions and ('16-mixed') gradient scaler."""
        plugin = self._precision_plugin
        name = self._precision or "32-true"
        if plugin is None or plugin.precision != name:
            plugin = self._precision_plugin = Precision(name, self.root_device)
        return plugin

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The user's `mixed_precision`, else what the precision string stands for."""
        return self.mixed_precision or mixed_precision_for(self._precision or "32-true")

    @property
    def timeout(self) -> timedelta | None:
        return self._timeout

    @property
    def launcher(self) -> Any:
        return self._launcher

    def _environment(self) -> ClusterEnvironment:
        if self.cluster_environment is None:
            self.cluster_environment = detect_environment()
        return self.cluster_environment

    def _devices(self) -> list[torch.device]:
        if self.parallel_devices is None:
            from fullshard.distributed.environment import launched_world_size

            n = launched_world_size() or 1
            if self._accelerator_type() == "cuda":
                self.parallel_devices = [torch.device("cuda", i) for i in range(n)]
            else:
                self.parallel_devices = [torch.device("cpu")] * n
        return self.parallel_devices

    def _accelerator_type(self) -> str:
        if self.accelerator is None:
            self.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        return self.accelerator

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {value!r}")
        self._num_nodes = value

    @property
    def num_processes(self) -> int:
        return len(self._devices())

    @property
    def world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return self._environment().world_size()

    @property
    def global_rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return self._environment().global_rank()

    @property
    def local_rank(self) -> int:
        return self._environment().local_rank()

    @property
    def node_rank(self) -> int:
        return self._environment().node_rank()

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        devices = self._devices()
        if self._accelerator_type() == "cuda":
            return devices[self.local_rank % len(devices)]
        return torch.device("cpu")

    @property
    def process_group_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Every rank is a data-parallel rank (replicate and shard axes alike)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_world_ranks(self) -> None:
        env = self._environment()
        n = self.num_processes
        env.set_world_ranks(
            world_size=self.num_nodes * n, global_rank=self.node_rank * n + self.local_rank
        )

    def _configure_launcher(self) -> None:
        """A launcher that starts the local ranks, unless something else already started them."""
        from fullshard.launch.subprocess_script import SubprocessScriptLauncher

        env = self._environment()
        if env.creates_processes_externally:
            self._launcher = None
        else:
            self._launcher = SubprocessScriptLauncher(
                env, num_processes=self.num_processes, num_nodes=self.num_nodes
            )

    def validate_world(self, world_size: int) -> None:
        """Check what depends on the world size (the mesh) before any process group exists."""
        mesh = self.device_mesh
        if isinstance(mesh, tuple) and mesh[0] * mesh[1] != world_size:
            raise ValueError(
                f"FSDPStrategy(device_mesh={mesh}) has {mesh[0] * mesh[1]} ranks but the world "
                f"size is {world_size}. Choose (replicate, shard) with replicate * shard == "
                f"{world_size}, e.g. ({max(1, world_size // mesh[1])}, {mesh[1]}) if that "
                f"divides evenly, or leave device_mesh=None for (nodes, ranks per node)."
            )

    def setup_environment(self) -> None:
        """Join (or create) the default process group for this rank."""
        from torch.distributed.constants import default_pg_timeout

        from fullshard.launch.subprocess_script import install_rank_hooks
        from fullshard.launch.torchrun import attempt_store

        env = self._environment()
        self._set_world_ranks()
        world = env.world_size()
        self.validate_world(world)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            kwargs: dict[str, Any] = {}
            if self._timeout is not None:
                kwargs["timeout"] = self._timeout
            store = attempt_store(self._timeout or default_pg_timeout)  # restarts: see there
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(
                self.process_group_backend, rank=env.global_rank(), world_size=world, **kwargs
            )
            # Exiting with a live gloo/NCCL group can abort in its destructors at shutdown.
            atexit.register(destroy_process_group_at_exit)
        elif dist.get_world_size() != world and "WORLD_SIZE" in os.environ:
            raise ValueError(
                f"torch.distributed is already initialized with world size "
                f"{dist.get_world_size()}, but the environment says {world}."
            )
        self.validate_world(dist.get_world_size())
        install_rank_hooks(dist.get_rank(), self.local_rank)

    def teardown(self) -> None:
        from fullshard.launch.silence import stop_heartbeat

        stop_heartbeat()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # -- wrapping ---------------------------------------------------------------------------
    def _mesh_argument(self) -> object:
        if not self._plan.hybrid:
            return None
        if self.device_mesh is not None:
            return self.device_mesh
        world = self.world_size
        per_node = self.num_processes if world % self.num_processes == 0 else world
        return (world // per_node, per_node)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard `module` in place with this strategy's options and return it (a compiled
        module: its original, compiled again the same way; see `fullshard.api.compiled`)."""
        module, recompile = unwrap_compiled(module)
        if isinstance(module, FullyShardedModule):
            return recompile(module)
        check_torch_options(self._torch_options, module, self.root_device)
        self.precision_plugin.convert_module(module)
        options: dict[str, Any] = dict(
            ignored_states=self._torch_options.ignored_states,
            device=self.root_device,
            sharding_strategy=self._plan.name,
            auto_wrap_policy=self.auto_wrap_policy,
            device_mesh=self._mesh_argument(),
            mixed_precision=self.mixed_precision_config,
            cpu_offload=self.cpu_offload,
            activation_checkpointing_policy=self.activation_checkpointing_policy,
            **self._engine_kwargs,
        )
        wrapped = fsdp(module, **options)
        self.precision_plugin.install_forward_hooks(wrapped)
        self._modules.append(weakref.ref(wrapped))
        return recompile(wrapped)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: Sequence[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard `module` and point optimizers built on its unwrapped parameters at the shards.

        Each optimizer must hold only `module`'s parameters and have no state yet (it was
        never stepped nor loaded); otherwise a `ValueError` says how to set things up instead.
        """
        optimizers = list(optimizers)
        for opt in optimizers:
            check_no_meta(opt)
        if isinstance(uncompiled(module), FullyShardedModule):
            for opt in optimizers:
                self.setup_optimizer(opt)
            return module, optimizers, scheduler
        names_of: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), name)
        for opt in optimizers:
            check_rebindable(opt, names_of)
        module = self.setup_module(module)
        new = dict(module.named_parameters(remove_duplicate=False))
        for opt in optimizers:
            repoint(opt, names_of, new)
            self.precision_plugin.setup_optimizer(opt)
        return module, optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that `optimizer` holds only shards of models set up by this strategy."""
        check_no_meta(optimizer)
        known = {id(p) for ref in self._modules if (m := ref()) is not None
                 for p in m.parameters()}
        check_holds_only(optimizer, known)
        return self.precision_plugin.setup_optimizer(optimizer)

    def module_to_device(self, module: nn.Module) -> None:
        """No-op: setting the module up places its shards on `root_device`."""

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.ExitStack:
        """Build the model on the meta device when `empty_init` (materialized and sharded one
        unit at a time by `setup_module`, via each module's `reset_parameters`)."""
        stack = contextlib.ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision_plugin.module_init_context())
        stack.enter_context(self.module_sharded_context())
        return stack

    def module_sharded_context(self) -> contextlib.AbstractContextManager:
        """torch's `enable_wrap`: a module passed to torch's `wrap()` inside it is marked and
        becomes a unit at `setup_module` (besides the policy's); `wrap()` returns it as is."""
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=mark_wrapped_unit)

    def _wrapped(self, module: nn.Module, what: str) -> nn.Module:
        module = uncompiled(module)  # type: ignore[assignment]
        if not isinstance(module, FullyShardedModule):
            raise TypeError(
                f"{what} needs a model set up by FSDPStrategy / fabric.setup(); got an "
                f"unwrapped {type(module).__name__}."
            )
        return module

    # -- training-loop helpers --------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None = None, *args: Any,
                 **kwargs: Any) -> None:
        self.precision_plugin.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return optimizer.step(**kwargs)

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Iterator[None]:
        if not enabled:
            yield
            return
        with self._wrapped(module, "no_backward_sync").no_sync():  # type: ignore[attr-defined]
            yield

    @torch.no_grad()
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Scale the gradients so their global norm is at most `max_norm`; return that norm.

        The norm is over the unsharded gradients: each rank's shard contributes its sum of
        `|g|^p` (its max for `inf`), reduced over the shard axis only -- replicas along the
        replicate axis hold the same shards, and padding rows are not part of the shards.
        Every rank gets the same norm, so with `error_if_nonfinite` they all raise together.
        """
        module = self._wrapped(module, "clip_gradients_norm")
        if self.precision_plugin.unscale_for_clipping(optimizer, "clip_gradients_norm"):
            error_if_nonfinite = False  # an overflow step: skipped, not an error
        runtime = module.fullshard_runtime  # type: ignore[attr-defined]
        group = runtime.mesh.shard
        norm_type = float(norm_type)
        sharded = {id(p.param) for u in runtime.units for p in u.params}
        grads = [p.grad for p in module.parameters() if p.grad is not None and id(p) in sharded]
        # Ignored parameters: full, unreduced local gradients (torch FSDP's rule).
        local = [p.grad for p in module.parameters()
                 if p.grad is not None and id(p) not in sharded]
        device = grads[0].device if grads else self.root_device
        return clip_grad_norm(
            grads, max_norm, norm_type, group, device, error_if_nonfinite=error_if_nonfinite,
            unreduced=local,
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer | None,
                             clip_val: float) -> None:
        """Clamp every gradient element to `[-clip_val, clip_val]` (exact on shards)."""
        self.precision_plugin.unscale_for_clipping(optimizer, "clip_gradients_value")
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)

    # -- collectives for the user -----------------------------------------------------------
    def all_reduce(self, tensor: Any, group: object = None, reduce_op: object = "mean") -> Any:
        """Reduce `tensor` in place over `group` (default: all ranks) and return it (see
        `api.collectives.all_reduce_tensor`)."""
        return collectives.all_reduce_tensor(tensor, group, reduce_op)

    def barrier(self, name: str | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            comm.barrier(comm.Group.from_process_group(None))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` from global rank `src` on every rank (any picklable object; no numpy needed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        return comm.broadcast_pickled(obj, src, comm.Group.from_process_group(None))

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save `state` ({'model': model, 'optimizer': opt, ...}) in `state_dict_type`'s format.

        **Collective: every rank must call it** (not only under `if rank == 0:`); a call made
        on some ranks only warns after a while and raises a `TimeoutError` after `timeout`,
        instead of hanging. 'sharded': a directory of `torch.distributed.checkpoint` shards
        plus `meta.pt`, loadable on any world size or strategy; 'full': one file written by
        rank 0 (original names, optimizer state keyed by parameter name). Written under a
        temporary name and renamed into place once complete. See `fullshard.checkpoint`.
        """
        from fullshard.checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError(
                "FSDPStrategy.save_checkpoint(..., storage_options=...) is not supported: the "
                "strategy writes its files itself."
            )
        # How long the call waits for the other ranks to call it too: the group's timeout.
        timeout = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        with uncompiled_entries(state) as state:
            save_checkpoint(path, state, state_dict_type=self._state_dict_type, filter=filter,
                            timeout=timeout)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | nn.Module | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint (either format, detected from disk; any world size) into `state`
        in place; return the checkpoint's entries that `state` did not ask for. Collective.
        Files are read without running code from them unless `weights_only=False` (only for
        files you trust); None means True."""
        from fullshard.checkpoint import load_checkpoint

        timeout = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        with uncompiled_entries(state) as state:
            return load_checkpoint(path, state, strict=strict, timeout=timeout,
                                   weights_only=weights_only)

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(sharding_strategy={self._plan.name!r}, "
            f"state_dict_type={self._state_dict_type!r}, "
            f"precision={self._precision or '32-true'!r})"
        )
