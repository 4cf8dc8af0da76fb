"""The engine's step replayed: over buffer sizes for the transient working set
(`working_set_bytes`), and over seconds for the step time (`simulate_step`).

[Note: the planner replays the engine's step]
This file is `Runtime`'s schedule (engine/hooks.py) for one step, written out again, twice:
over byte sizes and over seconds. The engine exposes no schedule to read, so a change to the
order below in hooks.py must be made in both replays here. Replayed, in order:
`Runtime.pre_forward` and `Unit.gather_ahead` (the prefetch window), `post_forward` (the release
after forward; the root is kept, see [Note: the root stays gathered] in engine/unit.py),
`_prefetch_backward_start` (see [Note: the turn from forward to backward] in
engine/hooks.py), `post_backward` with `Reductions.submit` (the `max_pending_reductions`
window) and the release, `_finalize_backward`. The gloo budgets are the engine's own
(`small_units_bytes()`; see [Note: small units travel together] in distributed/unit_comm.py).
tests/distributed/test_plan_accuracy.py compares the byte replay with the engine's
`memory_stats()["peak_unsharded_bytes"]` over real steps, so a schedule that moved shows there;
`benchmarks/plan_accuracy.py` compares the time replay with measured steps.

In the unit order root, blocks...:

forward   pre-hook of each unit: start its gather, prefetch the next `prefetch_limit` units
          (the order recorded on the previous step; none on the first step) -- on gloo more
          while the bytes in flight stay within `SMALL_UNITS_BYTES` per rank (unit_comm.py),
          refilled only when one of the next `prefetch_limit` is not in flight -- and wait.
          Post-hook: ZeRO-3 releases the unit, ZeRO-2 keeps it. The root's post-hook runs last.
backward  ZeRO-3 (with S > 1): the root is gathered again first (the LM head is the last op of
          forward), then each block in reverse, each gather prefetching the next
          `prefetch_limit` in the recorded backward order (the same window). When a unit's
          gradients are complete its buckets are packed and their reductions issued -- on
          gloo held back until the batch would pass `SMALL_UNITS_BYTES` -- those of at most
          `max_pending_reductions` issues stay in flight, so the one being packed can be the
          (max_pending_reductions + 1)-th; then the unit is released. The root's gradients
          complete last (its embedding is the first op of forward). ZeRO-2 and S == 1 (where
          autograd itself keeps whatever it saved) gather nothing in backward and release
          each unit after reducing it.

The working set: what is counted is exactly what the engine counts in `memory_stats()`
(`engine/bucket.py`, `track`): every buffer a bucket allocates beyond the shards and the
`.grad` storage, from its allocation until it is freed. Per bucket, with `L` its padded flat
shard on `S` shard ranks and `c` / `r` the compute / reduce dtype sizes:

    gathered   S * L * c   the all-gather output the modules compute with (S == 1: the shard
                           itself, counted only when cast to another dtype, then L * c)
    send       L * c       the shard cast to the compute dtype (mixed precision), alive until
                           its all-gather has completed
    copy-out   S * L * c   NCCL only, buckets of several parameters: the rank-major output and
                           its parameter-major copy coexist for a moment (gloo lands each
                           parameter's rows in place, so there is none)
    reduce     S * L * r   the packed gradients a reduce-scatter sends (trainable, S > 1; with
                           S == 1 the packed gradients become the `.grad` storage itself);
                           gloo sends from the unsharded gradients themselves, held until the
                           reduction is done: numel * r, no padding

The working set is the peak of the running sum, over the first step and a later one (with
prefetching); roughly, ZeRO-3 holds the root plus `prefetch_limit + 1` blocks plus up to
`max_pending_reductions + 1` units' reduce inputs, and ZeRO-2 the whole model gathered plus one
reduce input.

Not counted (they are not the engine's): autograd's unsharded gradients of the unit whose
backward is running (reported separately as `backward_scratch_bytes`: the root's plus the
largest other unit's, in the compute dtype), the activations, gloo's reduce-scatter receive
scratch, and NO_SHARD's reduce-dtype copy of the gradients under mixed precision.

The step time: the same order on two timelines, compute and one FIFO communication queue,
over the per-unit costs of `timing.py`. Forward: the root's pre-hook issues its gather and
prefetches the next `prefetch` units; each unit's pre-hook tops the window up and waits for its
own gather. Backward (ZeRO-3): the root stays gathered from its forward (the default
`reshard_after_forward=None`; a root that reshards is gathered again first), each block is
gathered again with the same prefetch window;
a unit's reduce-scatter (and HYBRID all-reduce) is queued when its backward is done, and with
more than `max_pending_reductions` in flight compute waits for the oldest. The root's gradients
complete last (the embedding is the first op of forward), so its reduction is exposed. Then the
optimizer step (`timing.optimizer_seconds`).

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

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from fullshard.planner.sizes import ModelStructure, PrecisionSpec, size_of
from fullshard.planner.timing import UnitTimes

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class BucketCost:
    gathered: int
    send: int
    copy_out: int
    reduce: int
    exchanged: int = 0
    """Bytes this rank sends per peer to gather the bucket (gloo batches by these)."""
    reduced: int = 0
    """Bytes of this rank's reduced shard (gloo batches reductions by these)."""


