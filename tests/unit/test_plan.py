"""`fullshard.plan()` and `fullshard plan`, without processes: exact model-state arithmetic,
communication formulas, the working set's shape, budgets and recommendations, activations,
the command line, and clear errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

import fullshard
from fullshard.cli import main
from fullshard.demo.config import build_demo_model
from fullshard.planner import parse_bytes
from fullshard.planner.models import LlamaConfig

PSI_7B = 6_738_415_616
TENSORS_7B = 32 * 9 + 3  # per block: 7 Linear weights + 2 RMSNorm weights; root: 3


@pytest.fixture(scope="module")
def llama7b():
    return fullshard.plan("llama-7b", world_sizes=(1, 2, 4, 8, 16))


# -- model state ---------------------------------------------------------------------------------
def test_llama_7b_is_planned_from_its_shapes(llama7b):
    # How long planning takes is benchmarks/plan_accuracy.py --planning-time's (issue 40).
    table = llama7b
    assert table.num_params == PSI_7B == LlamaConfig().num_params
    assert table.units == "root + 32 x LlamaBlock"


def test_full_shard_8_ranks_adamw_fp32_holds_16_psi_over_8(llama7b):
    table = llama7b
    row = table.row(8, "FULL_SHARD")
    # Every dim of this config (4096, 11008, 32000) divides by 8: no padding. AdamW keeps
    # exp_avg and exp_avg_sq (fp32) and a 4-byte fp32 step tensor per parameter tensor.
    assert row.param_bytes == row.grad_bytes == 4 * PSI_7B // 8
    assert row.optimizer_bytes == 8 * PSI_7B // 8 + 4 * TENSORS_7B
    assert row.model_state_bytes == 16 * PSI_7B // 8 + 4 * TENSORS_7B
    assert table.row(1, "NO_SHARD").model_state_bytes == 16 * PSI_7B + 4 * TENSORS_7B


def test_padding_is_counted_in_shards_and_grads_not_in_optimizer_state():
    table = fullshard.plan("llama-7b", world_sizes=(3,), strategies=["FULL_SHARD"])
    row = table.row(3, "FULL_SHARD")
    cfg = LlamaConfig()
    rows = {  # (dim0, row_numel, count)
        "wq/wo": (cfg.dim, cfg.dim, 2 * cfg.layers), "wk/wv": (cfg.dim, cfg.dim, 2 * cfg.layers),
        "w1/w3": (cfg.ffn, cfg.dim, 2 * cfg.layers), "w2": (cfg.dim, cfg.ffn, cfg.layers),
        "norms": (cfg.dim, 1, 2 * cfg.layers + 1), "emb/out": (cfg.vocab, cfg.dim, 2),
    }
    padded = sum(math.ceil(d0 / 3) * r * k for d0, r, k in rows.values())
    assert padded * 3 > PSI_7B  # 4096 and 32000 do not divide by 3
    assert row.param_bytes == row.grad_bytes == 4 * padded
    assert row.optimizer_bytes == 8 * padded + 4 * TENSORS_7B  # rank 0 owns ceil rows


def test_precision_and_optimizer_change_the_bytes():
    kw = {"world_sizes": (8,), "strategies": ["FULL_SHARD"]}
    mixed = fullshard.plan("llama-7b", precision="bf16-mixed", **kw).rows[0]
    true16 = fullshard.plan("llama-7b", precision="bf16-true", **kw).rows[0]
    sgd = fullshard.plan("llama-7b", optimizer="sgd", **kw).rows[0]
    momentum = fullshard.plan("llama-7b", optimizer="sgd-momentum", **kw).rows[0]
    # Mixed precision: shards, grads and AdamW state stay fp32.
    assert mixed.model_state_bytes == 16 * PSI_7B // 8 + 4 * TENSORS_7B
    assert true16.model_state_bytes == 8 * PSI_7B // 8 + 4 * TENSORS_7B
    assert sgd.optimizer_bytes == 0 and sgd.model_state_bytes == 8 * PSI_7B // 8
    assert momentum.optimizer_bytes == 4 * PSI_7B // 8


# -- communication and working set --------------------------------------------------------------
def test_communication_follows_the_zero_formulas(llama7b):
    table = llama7b
    n, words = 8, PSI_7B * 7 / 8
    # ZeRO-3 gathers the root (embed_tokens and lm_head, 32000 x 4096 each, and the final
    # norm) once: it stays gathered from its forward into backward.
    root_words = (2 * 32000 * 4096 + 4096) * 7 / 8
    z3, z2 = table.row(n, "FULL_SHARD"), table.row(n, "SHARD_GRAD_OP")
    ddp = table.row(n, "NO_SHARD")
    assert z3.comm_bytes == pytest.approx(4 * (3 * words - root_words), abs=100)
    assert z2.comm_bytes == pytest.approx(2 * 4 * words, abs=100)
    assert ddp.comm_bytes_by_kind["all_reduce"] == pytest.approx(2 * 4 * words, abs=100)
    assert all(r.comm_bytes == 0 for r in table.rows if r.world_size == 1 and r.applicable)
    mixed = fullshard.plan("llama-7b", world_sizes=(8,), strategies=["FULL_SHARD"],
                           precision="bf16-mixed").rows[0]
    assert mixed.comm_bytes_by_kind["all_gather"] == pytest.approx(
        2 * (2 * words - root_words), abs=100)


def test_strategies_order_memory_and_communication(llama7b):
    table = llama7b
    for n in (2, 4, 8, 16):
        rows = [r for r in table.rows if r.world_size == n]
        assert [r.strategy for r in rows] == [
            "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"
        ]
        z3, z2, ddp = rows[:3]
        assert z3.model_state_bytes == z2.model_state_bytes < ddp.model_state_bytes
        assert z3.working_set_bytes < z2.working_set_bytes
        assert z3.total_bytes < z2.total_bytes < ddp.total_bytes
        assert z3.comm_bytes > z2.comm_bytes >= ddp.comm_bytes
    assert not table.row(4, "HYBRID_SHARD").applicable
    assert "multiple of 8" in table.row(4, "HYBRID_SHARD").note
    hybrid = table.row(16, "HYBRID_SHARD")
    assert hybrid.mesh == (2, 8)
    assert hybrid.model_state_bytes == table.row(8, "FULL_SHARD").model_state_bytes
    assert hybrid.comm_bytes_by_kind["all_reduce"] > 0


def test_working_set_zero3_holds_root_and_two_blocks(llama7b):
    table = llama7b
    f32, d, f, v = 4, 4096, 11008, 32000
    block = (4 * d * d + 3 * d * f + 2 * d) * f32
    root = (2 * v * d + d) * f32
    for n in (2, 4, 8, 16):
        z3 = table.row(n, "FULL_SHARD").working_set_bytes
        z2 = table.row(n, "SHARD_GRAD_OP").working_set_bytes
        # ZeRO-3: root + running block + 1 prefetched, plus up to 3 reduce inputs (and NCCL's
        # copy-out of one gather); ZeRO-2: everything gathered plus a reduce input.
        assert root + 2 * block <= z3 <= root + 3 * block + 3 * block
        assert root + 32 * block <= z2 <= root + 35 * block
    assert table.row(1, "FULL_SHARD").working_set_bytes == 0  # nothing is gathered at N=1
    deeper = fullshard.plan("llama-7b", world_sizes=(8,), strategies=["FULL_SHARD"],
                            prefetch_limit=3).rows[0]
    assert deeper.working_set_bytes == table.row(8, "FULL_SHARD").working_set_bytes + 2 * block


# -- budget and recommendation ------------------------------------------------------------------
def test_budget_marks_fits_and_recommends_the_cheapest_that_fits():
    table = fullshard.plan("llama-7b", world_sizes=(8, 16), precision="bf16-mixed",
                           budget="80GiB", search=False)
    assert table.budget == 80 * 2**30 and table.search is None
    for r in table.rows:
        if r.applicable:
            assert r.fits == (r.total_bytes <= 80 * 2**30)
    assert table.row(8, "NO_SHARD").fits is False
    best = table.recommend(8)
    assert best.strategy == "SHARD_GRAD_OP" and best.fits and best.recommended
    fitting = [r for r in table.rows if r.world_size == 8 and r.applicable and r.fits]
    assert best.comm_bytes == min(r.comm_bytes for r in fitting)
    assert table.recommend() is best  # 8 ranks send less per rank than 16
    # A budget only ZeRO-3 meets.
    z3 = table.row(8, "FULL_SHARD")
    tight = fullshard.plan("llama-7b", world_sizes=(8,), precision="bf16-mixed",
                           budget=z3.total_bytes, search=False)
    assert tight.recommend(8).strategy in ("FULL_SHARD", "HYBRID_SHARD")
    assert tight.recommend(8).strategy == "FULL_SHARD"  # equal numbers: the first listed
    nothing = fullshard.plan("llama-7b", world_sizes=(8,), budget="1GiB", search=False)
    assert nothing.recommend() is None and all(r.fits is False for r in nothing if r.applicable)
    assert "nothing fits" in nothing.render()


def test_under_the_table_a_world_size_the_search_makes_fit_is_not_called_nothing_fits():
    """Issue 39: no plain row at N=2 fits 16 MiB, but the search below finds a configuration
    there (checkpointing, offload): the line under the table says it fits only with that."""
    table = fullshard.plan("demo", world_sizes=(2,), batch=16, seq=64, budget="16MiB",
                           hardware="l40s", backend="gloo")
    assert all(r.fits is False for r in table if r.applicable)
    best = table.search.best_at(2)
    assert best is not None and best.fits
    text = table.render()
    assert "nothing fits" not in text
    assert (f"N=2: no row fits as is; it fits only with what the search adds: "
            f"{best.config.describe()} (below).") in text.splitlines()
    # Without a search, or where the search finds nothing either, it is still "nothing fits".
    plain = fullshard.plan("demo", world_sizes=(2,), batch=16, seq=64, budget="16MiB",
                           search=False)
    assert "N=2: nothing fits." in plain.render().splitlines()
    hopeless = fullshard.plan("demo", world_sizes=(2,), batch=16, seq=64, budget="1MiB",
                              hardware="l40s", backend="gloo")
    assert hopeless.search.best is None
    assert "N=2: nothing fits." in hopeless.render().splitlines()


def test_buckets_and_their_dtypes_are_the_engines_own():
    """The planner reads the units and buckets through `engine.sharding.unit_specs`, what
    `shard_module` builds from: under mixed precision a full-precision module's parameters
    (BatchNorm) get a bucket of their own, gathered and reduced in fp32."""
    from fullshard.config import FSDPBucketingStrategy
    from fullshard.engine.sharding import unit_specs
    from fullshard.planner.sizes import model_structure, resolve_precision_spec
    from fullshard.testing.models import ConvBNNet

    precision = resolve_precision_spec("bf16-mixed")
    with torch.device("meta"):
        model = ConvBNNet()
    for bucketing in FSDPBucketingStrategy:
        engine = unit_specs(model, "root", bucketing, precision.mixed)
        planned = model_structure(model, "root", bucketing, mixed_precision=precision.mixed)
        assert [[tuple(o.current.shape for o in b.params) for b in u.buckets] for u in engine] \
            == [[b.shapes for b in u.buckets] for u in planned.units]
        for spec, shape in zip(engine[0].buckets, planned.units[0].buckets):
            master, compute, reduce = precision.dtypes(shape)
            assert compute == (spec.compute_dtype or spec.dtype)
            assert reduce == (spec.reduce_dtype or compute)
    full = [b for b in planned.units[0].buckets if b.full_precision]
    assert [b.shapes for b in full] == [(torch.Size([5]), torch.Size([5]))]  # bn weight, bias
    assert precision.dtypes(full[0])[1:] == (torch.float32, torch.float32)
    assert {precision.dtypes(b)[1] for b in planned.units[0].buckets if not b.full_precision} \
        == {torch.bfloat16}


def test_no_budget_means_fits_unknown():
    table = fullshard.plan("tiny", world_sizes=(2,))
    assert all(r.fits is None for r in table.rows)
    assert table.recommend(2).strategy == "NO_SHARD"  # least communication


def test_to_dict_is_json_data(llama7b):
    table = llama7b
    d = json.loads(json.dumps(table.to_dict()))
    assert d["num_params"] == PSI_7B and len(d["rows"]) == len(table.rows)
    first = d["rows"][0]
    assert {"world_size", "strategy", "mesh", "param_bytes", "grad_bytes", "optimizer_bytes",
            "model_state_bytes", "working_set_bytes", "total_bytes", "comm_bytes",
            "comm_bytes_by_kind", "fits", "recommended"} <= set(first)


# -- activations --------------------------------------------------------------------------------
def test_activation_estimate_from_a_meta_forward():
    one = fullshard.plan("demo", world_sizes=(2,), batch=1, seq=64).rows[0]
    four = fullshard.plan("demo", world_sizes=(2,), batch=4, seq=64).rows[0]
    assert one.activation_bytes > 0
    # Linear in the batch, up to the few batch-independent tensors (position ids).
    assert four.activation_bytes == pytest.approx(4 * one.activation_bytes, rel=1e-3)
    assert four.total_bytes == (four.model_state_bytes + four.working_set_bytes
                                + four.backward_scratch_bytes + four.activation_bytes)
    flash = fullshard.plan("llama-7b", world_sizes=(8,), batch=1, seq=2048).rows[0]
    math_ = fullshard.plan("llama-7b", world_sizes=(8,), batch=1, seq=2048,
                           attention="math").rows[0]
    # The math kernel also keeps the 32 layers x 32 heads x 2048^2 attention probabilities
    # (fp32), but not the attention output and log-sum-exp that flash saves.
    diff = math_.activation_bytes - flash.activation_bytes
    assert diff == 32 * (32 * 2048 * 2048 - 2048 * 4096 - 32 * 2048) * 4
    bf16 = fullshard.plan("llama-7b", world_sizes=(8,), batch=1, seq=2048,
                          precision="bf16-mixed").rows[0]
    assert bf16.activation_bytes < flash.activation_bytes
    assert fullshard.plan("tiny", world_sizes=(1,)).rows[0].activation_bytes is None


# -- models, factories, policies ----------------------------------------------------------------
class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 10)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return x


def make_net() -> nn.Module:
    return _Net()


def test_factory_path_callable_and_module_instance():
    by_path = fullshard.plan("tests.unit.test_plan:make_net", world_sizes=(2,), batch=2, seq=3)
    assert by_path.num_params == 50 * 10 + 3 * 110
    assert by_path.units == "root + 3 x _Layer"
    assert by_path.policy == "_Layer (default: repeated blocks)"
    by_callable = fullshard.plan(make_net, world_sizes=(2,))
    instance = fullshard.plan(_Net(), world_sizes=(2,))  # real tensors: only shapes are read
    assert by_callable.rows == instance.rows == [
        r for r in fullshard.plan("tests.unit.test_plan:make_net", world_sizes=(2,)).rows
    ]
    root_only = fullshard.plan(make_net, world_sizes=(2,), auto_wrap_policy="root")
    assert root_only.units == "root" and root_only.policy == "root only"
    by_name = fullshard.plan(make_net, world_sizes=(2,), auto_wrap_policy=["_Layer"])
    assert by_name.units == "root + 3 x _Layer"


@pytest.fixture(scope="module")
def llama70b():
    return fullshard.plan("llama-70b", world_sizes=(8, 16, 64), precision="bf16-mixed",
                          batch=1, seq=4096, budget="80GiB")


def test_llama_70b_needs_checkpointing_at_80gib(llama70b):
    # Issue 23's bound on planning time is benchmarks/plan_accuracy.py --planning-time's.
    table = llama70b
    assert 68e9 < table.num_params < 70e9
    assert table.row(8, "NO_SHARD").fits is False
    # Without checkpointing nothing fits (activations alone are 146 GiB per rank) ...
    assert all(r.fits is False for r in table.rows)
    assert table.rows[0].activation_bytes > 140 * 2**30
    # ... the search finds what practitioners run: 64 ranks, every block checkpointed.
    best = table.search.best_at(64)
    assert best is not None and best.fits and best.config.checkpoint_every == 1
    assert best.memory.total <= 80 * 2**30 and best.config.strategy == "FULL_SHARD"
    assert best.memory.activations < 10 * 2**30
    assert table.recommendation is table.search.best
    losers = [e for e in table.search.ranked if e.config.world_size == 64
              and e.config.checkpoint_every == 0]
    assert losers and all(not e.fits for e in losers)
    assert "activations" in table.search.why_not(losers[0])
    text = table.render()
    assert "Recommended:" in text and "AC all" in text and "tokens/s per rank" in text


# -- bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80G", 80 * 2**30), ("80GB", 80 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("512mib", 512 * 2**20), ("1024", 1024), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


# -- the command line ---------------------------------------------------------------------------
def test_cli_plan_tiny(capsys):
    assert main(["plan", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "fullshard plan: tiny" in out
    for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "recommended"):
        assert name in out


def test_cli_plan_options_and_json(capsys):
    argv = ["plan", "llama-7b", "--world-sizes", "8,16", "--precision", "bf16-mixed",
            "--optimizer", "adamw", "--batch", "1", "--seq", "1024", "--budget", "80GiB",
            "--bucketing", "BLOCK", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["budget"] == 80 * 2**30 and d["precision"] == "bf16-mixed"
    assert d["recommended"] == {"world_size": 8, "strategy": "SHARD_GRAD_OP"}
    assert {r["world_size"] for r in d["rows"]} == {8, 16}


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--world-sizes", "--precision", "--optimizer", "--batch", "--seq", "--budget",
                "--bucketing", "llama-7b"):
        assert opt in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "plan" in capsys.readouterr().out


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"model_or_factory": "gpt-9"}, r"Unknown model 'gpt-9'.*tiny, demo, llama-7b"),
    ({"model_or_factory": "no_such_pkg.mod:build"}, r"cannot import module 'no_such_pkg.mod'"),
    ({"model_or_factory": "tests.unit.test_plan:nope"}, r"has no attribute 'nope'"),
    ({"model_or_factory": "tests.unit.test_plan:PSI_7B"}, r"not a callable"),
    ({"world_sizes": (1, 0)}, r"world size must be an int >= 1, got 0"),
    ({"world_sizes": ()}, r"at least one world size"),
    ({"budget": "eighty gigs"}, r"Cannot read 'eighty gigs' as a byte size"),
    ({"budget": "0GiB"}, r"must be positive"),
    ({"precision": "fp8"}, r"precision='fp8' is not supported"),
    ({"optimizer": "lion"}, r"Unknown optimizer 'lion'"),
    ({"strategies": ["ZERO4"]}, r"Unknown sharding strategy 'ZERO4'"),
    ({"bucketing": "MODULE"}, r"Unknown bucketing strategy"),
    ({"batch": 4}, r"both batch and seq"),
    ({"batch": 0, "seq": 8}, r"batch must be an int >= 1"),
    ({"auto_wrap_policy": ["Blok"]}, r"No module class named 'Blok'"),
    ({"prefetch_limit": -1}, r"prefetch_limit must be an int >= 0"),
])
def test_bad_inputs_raise_clear_errors(kwargs, match):
    kwargs = {"model_or_factory": "tiny", **kwargs}
    with pytest.raises(ValueError, match=match):
        fullshard.plan(kwargs.pop("model_or_factory"), **kwargs)


def test_bad_types_and_non_meta_activation_estimate():
    with pytest.raises(TypeError, match="expects an nn.Module, a factory callable"):
        fullshard.plan(42)
    with pytest.raises(TypeError, match="returned a int, not an nn.Module"):
        fullshard.plan(lambda: 3)
    with pytest.raises(ValueError, match="meta-device forward.*on cpu"):
        fullshard.plan(_Net(), batch=1, seq=2)


@pytest.mark.parametrize("argv,message", [
    (["plan", "gpt-9"], "Unknown model 'gpt-9'"),
    (["plan", "tiny", "--world-sizes", "0"], "world size must be an int >= 1, got 0"),
    (["plan", "tiny", "--world-sizes", "2,x"], "--world-sizes must be comma-separated"),
    (["plan", "tiny", "--budget", "lots"], "Cannot read 'lots' as a byte size"),
    (["plan", "tiny", "--optimizer", "lion"], "invalid choice: 'lion'"),
    (["plan", "pkg_missing:f"], "cannot import module 'pkg_missing'"),
])
def test_cli_bad_inputs_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "fullshard plan: error:" in err and message in err


# -- the search, the time model, hardware --------------------------------------------------------
def test_checkpointing_keeps_only_block_inputs():
    from fullshard.planner.models import resolve_model
    from fullshard.planner.profile import profile_forward
    from fullshard.planner.search import _checkpointed, activation_bytes_with

    resolved = resolve_model("demo")
    prof = profile_forward(resolved.module, resolved.policy, 2, 64)
    # The same meta forward as the plain activation estimate, broken down per unit.
    assert prof.saved_bytes == fullshard.plan("demo", world_sizes=(2,), batch=2,
                                              seq=64).rows[0].activation_bytes
    blocks = prof.units[1:]
    assert len(blocks) == 4 and all(u.input_bytes == 2 * 64 * 128 * 4 for u in blocks)
    assert all(u.flops > 0 and u.ops > 0 for u in prof.units)
    every = _checkpointed(len(prof.units), 1)
    assert every == {1, 2, 3, 4} and _checkpointed(5, 2) == {1, 3}
    full = activation_bytes_with(prof, (), 2)
    assert full == prof.saved_bytes
    ckpt = activation_bytes_with(prof, every, 2)
    # The peak is the last block's recomputation: the root's, three blocks' inputs, and the
    # last block's full activations (the blocks are alike).
    assert ckpt == (prof.units[0].saved_bytes + sum(u.input_bytes for u in blocks[:3])
                    + blocks[3].saved_bytes)
    assert ckpt < activation_bytes_with(prof, _checkpointed(5, 2), 2) < full
    assert activation_bytes_with(prof, every, 4) == 2 * ckpt  # linear in the micro-batch


def test_checkpoint_every_policy_picks_what_the_search_priced():
    from fullshard.engine.activation_checkpoint import _checkpointed_modules
    from fullshard.planner.search import CheckpointEvery
    from fullshard.testing.models import Block

    model = build_demo_model(layers=5)
    numel = {id(p): p.numel() for p in model.parameters()}
    chosen = _checkpointed_modules(model, CheckpointEvery((Block,), 2), numel)
    assert chosen == [model.blocks[0], model.blocks[2], model.blocks[4]]
    assert _checkpointed_modules(model, CheckpointEvery((Block,), 1), numel) == list(
        model.blocks)
    with pytest.raises(ValueError, match=r"every=\) must be an int >= 1, got 0"):
        CheckpointEvery((Block,), 0)


def test_search_accumulates_to_the_global_batch_and_ranks_by_time():
    table = fullshard.plan("llama-7b", world_sizes=(8, 16), precision="bf16-mixed", seq=4096,
                           global_batch=64, budget="80GiB", hardware="a100-80gb")
    result = table.search
    fitting = result.fitting
    assert fitting and all(e.memory.total <= 80 * 2**30 for e in fitting)
    steps = [e.time.step for e in fitting]
    assert steps == sorted(steps)
    for e in result.ranked:
        c = e.config
        assert c.micro_batch * c.accumulation * c.world_size == 64
        assert e.time.tokens_per_step == c.micro_batch * c.accumulation * 4096
    # Accumulating under no_sync holds the unsharded gradients: more memory, less traffic.
    pairs = {}
    for e in result.ranked:
        if e.config.accumulation > 1:
            pairs.setdefault(dataclasses.replace(e.config, no_sync=True), {})[
                e.config.no_sync] = e
    pair = next(p for p in pairs.values() if len(p) == 2)
    assert pair[True].memory.accumulation > 0 == pair[False].memory.accumulation
    assert pair[True].time.comm < pair[False].time.comm
    d = json.loads(json.dumps(table.to_dict()))
    assert d["search"]["best"]["fits"] and d["search"]["hardware"]["name"] == "a100-80gb"


def test_time_model_schedule():
    from fullshard.planner.schedule import simulate_step
    from fullshard.planner.timing import UnitTimes

    # A root and 4 blocks; a gather takes 3, a block's forward 2 / backward 4.
    times = [UnitTimes(1.0, 2.0, 0.0, 3.0, 1.0)] + [UnitTimes(2.0, 4.0, 0.0, 3.0, 3.0)] * 4
    z3 = simulate_step(times, zero3=True, prefetch=1)
    z2 = simulate_step(times, zero3=False, prefetch=1)
    # Compute: 1 + 8 forward, 2 + 16 backward; each unit is gathered once in forward, and
    # ZeRO-3's blocks (not the root) again in backward.
    assert z3.compute == z2.compute == 27
    assert z3.comm == 15 + 12 + 13 and z2.comm == 15 + 13
    assert z3.first_gather == 3 and z3.last_reduce == 1
    assert z3.step > z2.step > z2.compute  # ZeRO-3 gathers again: more exposed
    deeper = simulate_step(times, zero3=True, prefetch=3)
    assert deeper.exposed <= z3.exposed
    regather = simulate_step(times, zero3=True, prefetch=1, root_regathered=True)
    assert regather.comm == z3.comm + 3
    free = [UnitTimes(t.forward, t.backward, 0.0, 0.0, 0.0) for t in times]
    alone = simulate_step(free, zero3=True)
    assert alone.step == alone.compute == 27 and alone.exposed == 0
    # Four micro-batches under no_sync reduce once; without it, every time.
    acc = simulate_step(times, zero3=True, micro_batches=4, no_sync=True)
    every = simulate_step(times, zero3=True, micro_batches=4, no_sync=False)
    assert every.comm - acc.comm == 3 * (1 + 4 * 3)


def test_time_model_drift_between_ranks():
    """Ranks that share cores drift apart while they compute: an exchange starts when the last
    of them reaches it. Small units wait for that; a large unit's compute or a busy queue hides
    it; a drift of 0 changes nothing."""
    from fullshard.planner.schedule import simulate_step
    from fullshard.planner.timing import UnitTimes

    drift = (0.5, 2.0)  # half a second per second of compute, at most 2

    def steps(times):  # type: ignore[no-untyped-def]
        return (simulate_step(times, zero3=True, prefetch=1, optimizer=1.0),
                simulate_step(times, zero3=True, prefetch=1, optimizer=1.0, drift=drift))

    # Small units: 1 of compute per pass between exchanges that take 0.1 (the latency-bound
    # demo): every exchange waits for a drift of 0.5.
    small = [UnitTimes(1.0, 1.0, 0.0, 0.1, 0.1)] * 5

    def cost(times):  # type: ignore[no-untyped-def]
        """What the drift adds to the step."""
        bare, drifting = steps(times)
        return drifting.step - bare.step

    bare, drifting = steps(small)
    assert drifting.comm == bare.comm  # the drift holds no link time
    assert drifting.step - bare.step >= 5 * 0.5
    assert drifting.exposed - bare.exposed == pytest.approx(drifting.step - bare.step)
    # Large units, prefetched: the drift hides behind each block's compute, except where
    # compute waits anyway: the first gathers (after the optimizer step), the first block of
    # backward (gathered as forward ends) and the last reduction.
    large = [UnitTimes(1.0, 2.0, 0.0, 1.0, 1.0)] + [UnitTimes(10.0, 20.0, 0.0, 1.0, 1.0)] * 4
    bare, drifting = steps(large)
    assert 0 < drifting.step - bare.step <= 3 * drift[1]
    # Small units that travel together (a third of an exchange each) pay a third of it.
    shared = [UnitTimes(1.0, 1.0, 0.0, 0.1, 0.1, share=1 / 3)] * 5
    assert 0 < cost(shared) < cost(small)
    # A busy queue (gathers far longer than compute): the drift is absorbed by the backlog.
    busy = [UnitTimes(0.5, 1.0, 0.0, 10.0, 10.0)] * 5
    bare, drifting = steps(busy)
    assert drifting.step - bare.step <= 2 * drift[1]
    assert simulate_step(small, zero3=True, drift=(0.0, 0.0)) == simulate_step(small, zero3=True)


def _gloo_times(world: int, hardware, *, dim: int = 64):
    """unit_times of a 2-block model on `world` gloo ranks (FULL_SHARD), one sequence."""
    from fullshard.planner.models import resolve_model
    from fullshard.planner.profile import profile_forward
    from fullshard.planner.sizes import model_structure, resolve_precision_spec
    from fullshard.planner.timing import unit_times
    from fullshard.testing.models import Block

    resolved = resolve_model(lambda: build_demo_model(layers=2, dim=dim),
                             auto_wrap_policy={Block})
    structure = model_structure(resolved.module, resolved.policy,
                                fullshard.config.FSDPBucketingStrategy.BLOCK)
    profile = profile_forward(resolved.module, resolved.policy, 1, 16)
    return structure, unit_times(structure, profile, 1, (1, world),
                                 resolve_precision_spec("32-true"), hardware, backend="gloo")


def test_gloo_exchanges_are_one_round_and_the_reduce_scatter_sends_once():
    """Gloo's all-gather and reduce-scatter are pairwise exchanges (distributed/gloo.py):
    one round to all peers, the reduce-scatter sending B (N-1)/N like the all-gather -- not a
    ring's N-1 latencies nor gloo's own reduce-scatter (an all-reduce, twice the bytes)."""
    from fullshard.planner.timing import Hardware

    slow_link = Hardware("t", 1e12, 1e12, 1.0, 1e12, 2**34, intra_bw=1e6, intra_latency=0.0,
                         inter_bw=1e6, inter_latency=0.0, ranks_per_node=64, backend="gloo")
    for world in (2, 3):
        _, times = _gloo_times(world, slow_link)
        for t in times:  # bandwidth-bound: same bytes each way
            assert t.reduce == pytest.approx(t.gather, rel=1e-6)
    latency_only = dataclasses.replace(slow_link, intra_bw=1e18, inter_bw=1e18,
                                       intra_latency=1e-3, inter_latency=1e-3)
    _, two = _gloo_times(2, latency_only, dim=384)
    _, three = _gloo_times(3, latency_only, dim=384)
    # Blocks of > 1 MiB per rank: a message per large piece (4 Linear weights), one for the
    # small ones, a header; the same at any N (the latency is measured per N).
    for a, b in zip(two[1:], three[1:]):
        assert a.gather == pytest.approx(b.gather) == pytest.approx(6e-3)
        assert a.reduce == pytest.approx(b.reduce) == pytest.approx(6e-3)


def test_measured_optimizer_and_engine_costs_are_priced():
    """`--hardware local` measures AdamW's step (per tensor, per byte) and the engine's cost
    per unit and per parameter; the time model charges exactly those."""
    from fullshard.planner.sizes import resolve_precision_spec
    from fullshard.planner.timing import Hardware, optimizer_seconds

    base = Hardware("t", 1e18, 1e18, 1.0, 1e18, 2**34, intra_bw=1e18, intra_latency=0.0,
                    inter_bw=1e18, inter_latency=0.0, ranks_per_node=64, backend="gloo")
    measured = dataclasses.replace(base, optimizer_tensor_s=1e-4, optimizer_byte_s=1e-9)
    structure, _ = _gloo_times(2, base)
    fp32 = resolve_precision_spec("32-true")
    shard_bytes = sum(b.padded_shard_numel(2) * 4 for u in structure.units for b in u.buckets)
    seconds = optimizer_seconds(structure, 2, fp32, measured, states=2, cpu_offload=False)
    assert seconds == pytest.approx(structure.trainable_tensors * 1e-4 + shard_bytes * 1e-9)
    engine = dataclasses.replace(base, unit_overhead=1e-3, param_overhead=1e-4)
    _, free = _gloo_times(2, base)
    _, costly = _gloo_times(2, engine)
    for unit, a, b in zip(structure.units, free, costly):
        params = sum(len(bk.shapes) for bk in unit.buckets)
        assert b.forward - a.forward == pytest.approx(1e-3 + params * 1e-4)
        assert b.backward - a.backward == pytest.approx(1e-3 + params * 1e-4)
    # ZeRO-3's second gather in backward costs the engine more work; ZeRO-2 does not pay it.
    from fullshard.planner.schedule import simulate_step

    regather = dataclasses.replace(base, regather_overhead=2e-3, regather_param_overhead=1e-4)
    _, again = _gloo_times(2, regather)
    blocks = sum(t.regather for t in again[1:])
    assert again[1].regather == pytest.approx(
        2e-3 + sum(len(bk.shapes) for bk in structure.units[1].buckets) * 1e-4)
    z3 = simulate_step(again, zero3=True).compute - simulate_step(free, zero3=True).compute
    z2 = simulate_step(again, zero3=False).compute - simulate_step(free, zero3=False).compute
    assert z3 == pytest.approx(blocks) and z2 == 0


def test_attention_scores_and_transcendental_elements_are_priced():
    """Fused attention's softmax per score and GELU / softmax per element run far below the
    matmul and copy rates on CPUs; `--hardware local` measures both (forward + backward) and
    the time model charges a third in forward, the rest in backward."""
    from fullshard.planner.models import resolve_model
    from fullshard.planner.profile import profile_forward
    from fullshard.planner.timing import Hardware
    from fullshard.testing.models import Block

    base = Hardware("t", 1e18, 1e18, 1.0, 1e18, 2**34, intra_bw=1e18, intra_latency=0.0,
                    inter_bw=1e18, inter_latency=0.0, ranks_per_node=64, backend="gloo")
    _, free = _gloo_times(2, base)
    _, costly = _gloo_times(2, dataclasses.replace(base, attention_score_s=2e-8,
                                                   transcendental_s=3e-9))
    small = resolve_model(lambda: build_demo_model(layers=2, dim=64),
                          auto_wrap_policy={Block})
    prof = profile_forward(small.module, small.policy, 1, 16)  # as _gloo_times
    # 4 heads, 16 tokens, causal: half the 4 x 16 x 16 scores; GELU over 16 x 256 elements;
    # the root has no attention, and the training loss's log-softmax (run outside the model
    # on its logits, counted as the root's) writes one element per logit.
    from fullshard.demo.data import VOCAB

    assert [(u.scores, u.transcendental) for u in prof.units] == (
        [(0, 16 * VOCAB)] + [(512, 4096)] * 2)
    for unit, a, b in zip(prof.units, free, costly):
        extra = unit.scores * 2e-8 + unit.transcendental * 3e-9
        assert b.forward - a.forward == pytest.approx(extra / 3, abs=1e-15)
        assert b.backward - a.backward == pytest.approx(2 * extra / 3, abs=1e-15)


def test_the_loss_over_the_logits_is_priced_as_the_roots_work():
    """A model that returns logits is trained on a cross-entropy computed outside it: the
    profile counts that loss (one log-softmax element per logit) as the root's work and saves
    nothing more for it; a model that returns anything else gets no loss."""
    from fullshard.planner.profile import profile_forward

    class Logits(torch.nn.Module):
        def __init__(self, out: str) -> None:
            super().__init__()
            self.emb, self.head, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50), out

        def forward(self, ids):  # type: ignore[no-untyped-def]
            logits = self.head(self.emb(ids))
            return logits if self.out == "logits" else logits.mean()

    def profile(out):  # type: ignore[no-untyped-def]
        with torch.device("meta"):
            model = Logits(out)
        return profile_forward(model, None, 3, 7).units[0]

    with_loss, without = profile("logits"), profile("mean")
    assert with_loss.transcendental == 3 * 7 * 50 and without.transcendental == 0
    assert with_loss.ops > without.ops and with_loss.moved_bytes > without.moved_bytes
    # Both keep the same activations and their output (the logits, or the mean's one float).
    assert with_loss.saved_bytes - 3 * 7 * 50 * 4 == without.saved_bytes - 4


def test_hardware_presets_files_and_errors(tmp_path):
    from fullshard.planner.presets import PRESETS, resolve_hardware
    from fullshard.planner.timing import Hardware

    h100 = resolve_hardware("H100-SXM")
    assert h100.peak_flops == 989e12 and h100.intra_bw == 450e9 and h100.inter_bw == 50e9
    assert {"h100-sxm", "h200-sxm", "a100-80gb", "l40s"} <= set(PRESETS)
    # A ring over whole nodes runs one ring per NIC; HYBRID's replicate axis has one NIC.
    assert h100.link(64, True) == (400e9, h100.inter_latency)
    assert h100.link(8, True, one_per_node=True)[0] == 50e9
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"base": "a100-80gb", "inter_bw": 12.5e9}))
    custom = resolve_hardware(str(f))
    assert custom.inter_bw == 12.5e9 and custom.peak_flops == 312e12
    full = dataclasses.asdict(PRESETS["l40s"])
    f.write_text(json.dumps(full))
    assert resolve_hardware(str(f)) == PRESETS["l40s"]
    for data, match in (({"base": "tpu"}, "base 'tpu' is not a preset"),
                        ({"name": "x"}, "missing field"),
                        ({"base": "l40s", "speed": 1}, r"unknown field\(s\) \['speed'\]")):
        f.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            resolve_hardware(str(f))
    with pytest.raises(ValueError, match="Unknown hardware 'b200'"):
        resolve_hardware("b200")
    with pytest.raises(ValueError, match="overlap must be in"):
        Hardware("x", 1, 1, 1, 1, 1, 1, 1, 1, 1, overlap=2.0)
    with pytest.raises(ValueError, match="global_batch must be an int >= 1"):
        fullshard.plan("tiny", world_sizes=(2,), budget="1GiB", seq=8, global_batch=0)


def test_recommendation_kwargs_build_fsdp_and_strategy(llama70b):
    from fullshard.planner.search import CheckpointEvery

    table = llama70b
    kw = table.recommendation.fsdp_kwargs()
    assert kw["sharding_strategy"] == "FULL_SHARD" and kw["bucketing_strategy"] == "BLOCK"
    assert kw["mixed_precision"].param_dtype == torch.bfloat16
    assert {c.__name__ for c in kw["activation_checkpointing_policy"]} == {"LlamaBlock"}
    fullshard.FSDPStrategy(**table.recommendation.strategy_kwargs())  # accepted as it is
    half = next(e for e in table.search.ranked if e.config.checkpoint_every == 2)
    assert isinstance(dataclasses.replace(half, unit_classes=(nn.Linear,))
                      .fsdp_kwargs()["activation_checkpointing_policy"], CheckpointEvery)


def test_cli_search(capsys):
    argv = ["plan", "demo", "--world-sizes", "2,4", "--budget", "64MiB", "--seq", "64",
            "--global-batch", "16", "--hardware", "l40s", "--precision", "32-true,bf16-mixed"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "search:" in out and "Recommended:" in out and "tok/s/rank" in out
    assert "bf16-mixed" in out.split("search:")[1]
    assert main(["plan", "demo", "--budget", "64MiB", "--no-search"]) == 0
    assert "search:" not in capsys.readouterr().out
