"""Assembling the gateway: flags, replica sets, servicer, server."""

from __future__ import annotations

import argparse
import dataclasses

from gateway.admission import AdmissionConfig
from gateway.callers import ClientStreams
from gateway.deadlines import DeadlineConfig
from gateway.downstream import FlowClient
from gateway.failover import RetryBudget
from gateway.health import GatewayServer, StageHealth
from gateway.inbound import InboundLimits
from gateway.pipeline import PipelineLimits
from gateway.routing import ReplicaSet
from gateway.servicer import GatewayServicer, VoiceRegistry
from gateway.voices import VoiceMaker
from token2wav.cli import EnvParser, add_server_flags
from token2wav.frontend.audio import FrontendUnavailable
from token2wav.security import TokenAuth, channel_credentials, load_tokens
from token2wav.server import ServerOptions
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc


def build_parser() -> EnvParser:
    p = EnvParser(
        "GATEWAY",
        prog="python -m gateway",
        description="The public token2wav API: one bidirectional Synthesize stream per "
        "utterance; chunks it, pipelines flow and vocoder, returns ordered "
        "audio.",
    )
    # largest legal message: a float32 audio chunk of 1003 tokens (max hop 1000 + 3): 3.9 MB
    add_server_flags(p, port=50051, metrics_port=9101, max_message_mb=8)
    p.flag(
        "--flow-addr",
        default="127.0.0.1:50052",
        help="flow replicas: HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT (re-resolved); "
        "calls go round robin and retry elsewhere on UNAVAILABLE",
    )
    p.flag(
        "--vocoder-addr",
        default="127.0.0.1:50053",
        help="vocoder replicas, same forms; each stream's replica is picked by rendezvous "
        "hashing of its request id",
    )
    p.flag("--resolve-interval", type=float, default=5.0, help="seconds between DNS lookups")
    p.flag(
        "--retire-grace",
        type=float,
        default=330.0,
        help="seconds a replica that left DNS keeps serving the calls already on it (a "
        "vocoder session lasts as long as its stream); no new calls go there",
    )
    p.flag(
        "--max-streams",
        type=int,
        default=1024,
        help="concurrent streams; past it Synthesize answers RESOURCE_EXHAUSTED",
    )
    p.flag(
        "--max-inflight-chunks",
        type=int,
        default=4,
        help="flow calls in flight per stream (bounds memory and queueing per stream)",
    )
    p.flag(
        "--max-buffered-chunks",
        type=int,
        default=4,
        help="audio chunks held for a slow client before the stream pauses",
    )
    p.flag(
        "--call-timeout",
        type=float,
        default=60.0,
        help="cap in seconds on each downstream call's deadline",
    )
    p.flag("--flow-attempts", type=int, default=3, help="replicas a flow call tries on UNAVAILABLE")
    p.flag(
        "--flow-affinity",
        default="stream",
        choices=["stream", "call"],
        help="stream: all flow calls of a stream go to one replica (rendezvous hash of the "
        "request id; its prefix cache is there), the next-ranked on UNAVAILABLE; call: round "
        "robin per call (even spread when the flow replicas run without the prefix cache)",
    )
    p.flag("--max-voices", type=int, default=1024, help="registered voices kept (LRU)")
    p.flag(
        "--frontend-dir",
        default=None,
        help="folder with speech_tokenizer_v3.onnx and campplus.onnx (Fun-CosyVoice3-0.5B-2512): "
        "RegisterVoice then also takes a prompt recording; needs pip install "
        "'token2wav[frontend]'. Unset: audio is refused with FAILED_PRECONDITION",
    )
    p.flag(
        "--frontend-workers",
        type=int,
        default=2,
        help="threads making voices from audio, off the event loop",
    )
    p.flag(
        "--frontend-max-pending",
        type=int,
        default=8,
        help="recordings accepted at once (running or waiting); past it RESOURCE_EXHAUSTED",
    )
    p.flag(
        "--deadlines",
        type=bool,
        default=True,
        help="send each flow call and vocoder chunk its playback deadline (slack_ms), so the "
        "services serve the least slack first",
    )
    p.flag(
        "--first-chunk-target-ms",
        type=float,
        default=150.0,
        help="a first chunk (or one whose tokens came late) is needed this long after its "
        "tokens are in",
    )
    p.flag(
        "--deadline-margin-ms",
        type=float,
        default=50.0,
        help="subtracted from every playback deadline sent downstream (vocoder step, transport)",
    )
    p.flag(
        "--admission",
        type=bool,
        default=False,
        help="refuse a new stream (RESOURCE_EXHAUSTED) when the flow capacity estimate says "
        "it would make admitted streams late",
    )
    p.flag(
        "--admission-headroom",
        type=float,
        default=0.8,
        help="share of the flow replicas' reported capacity admission plans with",
    )
    p.flag(
        "--admission-expected-tokens",
        type=int,
        default=250,
        help="tokens assumed for a stream whose input is still open (250 = 10 s)",
    )
    p.flag(
        "--admission-wait-ms",
        type=float,
        default=0.0,
        help="how long a stream that does not fit may wait for streams to end before it is "
        "refused; 0 refuses at once",
    )
    p.flag(
        "--admission-capacity",
        type=float,
        default=0.0,
        help="flow capacity in DiT frames/s for admission, replacing the replicas' reports; "
        "0: learned from the replicas",
    )
    p.flag(
        "--retry-budget",
        type=float,
        default=0.2,
        help="flow retries allowed per flow call, across all streams (plus 10 per second): "
        "a stage that is down is not hit with every call times --flow-attempts",
    )
    p.flag(
        "--max-streams-per-client",
        type=int,
        default=0,
        help="concurrent streams one client may hold (its auth identity, else its peer host: "
        "behind a proxy use auth); past it RESOURCE_EXHAUSTED; 0: no per-client bound",
    )
    p.flag(
        "--max-voices-per-client",
        type=int,
        default=0,
        help="registered voices one client may hold; its oldest is evicted past it (never "
        "another client's); 0: only --max-voices",
    )
    p.flag(
        "--first-tokens-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may wait for its StreamConfig, then for its first tokens, "
        "before it ends with DEADLINE_EXCEEDED (an idle stream holds a slot)",
    )
    p.flag(
        "--input-idle-timeout",
        type=float,
        default=120.0,
        help="seconds between client messages once tokens flow, until EndOfInput; past it "
        "the stream ends with DEADLINE_EXCEEDED",
    )
    p.flag(
        "--vocoder-failovers",
        type=int,
        default=3,
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
        "--health-check-interval",
        type=float,
        default=1.0,
        help="seconds between grpc.health checks of every flow and vocoder replica; unhealthy "
        "ones get calls only when no other is left, and the gateway reports NOT_SERVING while "
        "a stage has no healthy replica; 0 turns the checks off",
    )
    return p


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(
        enabled=args.admission,
        headroom=args.admission_headroom,
        expected_tokens=args.admission_expected_tokens,
        max_wait_s=args.admission_wait_ms / 1e3,
        capacity_override=args.admission_capacity,
    )


