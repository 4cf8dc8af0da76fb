"""The time model: step time, tokens/s and exposed communication of one configuration.

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
(`distributed/pairwise.py`): every rank posts its messages to all `n - 1` peers at once, one
round, sending `B * (n - 1) / n` (the reduce-scatter too: no all-reduce underneath), so

    all-gather / reduce-scatter   messages * alpha + B * (n - 1) / n / bw

with `alpha` one exchange's fixed cost at this `n` (what `hardware.py` measures: a small
all-gather through the engine's own path) and `messages` per peer: 1 for an exchange within
`comm.COALESCE_BYTES` per rank (packed), else one per piece above `SMALL_PIECE_BYTES`, one
for the small pieces and one for the header (the engine checks every unit's first bucket).
Small units travel together (see [Note: small units travel together] in engine/small_units.py):
units of `u` bytes per rank share one exchange `floor(SMALL_UNITS_BYTES / u)` at a time, so each
pays that fraction of `alpha`.

The engine's own copies, on the compute side (memory-bound, at `mem_bandwidth`): a gather
copies the rank's own shard into the unsharded buffer (read + write `L`); gloo's
reduce-scatter sums the `n` received chunks of the rank's shard (reads `n * L`, writes `L`).

Schedule: a replay of `engine/hooks.py` on two timelines, compute and one FIFO communication
queue (see [Note: the planner replays the engine's step] in planner/working_set.py). Forward:
the root's pre-hook issues its gather and prefetches the next `prefetch` units; each unit's
pre-hook tops the window up and waits for its own gather. Backward (ZeRO-3): the
root stays gathered from its forward (the default `reshard_after_forward=None`; a root that
reshards is gathered again first), each block is gathered again with the same prefetch window;
a unit's reduce-scatter (and HYBRID all-reduce) is queued when its backward is done, and with
more than `max_pending_reductions` in flight compute waits for the oldest. The root's gradients
complete last (the embedding is the first op of forward), so its reduction is exposed. Then the
optimizer step (`optimizer_seconds`).

Ranks that share cores (more ranks than cores, or a loaded machine) drift apart while they
compute, and an exchange completes only when the last of them reaches it: each exchange
starts `min(drift_max, drift_per_s * c)` after it was issued, `c` the compute since the ranks
last waited together (the last exchange compute waited for; at the start, the optimizer step),
or when the queue is free, whichever is later; small units that travel together pay their
share of it, as of the latency. Behind a large unit's compute or a busy queue the drift is
hidden; small units wait for it (`benchmarks/sync_cost.py`: 3 ranks on 2 cores
drift 3 ms in 9 ms of compute, 11 ms in 38).

Compute waits are the *exposed* communication. On CPUs the hidden part still costs
`(1 - overlap)` of its time (gloo's threads take cores from compute). Gradient accumulation over
`M` micro-batches either reduces every micro-batch or, under `no_sync`, only the last one (the
earlier ones gather but do not reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fullshard.distributed import comm
from fullshard.distributed.pairwise import SMALL_PIECE_BYTES
from fullshard.engine.small_units import small_units_bytes
from fullshard.planner.hardware import Hardware
from fullshard.planner.profile import ForwardProfile
from fullshard.planner.sizes import BucketShape, ModelStructure, PrecisionSpec, size_of

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


@dataclass(frozen=True)
class StepTime:
    step: float
    """Seconds per optimizer step (all micro-batches)."""
    compute: float
    comm: float
    """Communication time per step, hidden or not."""
    exposed: float
    """Communication compute waited for (plus the CPU cost of the hidden part)."""
    optimizer: float
    tokens_per_step: int
    first_gather: float = 0.0
    last_reduce: float = 0.0
    starved_units: list[str] = field(default_factory=list)
    """Units whose gather takes longer than the compute it hides behind."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step if self.step > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"step_s": self.step, "compute_s": self.compute, "comm_s": self.comm,
                "exposed_comm_s": self.exposed, "optimizer_s": self.optimizer,
                "tokens_per_s": self.tokens_per_s, "first_gather_s": self.first_gather,
                "last_reduce_s": self.last_reduce, "starved_units": list(self.starved_units)}


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
    """Messages per peer of one pairwise exchange of `bucket` (comm._small, pairwise's pieces)."""
    pieces = [_piece_numel(s, shard) * element_size for s in bucket.shapes]
    if sum(pieces) <= comm.COALESCE_BYTES:
        return 1
    large = sum(1 for p in pieces if p > SMALL_PIECE_BYTES)
    return large + (1 if large < len(pieces) else 0) + 1  # + the header, a message of its own


def _piece_numel(shape: torch.Size, shard: int) -> int:
    """One parameter's padded shard: the piece pairwise.py sends it as."""
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


