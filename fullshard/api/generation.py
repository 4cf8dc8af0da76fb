"""Hugging Face `generate()` on a sharded model: every rank steps together.

Each step of `generate()` is a forward, and under fullshard a forward is collective (units
gather their rows from every rank). Ranks whose sequences end at different lengths (a rank
meets EOS after 2 tokens, another runs to `max_new_tokens`) would stop calling forward at
different steps: the ones still generating then wait on a gather nobody joins (gloo:
"Connection closed by peer" once the others exit). Hugging Face's remedy is `synced_gpus=True`:
a finished rank keeps running forwards (discarding their tokens) until every rank is done,
agreed by one all-reduce per step. `generate()` turns it on by itself only for models it
recognizes as sharded (DeepSpeed ZeRO-3, or `_is_fsdp_managed_module`).

fullshard does not set `_is_fsdp_managed_module`: torch.compile reads the same attribute and
switches to its handling of torch FSDP modules (params unguarded as graph inputs), a change
to compiled models this module has no business making. Instead `sync_generation` gives a
wrapped model an instance-level `generate` that defaults `synced_gpus` to True when the
model spans more than one rank -- the value Hugging Face would pick -- and otherwise calls
the class's own `generate` unchanged; an explicit `synced_gpus=False` is respected. The
tokens each rank returns are those of the unwrapped model on that rank's prompts (a finished
rank's extra steps append nothing).
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn


def _is_hf_generation_model(model: nn.Module) -> bool:
    """A `transformers` model with `GenerationMixin.generate` (by name: not imported)."""
    return any(c.__name__ == "GenerationMixin" for c in type(model).__mro__) and callable(
        getattr(type(model), "generate", None)
    )


def sync_generation(model: nn.Module, world_size: int) -> None:
    """Make `model.generate()` default to `synced_gpus=True` over `world_size` > 1 ranks."""
    if world_size < 2 or not _is_hf_generation_model(model) or "generate" in model.__dict__:
        return
    # A bound method, so deepcopy / pickling of the model rebind it to the copy.
    object.__setattr__(model, "generate", types.MethodType(_synced_generate, model))


def _synced_generate(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    return type(model).generate(model, *args, **kwargs)
