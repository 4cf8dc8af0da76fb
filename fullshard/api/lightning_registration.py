"""`L.Fabric(strategy="fullshard")` after `import fullshard`, whichever is imported first.

Lightning looks strategy names up in its registry (`lightning.fabric.strategies.
STRATEGY_REGISTRY`), which fullshard can only fill by importing Lightning. `import fullshard`
must not import Lightning (it is optional, and slow to import), so:

- when Lightning's strategies are already imported, fullshard's strategy is registered now;
- otherwise a finder on `sys.meta_path` waits for `lightning.fabric.strategies` to be
  imported, lets it load as usual and registers fullshard's strategy right after (then removes
  itself). Without Lightning installed it simply never fires.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_STRATEGIES = "lightning.fabric.strategies"


def _register() -> None:
    import fullshard.api.lightning_strategy  # noqa: F401  (registers at import)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> Any:
        if name != _STRATEGIES:
            return None
        sys.meta_path.remove(self)  # out of the way: the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            try:
                _register()
            except Exception as exc:  # Lightning must import regardless; say why it is missing
                warnings.warn(f"fullshard could not register strategy='fullshard' with "
                              f"Lightning: {type(exc).__name__}: {exc}", stacklevel=2)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def register_when_lightning_is_imported() -> None:
    """See the module docstring. Idempotent."""
    if _STRATEGIES in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())
