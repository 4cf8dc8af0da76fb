"""One meta-device forward of the real model, broken down per unit: what each unit saves for
backward, what its input is (all a checkpointed unit saves), and its work (FLOPs of matmuls and
attention, bytes moved by every other op, the number of ops).

This is what the search (`search.py`) prices activation checkpointing and compute with; the
plain activation total of `activations.py` is the same forward without the breakdown.

Attribution: forward pre/post hooks on the unit modules keep a stack of the running units; an
op or a saved tensor belongs to the innermost unit running (the root for everything outside the
blocks: embeddings, final norm, head). The model's output (the logits, alive until the loss is
back-propagated) is the root's. A unit's *input bytes* are the distinct storages of its
floating-point tensor arguments: with the unit checkpointed (non-reentrant
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

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from fullshard.engine.wrap import select_units
from fullshard.planner.activations import ATTENTION, _FlashAttentionMode, meta_autocast

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
    """Root first, then the units in module order (as `structure.ModelStructure`)."""

    @property
    def saved_bytes(self) -> int:
        return sum(u.saved_bytes for u in self.units)

    @property
    def flops(self) -> float:
        return sum(u.flops for u in self.units)


class _WorkCounter(TorchDispatchMode):
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
            raise ValueError(f"The forward profile runs on the meta device, but {name!r} is on "
                             f"{t.device}; pass a factory or a built-in config name.")
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
    counter = _WorkCounter(current, len(units))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_autocast():
            with _FlashAttentionMode() if attention == "flash" else _Null(), counter:
                out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                _count_loss(out, batch, seq)
    except Exception as e:
        raise ValueError(
            f"The meta-device forward of {type(model).__name__} on token ids of shape "
            f"({batch}, {seq}) failed: {type(e).__name__}: {e}. Give the model an "
            f"`example_input(batch, seq)` method returning its inputs."
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


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
