"""OpenTelemetry traces across gateway -> flow -> vocoder, off unless the standard OTEL_*
variables ask for them.

On when `OTEL_TRACES_EXPORTER=otlp` or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; `OTEL_SERVICE_NAME` names the process (default:
the service's own name), the rest of OTEL_* (headers, sampler, batch sizes) as the SDK reads
them. Every gRPC listener gets a server interceptor and every gateway channel a client
interceptor (opentelemetry-instrumentation-grpc), so the W3C `traceparent` travels in gRPC
metadata: a stream's Synthesize span is the root, its flow Generate calls and its vocoder
Session are children, and the gateway adds a span per audio chunk carrying its ChunkTiming.
Without the `tracing` extra installed, asking for traces is a start-up error naming the
variable.
"""

from __future__ import annotations

import logging
import os
import time

from token2wav.errors import StartupError

logger = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_enabled = False
_tracer = None


def wanted(env=os.environ) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if not exporter:  # the SDK's default exporter is OTLP; here an endpoint must say so
        return any(env.get(v) for v in _ENDPOINT_VARS)
    if exporter != "otlp":
        raise StartupError(f"OTEL_TRACES_EXPORTER={exporter}: only otlp (or none) is supported")
    return True


def setup(service_name: str, exporter=None) -> bool:
    """Install the tracer provider once per process if traces are wanted (or `exporter`, a
    SpanExporter, is given: tests); True when tracing is on."""
    global _enabled, _tracer
    if _enabled:
        return True
    if exporter is None and not wanted():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise StartupError(
            "OTEL_TRACES_EXPORTER/OTEL_EXPORTER_OTLP_ENDPOINT: tracing needs the `tracing` "
            "extra (pip install 'token2wav[tracing]')"
        ) from None
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("token2wav")
    _enabled = True
    logger.info("tracing on: service.name=%s", name)
    return True


def server_interceptors() -> tuple:
    if not _enabled:
        return ()
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return (aio_server_interceptor(),)


def client_interceptors() -> list | None:
    if not _enabled:
        return None
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors()


def chunk_span(msg) -> None:
    """One span per audio chunk sent to the client, in the stream's trace: from its tokens
    being complete to its audio leaving (ChunkTiming.gateway_ms), with the stages' figures."""
    if not _enabled:
        return
    end = time.time_ns()
    t = msg.timing
    span = _tracer.start_span(
        "chunk",
        start_time=end - int(t.gateway_ms * 1e6),
        attributes={
            "t2w.seq": msg.seq,
            "t2w.sample_offset": msg.sample_offset,
            "t2w.num_samples": msg.num_samples,
            "t2w.is_final": msg.is_final,
            "t2w.flow_queue_ms": t.flow_queue_ms,
            "t2w.flow_compute_ms": t.flow_compute_ms,
            "t2w.flow_batch_size": t.flow_batch_size,
            "t2w.vocoder_queue_ms": t.vocoder_queue_ms,
            "t2w.vocoder_compute_ms": t.vocoder_compute_ms,
            "t2w.vocoder_batch_size": t.vocoder_batch_size,
            "t2w.gateway_ms": t.gateway_ms,
        },
    )
    span.end(end_time=end)


def disable() -> None:
    """New listeners and channels get no tracing interceptors (tests that turned it on)."""
    global _enabled
    _enabled = False
