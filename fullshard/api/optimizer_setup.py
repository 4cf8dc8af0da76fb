"""Checks that an optimizer fits a sharded model, and re-pointing a fresh one at the shards.

Setting a model up replaces every parameter by this rank's shard. An optimizer built before
that would update tensors the model no longer uses; one with no state yet can be re-pointed
at the shards by parameter name (`fabric.setup(model, optimizer)`), anything else is refused
with a message that says how to set things up instead.
"""

from __future__ import annotations

from collections.abc import Container

from torch.optim import Optimizer


def check_no_meta(optimizer: Optimizer) -> None:
    if any(p.is_meta for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            "The optimizer has references to the model's meta-device parameters. Set the model "
            "up first (`model = fabric.setup_module(model)`, which materializes and shards it), "
            "then create the optimizer from `model.parameters()` and set it up with "
            "`optimizer = fabric.setup_optimizers(optimizer)`."
        )


def _foreign(optimizer: Optimizer, known: Container[int]) -> tuple[list, list]:
    """(all parameters of `optimizer`, those whose id is not in `known`)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return params, [p for p in params if id(p) not in known]


def check_rebindable(optimizer: Optimizer, names_of: dict[int, str]) -> None:
    _, foreign = _foreign(optimizer, names_of)
    if foreign:
        raise ValueError(
            f"The optimizer holds {len(foreign)} parameter(s) that do not belong to the model "
            f"being set up (e.g. a tensor of shape {tuple(foreign[0].shape)}). Pass each model "
            f"together with the optimizer(s) built from its parameters, or create the optimizer "
            f"after `model = fabric.setup_module(model)` from `model.parameters()`."
        )
    if optimizer.state:
        raise ValueError(
            f"The {type(optimizer).__name__} already has state (it was stepped or loaded), "
            f"which belongs to the unsharded parameters. Set the model and optimizer up before "
            f"the first step and load checkpoints with fabric.load() afterwards, or create the "
            f"optimizer after `model = fabric.setup_module(model)`."
        )


def check_holds_only(optimizer: Optimizer, known: set[int]) -> None:
    """Raise unless every parameter of `optimizer` is one of the shards whose ids are `known`."""
    params, foreign = _foreign(optimizer, known)
    if foreign:
        raise ValueError(
            f"The optimizer holds {len(foreign)} of its {len(params)} parameters that are "
            f"not shards of a model set up by this strategy (e.g. a tensor of shape "
            f"{tuple(foreign[0].shape)}). Setting a model up replaces each parameter by "
            f"this rank's shard, so an optimizer built before that would update tensors the "
            f"model no longer uses. Create the optimizer after setting the model up: "
            f"`model = fabric.setup_module(model)`, then "
            f"`optimizer = torch.optim.AdamW(model.parameters(), ...)`, then "
            f"`optimizer = fabric.setup_optimizers(optimizer)`; or hand a fresh optimizer "
            f"to `model, optimizer = fabric.setup(model, optimizer)`."
        )


def repoint(optimizer: Optimizer, names_of: dict[int, str], new: dict) -> None:
    """Replace each parameter of `optimizer` by the shard registered under the same name."""
    for group in optimizer.param_groups:
        group["params"] = [new[names_of[id(p)]] for p in group["params"]]
