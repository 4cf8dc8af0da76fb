"""Walking a batch: apply a function to every tensor in a nested container, keeping its types.

Batches come in many shapes: a tensor, a tuple or list, a `dict`, any other `Mapping`
(`OrderedDict`, `defaultdict`, a transformers `BatchEncoding`), a namedtuple, a dataclass, or
an object that moves itself (`.to(device)`). `map_batch` rebuilds each container as the same
type around the transformed leaves: the precision plugin casts inputs with it
(`cast_floating`), the strategy's collectives reduce and gather every tensor in a batch.

How each container is rebuilt (the original is never modified):
- `dict` as `dict`; any other `MutableMapping` (`OrderedDict`, `defaultdict`, `UserDict`,
  `BatchEncoding`) as a shallow copy (`copy.copy`: same class, same `default_factory`, other
  attributes such as a `BatchEncoding`'s encodings kept) with the items replaced; a read-only
  `Mapping` by its class from the new items;
- namedtuples from their fields, other tuples and lists from the new elements;
- dataclass instances: a shallow copy with each field replaced (frozen ones too);
- anything else is a leaf and returned as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _rebuild_mapping(obj: Mapping, items: list[tuple[Any, Any]]) -> Mapping:
    if type(obj) is dict:
        return dict(items)
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)
        for k, v in items:
            out[k] = v
        return out
    try:
        return type(obj)(items)  # type: ignore[call-arg]
    except TypeError:
        pass
    raise TypeError(
        f"Cannot rebuild the batch's {type(obj).__name__} (a read-only Mapping whose "
        f"constructor does not take its items); return a dict, a dataclass or a tuple from "
        f"your collate_fn."
    )


def map_batch(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """`obj` with `fn` applied to every element for which `is_leaf` holds, containers rebuilt
    as their own types (see the module docstring)."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, [(k, map_batch(v, fn, is_leaf)) for k, v in obj.items()])
    if _is_namedtuple(obj):
        return type(obj)(*(map_batch(v, fn, is_leaf) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(map_batch(v, fn, is_leaf) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            if hasattr(obj, field.name):  # an init=False field may be unset
                value = map_batch(getattr(obj, field.name), fn, is_leaf)
                object.__setattr__(out, field.name, value)  # frozen dataclasses too
        return out
    return obj


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """`batch` with every floating-point tensor cast to `dtype`, types kept."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    return map_batch(batch, cast, lambda x: isinstance(x, torch.Tensor))