@dataclass(frozen=True)
class UnitCost:
    buckets: tuple[BucketCost, ...]
    trainable: bool


def unit_costs(
    structure: ModelStructure, shard_size: int, precision: PrecisionSpec, backend: str
) -> list[UnitCost]:
    """Byte sizes of every unit's transient buffers at this shard size (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    s = shard_size
    units = []
    for unit in structure.units:
        costs = []
        for b in unit.buckets:
            master, compute, reduce = precision.dtypes(b)
            flat = b.padded_shard_numel(s)
            cast = flat * size_of(compute) if compute != master else 0
            if s == 1:
                costs.append(BucketCost(cast, 0, 0, 0))
                continue
            gathered = s * flat * size_of(compute)
            copy_out = gathered if backend == "nccl" and len(b.shapes) > 1 else 0
            # NCCL packs the gradients (padding included); gloo holds them as they are.
            held = b.numel if backend == "gloo" else s * flat
            reduce_bytes = held * size_of(reduce) if b.requires_grad else 0
            costs.append(BucketCost(gathered, cast, copy_out, reduce_bytes,
                                    exchanged=flat * size_of(compute),
                                    reduced=flat * size_of(reduce) if b.requires_grad else 0))
        units.append(UnitCost(tuple(costs), unit.trainable))
    return units


def backward_scratch_bytes(structure: ModelStructure, precision: PrecisionSpec) -> int:
    """Autograd's unsharded gradients alive during backward: the root's (complete only at the
    end) plus the largest other unit's, in the compute dtype."""
    sizes = []
    for unit in structure.units:
        total = 0
        for b in unit.buckets:
            if b.requires_grad:
                total += b.numel * size_of(precision.dtypes(b)[1])
        sizes.append(total)
    return sizes[0] + max(sizes[1:], default=0)


def working_set_bytes(
    units: Sequence[UnitCost],
    *,
    reshard_after_forward: bool,
    shard_size: int,
    prefetch_limit: int,
    max_pending_reductions: int = 2,
    batch_bytes: int = 0,
) -> int:
    """Peak transient bytes over a step (the larger of the first step and a later one).
    `batch_bytes`: gloo's `unit_comm.small_units_bytes()` (small units' exchanges go together), 0
    for NCCL or S == 1."""
    return max(
        _Replay(units, reshard_after_forward and shard_size > 1, prefetch_limit,
                max_pending_reductions, warm=warm,
                batch_bytes=batch_bytes if shard_size > 1 else 0).run()
        for warm in (False, True)
    )


