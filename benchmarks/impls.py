"""The implementations the benchmark compares: what each is, and how it wraps and steps a model.

`IMPLS` lists them in the order each repetition runs them. An `Impl` is plain data the driver
and the report use (ranks, threads, the analytic model-state and communication figures);
`build_trainer` runs inside a rank and turns the freshly seeded `GPT` into a `Trainer` with the
implementation's forward / backward / optimizer step and a way to list the tensors that make
up its model state. Heavy imports (fullshard, FSDP2, DDP, DeepSpeed) happen only there, after
`comm_count.install()`.

Every implementation uses AdamW(lr=1e-3) with torch's other defaults and averages gradients
over the ranks, so all of them must produce the single process's losses to fp32 round-off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from gpt import GPTConfig, param_count
from torch import nn

LR = 1e-3
FULLSHARD_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
BUCKETINGS = ("NONE", "LAYER", "BLOCK")
FSDP2_REFERENCE = "fsdp2-default"
"""The FSDP2 row an implementation is compared with unless it names its own (`Impl.fsdp2`):
like with like, fullshard's default against FSDP2's default (both keep the root gathered
into backward), `reshard_after_forward=True` against True, SHARD_GRAD_OP against False."""
DDP_REFERENCE = "ddp"
LOSS_REFERENCES = ("single-t1", "single-t2")
"""Loss reference: the first of these that ran."""


@dataclass(frozen=True)
class Impl:
    name: str
    family: str
    """fullshard, fsdp2, ddp, deepspeed or single."""
    label: str
    nproc: int
    threads: int
    """torch intra-op threads per process."""
    comm_words: int
    """Analytic communication: ring bytes sent per rank and step = comm_words * Psi*(N-1)/N * 4."""
    sharded_state: bool
    """Analytic model state per rank: 16*Psi/N if True, else 16*Psi (AdamW, fp32)."""
    options: dict = field(default_factory=dict)
    root_gathered_once: bool = False
    """ZeRO-3 that keeps the root gathered into backward: one all-gather fewer of the root's
    parameters than `comm_words` counts (see `analytic_comm_words`)."""
    fsdp2: str = FSDP2_REFERENCE
    """The FSDP2 implementation this one's "/ FSDP2" ratio is taken against."""
    split_root: bool = False
    """torchtitan's units: the token embedding and the LM head units of their own, the head
    kept gathered from its forward into its backward (what it runs first), the root left
    with the position embedding and the final norm. Gathered once per step: the root and
    the head (see `analytic_comm_words`)."""


def root_numel(cfg: GPTConfig) -> int:
    """Parameters of the root unit (embeddings, final norm, head): what is not in a block."""
    d, v = cfg.dim, cfg.vocab
    return v * d + cfg.seq * d + 2 * d + d * v


def analytic_comm_words(impl: Impl, cfg: GPTConfig) -> float:
    """Ring bytes per rank and step are this * Psi*(N-1)/N * 4."""
    if impl.split_root:  # everything but the token embedding is gathered once
        return impl.comm_words - (root_numel(cfg) - cfg.vocab * cfg.dim) / param_count(cfg)
    if not impl.root_gathered_once:
        return impl.comm_words
    return impl.comm_words - root_numel(cfg) / param_count(cfg)


