"""Prometheus metrics of the gateway (calls by status code come from the bootstrap)."""

from prometheus_client import Counter, Gauge, Histogram

ACTIVE_STREAMS = Gauge("t2w_gateway_active_streams", "Synthesize streams open now")
STREAMS = Counter("t2w_gateway_streams_total", "Finished streams by outcome", ["outcome"])
FIRST_CHUNK = Histogram(
    "t2w_gateway_first_chunk_seconds",
    "First chunk's tokens complete -> its audio sent",
    buckets=(0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 1, 2, 5, 10),
)
STREAM_SECONDS = Histogram(
    "t2w_gateway_stream_seconds", "Stream duration", buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300)
)
ADMISSION_REFUSED = Counter(
    "t2w_gateway_admission_refused_total",
    "Streams refused because the flow capacity estimate said admitted streams would be late",
)
FLOW_CAPACITY = Gauge(
    "t2w_gateway_flow_capacity_frames_per_second",
    "Flow capacity admission plans with: replicas' reports summed, times --admission-headroom",
)
ADMISSION_FACTOR = Gauge(
    "t2w_gateway_admission_feedback_factor",
    "Share of the flow capacity estimate admission trusts after late chunks (1: all of it)",
)
AUDIO_SECONDS = Counter("t2w_gateway_audio_seconds_total", "Audio seconds sent to clients")


def count_audio(num_samples: int, sample_rate: int) -> None:
    """Audio sent to a client, counted in seconds of its output rate."""
    AUDIO_SECONDS.inc(num_samples / sample_rate)


VOCODER_FAILOVERS = Counter(
    "t2w_gateway_vocoder_failovers_total",
    "Streams moved to another vocoder session (mel replayed) after losing theirs, by reason",
    ["reason"],
)
RETRIES = Counter(
    "t2w_gateway_flow_retries_total",
    "Flow calls retried on another replica, and retries refused by the retry budget",
    ["outcome"],
)
FRONTEND_PENDING = Gauge(
    "t2w_gateway_frontend_pending", "Prompt recordings being made into voices or waiting to be"
)
FRONTEND_CALLS = Counter(
    "t2w_gateway_frontend_calls_total", "RegisterVoice calls with audio, by outcome", ["outcome"]
)
FRONTEND_SECONDS = Histogram(
    "t2w_gateway_frontend_seconds",
    "Time to make a voice from audio (front-end work only, not the wait for a worker)",
    buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)
