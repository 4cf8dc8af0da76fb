"""The time model: `Hardware` (what it needs to know about the machines) and what each unit's
compute and collectives, and the optimizer step, cost on it.

Fields (SI units: FLOP/s, bytes/s, seconds, bytes):

    peak_flops        dense matmul peak in the training dtype (bf16/fp16 tensor cores on GPUs;
                      `peak_flops_fp32` for fp32 models)
    matmul_efficiency the fraction of that peak large matmuls reach (stated, not fitted)
    mem_bandwidth     device memory bandwidth; every non-matmul op is priced as memory-bound
    mem_efficiency    the fraction of it elementwise kernels reach
    op_overhead       fixed seconds per kernel (launch / dispatch; on GPUs mostly hidden by
                      asynchronous launches, on CPUs the eager dispatcher's cost)
    attention_score_s seconds per attention score (profile.py) of a fused attention kernel,
                      forward and backward together, beyond its FLOPs at the matmul rate: the
                      softmax's exp, max and scaling per score and the kernel's blocking
                      (measured by `--hardware local`; 0 in the presets, where the FLOPs
                      dominate)
    transcendental_s  seconds per element of a transcendental elementwise op (GELU, softmax,
                      ...; profile.py), forward and backward together, beyond its bytes at
                      mem_bandwidth (measured by `--hardware local`; 0 in the presets)
    unit_overhead     fixed seconds per unit per pass for the engine's hooks and bookkeeping
    param_overhead    fixed seconds per parameter of a unit per pass (the engine's work per
                      parameter: views installed and removed, gradients handed out; 0 in
                      the presets, measured by `--hardware local`)
    regather_overhead, regather_param_overhead  the same for ZeRO-3's second gather of a unit
                      in backward (per unit, per parameter): the engine's work beyond
                      ZeRO-2's (measured by `--hardware local`, 0 in the presets)
    memory            device memory (the default budget)
    intra_bw, intra_latency  per-GPU bandwidth (one direction) and per-step latency of the
                      links inside a node (NVLink, PCIe, or loopback; on gloo the latency is
                      one pairwise exchange's fixed cost, see below)
    inter_bw, inter_latency  the same between nodes (InfiniBand / RoCE / Ethernet, per GPU)
    ranks_per_node    GPUs per node (HYBRID's default shard size; rings wider than this cross
                      the network)
    backend           the collective backend these links are driven by ('nccl', 'gloo')
    host_bw           host <-> device copies (CPU offload: PCIe), host_mem_bandwidth the host
                      memory the offloaded optimizer step streams through
    optimizer_tensor_s, optimizer_byte_s  a measured optimizer step (`--hardware local` times
                      torch's AdamW): seconds per parameter tensor and per byte of shard; 0
                      (the presets): priced from mem_bandwidth and op_overhead instead
    overlap           fraction of communication that can run while compute runs (1.0 on GPUs,
                      where collectives have their own streams and copy engines; lower on CPUs,
                      where gloo's threads share the cores with compute)
    drift_per_s, drift_max  how far ranks that share cores drift apart while they compute:
                      an exchange starts `min(drift_max, drift_per_s * c)` after it was
                      issued, `c` the compute since the ranks last waited together (the first
                      to arrive waits for the last; schedule.py). Measured by
                      `--hardware local`; 0 in the presets (a rank per GPU does not drift)

Compute, per unit and pass, from the forward profile (`profile.py`, scaled to the micro-batch):

    forward   flops / (peak * matmul_efficiency) + moved / (mem_bandwidth * mem_efficiency)
              + (scores * attention_score_s + transcendental * transcendental_s) / 3
              + ops * op_overhead + unit_overhead + params * param_overhead
    backward  twice the forward's flops and moved bytes and ops (the usual 2x: one matmul for
              the input's gradient, one for the weight's), + unit_overhead
              + params * param_overhead
    recompute one more forward in backward for a checkpointed unit
    regather  ZeRO-3 only, in backward: the engine's work to gather the unit again,
              regather_overhead + params * regather_param_overhead

(`attention_score_s` and `transcendental_s` are measured for forward and backward together,
so the forward carries a third of them and the backward, at twice the forward, the rest.)

Communication, per bucket and collective. NCCL: an alpha-beta model of a ring over `n` ranks:

    all-gather / reduce-scatter   (n - 1) * alpha + B * (n - 1) / n / bw
    all-reduce                    2 * (n - 1) * alpha + 2 * B * (n - 1) / n / bw

`B` the unsharded bytes (`n * L * dtype size`, `L` the padded shard), `bw`/`alpha` those of the
slowest hop: NVLink when the ring stays in a node, the network when it spans nodes. HYBRID's
reduce-scatter runs on the shard axis (inside a node) and its all-reduce of the shard on the
replicate axis (across nodes).

Gloo (the CPU backend): the engine's all-gathers and reduce-scatters are pairwise exchanges
(`distributed/gloo.py`): every rank posts its messages to all `n - 1` peers at once, one
round, sending `B * (n - 1) / n` (the reduce-scatter too: no all-reduce underneath), so

    all-gather / reduce-scatter   messages * alpha + B * (n - 1) / n / bw

with `alpha` one exchange's fixed cost at this `n` (what `hardware.py` measures: a small
all-gather through the engine's own path) and `messages` per peer: 1 for an exchange within
`comm.COALESCE_BYTES` per rank (packed), else one per piece above `SMALL_PIECE_BYTES`, one
for the small pieces and one for the header (the engine checks every unit's first bucket).
Small units travel together (see [Note: small units travel together] in distributed/unit_comm.py):
units of `u` bytes per rank share one exchange `floor(SMALL_UNITS_BYTES / u)` at a time, so each
pays that fraction of `alpha`.

The engine's own copies, on the compute side (memory-bound, at `mem_bandwidth`): a gather
copies the rank's own shard into the unsharded buffer (read + write `L`); gloo's
reduce-scatter sums the `n` received chunks of the rank's shard (reads `n * L`, writes `L`).

The step itself (the order of these costs on a compute and a communication timeline, the
optimizer step, the drift between ranks) is `schedule.simulate_step`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fullshard.distributed import comm
from fullshard.distributed.gloo import SMALL_PIECE_BYTES
from fullshard.distributed.unit_comm import small_units_bytes
from fullshard.planner.profile import ForwardProfile
from fullshard.planner.sizes import BucketShape, ModelStructure, PrecisionSpec, size_of


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    peak_flops_fp32: float
    matmul_efficiency: float
    mem_bandwidth: float
    memory: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    ranks_per_node: int = 8
    mem_efficiency: float = 0.7
    op_overhead: float = 0.0
    attention_score_s: float = 0.0
    transcendental_s: float = 0.0
    unit_overhead: float = 0.0
    param_overhead: float = 0.0
    regather_overhead: float = 0.0
    regather_param_overhead: float = 0.0
    overlap: float = 1.0
    drift_per_s: float = 0.0
    drift_max: float = 0.0
    backend: str = "nccl"
    host_bw: float = 25e9
    host_mem_bandwidth: float = 100e9
    optimizer_tensor_s: float = 0.0
    optimizer_byte_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"Hardware field {f.name} must be >= 0, got {v!r}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def flops_rate(self, dtype: torch.dtype) -> float:
        """Achievable matmul FLOP/s for a compute dtype."""
        peak = self.peak_flops_fp32 if dtype == torch.float32 else self.peak_flops
        return peak * self.matmul_efficiency

    def link(self, ranks: int, spans_nodes: bool, *, one_per_node: bool = False
             ) -> tuple[float, float]:
        """(bandwidth per rank, latency per step) of a ring over `ranks`.

        Inside a node: NVLink. A ring over whole nodes (FULL_SHARD over 64 ranks) runs as
        `ranks_per_node` rings at once, one per NIC (NCCL's multi-ring layout): each chunk
        enters a node once, through one of its NICs, and travels inside over NVLink, so a
        rank's effective bandwidth is `ranks_per_node * inter_bw`, capped by NVLink. A ring
        of one rank per node (HYBRID's replicate axis) has only its own NIC: `inter_bw`.
        """
        if not spans_nodes:
            return self.intra_bw, self.intra_latency
        if one_per_node:
            return self.inter_bw, self.inter_latency
        return min(self.intra_bw, self.ranks_per_node * self.inter_bw), self.inter_latency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


OPTIMIZER_KERNELS_PER_TENSOR = 12
"""Kernels torch's single-tensor AdamW runs per parameter (step count, two moment updates,
bias corrections, sqrt, division, weight decay, the update)."""

OPTIMIZER_PASSES = {2: 20, 1: 8, 0: 3}
"""Passes over a shard's bytes of torch's single-tensor step by state count: AdamW's kernels
(weight decay 2, lerp 3, mul 2, addcmul 3, sqrt 2, div 2, add 2, addcdiv 4), SGD with momentum
(mul 2, add 3, add 3), plain SGD (add 3). Scales the measured AdamW cost to other optimizers."""



@dataclass(frozen=True)
class UnitTimes:
    forward: float
    backward: float
    recompute: float
    gather: float
    """One all-gather of the unit (0 when nothing is sharded)."""
    reduce: float
    """Its gradient reduction: reduce-scatter, HYBRID/NO_SHARD all-reduce, offload copy."""
    regather: float = 0.0
    """Compute-side cost of ZeRO-3's second gather in backward (the engine's own work)."""
    share: float = 1.0
    """The fraction of one exchange the unit's collectives are (small units travel together):
    the part of an exchange's fixed costs, latency and drift, it pays."""


