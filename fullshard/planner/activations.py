"""Activation estimate: the bytes autograd saves for backward in one forward, measured by
running that forward on the meta device (no memory, no compute).

Counted: every distinct storage packed by `torch.autograd.graph.saved_tensors_hooks` during
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
per row. Activation checkpointing is not modelled.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

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


def activation_bytes(
    model: nn.Module,
    batch: int,
    seq: int,
    *,
    compute_dtype: torch.dtype | None = None,
    attention: str = "flash",
    copy_model: bool = True,
) -> int:
    """Bytes saved for backward by one forward of `batch x seq` tokens (module docstring).

    `model` must be on the meta device; it is copied first unless `copy_model=False` (the
    caller owns it and does not mind its dtype changing).
    """
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
    with torch.device("meta"):
        if hasattr(model, "example_input"):
            inputs = model.example_input(batch, seq)
        else:
            inputs = torch.zeros(batch, seq, dtype=torch.long)
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keep storages alive so their addresses stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in param_storages:
            saved.setdefault(storage._cdata, storage.nbytes())
            keep.append(t)
        return t

    mode = _FlashAttentionMode() if attention == "flash" else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_autocast():
            if mode is not None:
                with mode:
                    out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            else:
                out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    except Exception as e:  # a model whose forward does not take token ids
        raise ValueError(
            f"The activation estimate's meta-device forward of {type(model).__name__} on "
            f"token ids of shape ({batch}, {seq}) failed: {type(e).__name__}: {e}. Give the "
            f"model an `example_input(batch, seq)` method returning its inputs."
        ) from e
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            saved.setdefault(storage._cdata, storage.nbytes())
    return sum(saved.values())
