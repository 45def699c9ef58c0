"""vocoder_service configuration: its flags, and one frozen dataclass per component (sessions,
batcher, model) gathered in `VocoderServiceConfig`, whose `from_args` fills it from the flags.

Memory bound of one session (what `Session.nbytes` reports, and why it cannot grow):
    HiFT state            model-dependent, bounded by the model's window (state.nbytes)
  + reorder buffer        <= reorder_bytes            (early chunks waiting for a gap)
  + the in-order chunk    <= max_chunk_frames x 80 x 4 (the one chunk that can always enter)
  + retry cache           <= retry_cache_bytes        (audio of recently applied chunks)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from token2wav import MAX_FRAMES, MEL_BINS
from token2wav.cli import EnvParser, add_server_flags, prog
from token2wav.dtypes import DTYPES
from token2wav.security import PeerCertAuth
from token2wav.server import ServerOptions
from vocoder_service.model.graphs import (
    DEFAULT_FRAME_MULTIPLE,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_ROWS,
)

MEL_FRAME_BYTES = MEL_BINS * 4  # one float32 mel frame on the wire
PHASE_MODES = ("exact", "upstream")


@dataclass(frozen=True)
class SessionConfig:
    """Lifetime and bounds of the per-stream sessions (`SessionManager`)."""

    max_num_sessions: int = 256  # open sessions; one more answers RESOURCE_EXHAUSTED
    idle_timeout_s: float = 30.0  # no chunk for this long: the session is evicted (NOT_FOUND)
    gap_timeout_s: float = 5.0  # an early chunk waits this long for the gap before ABORTED
    reorder_window: int = 8  # chunks: seq may run at most this far ahead of the next expected
    # Mel bytes held for early chunks of one session: 16 MiB is 52k frames (~17 min of audio),
    # so the chunk window binds first for streaming chunks; this only bounds memory.
    reorder_bytes: int = 16 << 20
    # Duplicates are answered from the audio of the last `retry_window` applied chunks. An
    # older duplicate (or one whose audio was dropped by the byte cap) is ABORTED: the gateway
    # only retries chunks whose answer it has not seen, which are the most recent ones.
    retry_window: int = 8
    # Audio bytes kept for retries (~87 s of float32 at 24 kHz); the newest entry always stays.
    retry_cache_bytes: int = 8 << 20
    max_chunk_frames: int = MAX_FRAMES  # mel frames in one chunk (a 300 s non-streaming call)
    # Finalized and failed sessions linger as small tombstones for `idle_timeout_s`, so a retry
    # of the final chunk still gets its audio and a late chunk gets ABORTED, not NOT_FOUND.
    max_num_closed: int = 1024
    sweep_interval_s: float = 0.5  # how often idle sessions and stale gaps are checked

    def __post_init__(self):
        for name in ("max_num_sessions", "reorder_window", "retry_window", "max_chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("idle_timeout_s", "gap_timeout_s", "sweep_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.reorder_bytes < 0 or self.retry_cache_bytes < 0 or self.max_num_closed < 0:
            raise ValueError("byte and tombstone limits must be >= 0")


@dataclass(frozen=True)
class BatcherConfig:
    """How chunks of different sessions are grouped into one vocoder batch (`Batcher`)."""

    max_batch_sessions: int = 64  # sessions per batch; 1 turns batching off (same code path)
    # A batch waits at most this long after its oldest chunk became ready for more sessions to
    # join. Small: chunks of one stream come 1-4 s apart, so waiting longer buys no batch.
    max_wait_ms: float = 2.0
    # A ready chunk whose slack (deadline - now) is below this is urgent: while one is, a batch
    # takes only urgent chunks (least slack first) and the others wait for the next batch, so a
    # first chunk does not pay a batch of long chunks. With the gateway's defaults a first chunk
    # arrives with at most first-chunk target - margin = 100 ms of slack, a later chunk with
    # seconds. 0: off. Chunks without a deadline are never urgent.
    # 100 and 1600 won an A/B on an H200 against 0 (off), 200 and 800 frames
    # (docs/bench/2026-12-03-capacity-runs.md, the fifth run).
    urgent_slack_ms: float = 100.0
    # An urgent batch closes before a chunk would take its padded frames (rows x longest chunk)
    # past this (its first chunk always goes): a long urgent chunk does not pad a batch of first
    # chunks. 1600: 32 first chunks of 50 frames, or 8 of 200. 0: no bound.
    urgent_max_frames: int = 1600

    def __post_init__(self):
        if self.max_batch_sessions < 1:
            raise ValueError("max_batch_sessions must be >= 1")
        if self.max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0")
        if self.urgent_slack_ms < 0:
            raise ValueError(f"urgent_slack_ms {self.urgent_slack_ms:g}: want >= 0")
        if self.urgent_max_frames < 0:
            raise ValueError(f"urgent_max_frames {self.urgent_max_frames}: want >= 0")


@dataclass(frozen=True)
class ModelConfig:
    """Which HiFT to load and where."""

    preset: str | None = (
        None  # HIFT_PRESETS key; None: "cosyvoice3-0.5b" with model_dir, else "small"
    )
    model_dir: str | None = None  # directory holding hift.pt; None: random weights
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 (the f0 path stays float64 inside the model)
    # How the sine source's phase is rounded (layers.SourceModule): "exact" integrates f0 in
    # float64 (no drift over 300 s); "upstream" reproduces upstream's float32 cumsum rounding.
    phase_mode: str = "exact"
    # CUDA-graph replay of the vocoder batch (model/graphs.py), on CUDA only: batches are padded
    # to row buckets up to graph_max_rows and to a multiple of graph_frame_multiple frames up
    # to graph_max_frames (padding changes no sample beyond rounding); larger ones run eagerly.
    # The defaults are the graph module's (ShapeBuckets.for_limits, which the benchmarks use).
    cuda_graphs: bool = True  # on CUDA only (ignored on CPU)
    graph_max_rows: int = DEFAULT_MAX_ROWS
    graph_max_frames: int = DEFAULT_MAX_FRAMES
    graph_frame_multiple: int = DEFAULT_FRAME_MULTIPLE

    def __post_init__(self):
        if self.graph_max_rows < 1 or self.graph_frame_multiple < 1:
            raise ValueError("graph_max_rows and graph_frame_multiple must be >= 1")
        if self.graph_max_frames < self.graph_frame_multiple:
            raise ValueError("graph_max_frames must be >= graph_frame_multiple")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: want float32 or bfloat16")
        if self.phase_mode not in PHASE_MODES:
            raise ValueError(f"phase_mode {self.phase_mode!r}: want exact or upstream")


def build_parser() -> EnvParser:
    p = EnvParser(
        "VOCODER",
        prog=prog("vocoder_service"),
        description="The Stage-2 vocoder server (mel -> 24 kHz audio), one HiFT cache session "
        "per stream, batched across sessions. Every flag mirrors a VOCODER_* env var.",
    )
    # largest legal message: the audio of a 300 s non-streaming chunk (28.8 MB of float32)
    add_server_flags(p, port=50053, metrics_port=9103, max_message_mb=32)
    s, b = SessionConfig(), BatcherConfig()
    p.flag("--model-dir", default=None, help="directory with the official hift.pt; unset: random")
    p.flag(
        "--preset",
        default=None,
        help="HiFT preset (small | cosyvoice3-0.5b); unset: cosyvoice3-0.5b with --model-dir, "
        "else small",
    )
    p.flag("--device", default=ModelConfig.device, help="cpu, cuda or cuda:N")
    p.flag("--dtype", default=ModelConfig.dtype, choices=sorted(DTYPES), help="decoder dtype")
    p.flag(
        "--phase-mode",
        default=ModelConfig.phase_mode,
        choices=list(PHASE_MODES),
        help="sine phase rounding: exact (float64, no drift on long utterances) or upstream "
        "(upstream's float32 cumsum, as upstream on CPU); sessions only move between equal modes",
    )
    p.flag(
        "--cuda-graphs",
        type=bool,
        default=ModelConfig.cuda_graphs,
        help="on CUDA, replay captured graphs of the vocoder batch (rows and frames padded to "
        "buckets; the same samples up to rounding): a small batch is launch-bound, and a "
        "replay launches it at once; ignored on CPU",
    )
    p.flag(
        "--graph-max-rows",
        type=int,
        default=ModelConfig.graph_max_rows,
        help="largest vocoder batch (sessions) run through CUDA graphs; row buckets 1, 2, 4, 8, "
        "12, 16, 24, 32, ... up to it",
    )
    p.flag(
        "--graph-max-frames",
        type=int,
        default=ModelConfig.graph_max_frames,
        help="longest decoder window (frames: a chunk plus ~45 of context) run through graphs",
    )
    p.flag("--max-sessions", type=int, default=s.max_num_sessions, help="open sessions cap")
    p.flag("--idle-timeout", type=float, default=s.idle_timeout_s, help="s before eviction")
    p.flag("--gap-timeout", type=float, default=s.gap_timeout_s, help="s a seq gap may last")
    p.flag("--reorder-window", type=int, default=s.reorder_window, help="chunks seq may lead")
    p.flag("--retry-window", type=int, default=s.retry_window, help="applied chunks retryable")
    p.flag(
        "--max-batch-sessions",
        type=int,
        default=b.max_batch_sessions,
        help="sessions per vocoder batch (one HiFT call); 1 turns batching across sessions off",
    )
    p.flag("--max-wait-ms", type=float, default=b.max_wait_ms, help="wait for a fuller batch")
    p.flag(
        "--control-clients",
        default="",
        help="comma-separated names (certificate CN or DNS SAN): only peers with a verified "
        "client certificate naming one may call CancelSession, ExportSession, ImportSession "
        "(needs --tls-client-ca); unset: anyone who can connect",
    )
    return p


CONTROL_METHODS = ("CancelSession", "ExportSession", "ImportSession")


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The listener's options, with the control-call check when --control-clients is set."""
    options = ServerOptions.from_args(args)
    names = [n.strip() for n in args.control_clients.split(",") if n.strip()]
    if not names:
        return options
    if not options.tls_client_ca:
        raise ValueError("--control-clients needs mutual TLS (--tls-client-ca)")
    return dataclasses.replace(options, interceptors=(PeerCertAuth(CONTROL_METHODS, names),))


@dataclass(frozen=True)
class VocoderServiceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    server: ServerOptions = field(default_factory=ServerOptions)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VocoderServiceConfig:
        return cls(
            # An empty env var (VOCODER_MODEL_DIR=, as compose files write) means unset.
            model=ModelConfig(
                args.preset or None,
                args.model_dir or None,
                args.device,
                args.dtype,
                args.phase_mode,
                args.cuda_graphs,
                args.graph_max_rows,
                args.graph_max_frames,
            ),
            sessions=SessionConfig(
                max_num_sessions=args.max_sessions,
                idle_timeout_s=args.idle_timeout,
                gap_timeout_s=args.gap_timeout,
                reorder_window=args.reorder_window,
                retry_window=args.retry_window,
            ),
            batcher=BatcherConfig(
                max_batch_sessions=args.max_batch_sessions, max_wait_ms=args.max_wait_ms
            ),
            server=server_options(args),
        )
