"""`python -m vocoder_service`: the Stage-2 vocoder server (mel -> 24 kHz audio), one HiFT cache
session per stream, batched across sessions. Every flag mirrors a VOCODER_* env var."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from token2wav.cli import EnvParser, add_server_flags, check_device, check_ports, run_main
from token2wav.security import PeerCertAuth
from token2wav.server import ServerOptions, setup_logging
from vocoder_service.config import (
    BatcherConfig,
    ModelConfig,
    SessionConfig,
    VocoderServiceConfig,
)
from vocoder_service.server import VocoderServer, VocoderService


def build_parser() -> EnvParser:
    p = EnvParser("VOCODER", prog="python -m vocoder_service", description=__doc__)
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
    p.flag("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.flag("--dtype", default="float32", choices=["float32", "bfloat16"], help="decoder dtype")
    p.flag(
        "--phase-mode",
        default="exact",
        choices=["exact", "upstream"],
        help="sine phase rounding: exact (float64, no drift on long utterances) or upstream "
        "(upstream's float32 cumsum, as upstream on CPU); sessions only move between equal modes",
    )
    p.flag("--max-sessions", type=int, default=s.max_num_sessions, help="open sessions cap")
    p.flag("--idle-timeout", type=float, default=s.idle_timeout_s, help="s before eviction")
    p.flag("--gap-timeout", type=float, default=s.gap_timeout_s, help="s a seq gap may last")
    p.flag("--reorder-window", type=int, default=s.reorder_window, help="chunks seq may lead")
    p.flag("--reorder-bytes", type=int, default=s.reorder_bytes, help="early-chunk mel bytes")
    p.flag("--retry-window", type=int, default=s.retry_window, help="applied chunks retryable")
    p.flag("--retry-cache-bytes", type=int, default=s.retry_cache_bytes, help="retry audio bytes")
    p.flag(
        "--max-batch-sessions",
        type=int,
        default=b.max_batch_sessions,
        help="sessions per HiFT step; 1 turns batching across sessions off",
    )
    p.flag("--max-wait-ms", type=float, default=b.max_wait_ms, help="wait for a fuller step")
    p.flag(
        "--control-clients",
        default="",
        help="comma-separated names (certificate CN or DNS SAN): only peers with a verified "
        "client certificate naming one may call CancelSession, ExportSession, ImportSession "
        "(needs --tls-client-ca); unset: anyone who can connect",
    )
    return p


CONTROL_METHODS = ("CancelSession", "ExportSession", "ImportSession")


def server_options(args) -> ServerOptions:
    """The listener's options, with the control-call check when --control-clients is set."""
    options = ServerOptions.from_args(args)
    names = [n.strip() for n in args.control_clients.split(",") if n.strip()]
    if not names:
        return options
    if not options.tls_client_ca:
        raise ValueError("--control-clients needs mutual TLS (--tls-client-ca)")
    return dataclasses.replace(options, interceptors=(PeerCertAuth(CONTROL_METHODS, names),))


def config_from_args(args) -> VocoderServiceConfig:
    return VocoderServiceConfig(
        # An empty env var (VOCODER_MODEL_DIR=, as compose files write) means unset.
        model=ModelConfig(
            args.preset or None, args.model_dir or None, args.device, args.dtype, args.phase_mode
        ),
        sessions=SessionConfig(
            max_num_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout,
            gap_timeout_s=args.gap_timeout,
            reorder_window=args.reorder_window,
            reorder_bytes=args.reorder_bytes,
            retry_window=args.retry_window,
            retry_cache_bytes=args.retry_cache_bytes,
        ),
        batcher=BatcherConfig(args.max_batch_sessions, args.max_wait_ms),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "vocoder")
    try:
        config = config_from_args(args)
        options = server_options(args)
    except ValueError as exc:
        parser.error(str(exc))

    async def run() -> None:
        server = VocoderServer(options, VocoderService(config))
        await server.run(server.warmup)

    def body() -> None:
        check_ports(args)
        check_device(args.device)
        asyncio.run(run())

    # start-up failures (port taken, no CUDA, bad weights) end as one line; details at DEBUG
    return run_main("vocoder_service", body)


if __name__ == "__main__":
    sys.exit(main())