def load_voice_maker(args: argparse.Namespace) -> VoiceMaker | None:
    """The front end if --frontend-dir is set; FrontendUnavailable says what is missing."""
    if not args.frontend_dir:
        return None
    if args.frontend_workers < 1 or args.frontend_max_pending < 1:
        raise FrontendUnavailable("--frontend-workers and --frontend-max-pending must be >= 1")
    return VoiceMaker.from_dir(args.frontend_dir, args.frontend_workers, args.frontend_max_pending)


def create_server(args: argparse.Namespace, voice_maker: VoiceMaker | None = None):
    credentials = None
    if args.internal_ca or args.internal_cert:
        credentials = channel_credentials(args.internal_ca, args.internal_cert, args.internal_key)
    routing = dict(
        refresh_s=args.resolve_interval,
        max_message_mb=args.max_message_mb,
        retire_grace_s=args.retire_grace,
        credentials=credentials,
        server_name=args.internal_server_name,
    )
    flows = ReplicaSet(args.flow_addr, **routing)
    vocoders = ReplicaSet(args.vocoder_addr, **routing)
    deadlines = None
    if args.deadlines:
        deadlines = DeadlineConfig(args.first_chunk_target_ms / 1e3, args.deadline_margin_ms / 1e3)
    limits = PipelineLimits(
        args.max_inflight_chunks,
        args.max_buffered_chunks,
        args.call_timeout,
        deadlines,
        max_vocoder_failovers=args.vocoder_failovers,
    )
    inbound = InboundLimits(
        first_message_timeout=args.first_tokens_timeout,
        first_tokens_timeout=args.first_tokens_timeout,
        idle_timeout=args.input_idle_timeout,
    )
    if voice_maker is None:
        voice_maker = load_voice_maker(args)
    servicer = GatewayServicer(
        FlowClient(
            flows,
            args.flow_attempts,
            sticky=args.flow_affinity == "stream",
            budget=RetryBudget(args.retry_budget),
        ),
        vocoders,
        VoiceRegistry(args.max_voices, args.max_voices_per_client),
        limits,
        args.max_streams,
        voice_maker,
        admission_from_args(args),
        inbound=inbound,
        per_client=ClientStreams(args.max_streams_per_client),
    )
    options = ServerOptions.from_args(args)
    if args.auth_tokens:
        options = dataclasses.replace(
            options, interceptors=(TokenAuth(load_tokens(args.auth_tokens)),)
        )
    server = GatewayServer(
        options,
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        health=StageHealth({"flow": flows, "vocoder": vocoders}, args.health_check_interval),
    )

    async def close() -> None:
        await flows.close()
        await vocoders.close()
        if voice_maker is not None:
            voice_maker.close()

    return server, close
