"""The engine's hooks run eagerly under torch.compile, without importing dynamo before it is used.

The unit hooks issue collectives and swap tensors, and the saved-tensor hooks look at storage
pointers: under `torch.compile` each must be one clean graph break that runs eagerly
(`torch.compiler.disable`), not something dynamo traces into. But `torch.compiler.disable`
imports `torch._dynamo`, about 3 s of CPU in every process (every launcher and rank), and a
process that never compiles never needs it. Nothing can be compiling before `torch._dynamo` is
imported, so:

- `EagerFn(fn).get()` is `fn` until dynamo is imported, then `torch.compiler.disable(fn)`
  (made once). For what is looked up at each use (the saved-tensor hooks, pushed at every root
  forward: one `sys.modules` lookup per step).
- `register_unit_hooks` registers a module's forward pre-hook and post-hook. With dynamo
  already imported (a model compiled before wrapping) they are registered disabled. Otherwise
  they are registered plain, and the moment `torch._dynamo` finishes importing --
  `torch.compile` and `module.compile()` import it before they trace anything -- a one-shot
  finder on `sys.meta_path` replaces each, in place in the module's hook dict (same handle,
  same flags), by its disabled version. So compiling after wrapping (`torch.compile(fsdp(m))`,
  `block.compile()`) still never traces the engine.
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


def dynamo_loaded() -> bool:
    return _DYNAMO in sys.modules


def _disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(fn)


class EagerFn:
    """`fn`, or once dynamo is imported, `torch.compiler.disable(fn)`."""

    __slots__ = ("fn", "_disabled")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._disabled: Callable[..., Any] | None = None

    def get(self) -> Callable[..., Any]:
        if self._disabled is None:
            if not dynamo_loaded():
                return self.fn
            self._disabled = _disable(self.fn)
        return self._disabled


# Hooks registered plain, to disable when dynamo arrives: (module, hook dict name, handle id).
_pending: list[tuple[weakref.ReferenceType[nn.Module], str, int]] = []
_lock = threading.Lock()


def register_unit_hooks(
    module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]
) -> None:
    """`pre` as a forward pre-hook (prepended, with kwargs) and `post` as a forward hook
    (always called), kept out of dynamo's graphs now or as soon as dynamo is imported."""
    loaded = dynamo_loaded()
    if loaded:
        pre, post = _disable(pre), _disable(post)
    pre_handle = module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
    post_handle = module.register_forward_hook(post, always_call=True)
    if loaded:
        return
    with _lock:
        ref = weakref.ref(module)
        _pending.append((ref, "_forward_pre_hooks", pre_handle.id))
        _pending.append((ref, "_forward_hooks", post_handle.id))
        _watch_for_dynamo()
    if dynamo_loaded():  # imported meanwhile (another thread)
        _disable_pending()


def _disable_pending() -> None:
    """Dynamo has been imported: swap every plain hook for its disabled version."""
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for ref, dict_name, handle_id in pending:
        module = ref()
        if module is None:
            continue
        hooks = getattr(module, dict_name)
        if handle_id in hooks:  # a removed handle stays removed
            hooks[handle_id] = _disable(hooks[handle_id])


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch._dynamo` is about to be imported it steps aside (one
    shot), lets the other finders find it, and has the loader call `_disable_pending` once
    the module has executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _DYNAMO:
            return None
        _unwatch()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _disable_pending()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_watcher: _DynamoWatch | None = None


def _watch_for_dynamo() -> None:
    global _watcher
    if _watcher is None:
        _watcher = _DynamoWatch()
        sys.meta_path.insert(0, _watcher)


def _unwatch() -> None:
    global _watcher
    if _watcher is not None and _watcher in sys.meta_path:
        sys.meta_path.remove(_watcher)
    _watcher = None
