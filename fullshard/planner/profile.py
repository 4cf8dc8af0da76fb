"""One meta-device forward of the real model (no memory, no compute): the bytes autograd saves
for backward, in total (`activation_bytes`) and per unit with each unit's input and work
(`profile_forward`).

Saved bytes: every distinct storage packed by `torch.autograd.graph.saved_tensors_hooks` during
`model(inputs)`, except the parameters' own storages (those are the working set's), plus the
model's output (the logits live until the loss has been back-propagated). The inputs are token
ids of shape `(batch, seq)` (int64) unless the model has an `example_input(batch, seq)` method,
which is then called under `torch.device("meta")`. `batch` is the per-rank micro-batch, so the
number is the same for every strategy and world size.

Precision: floating parameters and buffers are converted to the compute dtype on a meta copy,
as the engine gathers them in `param_dtype` and casts each unit's inputs to it.

Attention: on the meta device `F.scaled_dot_product_attention` runs the math kernel, which
saves the `seq x seq` attention matrix per head. GPUs run flash / memory-efficient kernels that
save only the output and a log-sum-exp per row, so with `attention="flash"` (the default)
fused-eligible calls (no mask, no dropout) are counted as the flash kernel saves them.
Other ops are counted as their eager (composite) implementations save: e.g. `nn.RMSNorm` on
a 16-bit input keeps two fp32 copies, where a fused CUDA kernel keeps the input and one scalar
per row.

Per unit (what the search prices activation checkpointing and compute with): forward pre/post
hooks on the unit modules keep a stack of the running units; an op or a saved tensor belongs to
the innermost unit running (the root for everything outside the blocks: embeddings, final
norm, head). The model's output is the root's. A unit's *input bytes* are the distinct storages
of its floating-point tensor arguments: with the unit checkpointed (non-reentrant
`torch.utils.checkpoint`), autograd keeps exactly those and recomputes the rest in backward.

Work, counted by a `TorchDispatchMode` under the same forward (meta tensors: nothing runs):

    flops         2 * m * n * k for each mm / addmm / bmm (torch's `flop_counter` rules),
                  and for attention 4 * b * h * s_q * s_k * d, halved when causal (fused
                  kernels skip the masked blocks)
    moved bytes   for every other op, the bytes of its tensor inputs plus outputs (what a
                  memory-bound kernel reads and writes); views move nothing
    ops           the kernels launched (views excluded), for the fixed cost per op
    scores        attention scores (one query-key product each; halved when causal, as the
                  FLOPs): a fused kernel also runs the softmax over each (exp, max, scale),
                  work its FLOPs do not count
    transcendental  elements written by ops that evaluate exp / erf / tanh / log per element
                  (`TRANSCENDENTAL`: GELU, SiLU, softmax, log-softmax, ...): on CPUs these run
                  well below memory bandwidth (measured: ~2-4 ns per element, against ~0.3
                  for a copy), so they are priced per element as well as by bytes

Linear in the micro-batch for these models, so the search profiles one sequence and scales.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from fullshard.engine.wrap import ROOT_ONLY, select_units

ATTENTION = ("flash", "math")
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class _FlashAttentionMode(TorchFunctionMode):
    """Run fused-eligible `scaled_dot_product_attention` calls as the flash kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args))
            bound.update(kwargs)
            q, k, v = bound["query"], bound["key"], bound["value"]
            if (
                bound.get("attn_mask") is None
                and not bound.get("dropout_p", 0.0)
                and not bound.get("enable_gqa", False)
                and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            ):
                out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, is_causal=bool(bound.get("is_causal", False)),
                    scale=bound.get("scale"),
                )
                return out[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """Let a model's autocast calls through on the meta device: `torch.autocast("meta")` and
    `torch.is_autocast_enabled("meta")` raise "unknown device type for autocast", and Hugging
    Face's rotary embeddings (Llama, Mistral, Qwen, ...) call both with their input's device
    type, to keep that part in float32. For the meta forward only, `torch`'s two names take
    "meta" as "cpu" (whose autocast is off here); restored on exit."""
    real_autocast, real_enabled = torch.autocast, torch.is_autocast_enabled

    class _Autocast(real_autocast):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: object, **kwargs: object) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    def is_enabled(*args: object) -> bool:
        if args and args[0] == "meta":
            args = ("cpu", *args[1:])
        return real_enabled(*args)

    torch.autocast, torch.is_autocast_enabled = _Autocast, is_enabled
    try:
        yield
    finally:
        torch.autocast, torch.is_autocast_enabled = real_autocast, real_enabled


TRANSCENDENTAL = {
    "gelu", "silu", "sigmoid", "tanh", "exp", "expm1", "log", "log1p", "erf", "erfc",
    "_softmax", "_log_softmax", "softplus", "elu", "mish", "sin", "cos", "hardswish",
}
"""Ops (forward, by aten name) whose every output element costs a transcendental function."""

_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
}


@dataclass(frozen=True)
class UnitProfile:
    name: str
    saved_bytes: int
    """Bytes autograd saves for this unit's backward (its own ops, not nested units')."""
    input_bytes: int
    """Bytes of its floating inputs: what it saves when checkpointed."""
    flops: float
    moved_bytes: float
    ops: int
    scores: float = 0.0
    """Attention scores (causal: half), see the module docstring."""
    transcendental: float = 0.0
    """Elements written by `TRANSCENDENTAL` ops."""


@dataclass(frozen=True)
class ForwardProfile:
    batch: int
    seq: int
    units: tuple[UnitProfile, ...]
    """Root first, then the units in module order (as `sizes.ModelStructure`)."""

    @property
    def saved_bytes(self) -> int:
        return sum(u.saved_bytes for u in self.units)

    @property
    def flops(self) -> float:
        return sum(u.flops for u in self.units)