def _fullshard_impls() -> list[Impl]:
    words = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 2}
    fsdp2 = {"FULL_SHARD": "fsdp2-default", "SHARD_GRAD_OP": "fsdp2-noreshard",
             "NO_SHARD": FSDP2_REFERENCE}
    return [
        Impl(f"fullshard-{s.lower()}-{b.lower()}", "fullshard", f"fullshard {s}, bucketing {b}",
             nproc=2, threads=1, comm_words=words[s], sharded_state=s != "NO_SHARD",
             options={"sharding_strategy": s, "bucketing_strategy": b},
             root_gathered_once=s == "FULL_SHARD", fsdp2=fsdp2[s])
        for s in FULLSHARD_STRATEGIES for b in BUCKETINGS
    ] + [  # the root released after forward too, against FSDP2's True
        Impl("fullshard-full_shard_reshard-block", "fullshard",
             "fullshard FULL_SHARD, reshard_after_forward=True, bucketing BLOCK", nproc=2,
             threads=1, comm_words=3, sharded_state=True, fsdp2="fsdp2-reshard",
             options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK",
                      "reshard_after_forward": True})
    ] + [  # torchtitan's units, against FSDP2 wrapped the same way
        Impl("fullshard-full_shard-split", "fullshard",
             "fullshard FULL_SHARD, bucketing BLOCK, embedding and head units (head kept)",
             nproc=2, threads=1, comm_words=3, sharded_state=True, fsdp2="fsdp2-split",
             options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": "BLOCK"},
             split_root=True)
    ] + [  # the engine's own cost: one process, a group of one, against single-t1
        Impl(f"fullshard-ws1-{b.lower()}", "fullshard",
             f"fullshard FULL_SHARD, world size 1, bucketing {b}", nproc=1, threads=1,
             comm_words=0, sharded_state=False,
             options={"sharding_strategy": "FULL_SHARD", "bucketing_strategy": b})
        for b in ("NONE", "BLOCK")
    ]


IMPLS: list[Impl] = [
    Impl("single-t1", "single", "1 process, global batch, 1 thread", nproc=1, threads=1,
         comm_words=0, sharded_state=False),
    Impl("single-t2", "single", "1 process, global batch, 2 threads", nproc=1, threads=2,
         comm_words=0, sharded_state=False),
    Impl("ddp", "ddp", "torch DDP (all_reduce comm hook)", nproc=2, threads=1, comm_words=2,
         sharded_state=False),
    Impl("fsdp2-default", "fsdp2", "torch FSDP2, reshard_after_forward=None (all but the root)",
         nproc=2, threads=1, comm_words=3, sharded_state=True, root_gathered_once=True,
         options={"reshard_after_forward": None}),
    Impl("fsdp2-reshard", "fsdp2", "torch FSDP2, reshard_after_forward=True", nproc=2,
         threads=1, comm_words=3, sharded_state=True, options={"reshard_after_forward": True},
         fsdp2="fsdp2-reshard"),
    Impl("fsdp2-noreshard", "fsdp2", "torch FSDP2, reshard_after_forward=False", nproc=2,
         threads=1, comm_words=2, sharded_state=True, options={"reshard_after_forward": False},
         fsdp2="fsdp2-noreshard"),
    Impl("fsdp2-split", "fsdp2", "torch FSDP2, embedding and head units (head kept)",
         nproc=2, threads=1, comm_words=3, sharded_state=True, fsdp2="fsdp2-split",
         options={"reshard_after_forward": None}, split_root=True),
    Impl("deepspeed-z3", "deepspeed", "DeepSpeed ZeRO-3 (true ZeRO-3 knobs, no clipping)",
         nproc=2, threads=1, comm_words=3, sharded_state=True),
    *_fullshard_impls(),
]
IMPLS_BY_NAME = {impl.name: impl for impl in IMPLS}


@dataclass
class Trainer:
    """One implementation's training step, split so the worker can time the phases."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    state_tensors: Callable[[], list[torch.Tensor]]
    """This rank's params, grads and optimizer state (local tensors)."""


