"""Hugging Face transformers models under fullshard, built from tiny configs (no downloads).

GPT-2 (input/output embeddings tied), Llama (rotary-embedding buffers, grouped-query
attention) and BERT (an encoder; masked-LM head tied to the word embeddings, its bias tied too)
are trained with `labels=` losses beside their unwrapped twins on 2 and 3 ranks, for every
sharding strategy: losses, every local gradient shard and every local parameter shard after
SGD steps match one process (fp32, rtol=1e-5, atol=1e-6). Also through Lightning's `Fabric`
with fullshard's `FSDPStrategy` and `init_module(empty_init=True)`, the default units
(`_no_split_modules`), and what HF users call on the model: `config`, `generate()`,
`loss_function`, `save_pretrained()` of the full weights and `from_pretrained` of them.

`generate()` (GPT-2, Llama, T5; greedy and
seeded sampling) returns the unwrapped model's tokens on every rank while rank 0 stops after
2 tokens and the others run on; `get_encoder()` / `get_input_embeddings()` called directly see
gathered weights. (Hugging Face's gradient checkpointing: test_hf_gradient_checkpointing.py.)

One group per world size runs everything (one `run` per world size).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.testing import DistributedGroup
from tests.distributed.model_parity import train_and_compare

transformers = pytest.importorskip("transformers")

from tests.distributed.hf_tiny import (  # noqa: E402 - transformers is importable
    MODELS,
    STRATEGIES,
    VOCAB,
    batches,
    gpt2,
    hf_loss,
    llama,
    t5,
)


def _parity_all_strategies() -> dict:
    world = dist.get_world_size()
    results: dict[str, object] = {}
    for name, (build, unit_class) in MODELS.items():
        for strategy, bucketing in STRATEGIES.items():
            torch.manual_seed(0)
            ref = build()
            model = fullshard.fsdp(copy.deepcopy(ref), device="cpu",
                                   sharding_strategy=strategy, bucketing_strategy=bucketing)
            results[f"{name}/{strategy}"] = train_and_compare(
                model, ref, batches(name, world), hf_loss
            )
        units_line = repr(model).splitlines()[1]
        assert f"2 x {unit_class.split(' + ')[-1].removeprefix('2 x ')}" in units_line, units_line
        assert "(default: _no_split_modules)" in units_line, units_line
        results[f"{name}/units"] = units_line
    return results


def _hf_surface() -> dict:
    """What HF users call on the wrapped model behaves as on the unwrapped one."""
    torch.manual_seed(0)
    ref = gpt2()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy="FULL_SHARD")
    out: dict[str, object] = {}
    assert type(model).__name__ == "GPT2LMHeadModel"  # HF writes it into config.json
    assert isinstance(model, fullshard.FullyShardedModule)
    assert model.config is not None and model.config.n_layer == 2
    assert model.loss_function is ref.loss_function
    # tied input/output embeddings stay one parameter (the shard)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref_gen = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen), (gen, ref_gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.allclose(logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    # save_pretrained of the full weights on rank 0 loads back as the unwrapped model
    full = model.original_state_dict()
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        model.save_pretrained(path[0], state_dict=dict(full))  # HF empties the dict it gets
        with open(os.path.join(path[0], "config.json")) as f:
            out["architectures"] = json.load(f)["architectures"]
        loaded = transformers.GPT2LMHeadModel.from_pretrained(path[0])
        shutil.rmtree(path[0], ignore_errors=True)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ref.state_dict().items())
    # load_original_state_dict writes into the shards the optimizer holds
    shards = [p for p in model.parameters()]
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    model.load_original_state_dict(zeros)
    assert all(p is q and not p.any() for p, q in zip(model.parameters(), shards))
    return out


def _fabric_empty_init() -> dict:
    """Lightning's Fabric + fullshard's FSDPStrategy, models built on the meta device, then the
    reference's weights loaded through the thunder name; buffers (RoPE inv_freq, BERT
    position_ids) come from the model's own `_init_weights` and must equal the eagerly built
    model's."""
    import lightning as L

    world = dist.get_world_size()
    results = {}
    for name, (build, _) in MODELS.items():
        fabric = L.Fabric(accelerator="cpu", devices=world,
                          strategy=fullshard.FSDPStrategy(sharding_strategy="FULL_SHARD"))
        fabric.launch()
        torch.manual_seed(0)
        ref = build()
        with fabric.init_module(empty_init=True):
            model = build()
        assert all(p.is_meta for p in model.parameters())
        model = fabric.setup(model).module  # the sharded model in Lightning's _FabricModule
        assert "(default: _no_split_modules)" in repr(model).splitlines()[1]  # the strategy's
        assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        for (bn, b), (rn, rb) in zip(model.named_buffers(), ref.named_buffers()):
            assert bn == rn and torch.equal(b, rb), f"{name}: buffer {bn} differs"
        model.load_original_state_dict(ref.state_dict())
        results[name] = train_and_compare(model, ref, batches(name, world), hf_loss)
    return results


