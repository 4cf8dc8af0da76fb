"""Hugging Face's own gradient checkpointing under fullshard, on 2 and 3 real gloo ranks.

`gradient_checkpointing_enable()`, reentrant and not, switched on before or after wrapping,
trains GPT-2 and Llama (tiny configs) at parity with one process for every sharding strategy:
with the checkpointed layers as units, with units below them (the layer reads norms the root
owns), and under ZeRO-3 each layer unit is reduced and released after its own backward.

transformers changed how a `GradientCheckpointingLayer` checkpoints itself: up to 5.3 it
hands `checkpoint` its `nn.Module.__call__` (the recomputation runs the layer's hooks), later
5.x its plain `forward` (it runs none of them, the layer unit's own gather included). `make
test` runs this file against both: the newest transformers in .venv, litgpt's pin (5.3) in
.venv-litgpt. `test_gradient_checkpointing_style_is_known` names the style the installed
transformers uses, so a third one fails loudly instead of passing by luck.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.testing import DistributedGroup
from tests.distributed.model_parity import train_and_compare

transformers = pytest.importorskip("transformers")

from tests.distributed.hf_tiny import (  # noqa: E402 - transformers is importable
    MODELS,
    SEQ,
    STRATEGIES,
    VOCAB,
    batches,
    hf_loss,
)

# Units below the checkpointed layer: the layer's norms belong to the root, whose hooks do
# not run during the recomputation (4f84aec: "weight of shape [8]" on 2 ranks).
SUB_LAYER_UNITS = {"gpt2": ("GPT2Attention", "GPT2MLP"), "llama": ("LlamaAttention", "LlamaMLP")}


def _checkpointing_style() -> str:
    """What a `GradientCheckpointingLayer` of the installed transformers checkpoints."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if "__call__" in vars(GradientCheckpointingLayer):
        return "__call__"  # <= 5.3: checkpoint(partial(nn.Module.__call__, ...))
    forward = vars(GradientCheckpointingLayer).get("__init_subclass__")
    return "forward" if forward is not None else "unknown"


def _classes(model: torch.nn.Module, names: tuple[str, ...]) -> set[type]:
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _is_checkpointing(model: torch.nn.Module) -> bool:
    # `is_gradient_checkpointing` is deprecated from 5.x on in favour of this name
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def _gradient_checkpointing() -> dict:
    """Parity with one process for every strategy and both checkpoint flavours, switched on
    before or after wrapping (each strategy both ways, one per flavour), with units below the
    checkpointed layers (the layer reads the root's norms) and with the layers as units
    (FULL_SHARD's default)."""
    world = dist.get_world_size()
    results: dict[str, object] = {}
    for name in SUB_LAYER_UNITS:
        build = MODELS[name][0]
        for i, strategy in enumerate(STRATEGIES):
            for reentrant in (False, True):
                kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
                torch.manual_seed(0)
                ref = build()
                ref.gradient_checkpointing_enable(**kwargs)
                after = (i + reentrant) % 2 == 0  # switched on after wrapping
                model = build() if after else copy.deepcopy(ref)
                if after:
                    model.load_state_dict(ref.state_dict())
                units = _classes(model, SUB_LAYER_UNITS[name]) if strategy != "FULL_SHARD" else None
                model = fullshard.fsdp(model, device="cpu", sharding_strategy=strategy,
                                       bucketing_strategy=STRATEGIES[strategy],
                                       auto_wrap_policy=units)
                if after:
                    model.gradient_checkpointing_enable(**kwargs)
                assert _is_checkpointing(model)
                key = f"{name}/{strategy}/{'reentrant' if reentrant else 'non-reentrant'}"
                results[key] = train_and_compare(model, ref, batches(name, world)[:2], hf_loss)
        # sub-layer units under ZeRO-3 too (above, ZeRO-3 ran with the layers as units)
        for reentrant in (False, True):
            torch.manual_seed(0)
            ref = build()
            ref.gradient_checkpointing_enable({"use_reentrant": reentrant})
            model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy="FULL_SHARD",
                                   auto_wrap_policy=_classes(ref, SUB_LAYER_UNITS[name]))
            results[f"{name}/FULL_SHARD/sub-layer units/{reentrant}"] = train_and_compare(
                model, ref, batches(name, world)[:2], hf_loss
            )
    results["entry_point"] = _entry_point_first()
    results["zero3_release"] = _zero3_checkpointed_layers_release()
    results["style"] = _checkpointing_style()
    return results


