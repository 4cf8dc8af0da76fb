"""`seed_everything` and the seeding of DataLoader workers.

Same effect as Lightning's `seed_everything`: Python's `random`, numpy (when installed) and
torch on every device are seeded with the same value, and the seed is exported in the
environment (`FULLSHARD_GLOBAL_SEED`, and `PL_GLOBAL_SEED` so Lightning code in the same job
and ranks started later see it too). With `workers=True`, loaders set up by
`fabric.setup_dataloaders` that have no `worker_init_fn` get `seed_worker`, which gives every
(rank, worker) its own streams derived from the base seed (as Lightning's
`pl_worker_init_function` does; the derivation is ours, so the workers' numbers differ from
Lightning's while the main process's match).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random

import torch

SEED_VARS = ("FULLSHARD_GLOBAL_SEED", "PL_GLOBAL_SEED")
WORKERS_VARS = ("FULLSHARD_SEED_WORKERS", "PL_SEED_WORKERS")
_MAX_SEED = 2**32 - 1
log = logging.getLogger("fullshard")


def global_seed() -> int:
    """The seed set by `seed_everything` (in this or a parent process), else 0."""
    for var in SEED_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def seed_workers_enabled() -> bool:
    return any(os.environ.get(var) == "1" for var in WORKERS_VARS)


def seed_everything(seed: int | None = None, workers: bool = False,
                    verbose: bool = True) -> int:
    """Seed Python's `random`, numpy (when installed) and torch on every device; return the
    seed.

    `None` reads `FULLSHARD_GLOBAL_SEED` (or `PL_GLOBAL_SEED`), else uses 0. With `workers`,
    DataLoaders set up by `Fabric.setup_dataloaders` seed their workers from it. `verbose`
    logs the seed (logger 'fullshard', level INFO).
    """
    if seed is None:
        env = next((os.environ[v] for v in SEED_VARS if os.environ.get(v)), None)
        try:
            seed = int(env) if env is not None else 0
        except ValueError:
            raise ValueError(
                f"The seed in the environment ({env!r}) is not an int; unset "
                f"{'/'.join(SEED_VARS)} or pass seed_everything(seed=...)."
            ) from None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if verbose:
        log.info("Seed set to %d", seed)
    for var in SEED_VARS:
        os.environ[var] = str(seed)
    for var in WORKERS_VARS:
        os.environ[var] = "1" if workers else "0"
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def _seed_sequence(base: int, worker_id: int, rank: int, count: int) -> list[int]:
    """`count` independent 64-bit seeds for one (base seed, worker, rank): slices of a
    BLAKE2 digest, so neighbouring workers and ranks get unrelated streams."""
    digest = hashlib.blake2b(f"{base}:{worker_id}:{rank}".encode(), digest_size=8 * count)
    raw = digest.digest()
    return [int.from_bytes(raw[8 * i:8 * (i + 1)], "little") for i in range(count)]


def seed_worker(worker_id: int, rank: int | None = None) -> None:
    """DataLoader `worker_init_fn`: seed this worker's torch, `random` and numpy from the
    process seed torch gave the worker, the worker id and the global rank."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    base = torch.initial_seed() - worker_id  # torch seeds worker i with base + i
    seeds = _seed_sequence(base, worker_id, rank, count=4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 64) | seeds[2])
    try:
        import numpy as np

        np.random.seed(seeds[3] % 2**32)
    except ImportError:
        pass
