"""The benchmark workload (docs/BENCHMARKS.md, "Method"): seeded random voices and token sequences, and the
client-side copy of the chunk schedule that says when each chunk's tokens were all sent.

Random weights make noise-like audio whatever the tokens, so the numbers measure speed only.
Seeds are derived from (seed, purpose, index) so that batching on and off see the very same
streams at the same concurrency, and warm-up streams never reuse measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.schedule import ChunkPlanner, ScheduleConfig
from token2wav import MEL_BINS, SPK_EMBED_DIM, TOKEN_MEL_RATIO, VOCAB_SIZE
from token2wav.tensors import VoiceData, make_voice
from token2wav.v1 import gateway_pb2

SCHEDULES = {"upstream": ScheduleConfig(), "blocks": ScheduleConfig.blocks()}
SCHEDULE_KINDS = {
    "upstream": gateway_pb2.SCHEDULE_KIND_UPSTREAM,
    "blocks": gateway_pb2.SCHEDULE_KIND_BLOCKS,
}

TOKEN_RATE = 25  # speech tokens per second of audio (25 Hz)

# Purposes in the seed tuple: a voice for a worker, tokens for a measured stream, warm-up.
_VOICE, _TOKENS, _WARMUP = 1, 2, 3


class InvalidConfig(ValueError):
    """A benchmark setting is out of range; `field` names it (the flag without dashes)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class WorkloadConfig:
    prompt_tokens: int = 75  # 3 s voice prompt (150 mel frames)
    utterance_tokens: int = 250  # 10 s utterances
    pace: float = 0.0  # tokens/s sent per stream, like an LLM; 0: all at once
    seed: int = 0
    audio_format: str = "pcm16"  # what a player would ask for; float32 doubles the bytes
    schedule: str = "upstream"  # the chunk schedule each stream asks for (StreamConfig)

    def __post_init__(self):
        if not 1 <= self.prompt_tokens <= 750:
            raise InvalidConfig("prompt_tokens", f"{self.prompt_tokens}, want 1..750")
        if not 1 <= self.utterance_tokens <= 7000:
            raise InvalidConfig("utterance_tokens", f"{self.utterance_tokens}, want 1..7000")
        if self.pace < 0:
            raise InvalidConfig("pace", f"{self.pace}, want >= 0 tokens/s")
        if self.audio_format not in ("pcm16", "float32"):
            raise InvalidConfig("audio_format", f"{self.audio_format!r}, want pcm16 or float32")
        if self.schedule not in SCHEDULES:
            raise InvalidConfig("schedule", f"{self.schedule!r}, want upstream or blocks")

    @property
    def schedule_config(self) -> ScheduleConfig:
        return SCHEDULES[self.schedule]

    @property
    def utterance_seconds(self) -> float:
        return self.utterance_tokens / TOKEN_RATE


def make_bench_voice(seed: int, index: int, num_prompt_tokens: int) -> VoiceData:
    """A random voice (one per closed-loop worker, or per open-loop stream)."""
    rng = np.random.default_rng([seed, _VOICE, index])
    return make_voice(
        rng.integers(0, VOCAB_SIZE, num_prompt_tokens).astype(np.int64),
        # log-mel around -5, roughly where real prompt features sit
        (rng.standard_normal((TOKEN_MEL_RATIO * num_prompt_tokens, MEL_BINS)) - 5).astype(
            np.float32
        ),
        rng.standard_normal(SPK_EMBED_DIM).astype(np.float32),
        field=f"voice[{index}]",
    )


def make_tokens(seed: int, index: int, num_tokens: int, warmup: bool = False) -> np.ndarray:
    """Utterance `index` of a run: ids uniform in 0..6560."""
    rng = np.random.default_rng([seed, _WARMUP if warmup else _TOKENS, index])
    return rng.integers(0, VOCAB_SIZE, num_tokens).astype(np.int64)


def chunk_needs(
    num_prompt_tokens: int, num_tokens: int, schedule: ScheduleConfig = ScheduleConfig()
) -> list[int | None]:
    """Per chunk seq, how many tokens must have been sent before the gateway can issue it
    (first hop, or hop, plus lookahead), or None for the final chunk, which waits for the end
    of input. The gateway's own planner replayed on the client."""
    planner = ChunkPlanner(num_prompt_tokens, schedule)
    needs: list[int | None] = []
    for n in range(1, num_tokens + 1):
        while (chunk := planner.next_call(n, ended=False)) is not None:
            needs.append(chunk.num_tokens)
    while (chunk := planner.next_call(num_tokens, ended=True)) is not None:
        needs.append(None if chunk.finalize else chunk.num_tokens)
    return needs


def poisson_arrivals(seed: int, rate: float, duration: float) -> np.ndarray:
    """Start times (s from the window start) of a Poisson process of `rate` streams/s."""
    if rate <= 0:
        raise InvalidConfig("rates", f"{rate}, want > 0 streams/s")
    rng = np.random.default_rng([seed, 4, int(rate * 1000)])
    times: list[float] = []
    t = rng.exponential(1.0 / rate)
    while t < duration:
        times.append(t)
        t += rng.exponential(1.0 / rate)
    return np.asarray(times, np.float64)
