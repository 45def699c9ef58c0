"""How long a flow batch takes, learned online from the batches the engine runs.

The shape of the cost is linear: fixed overhead + rows x padded length / throughput. Batches
are bucketed by (rows rounded up to a power of two, padded length rounded up to 100 frames);
each bucket keeps an exponentially weighted mean of measured / linear-prior seconds, so within
a bucket the estimate still scales with rows x length, and across buckets it captures what the
line misses (launch-bound small batches, CUDA graph buckets, attention's quadratic term). A
bucket never seen uses the line with the learned throughput (EWMA over every batch, weighted by
its size, so the large compute-bound batches dominate; it starts from the prior). Estimates
are for a whole batch, all solver steps; `step_s` is one step of it.

`capacity_frames_per_s` (padded frames of large batches per second) is what the replica
reports to the gateway's admission control. Thread-safe enough by construction: one writer
(the loop thread, after each batch), readers tolerate a stale float.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostPrior:
    overhead_s: float = 0.02  # a batch's fixed cost (launches, CFG doubling, scatter)
    # Padded frames per second before anything is measured: about bf16 on an H200. Only the
    # first batches use it; the learned rate replaces it as they are observed.
    frames_per_s: float = 20000.0
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
        # (rows bucket, frames bucket) -> EWMA of measured / _line(rows, frames, prior rate)
        self._buckets: dict[tuple[int, int], float] = {}
        self._rate = prior.frames_per_s  # padded frames / s, size-weighted EWMA
        self._rate_weight = 0.0
        self.num_observed = 0

    def _key(self, rows: int, padded_len: int) -> tuple[int, int]:
        fb = self.prior.frame_bucket
        return 1 << max(0, rows - 1).bit_length(), -(-max(1, padded_len) // fb) * fb

    def _line(self, rows: int, padded_len: int, rate: float) -> float:
        return self.prior.overhead_s + rows * padded_len / rate

    def estimate(self, rows: int, padded_len: int) -> float:
        """Seconds for a batch of `rows` requests padded to `padded_len` frames."""
        ratio = self._buckets.get(self._key(rows, padded_len))
        if ratio is not None:
            return ratio * self._line(rows, padded_len, self.prior.frames_per_s)
        return self._line(rows, padded_len, self._rate)

    def step_s(self, rows: int, padded_len: int) -> float:
        return self.estimate(rows, padded_len) / self.num_steps

    def observe(self, rows: int, padded_len: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1:
            return
        a = self.prior.alpha
        key = self._key(rows, padded_len)
        ratio = seconds / self._line(rows, padded_len, self.prior.frames_per_s)
        old = self._buckets.get(key)
        self._buckets[key] = ratio if old is None else (1 - a) * old + a * ratio
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
