"""Lightning's precision strings on the fullshard engine: dtypes, contexts and the scaler.

This module owns what a precision string means to `FSDPStrategy` / `Fabric` beyond the engine's
`MixedPrecision` (which it derives): how the model is converted and initialized, the context
its forward runs in, how inputs and outputs are cast, and -- for '16-mixed' -- a gradient
scaler whose inf/NaN check is global across ranks. The engine itself never sees the string.

| precision  | shards, optimizer | gathered, reduced, buffers | init | forward            | scaler |
|------------|-------------------|----------------------------|------|--------------------|--------|
| 32-true    | fp32              | fp32                       | fp32 | --                 | --     |
| 16-mixed   | fp32              | fp16                       | fp32 | autocast(fp16)     | yes    |
| bf16-mixed | fp32              | bf16                       | fp32 | autocast(bf16)     | --     |
| 16-true    | fp16 (module.to)  | fp16                       | fp16 | default dtype fp16 | --     |
| bf16-true  | bf16 (module.to)  | bf16                       | bf16 | default dtype bf16 | --     |

As in Lightning: floating inputs are cast to fp32 for '*-mixed' and 32-true and to the low
dtype for '*-true' (the engine then casts each unit's inputs to its compute dtype); floating
outputs are cast back to the default dtype (fp32), so a loss computed from them is fp32 in
every mode. Aliases: 32 / '32' -> '32-true', 16 / '16' -> '16-mixed', 'bf16' -> 'bf16-mixed'.

Because `fabric.setup` hands back the user's own module and optimizers (no `_FabricModule` /
`_FabricOptimizer` wrappers), the forward context and the casts are forward hooks on the
root module (`install_forward_hooks`), and with a scaler each optimizer's `step` is routed
through it (`setup_optimizer`): `optimizer.step()` then unscales (unless `clip_gradients`
already did), skips the update when any rank found an inf/NaN, and updates the scale.

[Note: a global inf check]
Each rank holds different gradient shards, so an overflow may show up on one rank only. A
step skipped on one rank and taken on another would silently desynchronize the replicas of
the optimizer state, so `ShardedGradScaler` all-reduces (max) the found-inf flag over all
ranks in every unscale -- exactly one collective per optimizer and step, on every rank, even
a rank that holds no gradient -- through `fullshard.distributed.comm`, which counts it.

[Note: Lightning's utilities and `strategy.precision`]
`FSDPStrategy.precision` is a `Precision` object, as Lightning's `strategy.precision` is a
precision plugin; it compares equal to its string (`strategy.precision == "bf16-mixed"`), and
strings are still what users pass in. Lightning's own helpers that take a Fabric
(`ThroughputMonitor`) check `isinstance(plugin, lightning.fabric.plugins.Precision)` and then
read `plugin.mixed_precision_config.reduce_dtype` for FSDP plugins. No duck typing gets past an
`isinstance` on a plain class, and lightning must stay optional, so `as_lightning_plugin` makes
the object an instance of Lightning's `FSDPPrecision` *only when Lightning is already imported
in this process* (it looks in `sys.modules`, never imports it): the object's class becomes a
subclass of both our class (first in the MRO, so every method is ours) and Lightning's
`FSDPPrecision` (for the `isinstance` checks). It is the same object, scaler and state
included. The compute dtype Lightning then derives is the one its own `FSDPStrategy` would
report for the same precision string (`mixed_precision_config.reduce_dtype`, fp32 for
'32-true'). Without Lightning nothing of it is touched.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fullshard.api.batches import cast_floating
from fullshard.api.strategy_args import torch_mixed_precision
from fullshard.config import PRECISIONS, MixedPrecision, mixed_precision_for, resolve_precision
from fullshard.distributed import comm

_LOW = {"16": torch.float16, "bf16": torch.bfloat16, "32": torch.float32}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make `dtype` torch's default floating dtype inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ShardedGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf/NaN check covers every rank's gradient shards.

    Scaling, unscaling, the scale's growth/backoff and `state_dict` are torch's; the only
    change is that the per-device found-inf flags of each unscale are combined and all-reduced
    (max) over `group` (default: all ranks), so every rank skips the same steps and keeps the
    same scale. Works for CPU-offloaded gradients (host tensors) with a CUDA scale as well.
    """

    def __init__(self, device: str = "cpu", *, group: comm.Group | None = None,
                 **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._group = group

    def _comm_group(self) -> comm.Group | None:
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = comm.Group.from_process_group(None)
        return self._group

    def _make_global(self, per_device: dict[torch.device, torch.Tensor]) -> None:
        """Replace the local found-inf flags by their max over the group, in place."""
        group = self._comm_group()
        assert self._scale is not None
        device = self._scale.device
        if group is not None and "nccl" in group.backend and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for t in per_device.values():
            flag = torch.maximum(flag, t.reshape(1).to(device, torch.float32))
        if group is not None:
            comm.all_reduce(flag, group, op=dist.ReduceOp.MAX)
        if not per_device:  # no gradients here; the others may have some
            per_device[self._scale.device] = flag.to(self._scale.device)
        for t in per_device.values():
            t.copy_(flag.reshape(t.shape).to(t.device))

    def unscale_(self, optimizer: Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        self._make_global(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: Optimizer) -> dict[Any, torch.Tensor]:
        per_device = super()._check_inf_per_device(optimizer)
        self._make_global(per_device)
        return per_device

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether this step's (already unscaled) gradients of `optimizer` overflowed on any
        rank; False when they were not unscaled yet."""
        return _found_inf(self, optimizer)

    def is_unscaled(self, optimizer: Optimizer) -> bool:
        return _is_unscaled(self, optimizer)


# A user's scaler may be torch's FSDP `ShardedGradScaler`: these read torch's own per-optimizer
# record (`torch.amp.GradScaler` keeps it), so they work for either class.
def _found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
    flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return bool(sum(v.item() for v in flags.values()))


def _is_unscaled(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
    from torch.amp.grad_scaler import OptState

    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def _is_global_scaler(scaler: object) -> bool:
    """Ours, or torch's FSDP `ShardedGradScaler` (both check for inf/NaN over all ranks)."""
    if isinstance(scaler, ShardedGradScaler):
        return True
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Torch
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(scaler, Torch)


class Precision:
    """What one precision string means: see the module docstring's table.

    The methods Lightning's strategies call on a precision plugin have Lightning's
    signatures (`backward(tensor, model, *args, **kwargs)`, `optimizer_step(optimizer,
    **kwargs)`, `convert_module`, the contexts, `mixed_precision_config`).

    Args:
        precision: a Lightning precision string or alias (None: '32-true').
        device: where the model computes (the autocast and scaler device type).
        scaler: '16-mixed' only: the gradient scaler to use instead of a new
            `ShardedGradScaler` (ours, or torch's FSDP `ShardedGradScaler`: the inf check
            must cover every rank's shards, so a plain `torch.amp.GradScaler` is refused).
    """

    def __init__(self, precision: str | int | None = None,
                 device: torch.device | str = "cpu", *,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        try:
            self.precision = resolve_precision(precision)
        except ValueError:
            raise ValueError(
                f"precision={precision!r} is not supported in FSDP. `precision` must be one "
                f"of: {', '.join(PRECISIONS)} (aliases: 32, 16, 'bf16')."
            ) from None
        if scaler is not None and self.precision != "16-mixed":
            raise ValueError(
                f"`precision={self.precision!r}` does not use a scaler, found {scaler!r}. Only "
                f"'16-mixed' scales the loss; drop the scaler."
            )
        if scaler is not None and not _is_global_scaler(scaler):
            raise TypeError(
                f"Precision('16-mixed', scaler=...) needs a scaler whose inf/NaN check covers "
                f"every rank's gradient shards: fullshard.api.precision.ShardedGradScaler or "
                f"torch's torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler; got "
                f"{type(scaler).__name__}."
            )
        self.device = torch.device(device)
        bits, kind = self.precision.split("-")
        self.dtype: torch.dtype = _LOW[bits]
        """The low (compute) dtype; fp32 for '32-true'."""
        self.is_true = kind == "true"
        self.mixed_precision: MixedPrecision | None = mixed_precision_for(self.precision)
        """The engine's dtypes for this string (None for 32-true)."""
        self.scaler: torch.amp.GradScaler | None = scaler
        if self.precision == "16-mixed" and scaler is None:
            self.scaler = ShardedGradScaler(self.device.type)
        self._scaled_backwards = 0  # scaled backward calls so far
        self._seen_at_step: dict[int, int] = {}  # id(optimizer) -> that count at its last step

    def __repr__(self) -> str:
        return f"Precision({self.precision!r}, device={str(self.device)!r})"

    def __eq__(self, other: object) -> bool:
        """Equal to another `Precision` or a precision string/alias naming the same mode."""
        if isinstance(other, Precision):
            return self.precision == other.precision
        if isinstance(other, str | int) and not isinstance(other, bool):
            try:
                return self.precision == resolve_precision(other)
            except ValueError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.precision)

    @property
    def mixed_precision_config(self) -> Any:
        """torch's `MixedPrecision` with the dtypes this precision string gathers, reduces and
        keeps buffers in (fp32 for '32-true'): what Lightning's
        `FSDPPrecision.mixed_precision_config` reports (torch-equal to it). The engine
        applies `self.mixed_precision`, fullshard's own type with the same dtypes."""
        mp = self.mixed_precision
        f32 = torch.float32
        if mp is None:
            return torch_mixed_precision(f32, f32, f32)
        return torch_mixed_precision(mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Default dtype for tensors created by the user (`fabric.init_tensor()`): the low
        dtype for '*-true', unchanged otherwise."""
        if self.is_true and self.dtype != torch.float32:
            return default_dtype(self.dtype)
        return contextlib.nullcontext()

    # -- the model ----------------------------------------------------------------------------
    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Default dtype for building the model: the low dtype for '*-true', fp32 otherwise
        (mixed precision keeps fp32 master weights, so they are initialized in fp32)."""
        return default_dtype(self.dtype if self.is_true else torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """'*-true': `module.to(low dtype)` (in place, before sharding); otherwise unchanged."""
        if self.is_true and self.dtype != torch.float32:
            module.to(self.dtype)
        return module

    @property
    def input_dtype(self) -> torch.dtype:
        return self.dtype if self.is_true else torch.float32

    def convert_input(self, data: Any) -> Any:
        return cast_floating(data, self.input_dtype)

    def convert_output(self, data: Any) -> Any:
        return cast_floating(data, torch.get_default_dtype())

    def forward_context(self) -> contextlib.AbstractContextManager:
        """autocast in the low dtype for '*-mixed', the low default dtype for '*-true'."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        if self.is_true:
            return default_dtype(self.dtype)
        return torch.autocast(self.device.type, dtype=self.dtype)

    def install_forward_hooks(self, module: nn.Module) -> None:
        """Run `module`'s forward as Lightning's `_FabricModule` does: inputs converted, the
        forward context entered, outputs converted back. A no-op for '32-true'."""
        if self.precision == "32-true":
            return
        entered: list[contextlib.AbstractContextManager] = []

        def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
            ctx = self.forward_context()
            ctx.__enter__()
            entered.append(ctx)
            return self.convert_input((args, kwargs))

        def post(mod: nn.Module, args: Any, output: Any) -> Any:
            if entered:
                entered.pop().__exit__(None, None, None)
            return self.convert_output(output)

        # Before the engine's own pre-hook (which casts unit inputs to the compute dtype).
        module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        module.register_forward_hook(post, always_call=True)

    # -- the loss and the optimizer -------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, model: nn.Module | None = None, *args: Any,
                 **kwargs: Any) -> None:
        """`tensor.backward(*args, **kwargs)`, with the loss scaled first when there is a
        scaler. `model` is Lightning's plugin signature (the module the loss came from); it
        is not used."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
            self._scaled_backwards += 1
        tensor.backward(*args, **kwargs)

    def pre_backward(self, tensor: torch.Tensor, module: nn.Module | None = None) -> Any:
        """Lightning's plugin protocol: nothing to do before backward."""
        return tensor

    def post_backward(self, tensor: torch.Tensor, module: nn.Module | None = None) -> Any:
        """Lightning's plugin protocol: nothing to do after backward."""
        return tensor

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """`optimizer.step(**kwargs)`; with a scaler, through it (`scaler.step` then
        `scaler.update`) -- directly here for an optimizer `setup_optimizer` did not route,
        by its own routed `step` otherwise (so the scaler steps once either way)."""
        if self.scaler is None or getattr(optimizer, "_fullshard_precision", None) is self:
            return optimizer.step(**kwargs)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        """The parameters the optimizer updates (the fp32 shards in every mode but '*-true')."""
        for group in optimizer.param_groups:
            yield from group["params"]

    def teardown(self) -> None:
        """Lightning's plugin protocol: nothing held to release."""

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With a scaler, route `optimizer.step()` through it (once per optimizer)."""
        if self.scaler is None or getattr(optimizer, "_fullshard_precision", None) is self:
            return optimizer
        inner = optimizer.step  # possibly an LR scheduler's wrapper: keep it in the chain
        busy = [False]

        @functools.wraps(inner)
        def step(*args: Any, **kwargs: Any) -> Any:
            if busy[0]:  # the scaler itself calling the optimizer's step
                return inner(*args, **kwargs)
            self._check_scaled(optimizer)
            busy[0] = True
            try:
                assert self.scaler is not None
                out = self.scaler.step(optimizer, *args, **kwargs)
                self.scaler.update()
            finally:
                busy[0] = False
                self._seen_at_step[id(optimizer)] = self._scaled_backwards
            return out

        optimizer.step = step  # type: ignore[method-assign]
        optimizer._fullshard_precision = self  # type: ignore[attr-defined]
        return optimizer

    def _check_scaled(self, optimizer: Optimizer) -> None:
        if self._scaled_backwards <= self._seen_at_step.get(id(optimizer), 0):
            raise RuntimeError(
                f"precision={self.precision!r} scales the loss in `fabric.backward(loss)` (or "
                f"`strategy.backward(loss)`), but this optimizer step follows no such call: "
                f"the gradients come from a plain `loss.backward()`, so unscaling them would "
                f"shrink them by the loss scale. Call `fabric.backward(loss)` instead."
            )

    def unscale_for_clipping(self, optimizer: Optimizer | None, what: str) -> bool:
        """Before clipping: unscale `optimizer`'s gradients ('16-mixed'); True when the step
        overflowed on some rank (it will be skipped, so a non-finite norm is no error)."""
        if self.scaler is None:
            return False
        if optimizer is None:
            raise ValueError(
                f"{what}(module, optimizer=None, ...) with precision={self.precision!r}: the "
                f"gradients are still multiplied by the loss scale and only the optimizer says "
                f"which ones to unscale. Pass the optimizer (fabric.clip_gradients(model, "
                f"optimizer, ...))."
            )
        return self.unscale_gradients(optimizer)

    def unscale_gradients(self, optimizer: Optimizer) -> bool:
        """Unscale `optimizer`'s gradients in place (once per step) before they are clipped;
        return whether any rank found an inf/NaN (the step will then be skipped)."""
        if self.scaler is None:
            return False
        self._check_scaled(optimizer)
        if not _is_unscaled(self.scaler, optimizer):
            self.scaler.unscale_(optimizer)
        return _found_inf(self.scaler, optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)


# -- Lightning's view of the same object ----------------------------------------------------------
# See [Note: Lightning's utilities and `strategy.precision`].
_LIGHTNING_PLUGIN_MODULES = ("lightning.fabric.plugins", "lightning_fabric.plugins")
_COMPAT_CLASSES: dict[tuple[type, ...], type] = {}


def _lightning_fsdp_precision_classes() -> tuple[type, ...]:
    """Lightning's `FSDPPrecision` class(es) already imported in this process (the unified
    `lightning` package and the standalone `lightning_fabric` hold distinct classes)."""
    found = []
    for name in _LIGHTNING_PLUGIN_MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "FSDPPrecision", None) if module is not None else None
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def as_lightning_plugin(plugin: Precision) -> Precision:
    """`plugin` itself, made an instance of Lightning's `FSDPPrecision` too when Lightning is
    imported (its class becomes a subclass of both; our methods come first). Idempotent; a
    no-op without Lightning."""
    bases = tuple(c for c in _lightning_fsdp_precision_classes() if not isinstance(plugin, c))
    if not bases:
        return plugin
    own = type(plugin)
    key = (own, *bases)
    cls = _COMPAT_CLASSES.get(key)
    if cls is None:
        # `__init__` stays ours: Lightning's would rebuild state this object already has.
        cls = type(own.__name__, (own, *bases), {"__module__": own.__module__})
        _COMPAT_CLASSES[key] = cls
    plugin.__class__ = cls
    return plugin