def _ring(nbytes: float, n: int, bw: float, alpha: float, *, all_reduce: bool = False) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = 2 if all_reduce else 1
    return k * ((n - 1) * alpha + nbytes * (n - 1) / n / bw)


def _exchange(nbytes: float, n: int, bw: float, alpha: float, messages: float) -> float:
    """Gloo's pairwise all-gather / reduce-scatter of `nbytes` unsharded (module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return messages * alpha + nbytes * (n - 1) / n / bw


def _messages(bucket: BucketShape, shard: int, element_size: int) -> int:
    """Messages per peer of one pairwise exchange of `bucket` (comm._small, gloo.py's pieces)."""
    pieces = [_piece_numel(s, shard) * element_size for s in bucket.shapes]
    if sum(pieces) <= comm.COALESCE_BYTES:
        return 1
    large = sum(1 for p in pieces if p > SMALL_PIECE_BYTES)
    return large + (1 if large < len(pieces) else 0) + 1  # + the header, a message of its own


def _piece_numel(shape: torch.Size, shard: int) -> int:
    """One parameter's padded shard: the piece gloo.py sends it as."""
    return BucketShape((shape,), torch.float32, False).padded_shard_numel(shard)


def unit_times(
    structure: ModelStructure,
    profile: ForwardProfile,
    micro_batch: int,
    mesh: tuple[int, int],
    precision: PrecisionSpec,
    hardware: Hardware,
    *,
    checkpointed: frozenset[int] = frozenset(),
    backend: str = "nccl",
    cpu_offload: bool = False,
) -> list[UnitTimes]:
    """Per-unit compute and collective times (module docstring). `checkpointed`: unit indices
    whose activations are recomputed."""
    replicate, shard = mesh
    per_node = hardware.ranks_per_node
    world = replicate * shard
    # The shard axis is the inner one: contiguous ranks, inside a node while shard <= per_node.
    shard_bw, shard_alpha = hardware.link(shard, spans_nodes=shard > per_node)
    rep_bw, rep_alpha = hardware.link(replicate, spans_nodes=world > per_node,
                                      one_per_node=shard >= per_node)
    scale = micro_batch / profile.batch
    mem = hardware.mem_bandwidth * hardware.mem_efficiency
    pairwise = backend == "gloo"
    together = small_units_bytes() if pairwise else 0
    out = []
    for i, (unit, prof) in enumerate(zip(structure.units, profile.units)):
        compute_dtype = torch.float32
        for b in unit.buckets:
            compute_dtype = precision.dtypes(b)[1]
            break
        rate = hardware.flops_rate(compute_dtype)
        work = (prof.flops / rate + prof.moved_bytes / mem
                + (prof.scores * hardware.attention_score_s
                   + prof.transcendental * hardware.transcendental_s) / 3) * scale
        params = sum(len(b.shapes) for b in unit.buckets)
        fixed = hardware.unit_overhead + hardware.param_overhead * params  # the engine's own
        regather = hardware.regather_overhead + hardware.regather_param_overhead * params
        fwd = work + prof.ops * hardware.op_overhead + fixed
        bwd = 2 * work + 2 * prof.ops * hardware.op_overhead + fixed
        # Small units share an exchange (module docstring): the fraction of alpha each pays.
        per_rank = sum(b.padded_shard_numel(shard) * size_of(precision.dtypes(b)[1])
                       for b in unit.buckets)
        share = 1.0
        if together and 0 < per_rank <= together:
            share = 1.0 / max(1, together // per_rank)
        gather = reduce = 0.0
        gather_copy = reduce_sum = 0.0  # the engine's own copies, on the compute side
        for b in unit.buckets:
            master, compute, red = precision.dtypes(b)
            flat = b.padded_shard_numel(shard)
            if cpu_offload:  # the shard comes from the host for each gather
                gather += flat * size_of(master) / hardware.host_bw
            if shard > 1:
                nbytes = shard * flat * size_of(compute)
                gather_copy += 2 * flat * size_of(compute) / mem
                if pairwise:
                    msgs = share * _messages(b, shard, size_of(compute))
                    gather += _exchange(nbytes, shard, shard_bw, shard_alpha, msgs)
                else:
                    gather += _ring(nbytes, shard, shard_bw, shard_alpha)
            if not b.requires_grad:
                continue
            if shard > 1:
                nbytes = shard * flat * size_of(red)
                if pairwise:
                    msgs = share * _messages(b, shard, size_of(red))
                    reduce += _exchange(nbytes, shard, shard_bw, shard_alpha, msgs)
                    reduce_sum += (shard + 1) * flat * size_of(red) / mem
                else:
                    reduce += _ring(nbytes, shard, shard_bw, shard_alpha)
            if replicate > 1:
                reduce += _ring(flat * size_of(red), replicate, rep_bw, rep_alpha, all_reduce=True)
            if cpu_offload:
                reduce += flat * size_of(master) / hardware.host_bw
        # ZeRO-3's second gather copies again in backward; not counted (one pass over L).
        fwd += gather_copy
        bwd += reduce_sum
        out.append(UnitTimes(fwd, bwd, fwd if i in checkpointed else 0.0, gather, reduce,
                             regather if shard > 1 else 0.0, share))
    return out


def optimizer_seconds(structure: ModelStructure, shard: int, precision: PrecisionSpec,
                      hardware: Hardware, *, states: int, cpu_offload: bool) -> float:
    """The optimizer step over each rank's shards.

    Where the hardware carries measured optimizer costs (`--hardware local` times torch's
    AdamW step itself: `optimizer_tensor_s` per parameter tensor, `optimizer_byte_s` per byte
    of shard), those: `tensors * optimizer_tensor_s + shard bytes * optimizer_byte_s`. (Off the
    GPU torch runs the single-tensor AdamW: about 12 kernels per parameter, together some 20
    passes over a shard's bytes -- three times the 7 the data-sheet model below counts.)

    Otherwise (the presets): the step streams each local element's parameter, gradient and
    state once, and launches kernels per tensor: the single-tensor Adam(W) (its default off
    the GPU) about `OPTIMIZER_KERNELS_PER_TENSOR` per parameter; on GPUs the foreach path
    groups the tensors (counted as one kernel per tensor)."""
    nbytes = 0
    for unit in structure.units:
        for b in unit.buckets:
            if b.requires_grad:
                nbytes += b.padded_shard_numel(shard) * size_of(precision.dtypes(b)[0])
    if hardware.optimizer_tensor_s or hardware.optimizer_byte_s:
        scale = OPTIMIZER_PASSES.get(states, 20) / OPTIMIZER_PASSES[2]  # measured on AdamW
        return (structure.trainable_tensors * hardware.optimizer_tensor_s
                + nbytes * hardware.optimizer_byte_s * scale)
    per_element = 3 + 2 * states if states else 3
    bw = hardware.host_mem_bandwidth if cpu_offload else hardware.mem_bandwidth
    per_tensor = OPTIMIZER_KERNELS_PER_TENSOR if hardware.backend == "gloo" or cpu_offload else 1
    launches = structure.trainable_tensors * per_tensor * hardware.op_overhead
    return nbytes * per_element / bw + launches
