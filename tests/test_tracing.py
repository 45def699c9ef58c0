"""Traces (token2wav/tracing.py): one stream through the three real servers on loopback is one
trace, with spans from all three (context carried in gRPC metadata) and a span per chunk
carrying its ChunkTiming; off by default, on through the standard OTEL_* variables."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _stack import start_stack, stream_inputs
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flow_service.model import load_flow
from gateway.client import AsyncClient
from token2wav import tracing
from token2wav.errors import StartupError
from vocoder_service.model import load_hift

torch.set_num_threads(1)

SYNTHESIZE = "/token2wav.v1.Gateway/Synthesize"
GENERATE = "/token2wav.v1.Flow/Generate"
SESSION = "/token2wav.v1.Vocoder/Session"


def test_off_unless_otel_variables_ask():
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    with pytest.raises(StartupError, match="OTEL_TRACES_EXPORTER=zipkin"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert tracing.server_interceptors() == () and tracing.client_interceptors() is None


async def test_one_stream_is_one_trace_across_the_three_services():
    exporter = InMemorySpanExporter()
    assert tracing.setup("test", exporter=exporter)
    try:
        models = load_flow(None, preset="small"), load_hift(None, preset="small")
        stack = await start_stack(models)
        try:
            voice, tokens = stream_inputs(9, 20, 60)
            async with AsyncClient(stack.target) as client:
                stream = client.stream(voice, audio_format="pcm16", request_id="traced")
                await stream.send(tokens)
                await stream.end()
                chunks = [c async for c in stream]
        finally:
            await stack.stop()
        await asyncio.sleep(0)
    finally:
        tracing.disable()
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == SYNTHESIZE]
    trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    names = {s.name for s in trace}
    # The flow's and the vocoder's own server spans, under the gateway's client spans.
    server_kinds = {s.name for s in trace if s.kind.name == "SERVER"}
    assert {SYNTHESIZE, GENERATE, SESSION} <= server_kinds, names
    assert sum(s.name == GENERATE and s.kind.name == "CLIENT" for s in trace) >= 1
    by_id = {s.context.span_id: s for s in trace}
    for s in trace:
        if s is root:
            continue
        assert s.parent is not None, s.name
        if s.kind.name == "SERVER":  # its parent came over the wire, in gRPC metadata
            assert s.parent.is_remote, s.name
        else:
            assert s.parent.span_id in by_id, s.name
    chunk_spans = sorted(
        (s for s in trace if s.name == "chunk"), key=lambda s: s.attributes["t2w.seq"]
    )
    assert [s.attributes["t2w.seq"] for s in chunk_spans] == [c.seq for c in chunks]
    for span, chunk in zip(chunk_spans, chunks):
        assert span.parent.span_id == root.context.span_id
        assert span.attributes["t2w.num_samples"] == chunk.num_samples
        assert span.attributes["t2w.flow_batch_size"] == chunk.timing.flow_batch_size >= 1
        assert span.attributes["t2w.gateway_ms"] == pytest.approx(chunk.timing.gateway_ms)
        assert span.end_time - span.start_time == pytest.approx(
            chunk.timing.gateway_ms * 1e6, rel=1e-3
        )
