"""`fullshard.fsdp()`: the functional door onto the engine (thunder's signature).

It validates what the user passed, builds the (replicate, shard) mesh for the strategy, and
hands everything to `engine.sharding.shard_module`. It owns no sharding logic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fullshard.api.compile_units import unwrap_for_units
from fullshard.api.frozen_gathers import check_keep_frozen_gathered, decide_keep_frozen_gathered
from fullshard.api.generation import sync_generation
from fullshard.config import (
    Compression,
    CPUOffload,
    FSDPBucketingStrategy,
    FSDPType,
    MixedPrecision,
    check_bool,
    check_ignored_states,
    resolve_bucketing_strategy,
    resolve_sharding_strategy,
)
from fullshard.distributed.mesh import build_mesh
from fullshard.engine.entry import hook_entry_points
from fullshard.engine.ignored import resolve_ignored
from fullshard.engine.runtime_lookup import is_wrapped
from fullshard.engine.sharding import shard_module
from fullshard.engine.thunder_refusal import refuse_thunder_module
from fullshard.engine.wrap import normalize_policy


def default_device() -> torch.device:
    """thunder's default: `cuda:LOCAL_RANK` when CUDA is available (the current CUDA device
    when LOCAL_RANK is unset, where thunder raises a KeyError), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    if not local_rank.isdigit() or int(local_rank) >= torch.cuda.device_count():
        raise ValueError(
            f"fsdp(device=None) places the shards on cuda:LOCAL_RANK, but LOCAL_RANK="
            f"{local_rank!r} is not one of this machine's {torch.cuda.device_count()} CUDA "
            f"devices. Pass device= explicitly or fix LOCAL_RANK."
        )
    return torch.device("cuda", int(local_rank))


