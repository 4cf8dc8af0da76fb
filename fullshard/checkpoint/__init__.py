"""Checkpoints: full and sharded formats, resharding on load, consolidation, crash safety.

- `save_checkpoint(path, state, state_dict_type='sharded'|'full', filter=None,
  async_save=False)` -- collective; `async_save=True` returns an `AsyncSave` handle while
  the files are written in the background (`background`; `wait_pending()` waits for it);
- `load_checkpoint(path, state=None, strict=True, weights_only=None, allow_symlinks=False)`
  -- format detected from disk, objects restored in place, the entries `state` did not ask
  for returned; files are read without running code from them unless `weights_only=False`
  (`safe_load`), checked against the checksums saved with them (`integrity`), and never
  outside the checkpoint directory;
- `consolidate(ckpt_dir, out)` / `to_full(ckpt_dir)` -- a sharded checkpoint as one full file
  (`.safetensors` or `torch.save`), without a process group (`fullshard consolidate`).

Both formats are Lightning Fabric's, so checkpoints move between the two both ways.

Files: `api` (entry points, collective guard), `full` and `sharded` (the two formats),
`objects` (what the entries of `state` are; parameter names and layouts), `atomic` (temporary
names and the final rename), `safe_load` (reading files without running code), `integrity`
(checksums, a full disk), `background` (asynchronous saves), `errors`, `consolidate`.
"""

from fullshard.checkpoint.api import load_checkpoint, save_checkpoint
from fullshard.checkpoint.background import AsyncSave, wait_pending
from fullshard.checkpoint.consolidate import consolidate, to_full
from fullshard.checkpoint.errors import CheckpointError
from fullshard.checkpoint.safe_load import UnsafeCheckpointError

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "UnsafeCheckpointError",
    "consolidate",
    "load_checkpoint",
    "save_checkpoint",
    "to_full",
    "wait_pending",
]
