"""Prometheus metrics of the vocoder service (module level: one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ACTIVE_SESSIONS = Gauge("t2w_vocoder_active_sessions", "Open sessions (holding HiFT state)")
CLOSED_SESSIONS = Gauge(
    "t2w_vocoder_closed_sessions", "Finalized/failed sessions kept as tombstones for retries"
)
EVICTIONS = Counter(
    "t2w_vocoder_evictions_total",
    "Sessions that left the active set, by reason",
    ["reason"],  # idle | finalize | cancel | error | moved | replaced
)
CHUNKS = Counter(
    "t2w_vocoder_chunks_total",
    "Chunks received, by outcome",
    ["outcome"],  # applied | duplicate | rejected | failed
)
CHUNK_LATENCY = Histogram(
    "t2w_vocoder_chunk_latency_seconds",
    "From a chunk's arrival to its audio (includes waiting for earlier seqs)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
QUEUE_SECONDS = Histogram(
    "t2w_vocoder_queue_seconds",
    "From a chunk becoming applicable (its turn in seq order) to its batch starting",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
STEP_SECONDS = Histogram(
    "t2w_vocoder_step_seconds",
    "Model time of one vocoder batch, one batched HiFT call (device synchronised)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
URGENT_BATCHES = Counter(
    "t2w_vocoder_urgent_batches_total",
    "Vocoder batches of urgent chunks only (slack below 100 ms), run while other "
    "ready chunks waited for the next batch",
)
BATCH_SESSIONS = Histogram(
    "t2w_vocoder_batch_sessions",
    "Sessions advanced by one vocoder batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
STATE_BYTES = Gauge(
    "t2w_vocoder_state_bytes",
    "Bytes held by all sessions: HiFT state + reorder buffer + retry cache",
)
MAX_SESSION_BYTES = Gauge("t2w_vocoder_max_session_bytes", "Largest single session, bytes")
GRAPH_CALLS = Counter(
    "t2w_vocoder_graph_calls_total",
    "Vocoder batches with --cuda-graphs on, by what ran: replay of a held graph, capture of a "
    "new shape (then a replay; a capture costs a few eager batches), or eager (a shape past "
    "the buckets); start-up captures included",
    ["path"],  # replay | capture | eager
)
GPU_FAULTS = Counter(
    "t2w_vocoder_gpu_faults_total",
    "GPU faults contained: oom_split (a batch out of memory, retried as two halves), oom_row (a "
    "chunk out of memory alone: it alone was refused, its session intact), device_lost (a "
    "sticky CUDA error: the replica went NOT_SERVING and exited for a restart)",
    ["kind"],
)
