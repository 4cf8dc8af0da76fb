"""`fabric.setup_dataloaders`: give a DataLoader its share of the data and move its batches.

- A loader over a map-style dataset with the default samplers (`SequentialSampler`,
  `RandomSampler`) gets a `DistributedSampler` over all data-parallel ranks (shuffling if it
  shuffled, seeded by `seed_everything`'s seed), as in Lightning.
- A loader with any other sampler (`WeightedRandomSampler`, a user's class) keeps it:
  `DistributedSamplerWrapper` draws the sampler's indices each epoch and gives every rank
  its slice of them, as Lightning's wrapper of the same name does (same slices).
- A loader that already has a `DistributedSampler`, or an `IterableDataset`, is left alone.
- `DeviceDataLoader` moves each batch to the device (any nesting of tensors, `Mapping`s,
  namedtuples, dataclasses and objects with `.to()`, types kept: `api.batches`) and calls
  `sampler.set_epoch(n)` before the n-th pass, so shuffling differs per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from functools import partial
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fullshard.api.batches import move_to_device
from fullshard.api.seed import global_seed, seed_worker, seed_workers_enabled


class _SamplerLength:
    """Stands in for the dataset of `DistributedSampler`: only its length is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class DistributedSamplerWrapper(DistributedSampler):
    """Shard the indices any sampler draws across ranks.

    Each epoch the wrapped sampler is drawn in full (on every rank), and rank `r` of `N` gets
    positions `r, r + N, r + 2N, ...` of that draw (after `DistributedSampler`'s padding to a
    multiple of `N`, or cut with `drop_last`; permuted first if `shuffle`). The randomness is
    the wrapped sampler's: it must draw the same sequence on every rank -- give it a seeded
    `generator`, or rely on `seed_everything` and equal use of the global RNG on all ranks.
    `set_epoch` is passed on to the wrapped sampler when it has one.
    """

    def __init__(self, sampler: Sampler | Any, *, num_replicas: int, rank: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(
                f"The DataLoader's sampler {type(sampler).__name__} has no __len__, so it cannot "
                f"be split across ranks. Give it a __len__, or shard it yourself and pass "
                f"setup_dataloaders(..., use_distributed_sampler=False)."
            )
        n = len(sampler)
        if not isinstance(n, int):  # e.g. float('inf')
            raise TypeError(
                f"The DataLoader's sampler {type(sampler).__name__} has length {n!r}; only a "
                f"finite int length can be split across ranks (or pass "
                f"use_distributed_sampler=False)."
            )
        super().__init__(_SamplerLength(n), num_replicas=num_replicas, rank=rank,  # type: ignore[arg-type]
                         shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        drawn = list(self.sampler)
        if len(drawn) != len(self.dataset):  # type: ignore[arg-type]
            raise RuntimeError(
                f"The sampler {type(self.sampler).__name__} said its length is "
                f"{len(self.dataset)} but drew {len(drawn)} indices; its __len__ must match "  # type: ignore[arg-type]
                f"what it yields."
            )
        return (drawn[i] for i in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        inner = getattr(self.sampler, "set_epoch", None)
        if callable(inner):
            inner(epoch)


def distributed_sampler(loader: DataLoader, num_replicas: int, rank: int) -> Sampler | None:
    """The sampler `loader` gets for `num_replicas` ranks, or None to keep the loader as is."""
    if isinstance(loader.dataset, IterableDataset):
        return None
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return None
    kwargs = dict(num_replicas=num_replicas, rank=rank, seed=global_seed(),
                  shuffle=isinstance(sampler, RandomSampler))
    if type(sampler) in (RandomSampler, SequentialSampler):
        return DistributedSampler(loader.dataset, **kwargs)  # type: ignore[arg-type]
    return DistributedSamplerWrapper(sampler, **kwargs)  # type: ignore[arg-type]


def with_sampler(loader: DataLoader, sampler: Sampler | None, rank: int) -> DataLoader:
    """`loader`, or a copy of it drawing from `sampler` when given; with our worker seeding
    when `seed_everything(workers=True)` asked for it and the loader has no `worker_init_fn`
    (set on the loader, as Lightning does)."""
    if sampler is not None:
        batch_sampler = loader.batch_sampler
        if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
            raise TypeError(
                f"The DataLoader has a custom batch_sampler ({type(batch_sampler).__name__}), "
                f"which cannot be split across ranks automatically; give it a "
                f"DistributedSampler yourself and pass use_distributed_sampler=False."
            )
        kwargs: dict[str, Any] = dict(
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
        loader = DataLoader(loader.dataset, **kwargs)
    if loader.worker_init_fn is None and seed_workers_enabled():
        loader.worker_init_fn = partial(seed_worker, rank=rank)
    return loader


class DeviceDataLoader:
    """A DataLoader that moves each batch to `device` (None: leave batches where they are)
    and calls `sampler.set_epoch` on every new pass (as Lightning's `_FabricDataLoader`).
    Other attributes pass through to the wrapped loader."""

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    @property
    def device(self) -> torch.device | None:
        return self._device

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        for owner in (self._loader.sampler, getattr(self._loader, "batch_sampler", None)):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self._epoch)
                break
        self._epoch += 1
        for batch in self._loader:
            yield batch if self._device is None else move_to_device(batch, self._device)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)