class _Queue:
    """One FIFO communication queue: a collective starts when issued and the previous is done."""

    def __init__(self) -> None:
        self.free = 0.0
        self.busy = 0.0

    def issue(self, at: float, duration: float) -> float:
        start = max(self.free, at)
        self.free = start + duration
        self.busy += duration
        return self.free


def simulate_step(
    times: list[UnitTimes],
    *,
    zero3: bool,
    root_regathered: bool = False,
    prefetch: int = 1,
    max_pending_reductions: int = 2,
    micro_batches: int = 1,
    no_sync: bool = True,
    optimizer: float = 0.0,
    overlap: float = 1.0,
    drift: tuple[float, float] = (0.0, 0.0),
    tokens_per_micro_batch: int = 0,
    names: list[str] | None = None,
) -> StepTime:
    """Replay one optimizer step (module docstring) and return its timing. `drift`:
    (drift_per_s, drift_max) of the hardware."""
    q = _Queue()
    t = 0.0
    compute = 0.0
    waited = 0.0  # compute waiting for exchanges, drift included
    waited_on_queue = 0.0  # the part of it spent on the exchanges' own time (not hidden)
    drift_per_s, drift_max = drift
    met = -optimizer  # when the ranks last waited together: the previous step's last reduction

    def done(at: float, duration: float, share: float) -> tuple[float, float]:
        """(when an exchange issued at `at` completes, its time on the queue): it starts once
        the last rank has reached it, `at` plus the drift since the ranks last met (a small
        unit's `share` of it: one drift per exchange), and the queue is free (so behind a
        busy queue the drift costs nothing)."""
        late = share * min(drift_max, drift_per_s * max(at - met, 0.0))
        return q.issue(at + late, duration), duration

    def block(exchange: tuple[float, float]) -> None:
        """Compute waits for an exchange: the ranks meet when it completes."""
        nonlocal t, waited, waited_on_queue, met
        until, duration = exchange
        if until > t:
            waited += until - t
            waited_on_queue += min(until - t, duration)
            t = met = until

    first_gather = times[0].gather if times else 0.0
    starved: set[int] = set()
    last_reduce = 0.0
    n = len(times)
    blocks = list(range(1, n))
    gathered_until: dict[int, tuple[float, float]] = {}  # unit -> done() of its gather

    def issue(j: int, at: float) -> None:
        if j not in gathered_until:
            gathered_until[j] = done(at, times[j].gather, times[j].share)

    def wait(j: int) -> None:
        if gathered_until[j][0] > t and j != 0:
            starved.add(j)
        block(gathered_until[j])

    for m in range(micro_batches):
        reduce_now = m == micro_batches - 1 or not no_sync
        gathered_until.clear()  # every unit is sharded between micro-batches

        # -- forward: root, blocks in order, the root's head last -----------------------------
        order = [0, *blocks]
        for k, i in enumerate(order):
            issue(i, t)
            for j in order[k + 1 : k + 1 + prefetch]:
                issue(j, t)
            wait(i)
            if i != 0:
                t += times[i].forward
                compute += times[i].forward
                if zero3:
                    del gathered_until[i]
        t += times[0].forward
        compute += times[0].forward
        # -- backward: root's head, blocks reversed, root's embedding -------------------------
        pending: list[tuple[float, float]] = []
        if zero3 and root_regathered:
            gathered_until.pop(0, None)
        border = [0, *reversed(blocks)]
        for k, i in enumerate(border):
            # ZeRO-2 / NO_SHARD / the kept root: still gathered, nothing is issued.
            issue(i, t)
            for j in border[k + 1 : k + 1 + prefetch]:
                issue(j, t)
            wait(i)
            if i == 0:
                continue  # the root's backward finishes last, below
            work = times[i].backward + times[i].recompute + (times[i].regather if zero3 else 0.0)
            t += work
            compute += work
            if reduce_now:
                while len(pending) >= max_pending_reductions + 1:
                    block(pending.pop(0))
                pending.append(done(t, times[i].reduce, times[i].share))
        work = times[0].backward + times[0].recompute
        if zero3 and root_regathered:
            work += times[0].regather
        t += work
        compute += work
        if reduce_now:
            last_reduce = times[0].reduce
            block(done(t, times[0].reduce, times[0].share))
        if pending:  # the drift can end an earlier reduction after the root's
            block(max(pending))  # tuples: by completion
        t = max(t, q.free)
    hidden = max(0.0, q.busy - waited_on_queue)
    exposed = waited + (1.0 - overlap) * hidden
    step = t + (1.0 - overlap) * hidden + optimizer
    labels = names or [str(i) for i in range(n)]
    return StepTime(step, compute, q.busy, exposed, optimizer,
                    tokens_per_micro_batch * micro_batches, first_gather, last_reduce,
                    [labels[i] for i in sorted(starved)])