def build_trainer(impl: Impl, model: nn.Module, world: int, micro_batch: int) -> Trainer:
    """Wrap `model` (already seeded, on CPU) the way `impl` does and give it an optimizer.

    `world` is the number of ranks, `micro_batch` the rows each rank trains on per step.
    """
    if impl.family == "single":
        return _torch_trainer(model, model)
    if impl.family == "deepspeed":
        return _deepspeed(model, micro_batch)
    builders = {"ddp": _ddp, "fsdp2": _fsdp2, "fullshard": _fullshard}
    return builders[impl.family](impl, model, world)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _torch_state(params: Iterable[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = []
    for p in params:
        tensors.append(_local(p))
        if p.grad is not None:
            tensors.append(_local(p.grad))
    for state in opt.state.values():
        tensors.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def _torch_trainer(forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module) -> Trainer:
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    return Trainer(
        forward=forward,
        backward=lambda loss: loss.backward(),
        step=opt.step,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        state_tensors=lambda: _torch_state(params, opt),
    )


def _ddp(impl: Impl, model: nn.Module, world: int) -> Trainer:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    # The C++ reducer's own all-reduce bypasses torch.distributed's Python functions; these
    # hooks average through dist.all_reduce, so comm_count sees it. "bf16": gradients
    # all-reduced in bf16, the peer of compressed gradients: torch's `bf16_compress_hook`
    # refuses anything but CUDA/NCCL, so this calls what it runs after that check.
    def bf16_allreduce_hook(state, bucket):  # unannotated: DDP checks them
        return default_hooks._compress_hook(torch.bfloat16, state, bucket)

    hooks = {None: default_hooks.allreduce_hook, "bf16": bf16_allreduce_hook}
    ddp.register_comm_hook(None, hooks[impl.options.get("comm_hook")])
    return _torch_trainer(ddp, model)


def _fsdp2(impl: Impl, model: nn.Module, world: int) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    reshard = impl.options["reshard_after_forward"]  # None: every block resharded, not the root
    if impl.split_root:
        fully_shard(model.tok_emb, mesh=mesh, reshard_after_forward=reshard)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    if impl.split_root:
        fully_shard(model.head, mesh=mesh, reshard_after_forward=False)
    # an int (hpZ) for the blocks; the root as fullshard's, kept gathered into backward
    root_reshard = None if type(reshard) is int else reshard
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
    return _torch_trainer(model, model)


def _fullshard(impl: Impl, model: nn.Module, world: int) -> Trainer:
    from gpt import Block

    import fullshard

    options = dict(impl.options)
    if isinstance(options.get("compression"), dict):  # plain data in `Impl`, built here
        options["compression"] = fullshard.Compression(**options["compression"])
    if impl.split_root:
        units = (model.tok_emb, model.head)
        head = model.head
        model = fullshard.fsdp(
            model, device="cpu",
            auto_wrap_policy=lambda m, recurse, n: recurse or isinstance(m, Block) or m in units,
            reshard_after_forward=lambda m: False if m is head else None, **options)
    else:
        model = fullshard.fsdp(model, device="cpu", auto_wrap_policy={Block}, **options)
    return _torch_trainer(model, model)


def deepspeed_config(micro_batch: int) -> dict:
    """True ZeRO-3 (re-gather in backward) without DeepSpeed's default gradient clipping of 1.0.

    With DeepSpeed's defaults for the three stage-3 knobs a model below the 5e7-element
    prefetch bucket stays gathered from forward to backward (ZeRO-2 traffic): setting them
    to 0 is what makes it re-gather in backward.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
    }


def _deepspeed(model: nn.Module, micro_batch: int) -> Trainer:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # reuses the initialized process group
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
        config=deepspeed_config(micro_batch),
    )
    return Trainer(
        forward=engine,
        backward=engine.backward,
        step=engine.step,
        zero_grad=lambda: None,  # engine.step() zeroes the gradients
        state_tensors=lambda: _deepspeed_state(engine),
    )


def _deepspeed_state(engine: nn.Module) -> list[torch.Tensor]:
    """Param shards (`ds_tensor`), fp32 master partitions, the gradient partition buffer and
    the inner optimizer's state. Attribute names are DeepSpeed 0.19's stage-3 optimizer's."""
    opt = engine.optimizer
    tensors = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    tensors += list(getattr(opt, "fp32_partitioned_groups_flat", []))
    grad_buffer = getattr(opt, "grad_partitions_flat_buffer", None)
    if isinstance(grad_buffer, torch.Tensor):
        tensors.append(grad_buffer)
    inner = getattr(opt, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a flat bucket counts once, padding in)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
