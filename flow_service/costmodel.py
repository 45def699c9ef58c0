"""How long a flow batch takes, learned online from the batches the engine runs.

Batches are bucketed by (rows rounded up to a power of two, padded length rounded up to 100
frames); each bucket keeps an exponentially weighted mean of measured seconds. A bucket never
seen is estimated from a linear model, fixed overhead + padded frames / throughput, whose
throughput is itself learned (EWMA over every batch, weighted by its size, so the large
compute-bound batches dominate) and starts from a prior. Estimates are for a whole batch, all
solver steps; `step_s` is one step of it.

`capacity_frames_per_s` (padded frames of large batches per second) is what the replica
reports to the gateway's admission control. Thread-safe enough by construction: one writer
(the loop thread, after each batch), readers tolerate a stale float.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostPrior:
    overhead_s: float = 0.02  # a batch's fixed cost (launches, CFG doubling, scatter)
    frames_per_s: float = 20000.0  # padded frames per second before anything is measured
    alpha: float = 0.2  # EWMA weight of a new measurement
    frame_bucket: int = 100

    def __post_init__(self):
        if self.overhead_s < 0 or self.frames_per_s <= 0 or not 0 < self.alpha <= 1:
            raise ValueError("cost prior: want overhead >= 0, frames/s > 0, 0 < alpha <= 1")


def num_solver_steps(model) -> int:
    """Solver steps of a FlowModel (10 upstream); 10 for a stand-in without a decoder."""
    return len(getattr(getattr(model, "decoder", None), "steps", ())) or 10


class CostModel:
    """Seconds per (rows, padded length) batch; `observe()` after each batch, `estimate()`
    before forming one."""

    def __init__(self, num_steps: int, prior: CostPrior = CostPrior()):
        self.num_steps = max(1, num_steps)
        self.prior = prior
        self._buckets: dict[tuple[int, int], float] = {}  # (rows bucket, frames bucket) -> s
        self._rate = prior.frames_per_s  # padded frames / s, size-weighted EWMA
        self._rate_weight = 0.0
        self.num_observed = 0

    def _key(self, rows: int, padded_len: int) -> tuple[int, int]:
        fb = self.prior.frame_bucket
        return 1 << max(0, rows - 1).bit_length(), -(-max(1, padded_len) // fb) * fb

    def estimate(self, rows: int, padded_len: int) -> float:
        """Seconds for a batch of `rows` requests padded to `padded_len` frames."""
        seen = self._buckets.get(self._key(rows, padded_len))
        if seen is not None:
            return seen
        return self.prior.overhead_s + rows * padded_len / self._rate

    def step_s(self, rows: int, padded_len: int) -> float:
        return self.estimate(rows, padded_len) / self.num_steps

    def observe(self, rows: int, padded_len: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1:
            return
        a = self.prior.alpha
        key = self._key(rows, padded_len)
        old = self._buckets.get(key)
        self._buckets[key] = seconds if old is None else (1 - a) * old + a * seconds
        # Throughput without the fixed overhead, weighted by the batch's frames: large
        # batches say what the card does; small ones are launch-bound and say little.
        frames = rows * padded_len
        net = max(seconds - self.prior.overhead_s, seconds / 2)
        w = a * frames / (frames + 2000.0)
        self._rate = (1 - w) * self._rate + w * (frames / net)
        self._rate_weight = min(1.0, self._rate_weight + w)
        self.num_observed += 1

    @property
    def capacity_frames_per_s(self) -> float:
        """Padded frames per second in large batches; 0 before any batch was measured."""
        return self._rate if self.num_observed else 0.0
