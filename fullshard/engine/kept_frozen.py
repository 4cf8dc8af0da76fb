"""Units with nothing trainable kept gathered across micro-batches (`keep_frozen_gathered`).

[Note: frozen units stay gathered]
A unit whose parameters are all frozen (a LoRA base) gets no gradient, so nothing ever
writes its shards during training: its gathered copy stays valid. Under gradient
accumulation without `no_sync()` (each micro-batch reduces its gradients; what a loop that
calls backward N times and then steps does) the usual rule would release it after each
micro-batch's forward and, under ZeRO-3, gather it again for backward (its inputs' gradients
need its weights): per optimizer step of N micro-batches, 2N gathers under ZeRO-3, N under
ZeRO-2. With
`keep_frozen_gathered` on (FSDP2's `set_reshard_after_backward(False)`, made automatic for
frozen units) such a unit is gathered once and kept until a release point:

- its shards were written (a load, an edit under no_grad): `Unit.reshard_if_stale`;
- `reset_step` (a failed step, `model.zero_grad()`, a load, the user's own call);
- one of its parameters becomes trainable (`Unit.refresh_requires_grad`): from then on the
  unit follows the strategy's rule;
- an optimizer step: right after it (`release`, called by a step post-hook that api/
  registers for optimizers holding the model's shards); else, for an update made without a
  `torch.optim.Optimizer`, at the next root forward, which finds the model's trainable
  shards written since the last one (`release_if_stepped`: their version counters, one int
  per trainable bucket; the copy then lives until that forward). Either way a frozen unit is
  gathered once per optimizer step, not once per micro-batch;
- the option switched off (`enable(False, ...)`).

Frozen parameters are never reduced either way (a unit with nothing trainable has no
`GatheredParams` node; its buckets are not in `Unit.routing`). Memory: every kept unit's
unsharded buffer, counted by `bucket.track` as any gathered buffer, for the whole optimizer
step (with a shard axis of size 1 only the mixed-precision copy, if any: the shards are the
data); whether that fits is decided above the engine (api/frozen_gathers.py), which hands
down a plain bool. A forward without grad (evaluation) keeps them too: they are as valid
for the next training forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from fullshard.engine.unit import Reshard, Unit


class KeptFrozenUnits:
    """The model-wide switch and the step boundary of [Note: frozen units stay gathered]."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = list(units)
        self.enabled = False
        self.reason = "off: not decided yet"  # why on or off, for users (`enable`)
        self._seen_versions: dict[int, int] = {}  # id(trainable bucket) -> shard version

    def enable(self, on: bool, reason: str) -> None:
        """Keep frozen units gathered (`on`) or follow the strategy's rule for them; `reason`
        says why, e.g. which budget auto compared against."""
        self.enabled, self.reason = on, reason
        for u in self.units:
            u.keep_frozen_gathered = on
        if not on:
            self.release()

    def frozen_unsharded_bytes(self) -> int:
        """Bytes per rank that the units with nothing trainable (at the present flags) hold
        while gathered."""
        return sum(u.unsharded_nbytes for u in self.units if u.buckets and not u.trainable_params)

    def kept(self) -> list[Unit]:
        """The units held gathered now by this rule."""
        return [u for u in self.units if u.keeps_gathered and u.in_flight]

    def release(self) -> None:
        """Drop every kept copy now (the optimizer stepped, or memory is wanted)."""
        for u in self.kept():
            u.reshard(Reshard.NOW)

    def release_if_stepped(self) -> None:
        """At the root's pre-forward: drop the kept copies if the model's trainable shards
        were written since the last root forward (an optimizer step, as seen from here). A
        bucket trainable now and not then (requires_grad flipped) is no sign of a step."""
        if not self.enabled:
            return
        seen = self._seen_versions
        now = {id(b): b.shard_flat._version for u in self.units for b, _ in u.routing}
        self._seen_versions = now
        if any(seen.get(key, version) != version for key, version in now.items()):
            self.release()
