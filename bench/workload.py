"""The benchmark workload (docs/BENCHMARKS.md, "Method"): seeded random voices and token sequences, and the
client-side copy of the chunk schedule that says when each chunk's tokens were all sent.

Random weights make noise-like audio whatever the tokens, so the numbers measure speed only.
Seeds are derived from (seed, purpose, index) so that batching on and off see the very same
streams at the same concurrency, and warm-up streams never reuse measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.deadlines import MAX_START_BUFFER_MS
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

# Purposes in the seed tuple: a voice for a worker, tokens for a measured stream, warm-up,
# the shape of a stream of the mixed workload.
_VOICE, _TOKENS, _WARMUP, _MIX = 1, 2, 3, 6

# The mixed workload (issue 28's "as a user would"): six voices with 2-8 s prompts; utterances
# of 1-30 s, median 6 s (log-normal); three in four streams paced like a language model at
# 40-120 tokens/s in bursts of 1-5 tokens, the rest sent at once.
MIX_PROMPT_TOKENS = (50, 75, 100, 125, 150, 200)
MIX_MEDIAN_TOKENS, MIX_SIGMA, MIX_MIN_TOKENS, MIX_MAX_TOKENS = 150, 0.8, 25, 750
MIX_PACED_SHARE, MIX_PACE_RANGE, MIX_MAX_BURST = 0.75, (40.0, 120.0), 5
MIXES = ("uniform", "mixed")


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
    # uniform: every stream has the prompt, length and pace above; mixed: each its own
    # (`StreamShape`, the MIX_ constants), whatever those three say
    mix: str = "uniform"
    # StreamConfig.start_buffer_ms each stream sends; None: unset (the gateway's default)
    start_buffer_ms: int | None = None

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
        if self.mix not in MIXES:
            raise InvalidConfig("mix", f"{self.mix!r}, want uniform or mixed")
        ms = self.start_buffer_ms
        if ms is not None and not 0 <= ms <= MAX_START_BUFFER_MS:
            raise InvalidConfig("start_buffer_ms", f"{ms}, want 0..{MAX_START_BUFFER_MS} ms")

    def shape(self, index: int) -> StreamShape:
        """Stream `index`'s voice, length and pace."""
        if self.mix == "uniform":
            return StreamShape(index, self.prompt_tokens, self.utterance_tokens, self.pace, 1)
        rng = np.random.default_rng([self.seed, _MIX, index])
        voice = int(rng.integers(len(MIX_PROMPT_TOKENS)))
        tokens = round(MIX_MEDIAN_TOKENS * float(np.exp(MIX_SIGMA * rng.standard_normal())))
        tokens = min(MIX_MAX_TOKENS, max(MIX_MIN_TOKENS, tokens))
        paced = rng.random() < MIX_PACED_SHARE
        pace = float(rng.uniform(*MIX_PACE_RANGE)) if paced else 0.0
        burst = int(rng.integers(1, MIX_MAX_BURST + 1))
        return StreamShape(voice, MIX_PROMPT_TOKENS[voice], tokens, pace, burst)

    @property
    def mean_utterance_seconds(self) -> float:
        """The mean audio length of a stream (the mixed one's over its first 4000 streams)."""
        if self.mix == "uniform":
            return self.utterance_seconds
        return float(np.mean([self.shape(i).utterance_tokens for i in range(4000)])) / TOKEN_RATE

    @property
    def longest_input_seconds(self) -> float:
        """How long the slowest stream's tokens take to send."""
        if self.mix == "uniform":
            return self.utterance_tokens / self.pace if self.pace > 0 else 0.0
        return MIX_MAX_TOKENS / MIX_PACE_RANGE[0]

    @property
    def schedule_config(self) -> ScheduleConfig:
        return SCHEDULES[self.schedule]

    @property
    def utterance_seconds(self) -> float:
        return self.utterance_tokens / TOKEN_RATE


@dataclass(frozen=True)
class StreamShape:
    voice: int  # which voice (`make_bench_voice` index); the mixed workload has six
    prompt_tokens: int
    utterance_tokens: int
    pace: float  # tokens/s; 0: all at once
    burst: int  # tokens per message when paced


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
