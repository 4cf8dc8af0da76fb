"""Checkpoints of an `FSDPStrategy`: `save_checkpoint` / `load_checkpoint` (what
`fabric.save` / `fabric.load` / `fabric.load_raw` call), delegated to `fullshard.checkpoint`.

A mixin of `FSDPStrategy`, split out to keep one concern per file; it reads the attributes the
strategy's constructor sets: `_state_dict_type` and `_timeout`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch import nn
from torch.optim import Optimizer

from fullshard.api.compiled import uncompiled_entries
from fullshard.api.strategy_args import check_raw_path


class CheckpointMethods:
    """`save_checkpoint` / `load_checkpoint` of an `FSDPStrategy` (see the module docstring)."""

    _state_dict_type: str
    _timeout: timedelta | None

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
        *,
        async_save: bool = False,
    ) -> Any:
        """Save `state` ({'model': model, 'optimizer': opt, ...}) in `state_dict_type`'s format.

        **Collective: every rank must call it** (not only under `if rank == 0:`); a call made
        on some ranks only warns after a while and raises a `TimeoutError` after `timeout`,
        instead of hanging. 'sharded': a directory of `torch.distributed.checkpoint` shards
        plus `meta.pt`, loadable on any world size or strategy; 'full': one file written by
        rank 0 (original names, optimizer state keyed by parameter name). Written under a
        temporary name and renamed into place once complete. See `fullshard.checkpoint`.
        `async_save=True` returns a handle (`.wait()`) while the files are written in the
        background (`fullshard.checkpoint.background`); None otherwise.
        """
        from fullshard.checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError(
                "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported: the "
                "strategy writes its files itself (no `CheckpointIO`)."
            )
        if isinstance(state, dict) and not state:
            raise ValueError(
                "Could not find a FSDP model in the provided checkpoint state: state={} holds "
                "nothing to save. Pass the model as part of the state, e.g. "
                "`fabric.save(path, {'model': model, 'optimizer': optimizer})`, with the model "
                "(and optimizers) set up through the strategy."
            )
        # How long the call waits for the other ranks to call it too: the group's timeout.
        timeout = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        with uncompiled_entries(state) as state:
            done = save_checkpoint(path, state, state_dict_type=self._state_dict_type,
                                   filter=filter, timeout=timeout, async_save=async_save)
        return done if async_save else None

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | nn.Module | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
        *,
        allow_symlinks: bool = False,
    ) -> dict[str, Any]:
        """Load a checkpoint (either format, detected from disk; any world size) into `state`
        in place; return the checkpoint's entries that `state` did not ask for. Collective.
        Files are read without running code from them unless `weights_only=False` (only for
        files you trust); None means True. Every file is checked against its checksums, and a
        sharded checkpoint reads only files inside its directory (`allow_symlinks=True` lets
        it follow symlinks there)."""
        from fullshard.checkpoint import load_checkpoint

        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading a single optimizer object from a checkpoint is not supported yet with "
                "the FSDP strategy: an optimizer's state is keyed by its model's parameter "
                "names, so load them together: fabric.load(path, {'model': model, "
                "'optimizer': optimizer})."
            )
        if isinstance(state, dict) and not state:
            state = None  # nothing asked for: the whole checkpoint, as for state=None
        if isinstance(state, nn.Module):
            check_raw_path(path)
        timeout = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        with uncompiled_entries(state) as state:
            return load_checkpoint(path, state, strict=strict, timeout=timeout,
                                   weights_only=weights_only, allow_symlinks=allow_symlinks)
