"""The planner on a Hugging Face model: its meta-device forward runs through HF's own code
(Llama's rotary embedding asks `torch.autocast` about the meta device), and the activations
it counts are the bytes a real forward saves for backward."""

from __future__ import annotations

import pytest
import torch

import fullshard
from fullshard.planner.profile import activation_bytes

transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def _saved_by_a_real_forward(model: torch.nn.Module, batch: int, seq: int) -> int:
    """What `activation_bytes` counts, on a real CPU forward: the storages autograd saves
    (parameters excluded) and the outputs."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    keep = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved.setdefault(storage._cdata, storage.nbytes())
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.zeros(batch, seq, dtype=torch.long))
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            saved.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
    return sum(saved.values())


def test_plan_of_hf_llama_counts_what_a_real_forward_saves() -> None:
    autocast, enabled = torch.autocast, torch.is_autocast_enabled
    with torch.device("meta"):
        meta = tiny_llama()
    counted = activation_bytes(meta, 2, 8, attention="math")
    assert torch.autocast is autocast and torch.is_autocast_enabled is enabled  # restored
    torch.manual_seed(0)
    assert counted == _saved_by_a_real_forward(tiny_llama(), 2, 8)

    table = fullshard.plan(tiny_llama, world_sizes=(2,), batch=2, seq=8, budget="1GiB")
    assert table.units == "root + 2 x LlamaDecoderLayer"
    assert table.rows[0].activation_bytes > 0 and table.recommendation is not None