GENERATION = {"gpt2": ("FULL_SHARD", gpt2), "llama": ("HYBRID_SHARD", llama),
              "t5": ("FULL_SHARD", t5)}


def _generation() -> dict:
    """`generate()` through `fsdp()` (no `mark_forward_method`) returns, on every rank, the
    unwrapped model's tokens for that rank's own prompt, greedy and sampling (the same seed
    on both sides), while rank 0 stops after at most 2 new tokens (its `eos_token_id` is its
    own 2nd token) and the other ranks run to `max_new_tokens`. The root-owned entry points
    (`get_encoder()`, `get_input_embeddings()`) called directly see gathered weights."""
    rank = dist.get_rank()
    out: dict[str, object] = {}
    for name, (strategy, build) in GENERATION.items():
        torch.manual_seed(0)
        ref = build().eval()
        model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy=strategy)
        ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10 + rank))
        with torch.no_grad():
            assert torch.equal(model.get_input_embeddings()(ids), ref.get_input_embeddings()(ids))
            if name == "t5":  # the encoder's embedding and final norm belong to the root
                mine = model.get_encoder()(input_ids=ids).last_hidden_state
                theirs = ref.get_encoder()(input_ids=ids).last_hidden_state
                assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6), name
        first = 1 if name == "t5" else ids.shape[1]  # where the generated tokens start
        for sample in (False, True):
            kwargs = {"max_new_tokens": 8, "do_sample": sample, "pad_token_id": 0,
                      "attention_mask": torch.ones_like(ids)}
            torch.manual_seed(100 + rank)
            full = ref.generate(ids, **kwargs)
            kwargs["eos_token_id"] = int(full[0, first + 1]) if rank == 0 else VOCAB + 1
            torch.manual_seed(100 + rank)
            expected = ref.generate(ids, **kwargs)
            torch.manual_seed(100 + rank)
            got = model.generate(ids, **kwargs)
            assert torch.equal(got, expected), (name, sample, got, expected)
            out[f"{name}/{'sample' if sample else 'greedy'}"] = got.shape[1] - first
    return out


def _everything() -> dict:
    """Every section; one that raises is reported by its own test (as its traceback), the
    others still run. Generation goes last: where it fails, ranks may leave it out of step."""
    out: dict[str, object] = {}
    for key, section in (("parity", _parity_all_strategies), ("surface", _hf_surface),
                         ("fabric", _fabric_empty_init), ("generation", _generation)):
        try:
            out[key] = section()
        except Exception:  # noqa: BLE001 - reported by the section's test
            out[key] = traceback.format_exc()
    return out


def _section(results: list[dict], key: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert isinstance(r[key], dict), f"rank {rank}, {key}:\n{r[key]}"
    return [r[key] for r in results]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def results(request) -> list[dict]:
    with DistributedGroup(request.param) as group:
        yield group.run(_everything, timeout=600)


def test_parity_every_strategy(results: list[dict]) -> None:
    for name in MODELS:
        for strategy in STRATEGIES:
            worst = _section(results, "parity")[0][f"{name}/{strategy}"]
            assert worst["loss"] <= 1e-5, (name, strategy, worst)


def test_default_units_are_no_split_modules(results: list[dict]) -> None:
    assert "units: root + 2 x GPT2Block (default: _no_split_modules)" in (
        _section(results, "parity")[0]["gpt2/units"]
    )
    assert "root + 1 x BertEmbeddings + 2 x BertLayer" in results[0]["parity"]["bert/units"]


def test_hf_surface(results: list[dict]) -> None:
    assert _section(results, "surface")[0]["architectures"] == ["GPT2LMHeadModel"]


def test_fabric_empty_init(results: list[dict]) -> None:
    assert set(_section(results, "fabric")[0]) == set(MODELS)


def test_generate_ranks_stop_at_different_lengths(results: list[dict]) -> None:
    lengths = _section(results, "generation")
    for name in GENERATION:
        for mode in ("greedy", "sample"):
            key = f"{name}/{mode}"
            assert lengths[0][key] <= 2, key  # rank 0 stopped early
            assert all(r[key] == 8 for r in lengths[1:]), key  # the others ran on
