"""`fullshard.clip_grad_norm_`: the functional API's clipping by the true global norm.

On 2 and 3 real gloo ranks, a wrapped model and the unwrapped one (one process, whole global
batch) run one backward; then `fullshard.clip_grad_norm_` on the shards and
`torch.nn.utils.clip_grad_norm_` on the reference must return the same total norm (2, 1, 0.5,
and inf norms; clipping and not) and leave every local gradient shard equal to the
reference's clipped rows. OddMLP gives ranks uneven rows (some none) and a 0-dim parameter;
TinyGPT has several units and a tied weight; FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (replicated
shards must not be counted twice). A NaN on one rank raises on every rank with
`error_if_nonfinite=True` and gives NaN everywhere otherwise; a model that is not wrapped is a
ValueError naming the fix.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.testing import DistributedGroup, local_rows
from fullshard.testing.models import Block, OddMLP, TinyGPT

MODELS = {"OddMLP": (OddMLP, None), "TinyGPT": (TinyGPT, {Block})}
# (torch's norm_type=0 counts the tensors with a non-zero gradient, not the elements: not a
# norm of the concatenated gradients, so it is not compared; see clip_grad_norm_'s docstring.)
NORMS = [2.0, 1.0, 0.5, math.inf]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def group(request):
    with DistributedGroup(request.param) as g:
        yield g


def _backward(model_name: str, strategy: str):  # type: ignore[no-untyped-def]
    rank, world = dist.get_rank(), dist.get_world_size()
    make, policy = MODELS[model_name]
    torch.manual_seed(0)
    ref = make()
    model = fullshard.fsdp(copy.deepcopy(ref), device="cpu", sharding_strategy=strategy,
                           auto_wrap_policy=policy)
    x, y = ref.make_batch(2 * world, torch.Generator().manual_seed(1))
    model.loss(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
    ref.loss(x, y).backward()
    return ref, model


def _clip_equals_torch(model_name: str, strategy: str) -> list[tuple]:
    out = []
    ref, model = _backward(model_name, strategy)
    pairs = [(p, p.grad.clone()) for m in (ref, model) for p in m.parameters()]
    for norm_type in NORMS:
        for scale in (0.5, 2.0):  # max_norm below the norm (clips) and above it (does not)
            for p, g in pairs:
                p.grad.copy_(g)
            full = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf, norm_type)
            max_norm = scale * full.item()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            got = fullshard.clip_grad_norm_(model, max_norm, norm_type)
            runtime = model.fullshard_runtime
            s, r = runtime.mesh.shard.size, runtime.mesh.shard.rank
            refs = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, local_rows(refs[name].grad, s, r),
                                           rtol=1e-5, atol=1e-6, msg=f"{name} {norm_type}")
            out.append((norm_type, scale, got.item(), want.item(), got.dtype, got.dim()))
    return out


@pytest.mark.parametrize("model_name,strategy", [
    ("OddMLP", "FULL_SHARD"), ("TinyGPT", "SHARD_GRAD_OP"), ("OddMLP", "NO_SHARD"),
])
def test_clip_grad_norm_equals_torch_on_one_process(group, model_name, strategy) -> None:
    results = group.run(_clip_equals_torch, model_name, strategy)
    for rank_results in results:
        assert rank_results == results[0]  # the same norm on every rank
        for norm_type, scale, got, want, dtype, dim in rank_results:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (norm_type, scale)
            assert dtype == torch.float32 and dim == 0


def _nonfinite() -> dict:
    out = {}
    for error in (True, False):
        _, model = _backward("OddMLP", "FULL_SHARD")
        if dist.get_rank() == dist.get_world_size() - 1:
            next(p for p in model.parameters() if p.numel()).grad.view(-1)[0] = float("nan")
        try:
            out[error] = fullshard.clip_grad_norm_(model, 1.0, error_if_nonfinite=error).item()
        except RuntimeError as e:
            out[error] = str(e)
    try:
        fullshard.clip_grad_norm_(OddMLP(), 1.0)
    except ValueError as e:
        out["unwrapped"] = str(e)
    try:
        fullshard.clip_grad_norm_(model.parameters(), 1.0)  # type: ignore[arg-type]
    except TypeError as e:
        out["params"] = str(e)
    return out


def test_nonfinite_norm_raises_on_every_rank_and_misuse_is_named(group) -> None:
    for r in group.run(_nonfinite):
        assert "non-finite" in r[True] and "error_if_nonfinite=False" in r[True]
        assert math.isnan(r[False])
        assert "not wrapped by fullshard" in r["unwrapped"]
        assert "Pass the model itself" in r["params"]