def _hidden_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.base_model(input_ids=batch["input_ids"]).last_hidden_state.pow(2).mean()


def _entry_point_first() -> dict:
    """Switched on after wrapping, then trained through `model.base_model(...)` (an entry
    point: the root's forward never runs) from the first step, ZeRO-3 with units below the
    layers: the layers' checkpoint function is wrapped before they are called."""
    world = dist.get_world_size()
    out = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        ref = MODELS["gpt2"][0]()
        ref.gradient_checkpointing_enable({"use_reentrant": reentrant})
        model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy="FULL_SHARD",
                               auto_wrap_policy=_classes(ref, SUB_LAYER_UNITS["gpt2"]))
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        out[reentrant] = train_and_compare(model, ref, batches("gpt2", world)[:2], _hidden_loss)
    return out


def _zero3_checkpointed_layers_release() -> dict:
    """ZeRO-3, 4 GPT-2 blocks as units, HF checkpointing reentrant and not: during backward at
    most the root and two blocks (the running one and one prefetched) are gathered, and each
    unit is reduced once. At 4f84aec the recomputation counted a second node per block that
    never ran, so every block stayed gathered (and unreduced) until backward ended. (From
    transformers 5.25 a layer unit's hooks run outside a reentrant checkpoint, so its forward
    creates a counted node that never runs: the nested backward's end reduces and releases.)"""
    cfg = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB,
                                  n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    out = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        model = fullshard.fsdp(model, device="cpu", sharding_strategy="FULL_SHARD",
                               bucketing_strategy="BLOCK")
        root, *blocks = model.fullshard_runtime.units
        assert len(blocks) == 4
        s = model.fullshard_runtime.mesh.shard.size
        nbytes = [s * sum(b.numel for b in u.buckets) * 4 for u in (root, *blocks)]
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
        loss = model(input_ids=ids, labels=ids).loss
        fullshard.reset_memory_stats()
        fullshard.reset_comm_stats()
        loss.backward()
        peak = fullshard.memory_stats()["peak_unsharded_param_bytes"]
        bound = nbytes[0] + 2 * max(nbytes[1:])
        assert peak <= bound, f"{reentrant=}: peak {peak} > root + 2 blocks {bound}"
        assert fullshard.memory_stats()["unsharded_param_bytes"] == 0
        assert fullshard.comm_stats()["reduce_scatter"]["calls"] == 5, reentrant  # one per unit
        out[reentrant] = {"peak": peak, "bound": bound}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def results(request) -> list[dict]:
    with DistributedGroup(request.param) as group:
        yield group.run(_gradient_checkpointing, timeout=600)


def test_gradient_checkpointing_every_strategy(results: list[dict]) -> None:
    done = results[0]
    for name in SUB_LAYER_UNITS:
        for strategy in STRATEGIES:
            for flavour in ("reentrant", "non-reentrant"):
                assert done[f"{name}/{strategy}/{flavour}"]["loss"] <= 1e-5
        assert {f"{name}/FULL_SHARD/sub-layer units/{r}" for r in (False, True)} <= set(done)


def test_gradient_checkpointing_through_an_entry_point(results: list[dict]) -> None:
    for reentrant in (False, True):
        assert results[0]["entry_point"][reentrant]["loss"] <= 1e-5


def test_gradient_checkpointing_zero3_releases_each_layer(results: list[dict]) -> None:
    for reentrant in (False, True):
        release = results[0]["zero3_release"][reentrant]
        assert release["peak"] <= release["bound"], (reentrant, release)


def test_gradient_checkpointing_style_is_known(results: list[dict]) -> None:
    assert results[0]["style"] in ("__call__", "forward"), transformers.__version__