class _Replay:
    def __init__(self, units: Sequence[UnitCost], zero3: bool, prefetch_limit: int,
                 max_pending: int, *, warm: bool, batch_bytes: int) -> None:
        self.units = units
        self.batch_bytes = batch_bytes
        self.batch: list[int] = []  # deferred reductions' held bytes (engine: _reduce_batch)
        self.batch_out = 0
        self.zero3 = zero3
        self.prefetch = prefetch_limit
        self.max_pending = max_pending
        self.warm = warm
        self.live = self.peak = 0
        self.state = ["sharded"] * len(units)
        self.sending = [False] * len(units)
        self.exchange: list[list[int]] = [[] for _ in units]
        self.pending: collections.deque[list[int]] = collections.deque()  # per issue

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    # -- the engine's bucket operations ----------------------------------------------------------
    def start(self, i: int, exchange: list[int] | None = None) -> None:
        """Issue unit i's gather; `exchange`: the units whose gathers travel with it."""
        if self.state[i] != "sharded":
            return
        for b in self.units[i].buckets:
            self._add(b.send + b.gathered)
        self.state[i] = "gathering"
        self.sending[i] = True
        self.exchange[i] = exchange or [i]

    def _sent(self, i: int) -> None:
        """The exchange carrying unit i completed: its cast inputs are dropped."""
        if self.sending[i]:
            self.live -= sum(b.send for b in self.units[i].buckets)
            self.sending[i] = False

    def wait(self, i: int) -> None:
        self.start(i)
        if self.state[i] == "gathering":
            for j in self.exchange[i]:  # waiting for one waits for the whole exchange
                self._sent(j)
            for b in self.units[i].buckets:
                self._add(b.copy_out)
                self.live -= b.copy_out
            self.state[i] = "gathered"

    def release(self, i: int) -> None:
        if self.state[i] == "sharded":
            return
        self._sent(i)
        for b in self.units[i].buckets:
            self.live -= b.gathered
        self.state[i] = "sharded"

    def reduce(self, i: int) -> None:
        """hooks.Runtime.post_backward (Reductions.submit): into the batch, issued when another
        unit of this size would not fit; `max_pending` issues in flight."""
        held = [b.reduce for b in self.units[i].buckets if b.reduce]
        out = sum(b.reduced for b in self.units[i].buckets if b.reduce)
        for nbytes in held:
            self._add(nbytes)
        self.batch += held
        self.batch_out += out
        if self.batch and self.batch_out + out > self.batch_bytes:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self.pending.append(self.batch)
            self.batch, self.batch_out = [], 0
        while len(self.pending) > self.max_pending:
            self.live -= sum(self.pending.popleft())

    def gather_ahead(self, i: int, order: list[int], limit: int) -> None:
        """hooks.Runtime._gather_ahead: unit i plus the next `limit` units of `order` and, with
        batching, more while the bytes in flight stay within `batch_bytes`; refilled only
        when one of the next `limit` is not in flight."""
        window: list[int] = []
        if limit > 0 and i in order:
            nbytes = self._exchanged(i)
            for j in order[order.index(i) + 1 :]:
                if j == i or j in window:
                    continue
                if len(window) >= limit and nbytes + self._exchanged(j) > self.batch_bytes:
                    break
                window.append(j)
                nbytes += self._exchanged(j)
        if self.state[i] != "sharded" and all(self.state[j] != "sharded" for j in window[:limit]):
            return
        self.start_together([j for j in [i, *window] if self.state[j] == "sharded"])

    def start_together(self, todo: list[int]) -> None:
        """Unit.start_gather_with: the gathers of `todo`, issued at once."""
        buckets = sum(len(self.units[j].buckets) for j in todo)
        together = buckets > 1 and sum(self._exchanged(j) for j in todo) <= self.batch_bytes
        for j in todo:  # comm.all_gather_batch sends small ones as one exchange
            self.start(j, todo if together else None)

    def _exchanged(self, i: int) -> int:
        return sum(b.exchanged for b in self.units[i].buckets)

    # -- one step ----------------------------------------------------------------------------------
    def run(self) -> int:
        n = len(self.units)
        forward = list(range(n))
        for i in forward:
            self.gather_ahead(i, forward if self.warm else [], self.prefetch)
            self.wait(i)
            if i != 0:
                self._post_forward(i)
        self._post_forward(0)
        backward = [0, *reversed(forward[1:])]  # the order gathers happen in backward
        recorded = backward if self.warm else list(reversed(forward))  # the prefetch order
        if self.zero3 and self.prefetch > 0:
            # hooks.Runtime._prefetch_backward_start: the root's post-hook starts the first
            # units backward needs. See [Note: the turn from forward to backward] in
            # engine/hooks.py.
            first = [j for j in recorded if self.state[j] == "sharded"]
            self.start_together(first[: self.prefetch])
        for i in backward:
            if self.zero3 and self.state[i] != "gathered":
                self.gather_ahead(i, recorded, self.prefetch)
                self.wait(i)
            if i != 0:
                self._post_backward(i)
        self._post_backward(0)
        self.flush()
        while self.pending:
            self.live -= sum(self.pending.popleft())
        for i in range(n):
            self.release(i)
        assert self.live == 0, self.live
        return self.peak

    def _post_forward(self, i: int) -> None:
        # The engine also releases units without trainable parameters here, but without the
        # ZeRO-3 saved-tensor hooks autograd keeps what it saved of them until backward.
        if self.zero3:
            self.release(i)

    def _post_backward(self, i: int) -> None:
        if not self.units[i].trainable and self.zero3:
            return  # no gradients: stays gathered until the end of backward
        self.reduce(i)
        self.release(i)


# -- the step over seconds ------------------------------------------------------------------------
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