def fsdp(
    model: nn.Module,
    *,
    device: torch.device | str | int | None = None,
    broadcast_from: int | None = None,
    sharding_strategy: FSDPType | str | object = FSDPType.ZERO2,
    reshard_after_forward: bool | int | None | Callable[[nn.Module], bool | None] = None,
    bucketing_strategy: FSDPBucketingStrategy | str = FSDPBucketingStrategy.NONE,
    move_state_dict_to_cpu: bool | None = None,
    auto_wrap_policy: object = None,
    mixed_precision: MixedPrecision | object | None = None,
    cpu_offload: CPUOffload | bool | object | None = None,
    activation_checkpointing_policy: object = None,
    device_mesh: object = None,
    prefetch_limit: int = 1,
    max_pending_reductions: int = 2,
    forward_prefetch: bool = True,
    backward_prefetch: bool = True,
    ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
    param_init_fn: Callable[[nn.Module], object] | None = None,
    keep_frozen_gathered: bool | None = None,
    compression: Compression | str | None = None,
) -> nn.Module:
    """Shard `model` in place over the default process group and return it.

    Args:
        device: where the shards live: 'cpu' or a CUDA device this process has (an int is a
            CUDA index); default, as thunder: `cuda:LOCAL_RANK` when CUDA is available, else
            CPU.
        broadcast_from: a global rank whose parameter and buffer values become everyone's;
            each rank receives only its own shard (one scatter per bucket).
        sharding_strategy: `FSDPType.ZERO3` / `ZERO2`, or a `ShardingStrategy` (also torch's)
            or its name: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD.
        reshard_after_forward: FSDP2's: None (default) keeps the strategy's schedule --
            ZeRO-3 (FULL_SHARD, HYBRID_SHARD) releases every unit but the root after its
            forward, the root staying gathered into backward, which runs it first; True
            releases the root too; False keeps every unit gathered until its backward (ZeRO-2's
            schedule). True with a strategy that keeps parameters gathered is a ValueError.
            An int k (FSDP2's; ZeRO++'s hpZ), e.g. the ranks per node: after its forward each
            unit but the root is kept sharded over runs of k consecutive ranks (1/k of it per
            rank), and backward gathers it within the run (the node) instead of across all
            ranks; k must divide the ranks that shard a parameter. Memory: 1/k of every unit
            stays from its forward to its backward.
            Or, as FSDP2's per-module argument, a callable `f(unit_module) -> True | False |
            None` asked once per unit at wrap (None: the strategy's default for that unit).
            E.g. with the LM head a unit of its own, `lambda m: False if m is head else None`
            keeps the head, which runs last in forward and first in backward, gathered
            between the two (torchtitan's layout), so it is gathered once per step.
        bucketing_strategy: `FSDPBucketingStrategy` NONE (a collective per parameter), LAYER
            (per leaf module) or BLOCK (per unit), or its name.
        move_state_dict_to_cpu: default of `full_state_dict(cpu_offload=...)` and of
            `model.original_state_dict()` (None: False, thunder's default).
        auto_wrap_policy: which modules become units (see `fullshard.engine.wrap`); default:
            the classes in `_no_split_modules` (Hugging Face), else the repeated blocks;
            "root" for the whole model as one unit; one class alone means `{that class}`.
        mixed_precision: `MixedPrecision` (or torch's): gather in `param_dtype`, reduce in
            `reduce_dtype`; shards, `.grad` and the optimizer stay in the parameters' dtype.
        cpu_offload: True / `CPUOffload(offload_params=True)`: shards, gradients and optimizer
            state live in host memory; each unit is copied to `device` to be gathered.
        activation_checkpointing_policy: modules (same forms as `auto_wrap_policy`) whose
            activations are recomputed in backward (non-reentrant checkpointing).
        device_mesh: HYBRID_SHARD only: `(replicate, shard)` or a 2-D `DeviceMesh`.
        prefetch_limit: units gathered ahead of the one running (0 disables prefetch).
        max_pending_reductions: units whose gradient reductions may be in flight during
            backward before the oldest is waited for.
        forward_prefetch / backward_prefetch: whether `prefetch_limit` applies in forward /
            backward (False: a unit is gathered only when it runs).
        ignored_states: submodules or parameters left alone, as torch FSDP's
            `ignored_states`: not sharded, not moved, cast or broadcast, and their gradients
            not reduced (see `fullshard.engine.ignored`).
        param_init_fn: torch FSDP's: called on each module with meta-device tensors, one unit
            at a time, instead of its `reset_parameters()` (see `fullshard.engine.materialize`).
        keep_frozen_gathered: units whose parameters are all frozen (a LoRA base) stay
            gathered from their first forward to the next optimizer step, instead of being
            gathered again in every micro-batch (and, under ZeRO-3, for their backward). True:
            always; False: never; None (auto): when they fit a quarter of the free device
            (or host) memory. The verdict: `model.fullshard_runtime.kept_frozen.reason`
            (see `fullshard.api.frozen_gathers`, `fullshard.engine.kept_frozen`).
        compression: what travels compressed on the wire: a `fullshard.Compression`
            (weights, gradients, frozen_weights: None, "bf16" or "int8"; block_size), or
            "int8" / "bf16" for all three; None (default): everything exact. The shards,
            the optimizer step and checkpoints stay full precision. Not with NO_SHARD.

    After the call, `model.named_parameters()` yields this rank's shards under the original
    names: build the optimizer afterwards. Gradients are averaged over all ranks, as DDP does.
    A `torch.compile`d model is unwrapped, its original sharded in place, every unit but the
    root gets its `forward` compiled in place with the same options, and the root comes back
    compiled with them, its own frame eager (see `fullshard.api.compile_units`: dynamo cannot
    compile a frame that loops over units, and the fragments it compiles instead cost more).
    thunder does not compose with fullshard in either order: a `thunder.jit` module in `model`
    is a TypeError here, and `thunder.jit` of the returned model one at its first forward
    (`fullshard.engine.thunder_refusal` says why; use `thunder.distributed.fsdp` for thunder).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp() expects an nn.Module, got {type(model).__name__}")
    # torch.compile'd: shard what it wraps, then compile each unit and the root again
    model, recompile = unwrap_for_units(model)
    refuse_thunder_module(model)  # before anything is sharded (engine/thunder_refusal.py)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fullshard.fsdp() needs torch.distributed to be initialized. Call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first, or launch "
            "through `fullshard run` (or Lightning's Fabric with fullshard.FSDPStrategy)."
        )
    if is_wrapped(model):
        raise ValueError(
            f"This {type(model).__name__} (or one of its submodules) is already wrapped by "
            f"fullshard. Wrap the original, unwrapped model exactly once."
        )
    plan = resolve_sharding_strategy(sharding_strategy)
    reshard_unit = None
    if callable(reshard_after_forward):
        reshard_unit, reshard_after_forward = reshard_after_forward, None
    plan = plan.with_reshard_after_forward(reshard_after_forward)
    bucketing = resolve_bucketing_strategy(bucketing_strategy)
    for name, value in (("prefetch_limit", prefetch_limit),
                        ("max_pending_reductions", max_pending_reductions)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if max_pending_reductions < 1:
        raise ValueError("max_pending_reductions must be >= 1")
    world_size = dist.get_world_size()
    if broadcast_from is not None and (
        not isinstance(broadcast_from, int) or not 0 <= broadcast_from < world_size
    ):
        raise ValueError(
            f"broadcast_from must be a global rank in [0, {world_size}), got {broadcast_from!r}"
        )
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta and broadcast_from is not None:
        raise ValueError(
            f"broadcast_from={broadcast_from} needs real values to send, but the model has "
            f"tensors on the meta device (e.g. {on_meta[0]!r}). Materialize the model on "
            f"the source rank first, or drop broadcast_from."
        )
    for name, value in (("forward_prefetch", forward_prefetch),
                        ("backward_prefetch", backward_prefetch)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be callable, got {param_init_fn!r}")
    check_bool("move_state_dict_to_cpu", move_state_dict_to_cpu, optional=True)
    check_keep_frozen_gathered(keep_frozen_gathered, "fsdp")
    normalize_policy(auto_wrap_policy)  # a malformed policy fails before anything changes
    normalize_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
    ignored = resolve_ignored(model, check_ignored_states("ignored_states", ignored_states))
    mp = MixedPrecision.coerce(mixed_precision)
    offload = CPUOffload.coerce(cpu_offload).offload_params
    wire = Compression.coerce(compression)
    resolved_device = default_device() if device is None else _as_device(device)
    mesh = build_mesh(plan, device_mesh)
    if wire is not None and mesh.shard.size == 1 and mesh.replicate.size > 1:
        raise ValueError(
            f"compression={compression!r} does not apply to NO_SHARD (a shard axis of size 1: "
            f"parameters are never gathered and gradients are all-reduced whole, as DDP). Use "
            f"FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD with a shard axis > 1, or drop "
            f"compression."
        )
    runtime = shard_module(
        model,
        mesh=mesh,
        plan=plan,
        device=resolved_device,
        bucketing=bucketing,
        auto_wrap_policy=auto_wrap_policy,
        broadcast_from=broadcast_from,
        mixed_precision=mp,
        offload=offload,
        activation_checkpointing_policy=activation_checkpointing_policy,
        prefetch_limit=prefetch_limit if forward_prefetch else 0,
        backward_prefetch_limit=prefetch_limit if backward_prefetch else 0,
        max_pending_reductions=max_pending_reductions,
        ignored=ignored,
        param_init_fn=param_init_fn,
        reshard_unit=reshard_unit,
        compression=wire,
    )
    runtime.move_state_dict_to_cpu = bool(move_state_dict_to_cpu)  # None: False (thunder)
    decide_keep_frozen_gathered(runtime, keep_frozen_gathered, resolved_device)
    # Hugging Face: `get_encoder()(...)` and the other entry points gather what they read
    # outside the root's forward; `generate()` keeps the ranks in step (synced_gpus).
    hook_entry_points(model, runtime)
    sync_generation(model, mesh.world.size)
    return recompile(model)


def _as_device(device: torch.device | str | int) -> torch.device:
    """`device=` as a torch.device the shards can live on: the CPU, or a CUDA device this
    process has (an int is a CUDA index, as in thunder). Anything else is a ValueError naming
    what is accepted -- before it, torch would fail later with `AssertionError: Torch not
    compiled with CUDA enabled` from deep inside the sharding."""
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise TypeError(
            f"device must be a torch.device, a string ('cpu', 'cuda', 'cuda:1') or a CUDA "
            f"index, got {type(device).__name__} {device!r}"
        )
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"Invalid device {device!r}: {e}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False in "
                f"this process (a CPU-only torch, or no visible GPU). Pass device='cpu' (the "
                f"gloo backend), or run where CUDA is available."
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA "
                f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})."
            )
    elif resolved.type != "cpu":
        raise ValueError(
            f"device={device!r}: fullshard keeps the shards on 'cpu' or a 'cuda' device, "
            f"not {resolved.type!r}."
        )
    return resolved
