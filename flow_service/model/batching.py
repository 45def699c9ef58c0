"""Length bucketing: split pending chunk requests into solver batches with bounded padding.

Pure function of the requests' DiT lengths (`FlowRequest.num_seq_frames`), so a scheduler can
plan without touching tensors. Cost of a batch is ~ rows x padded length (attention adds
~ rows x length^2), so the rule bounds the padded share of each batch and its total frames.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_by_length(
    seq_frames: Sequence[int],
    max_batch: int,
    max_padding: float = 0.25,
    max_batch_frames: int | None = None,
) -> list[list[int]]:
    """Indices of `seq_frames` grouped into batches, longest first.

    A request joins the current batch (whose padded length is its first, longest member)
    while the batch stays within `max_batch` requests, `max_batch_frames` padded frames
    (rows x longest; None = no cap) and a padded share <= `max_padding` of its frames.
    Every index appears exactly once; a single request always forms a batch on its own.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch: {max_batch} < 1")
    if not 0.0 <= max_padding < 1.0:
        raise ValueError(f"max_padding: {max_padding} outside [0, 1)")
    order = sorted(range(len(seq_frames)), key=lambda i: (-seq_frames[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    for i in order:
        frames = max(int(seq_frames[i]), 1)
        if current:
            rows = len(current) + 1
            padded = rows * longest
            fits = (
                rows <= max_batch
                and (max_batch_frames is None or padded <= max_batch_frames)
                and padded - (real + frames) <= max_padding * padded
            )
            if fits:
                current.append(i)
                real += frames
                continue
            groups.append(current)
        current, longest, real = [i], frames, frames
    if current:
        groups.append(current)
    return groups
