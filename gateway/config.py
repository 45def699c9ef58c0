"""The gateway's flags and its frozen config: the one place flags become values."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from gateway.admission import AdmissionConfig
from gateway.inbound import InboundLimits
from gateway.pipeline import PipelineLimits
from gateway.schedule import ScheduleConfig
from token2wav.cli import EnvParser, add_server_flags, prog
from token2wav.security import TokenAuth, load_tokens
from token2wav.server import ServerOptions


def build_parser() -> EnvParser:
    d = GatewayConfig()  # every default is the frozen config's
    p = EnvParser(
        "GATEWAY",
        prog=prog("gateway"),
        description="The public token2wav API: one bidirectional Synthesize stream per "
        "utterance; chunks it, pipelines flow and vocoder, returns ordered "
        "audio.",
    )
    # largest legal message: a float32 audio chunk of 1003 tokens (max hop 1000 + 3): 3.9 MB
    add_server_flags(p, port=50051, metrics_port=9101, max_message_mb=8)
    p.flag(
        "--flow-addr",
        default=d.flow_addr,
        help="flow replicas: HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT (re-resolved); "
        "calls go round robin and retry elsewhere on UNAVAILABLE",
    )
    p.flag(
        "--vocoder-addr",
        default=d.vocoder_addr,
        help="vocoder replicas, same forms; each stream's replica is picked by rendezvous "
        "hashing of its request id",
    )
    p.flag(
        "--resolve-interval",
        type=float,
        default=d.resolve_interval,
        help="seconds between DNS lookups",
    )
    p.flag(
        "--max-streams",
        type=int,
        default=d.max_streams,
        help="concurrent streams; past it Synthesize answers RESOURCE_EXHAUSTED",
    )
    p.flag(
        "--max-inflight-chunks",
        type=int,
        default=d.limits.max_inflight_chunks,
        help="flow calls in flight per stream (bounds memory and queueing per stream)",
    )
    p.flag(
        "--max-buffered-chunks",
        type=int,
        default=d.limits.max_buffered_chunks,
        help="audio chunks held for a slow client before the stream pauses",
    )
    p.flag(
        "--call-timeout",
        type=float,
        default=d.limits.call_timeout_cap,
        help="cap in seconds on each downstream call's deadline",
    )
    p.flag(
        "--flow-attempts",
        type=int,
        default=d.flow_attempts,
        help="replicas a flow call tries on UNAVAILABLE",
    )
    p.flag(
        "--flow-affinity",
        default="stream" if d.flow_sticky else "call",
        choices=["stream", "call"],
        help="stream: all flow calls of a stream go to one replica (rendezvous hash of the "
        "request id; its prefix cache is there), the next-ranked on UNAVAILABLE; call: round "
        "robin per call (even spread when the flow replicas run without the prefix cache)",
    )
    p.flag("--max-voices", type=int, default=d.max_voices, help="registered voices kept (LRU)")
    p.flag(
        "--frontend-dir",
        default=d.frontend_dir,
        help="folder with speech_tokenizer_v3.onnx and campplus.onnx (Fun-CosyVoice3-0.5B-2512): "
        "RegisterVoice then also takes a prompt recording; needs pip install "
        "'token2wav[frontend]'. Unset: audio is refused with FAILED_PRECONDITION",
    )
    p.flag(
        "--frontend-workers",
        type=int,
        default=d.frontend_workers,
        help="threads making voices from audio, off the event loop",
    )
    p.flag(
        "--frontend-max-pending",
        type=int,
        default=d.frontend_max_pending,
        help="recordings accepted at once (running or waiting); past it RESOURCE_EXHAUSTED",
    )
    p.flag(
        "--first-chunk-target-ms",
        type=float,
        default=d.limits.deadlines.first_chunk_target_s * 1e3,
        help="a first chunk (or one whose tokens came late) is needed this long after its "
        "tokens are in",
    )
    p.flag(
        "--schedule",
        choices=("upstream", "blocks"),
        default="blocks" if d.limits.schedule == ScheduleConfig.blocks() else "upstream",
        help="chunks of a stream that sets no schedule: upstream's (25 + pad, 50, 100, ... "
        "tokens; upstream's audio exactly) or every 25-token block as soon as it is computed "
        "(upstream run with a constant hop of 25)",
    )
    p.flag(
        "--block-calls",
        type=bool,
        default=d.limits.block_calls,
        help="compute each 25-token block of a chunk as soon as its tokens + 3 lookahead are "
        "in and assemble the chunk from them (same audio); off: one flow call per chunk",
    )
    p.flag(
        "--final-attention",
        choices=("full", "chunked"),
        default="chunked" if d.limits.schedule.chunked_final else "full",
        help="the last call of a stream that sets none: full attention over the utterance "
        "(upstream's default, exact) or block-causal reusing the cached blocks (upstream's "
        "finalize + streaming: cheaper, and the last chunk differs from the default's)",
    )
    p.flag(
        "--start-buffer-ms",
        type=float,
        default=d.limits.start_buffer_s * 1e3,
        help="hold the first audio of a stream whose input is still open until this long after "
        "its first chunk's tokens: playback starts later, every later chunk has that much more "
        "slack (0: send at once); a stream's StreamConfig.start_buffer_ms overrides it",
    )
    p.flag(
        "--admission",
        type=bool,
        default=d.admission.enabled,
        help="refuse a new stream (RESOURCE_EXHAUSTED) when the flow capacity estimate says "
        "it would make admitted streams late",
    )
    p.flag(
        "--admission-headroom",
        type=float,
        default=d.admission.headroom,
        help="share of the flow replicas' reported capacity admission plans with",
    )
    p.flag(
        "--admission-wait-ms",
        type=float,
        default=d.admission.max_wait_s * 1e3,
        help="how long a stream that does not fit may wait for streams to end before it is "
        "refused; 0 refuses at once",
    )
    p.flag(
        "--retry-budget",
        type=float,
        default=d.retry_budget,
        help="flow retries allowed per flow call, across all streams (plus 10 per second): "
        "a stage that is down is not hit with every call times --flow-attempts",
    )
    p.flag(
        "--max-streams-per-client",
        type=int,
        default=d.max_streams_per_client,
        help="concurrent streams one client may hold (its auth identity, else its peer host: "
        "behind a proxy use auth); past it RESOURCE_EXHAUSTED; 0: no per-client bound",
    )
    p.flag(
        "--max-voices-per-client",
        type=int,
        default=d.max_voices_per_client,
        help="registered voices one client may hold; its oldest is evicted past it (never "
        "another client's); 0: only --max-voices",
    )
    p.flag(
        "--first-tokens-timeout",
        type=float,
        default=d.inbound.first_tokens_timeout,
        help="seconds a stream may wait for its StreamConfig, then for its first tokens, "
        "before it ends with DEADLINE_EXCEEDED (an idle stream holds a slot)",
    )
    p.flag(
        "--input-idle-timeout",
        type=float,
        default=d.inbound.idle_timeout,
        help="seconds between client messages once tokens flow, until EndOfInput; past it "
        "the stream ends with DEADLINE_EXCEEDED",
    )
    p.flag(
        "--vocoder-failovers",
        type=int,
        default=d.limits.max_vocoder_failovers,
        help="times a stream may move to another vocoder replica (replaying its mel) when "
        "its session is lost; 0 turns failover off",
    )
    p.flag(
        "--auth-tokens",
        help="file of bearer tokens, one `NAME TOKEN [METHOD,...]` per line: calls without a "
        "listed token get UNAUTHENTICATED, methods the token does not list PERMISSION_DENIED; "
        "NAME is the client for the per-client limits (unset: no authentication)",
    )
    p.flag(
        "--internal-ca",
        help="PEM CA that signed the flow and vocoder replicas' certificates: talk TLS to them",
    )
    p.flag("--internal-cert", help="PEM client certificate the gateway shows them (mutual TLS)")
    p.flag("--internal-key", help="PEM private key of --internal-cert")
    p.flag(
        "--internal-server-name",
        help="name in the replicas' certificates, when they are dialled by IP or a DNS name "
        "their certificates do not carry",
    )
    p.flag(
        "--websocket-port",
        type=int,
        default=d.websocket_port,
        help="also serve Synthesize over WebSocket on this port (JSON config, tokens, binary "
        "audio frames; gateway/websocket.py), with a demo page at / ; unset: off. Relayed to "
        "the gRPC listener, so auth, limits and admission are the same; not with --tls-cert",
    )
    p.flag(
        "--health-check-interval",
        type=float,
        default=d.health_check_interval,
        help="seconds between grpc.health checks of every flow and vocoder replica; unhealthy "
        "ones get calls only when no other is left, and the gateway reports NOT_SERVING while "
        "a stage has no healthy replica; 0 turns the checks off",
    )
    return p


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerOptions = field(default_factory=ServerOptions)
    flow_addr: str = "127.0.0.1:50052"
    vocoder_addr: str = "127.0.0.1:50053"
    resolve_interval: float = 5.0
    # A replica that left DNS keeps serving the calls already on it this long: a vocoder
    # session lasts as long as its stream, up to 300 s of audio played at real time, plus 30 s.
    retire_grace: float = 330.0
    internal_ca: str | None = None  # PEM files for TLS to the replicas; None: plaintext
    internal_cert: str | None = None
    internal_key: str | None = None
    internal_server_name: str | None = None
    health_check_interval: float = 1.0  # 0: no checks
    max_streams: int = 1024
    max_streams_per_client: int = 0
    flow_attempts: int = 3
    flow_sticky: bool = True  # --flow-affinity stream
    retry_budget: float = 0.2
    max_voices: int = 1024
    max_voices_per_client: int = 0
    frontend_dir: str | None = None  # None: no voices from audio
    frontend_workers: int = 2
    frontend_max_pending: int = 8
    websocket_port: int | None = None  # None: no WebSocket endpoint; 0: any free port (tests)
    limits: PipelineLimits = field(default_factory=PipelineLimits)
    inbound: InboundLimits = field(default_factory=InboundLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        if args.frontend_dir and (args.frontend_workers < 1 or args.frontend_max_pending < 1):
            raise ValueError("--frontend-workers and --frontend-max-pending must be >= 1")
        server = ServerOptions.from_args(args)
        if args.websocket_port is not None and server.tls_cert:
            # The relay dials the gRPC listener in plaintext; terminate TLS in front instead.
            raise ValueError("--websocket-port: not with --tls-cert (put a TLS proxy in front)")
        if args.auth_tokens:
            server = dataclasses.replace(
                server, interceptors=(TokenAuth(load_tokens(args.auth_tokens)),)
            )
        d = cls()
        deadlines = dataclasses.replace(
            d.limits.deadlines, first_chunk_target_s=args.first_chunk_target_ms / 1e3
        )
        return cls(
            server=server,
            flow_addr=args.flow_addr,
            vocoder_addr=args.vocoder_addr,
            resolve_interval=args.resolve_interval,
            internal_ca=args.internal_ca,
            internal_cert=args.internal_cert,
            internal_key=args.internal_key,
            internal_server_name=args.internal_server_name,
            health_check_interval=args.health_check_interval,
            max_streams=args.max_streams,
            max_streams_per_client=args.max_streams_per_client,
            flow_attempts=args.flow_attempts,
            flow_sticky=args.flow_affinity == "stream",
            retry_budget=args.retry_budget,
            max_voices=args.max_voices,
            max_voices_per_client=args.max_voices_per_client,
            frontend_dir=args.frontend_dir or None,
            frontend_workers=args.frontend_workers,
            frontend_max_pending=args.frontend_max_pending,
            websocket_port=args.websocket_port,
            limits=PipelineLimits(
                args.max_inflight_chunks,
                args.max_buffered_chunks,
                args.call_timeout,
                deadlines,
                max_vocoder_failovers=args.vocoder_failovers,
                start_buffer_s=args.start_buffer_ms / 1e3,
                block_calls=args.block_calls,
                schedule=ScheduleConfig.named(args.schedule, args.final_attention),
            ),
            inbound=InboundLimits(
                first_message_timeout=args.first_tokens_timeout,
                first_tokens_timeout=args.first_tokens_timeout,
                idle_timeout=args.input_idle_timeout,
            ),
            admission=dataclasses.replace(
                d.admission,
                enabled=args.admission,
                headroom=args.admission_headroom,
                max_wait_s=args.admission_wait_ms / 1e3,
            ),
        )
