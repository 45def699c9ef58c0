"""When each chunk of a stream is needed: the playback deadlines the gateway sends downstream.

The model is a player that starts the moment the first audio reaches the client and pauses
whenever it runs dry. A chunk is needed when the audio before it has played out:

  first chunk     tokens in (ready_at) + first_chunk_target
  chunk k         play_end + (audio position of chunk k - audio delivered), where play_end is
                  when the audio sent so far runs out (each send: max(play_end, now) + its
                  length); before the first send, play_end is when the first chunk's tokens
                  came: the player may start as soon as a fast first chunk is there, and a
                  deadline counted from the first chunk's target would be late for every
                  stream whose first chunk beats it (the flow scheduler moves a stream's later
                  deadlines back when its first chunk comes late: Scheduler.finished)
  late tokens     a chunk whose tokens came in after that point cannot be on time whatever the
                  back end does (the player has stalled on the input): it is needed as fast as
                  the stream's first chunk came (tokens in -> audio out, measured at its send;
                  first_chunk_target until then). The player is silent meanwhile, and the
                  bench counts every ms beyond that latency as stall the stack added, so the
                  target (a bound for first chunks) would grant such a chunk a stall of up to
                  target - first-chunk latency that the stream is then judged late for

A start buffer (`--start-buffer-ms`) holds a paced stream's first audio in the gateway; the
player then starts later than the deadlines above assume until that first send, which only
makes them earlier than needed (safe), and from the send on `play_end` is the real one.

The deadline sent to the flow and vocoder services is that time minus `margin` (transport,
vocoder step, client buffering), as slack: milliseconds from the send (see flow.proto).
Audio position counts what the vocoder really delivers: it holds back the last
`VOCODER_HOLDBACK_FRAMES` mel frames of each chunk until the next one comes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.schedule import FlowCall
from token2wav import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKEN_MEL_RATIO

# vocoder_service.model.config.HOLDBACK_FRAMES (a test keeps them equal; the gateway does not
# import the vocoder's model code).
VOCODER_HOLDBACK_FRAMES = 8
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE
# StreamConfig.start_buffer_ms's bound: a start buffer past 2 s is a client bug, not a latency
# choice.
MAX_START_BUFFER_MS = 2000


@dataclass(frozen=True)
class DeadlineConfig:
    first_chunk_target_s: float = 0.15  # a first chunk is needed this long after its tokens
    # Subtracted from every playback deadline before it goes downstream: room for the vocoder
    # step that follows the flow call, and transport (the vocoder's urgent slack, 100 ms, is the
    # first-chunk target less this).
    margin_s: float = 0.05

    def __post_init__(self):
        if self.first_chunk_target_s <= 0:
            raise ValueError("--first-chunk-target-ms: want > 0")
        if self.margin_s < 0:
            raise ValueError("deadline margin_s: want >= 0")


def audio_position_s(chunk: FlowCall) -> float:
    """Seconds of audio the client has received before chunk `chunk`'s audio starts."""
    if chunk.seq == 0:
        return 0.0
    frames = TOKEN_MEL_RATIO * chunk.token_offset - VOCODER_HOLDBACK_FRAMES
    return max(0, frames) * FRAME_S


class PlaybackClock:
    """One stream's player, as the gateway sees it (see the module docstring)."""

    def __init__(self, config: DeadlineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.first_needed: float | None = None  # when the first chunk is needed
        self.play_end: float | None = None  # when the audio sent so far runs out
        self.delivered_s = 0.0
        self.first_latency: float | None = None  # first chunk's tokens in -> its audio sent

    def needed_at(self, chunk: FlowCall, ready_at: float, project: bool = False) -> float:
        """When the client needs chunk `chunk` whose tokens were all in at `ready_at`. The
        first call fixes when playback is expected to start, unless `project` (an estimate for
        chunks whose tokens have not come yet)."""
        target = self.config.first_chunk_target_s
        first = self.first_needed if self.first_needed is not None else ready_at + target
        if not project:
            self.first_needed = first
        if chunk.seq == 0:
            return first
        base = self.play_end if self.play_end is not None else first - target
        needed = base + audio_position_s(chunk) - self.delivered_s
        late_tokens = self.first_latency if self.first_latency is not None else target
        return max(needed, ready_at + late_tokens)

    def due(self, chunk: FlowCall, ready_at: float, project: bool = False) -> float:
        """The deadline sent downstream: needed_at minus the margin."""
        return self.needed_at(chunk, ready_at, project) - self.config.margin_s

    def sent(self, audio_s: float) -> None:
        """`audio_s` seconds of audio went to the client now."""
        now = self.clock()
        if self.play_end is None and self.first_needed is not None:
            self.first_latency = now - (self.first_needed - self.config.first_chunk_target_s)
        self.play_end = max(self.play_end if self.play_end is not None else now, now) + audio_s
        self.delivered_s += audio_s


def slack_ms(due: float, now: float) -> int:
    """The wire form: whole ms from now, clamped to int32."""
    if math.isinf(due):
        raise ValueError("no deadline")
    return int(max(-(2**31), min(2**31 - 1, math.floor((due - now) * 1e3))))
