"""`FSDPStrategy`: Lightning Fabric's FSDP strategy (constructor, methods, meanings) on our engine.

It owns the translation from Lightning's options to `fullshard.fsdp()` and the job-level
duties around it: the process group (`setup_environment`), which launcher starts the ranks
(`_configure_launcher`), wrapping and optimizer checks, user collectives, the global gradient
norm, and checkpoints (`api.strategy_checkpoints`, delegated to `fullshard.checkpoint`). It
owns no sharding logic. `fullshard.FSDPStrategy` is `api.lightning_strategy.FSDPStrategy`: this
class with Lightning Fabric's strategy base classes under it (Lightning's own `Fabric` takes
it).

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
  (see [Note: torch FSDP's keywords] in api/strategy_args.py); other keywords are a `TypeError`.
- `module_sharded_context()` is torch's `enable_wrap`: `wrap()`ped modules become units.
- ignored parameters count in `clip_gradients_norm` with their local gradients, added after
  the reduction of the shards' norms, as torch FSDP does.
- the README's "Lightning differences" table lists the rest, each with its reason.

The constructor's annotations are real objects, not strings (no `from __future__ import
annotations` here): jsonargparse / LightningCLI read them from `inspect.signature`.
"""

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fullshard.api import collectives
from fullshard.api.compile_units import unwrap_for_units
from fullshard.api.compiled import uncompiled, unwrap_compiled
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
    check_clip_val,
    check_engine_kwargs,
    check_max_norm,
    check_mesh_or_group,
    check_norm_type,
    check_optimizers,
    check_torch_options,
    lightning_precision_name,
    mark_wrapped_unit,
    merge_checkpointing_arguments,
    torch_cpu_offload,
    torch_sharding_strategy,
)
from fullshard.api.strategy_checkpoints import CheckpointMethods
from fullshard.api.strategy_env import RankPlacement
from fullshard.config import (
    Compression,
    CPUOffload,
    MixedPrecision,
    mixed_precision_for,
    resolve_precision,
    resolve_sharding_strategy,
)
from fullshard.distributed import comm
from fullshard.distributed.mesh import (
    check_mesh_shape,
    is_device_mesh,
)
from fullshard.engine.module import FullyShardedModule
from fullshard.engine.wrap import normalize_policy
from fullshard.launch.environment import ClusterEnvironment

try:  # the annotation of `device_mesh` (jsonargparse parses `[1, 2]` into the tuple)
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without distributed
    DeviceMesh = object  # type: ignore[assignment,misc]


