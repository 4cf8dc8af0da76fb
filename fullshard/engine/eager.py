"""The engine's hooks run eagerly under torch.compile, without importing dynamo before it is used.

The unit hooks issue collectives and swap tensors, and the saved-tensor hooks look at storage
pointers: under `torch.compile` each must be one clean graph break that runs eagerly
(`torch.compiler.disable`, as FSDP2's `_dynamo_disable`), not something dynamo traces into.
FSDP2's wrapper calls `disable` at every call, which imports `torch._dynamo` (about 3 s of CPU
in every launcher and rank that never compiles) and, called inside a traced frame, is itself
a counted graph break. So `keep_eager` swaps a hook registered plain for its disabled version
in place, in the dict that holds it: at once if dynamo is imported, else the moment
`torch._dynamo` finishes importing -- `torch.compile` and `module.compile()` import it before
they trace anything -- through a one-shot finder on `sys.meta_path`. Compiling after wrapping
(`torch.compile(fsdp(m))`, `block.compile()`) thus never traces the engine either.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_DYNAMO = "torch._dynamo"
# Hooks registered plain, to disable when dynamo arrives: (owner, name of its dict, key).
_pending: list[tuple[weakref.ReferenceType[Any], str, Any]] = []
_lock = threading.Lock()


def keep_eager(owner: Any, dict_name: str, key: Any) -> None:
    """Keep the callable `getattr(owner, dict_name)[key]` out of dynamo's graphs, now or as
    soon as dynamo is imported (`owner` is held weakly)."""
    with _lock:
        _pending.append((weakref.ref(owner), dict_name, key))
        if _DYNAMO not in sys.modules and _WATCH not in sys.meta_path:
            sys.meta_path.insert(0, _WATCH)
    if _DYNAMO in sys.modules:  # imported already, or meanwhile (another thread)
        _disable_pending()


def register_unit_hooks(
    module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]
) -> None:
    """`pre` as a forward pre-hook (prepended, with kwargs) and `post` as a forward hook
    (always called), both kept eager."""
    pre_handle = module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
    post_handle = module.register_forward_hook(post, always_call=True)
    keep_eager(module, "_forward_pre_hooks", pre_handle.id)
    keep_eager(module, "_forward_hooks", post_handle.id)


def _disable_pending() -> None:
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for ref, dict_name, key in pending:
        owner = ref()
        hooks = getattr(owner, dict_name, None)
        if hooks is not None and key in hooks:  # a removed handle stays removed
            hooks[key] = torch.compiler.disable(hooks[key])


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch._dynamo` is about to be imported it steps aside (one
    shot), lets the other finders find it, and has the loader call `_disable_pending` once
    the module has executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _DYNAMO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _disable_pending()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_WATCH = _DynamoWatch()
