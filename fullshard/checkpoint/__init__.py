"""Checkpoints: full and sharded formats, resharding on load, consolidation, crash safety.

- `save_checkpoint(path, state, state_dict_type='sharded'|'full', filter=None)` -- collective;
- `load_checkpoint(path, state=None, strict=True)` -- format detected from disk, objects
  restored in place, the entries `state` did not ask for returned;
- `consolidate(ckpt_dir, out)` / `to_full(ckpt_dir)` -- a sharded checkpoint as one full file
  (`.safetensors` or `torch.save`), without a process group (`fullshard consolidate`).

Files: `api` (entry points, collective guard), `full` and `sharded` (the two formats),
`objects` (what the entries of `state` are; parameter names and layouts), `atomic` (temporary
names and the final rename), `consolidate`.
"""

from fullshard.checkpoint.api import load_checkpoint, save_checkpoint
from fullshard.checkpoint.consolidate import consolidate, to_full
from fullshard.checkpoint.sharded import CheckpointError

__all__ = ["CheckpointError", "consolidate", "load_checkpoint", "save_checkpoint", "to_full"]