class FSDPStrategy(RankPlacement, CheckpointMethods):
    """Fully sharded data parallel training, configured as Lightning Fabric's `FSDPStrategy`.

    Args:
        accelerator: 'cpu', 'cuda'/'gpu' or None (CUDA when available; Fabric sets it).
        parallel_devices: the devices of this node's ranks (Fabric sets it from `devices`).
        cluster_environment: a `fullshard.launch.environment.ClusterEnvironment`
            (default: detected -- torchelastic, SLURM, else the local environment).
        precision: '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' (None: fp32),
            or a precision plugin (ours, or Lightning's `FSDPPrecision`; any other plugin
            is a `TypeError`, as in Lightning).
        process_group_backend: default 'nccl' on CUDA, 'gloo' on CPU.
        timeout: the process group's collective timeout.
        cpu_offload: True / `CPUOffload` (ours or torch's); `strategy.cpu_offload` reports
            the object passed, or torch's `CPUOffload(offload_params=...)` for a bool.
        mixed_precision: `MixedPrecision` (ours or torch's); wins over `precision`.
            `strategy.mixed_precision_config` reports it as passed, else torch's
            `MixedPrecision` for the precision string.
        auto_wrap_policy: which modules become units: a set of module classes, torch's
            `ModuleWrapPolicy`, or a callable `(module, recurse, nonwrapped_numel) -> bool`;
            default: `_no_split_modules`, else the repeated blocks; "root": the root alone.
        activation_checkpointing: deprecated; a module class or list of them.
        activation_checkpointing_policy: modules whose activations are recomputed in
            backward (same forms as `auto_wrap_policy`).
        sharding_strategy: 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD' (any
            case), torch's `ShardingStrategy` or ours; `strategy.sharding_strategy` reports
            torch's `ShardingStrategy` member.
        state_dict_type: 'sharded' (one file per rank) or 'full' (one file) for checkpoints.
        device_mesh: HYBRID_SHARD only: `(replicate, shard)` with product == world size, or a
            2-D `DeviceMesh`. Default for HYBRID_SHARD: (nodes, ranks per node).
        compression: `fullshard.Compression`, or "int8" / "bf16" for weights and gradients
            alike; None (default): exact (see `fullshard.fsdp`).
        **kwargs: engine options of `fullshard.fsdp`: bucketing_strategy, prefetch_limit,
            max_pending_reductions, broadcast_from, move_state_dict_to_cpu,
            reshard_after_forward (FSDP2's True / False / None / an int, e.g. the ranks per
            node, or per unit a callable of the unit's module, as `fsdp`),
            keep_frozen_gathered (as `fsdp`); and torch
            `FullyShardedDataParallel`'s other keywords (meanings: `strategy_args`, README).
    """

    def __init__(
        self,
        *,
        accelerator: str | None = None,
        parallel_devices: Sequence[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: str | int | Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(seconds=1800),
        cpu_offload: bool | CPUOffload | object | None = None,
        mixed_precision: MixedPrecision | object | None = None,
        auto_wrap_policy: object = None,
        activation_checkpointing: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
        activation_checkpointing_policy: object = None,
        sharding_strategy: object = "FULL_SHARD",
        state_dict_type: str = "sharded",
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        compression: Compression | str | None = None,
        **kwargs: Any,
    ) -> None:
        check_mesh_or_group(kwargs.get("process_group"), device_mesh)
        self._engine_kwargs, self._torch_options = check_engine_kwargs(kwargs)

        self._plan = resolve_sharding_strategy(sharding_strategy)
        reshard = self._engine_kwargs.get("reshard_after_forward")
        if not callable(reshard):  # a per-unit callable is checked unit by unit at setup
            self._plan.with_reshard_after_forward(reshard)
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
        normalize_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy

        # The engine's own types; the user's objects (or torch's equivalents) are what the
        # `cpu_offload` / `mixed_precision` attributes report, as in Lightning.
        self._cpu_offload = CPUOffload.coerce(cpu_offload)
        self.compression = Compression.coerce(compression)
        self.cpu_offload = torch_cpu_offload(cpu_offload)
        self._mixed_precision = MixedPrecision.coerce(mixed_precision)
        self.mixed_precision = mixed_precision
        self._precision_name: str | None = None  # set explicitly (else '32-true')
        self._precision_plugin: Precision | None = None
        if precision is not None:
            self.precision = precision  # the setter: a string/alias or a precision plugin

        self.accelerator = self._checked_accelerator(accelerator)
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

    @staticmethod
    def _checked_accelerator(accelerator: object) -> Any:
        """The accelerator to store: None, 'cpu' or 'cuda' ('gpu' means 'cuda')."""
        if accelerator is not None and accelerator not in ("cpu", "cuda", "gpu"):
            raise ValueError(
                f"FSDPStrategy(accelerator={accelerator!r}) must be 'cpu', 'cuda' or 'gpu'."
            )
        return "cuda" if accelerator == "gpu" else accelerator

    # -- job facts --------------------------------------------------------------------------
    @property
    def sharding_strategy(self) -> Any:
        """torch's `torch.distributed.fsdp.ShardingStrategy` member (as Lightning reports it),
        whichever spelling was passed (`FSDPType.ZERO3` is FULL_SHARD, ZERO2 SHARD_GRAD_OP)."""
        return torch_sharding_strategy(self._plan.name)

    @property
    def checkpoint_io(self) -> Any:
        """Not used (as in Lightning): the strategy writes its checkpoints itself."""
        raise NotImplementedError(
            f"The `{type(self).__name__}` does not use the `CheckpointIO` plugin interface: it "
            f"writes checkpoints itself (fabric.save / fabric.load)."
        )

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        raise NotImplementedError(
            f"The `{type(self).__name__}` does not support setting a `CheckpointIO` plugin "
            f"(got {io!r}): it writes checkpoints itself (fabric.save / fabric.load)."
        )

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
            self._precision_name, self._precision_plugin = value.precision, value
            return
        if value is not None and not isinstance(value, str | int):
            name = lightning_precision_name(value)
            if name is None:
                raise TypeError(
                    f"The FSDP strategy can only work with the `FSDPPrecision` plugin (fullshard's "
                    f"`fullshard.api.precision.Precision`, or Lightning's `FSDPPrecision`) or a "
                    f"precision string ('32-true', '16-mixed', 'bf16-mixed', '16-true', "
                    f"'bf16-true'), found {value!r}."
                )
            value = name  # the name: the plugin is built for this rank's device
        self._precision_name = resolve_precision(value) if value is not None else None

    @property
    def precision_plugin(self) -> Precision:
        """The precision string's contexts, conversions and ('16-mixed') gradient scaler."""
        plugin = self._precision_plugin
        name = self._precision_name or "32-true"
        if plugin is None or plugin.precision != name:
            plugin = self._precision_plugin = Precision(name, self.root_device)
        return plugin

    @property
    def mixed_precision_config(self) -> Any:
        """The user's `mixed_precision` object as passed, else torch's `MixedPrecision` for the
        precision string (fp32 throughout for '32-true'), as Lightning reports it."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        return self.precision_plugin.mixed_precision_config

    def _engine_mixed_precision(self) -> MixedPrecision | None:
        """What the engine applies: the user's `mixed_precision`, else the precision string's
        dtypes (None for '32-true')."""
        return self._mixed_precision or mixed_precision_for(self._precision_name or "32-true")

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
        """Shard `module` in place with this strategy's options and return it. A compiled
        module: its original is sharded, each unit but the root compiled in place and the root
        compiled again (its own frame eager), all with its options
        (`fullshard.api.compile_units`); a module compiled after it was sharded is returned as
        it is (the root compiled alone)."""
        if isinstance(uncompiled(module), FullyShardedModule):
            inner, recompile = unwrap_compiled(module)
            return recompile(inner)
        module, recompile = unwrap_for_units(module)
        check_torch_options(self._torch_options, module, self.root_device)
        self.precision_plugin.convert_module(module)
        options: dict[str, Any] = dict(
            ignored_states=self._torch_options.ignored_states,
            device=self.root_device,
            sharding_strategy=self._plan.name,
            auto_wrap_policy=self.auto_wrap_policy,
            device_mesh=self._mesh_argument(),
            mixed_precision=self._engine_mixed_precision(),
            cpu_offload=self._cpu_offload,
            compression=self.compression,
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
        check_optimizers(optimizers, "setup")
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
        check_optimizers([optimizer], "setup_optimizers")
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
            # Lightning's wording, so a search for it finds the same cause.
            raise TypeError(
                f"`{what}` is only possible if the module passed to it is wrapped in "
                f"`FullyShardedDataParallel` -- under fullshard: a model set up by "
                f"FSDPStrategy / fabric.setup(); got an unwrapped {type(module).__name__}."
            )
        return module

    # -- training-loop helpers --------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None = None, *args: Any,
                 **kwargs: Any) -> None:
        self.precision_plugin.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """`optimizer.step(**kwargs)`, through the gradient scaler under '16-mixed'."""
        return self.precision_plugin.optimizer_step(optimizer, **kwargs)

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
        max_norm = check_max_norm(max_norm)
        norm_type = check_norm_type(norm_type)
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
        clip_val = check_clip_val(clip_val)
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

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(sharding_strategy={self._plan.name!r}, "
            f"state_dict_type={self._state_dict_type!r}, "
            f"precision={self._precision_name or '32-true'!r})"
        )

