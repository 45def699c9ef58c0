"""Prometheus metrics of the flow service (calls by status code come from the bootstrap)."""

from prometheus_client import Counter, Gauge, Histogram

_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

BATCH_SIZE = Histogram("t2w_flow_batch_size", "Requests per solver batch", buckets=_SIZES)
BATCH_PADDED_FRAMES = Histogram(
    "t2w_flow_batch_padded_frames",
    "Rows x padded length per batch (frames)",
    buckets=(100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000),
)
PADDING_EFFICIENCY = Histogram(
    "t2w_flow_padding_efficiency",
    "Real frames / padded frames per batch",
    buckets=(0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
)
QUEUE_WAIT = Histogram("t2w_flow_queue_wait_seconds", "Arrival to batch start", buckets=_SECONDS)
COMPUTE = Histogram("t2w_flow_batch_compute_seconds", "Solver time per batch", buckets=_SECONDS)
QUEUE_DEPTH = Gauge("t2w_flow_queue_depth", "Calls waiting for a batch")
DROPPED = Counter(
    "t2w_flow_dropped_calls_total", "Calls that left before or during their batch", ["reason"]
)
PREEMPTIONS = Counter(
    "t2w_flow_preemptions_total",
    "Batches of first chunks run between the solver steps of a running batch",
)
LEFT_OUT = Counter(
    "t2w_flow_left_out_calls_total",
    "Waiting calls left out of a batch formed from their pool, by the limit that kept each out "
    "(flow_service/scheduler.py LEFT_OUT: rows, frames, padding, deadline, first_chunks); one "
    "call counts once per batch it missed",
    ["reason"],
)
VOICE_CACHE = Gauge("t2w_flow_voice_cache_entries", "Voices held in the LRU cache")
CAPACITY = Gauge(
    "t2w_flow_capacity_frames_per_second",
    "Learned throughput: DiT sequence frames (rows x padded length, all steps) per second",
)
LATE = Counter(
    "t2w_flow_late_calls_total", "Calls with a playback deadline whose batch finished after it"
)
GPU_FAULTS = Counter(
    "t2w_flow_gpu_faults_total",
    "GPU faults contained: oom_split (a batch out of memory, retried as two halves), oom_row (a "
    "row out of memory alone: its call alone failed), device_lost (a sticky CUDA error: the "
    "replica went NOT_SERVING and exited for a restart)",
    ["kind"],
)
PREFIX_CACHE_LOOKUPS = Counter(
    "t2w_flow_prefix_cache_lookups_total",
    "Streaming rows that could reuse a cached prefix, by outcome: hit (own stream), voice_hit "
    "(prompt blocks shared by the voice's streams), miss (recomputed)",
    ["result"],
)
PREFIX_CACHE_FRAMES = Counter(
    "t2w_flow_prefix_cache_frames_total",
    "DiT frames of every call, by whether they were taken from the prefix cache (reused) or "
    "computed",
    ["kind"],
)
PREFIX_CACHE_EVICTIONS = Counter(
    "t2w_flow_prefix_cache_evictions_total", "Prefix cache entries evicted to make room (LRU)"
)
PREFIX_CACHE_BYTES = Gauge("t2w_flow_prefix_cache_bytes", "Prefix cache bytes in use")
PREFIX_CACHE_ENTRIES = Gauge(
    "t2w_flow_prefix_cache_entries", "Prefix cache entries (streams and shared voice prompts)"
)


def observe_prefix_cache(name: str, value: float) -> None:
    """The prefix cache's event hook (flow_service.model stays free of Prometheus)."""
    lookup = {"hits": "hit", "voice_hits": "voice_hit", "misses": "miss"}.get(name)
    if lookup is not None:
        PREFIX_CACHE_LOOKUPS.labels(lookup).inc(value)
    elif name in ("reused_frames", "computed_frames"):
        PREFIX_CACHE_FRAMES.labels(name.removesuffix("_frames")).inc(value)
    elif name == "evictions":
        PREFIX_CACHE_EVICTIONS.inc(value)
    elif name == "bytes":
        PREFIX_CACHE_BYTES.set(value)
    elif name == "entries":
        PREFIX_CACHE_ENTRIES.set(value)