class WorkCounter(TorchDispatchMode):
    def __init__(self, current: list[int], n: int) -> None:
        super().__init__()
        self.current = current
        self.flops = [0.0] * n
        self.moved = [0.0] * n
        self.ops = [0] * n
        self.scores = [0.0] * n
        self.transcendental = [0.0] * n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = packet.__name__
        if torch.Tag.view_copy in func.tags or _is_view(func):
            return out
        i = self.current[-1]
        self.ops[i] += 1
        if name in _ATTENTION_OPS:
            q, k = args[0], args[1]
            b_h = q.shape[:-2].numel()
            scores = float(b_h * q.shape[-2] * k.shape[-2])
            causal = bool(kwargs.get("is_causal", args[4] if len(args) > 4 else False))
            half = 0.5 if causal else 1.0
            self.flops[i] += 4.0 * scores * q.shape[-1] * half
            self.scores[i] += scores * half
        elif packet in flop_registry:
            self.flops[i] += float(flop_registry[packet](*args, **kwargs, out_val=out))
        else:
            seen: set[int] = set()
            for t in (*tree_leaves(args), *tree_leaves(kwargs), *tree_leaves(out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.moved[i] += t.numel() * t.element_size()
            if name in TRANSCENDENTAL:
                self.transcendental[i] += sum(
                    t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _is_view(func: object) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def profile_forward(
    model: nn.Module,
    policy: object,
    batch: int,
    seq: int,
    *,
    compute_dtype: torch.dtype | None = None,
    attention: str = "flash",
    copy_model: bool = True,
) -> ForwardProfile:
    """Per-unit saved bytes, input bytes and work of one forward (module docstring).
    `model` must be on the meta device; `policy` chooses the units as `fsdp()` would."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if not t.is_meta:
            raise ValueError(
                f"The activation estimate runs a meta-device forward, but {name!r} is on "
                f"{t.device}. Pass a factory or a built-in config name (built on meta), or a "
                f"module created under torch.device('meta')."
            )
    if copy_model:
        model = copy.deepcopy(model)
    if compute_dtype is not None:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(compute_dtype)
    units = select_units(model, policy)
    index = {id(m): i for i, m in enumerate(units)}
    names = {id(m): n for n, m in model.named_modules()}
    current = [0]
    inputs_bytes = [0] * len(units)
    saved = [0] * len(units)
    handles = []

    def pre(module: nn.Module, args: tuple) -> None:
        i = index[id(module)]
        current.append(i)
        seen: set[int] = set()
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                key = t.untyped_storage()._cdata
                if key not in seen:
                    seen.add(key)
                    inputs_bytes[i] += t.untyped_storage().nbytes()

    def post(module: nn.Module, args: tuple, output: object) -> None:
        current.pop()

    for m in units[1:]:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    counted: set[int] = set()
    keep: list[torch.Tensor] = []  # keep storages alive so their addresses stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages and key not in counted:
            counted.add(key)
            saved[current[-1]] += t.untyped_storage().nbytes()
            keep.append(t)
        return t

    with torch.device("meta"):
        if hasattr(model, "example_input"):
            inputs = model.example_input(batch, seq)
        else:
            inputs = torch.zeros(batch, seq, dtype=torch.long)
    counter = WorkCounter(current, len(units))
    flash = _FlashAttentionMode() if attention == "flash" else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_autocast():
            with flash, counter:
                out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                _count_loss(out, batch, seq)
    except Exception as e:
        raise ValueError(
            f"The activation estimate's meta-device forward of {type(model).__name__} on "
            f"token ids of shape ({batch}, {seq}) failed: {type(e).__name__}: {e}. Give the "
            f"model an `example_input(batch, seq)` method returning its inputs."
        ) from e
    finally:
        for h in handles:
            h.remove()
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in counted:
                counted.add(key)
                saved[0] += t.untyped_storage().nbytes()
    return ForwardProfile(batch, seq, tuple(
        UnitProfile(names[id(m)], saved[i], inputs_bytes[i], counter.flops[i],
                    counter.moved[i], counter.ops[i], counter.scores[i],
                    counter.transcendental[i])
        for i, m in enumerate(units)
    ))


def _count_loss(out: object, batch: int, seq: int) -> None:
    """Count the training loss as the root's work: a model whose output is logits
    `(batch, seq, vocab)` (as such or as HF's `.logits`) is trained on a cross-entropy over
    them computed outside it (benchmark loops, litgpt; HF models compute it inside only when
    given labels, which the profile does not pass). Its log-softmax writes one element per
    logit, a step cost on the order of a block's for small models with large vocabularies.
    Under `no_grad`: it adds work, not saved bytes (the model's output is already counted as
    alive until the loss is back-propagated)."""
    logits = getattr(out, "logits", out)
    if not (isinstance(logits, torch.Tensor) and logits.is_floating_point()
            and logits.dim() == 3 and tuple(logits.shape[:2]) == (batch, seq)):
        return
    targets = torch.zeros(batch * seq, dtype=torch.long, device=logits.device)
    with torch.no_grad():
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets)


def activation_bytes(
    model: nn.Module,
    batch: int,
    seq: int,
    *,
    compute_dtype: torch.dtype | None = None,
    attention: str = "flash",
    copy_model: bool = True,
) -> int:
    """Bytes saved for backward by one forward of `batch x seq` tokens (module docstring): the
    total of `profile_forward` over the whole model as one unit.

    `model` must be on the meta device; it is copied first unless `copy_model=False` (the
    caller owns it and does not mind its dtype changing).
    """
    return profile_forward(model, ROOT_ONLY, batch, seq, compute_dtype=compute_dtype,
                           attention=attention, copy_model=copy_model).saved_bytes
