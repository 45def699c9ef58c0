"""GPU faults stay inside one batch (token2wav/faults.py), checked on the CPU by a fault
injector installed on the runners (tests only):

- out of memory in a batch: split in halves and retried, every row answered as unfaulted;
- a row out of memory even alone: only its request fails, RESOURCE_EXHAUSTED naming it;
- a sticky device error: the calls get UNAVAILABLE, health goes NOT_SERVING and the process
  exits non-zero (the exit function is the test's), and the gateway's failover carries the
  streams to another replica.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref

import grpc
import numpy as np
import pytest
import torch
from _stack import flow_config, start_flow, start_stack, stream_inputs, until
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from flow_service.contain import execute_contained
from flow_service.model import FlowRequest, Voice, load_flow
from flow_service.service import FlowService
from gateway.client import AsyncClient
from gateway.routing import rendezvous
from token2wav import SAMPLES_PER_TOKEN
from token2wav.errors import ResourceExhausted, Unavailable
from token2wav.faults import (
    EXIT_DEVICE_LOST,
    FaultInjector,
    RowOutOfMemory,
    injected_device_error,
    injected_oom,
    is_device_lost,
    is_out_of_memory,
)
from token2wav.tensors import encode
from token2wav.v1 import flow_pb2, flow_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.batcher import Batcher
from vocoder_service.chunks import MelChunk
from vocoder_service.config import BatcherConfig, SessionConfig, VocoderServiceConfig
from vocoder_service.manager import SessionManager
from vocoder_service.model import HiFTSessionState, load_hift
from vocoder_service.runner import HiFTRunner
from vocoder_service.service import VocoderService

torch.set_num_threads(1)
IDS = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_fault_classes():
    assert is_out_of_memory(injected_oom()) and not is_device_lost(injected_oom())
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    for text in (
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
    ):
        assert is_device_lost(RuntimeError(text)) and not is_out_of_memory(RuntimeError(text))
    assert not is_device_lost(RuntimeError("shape mismatch"))
    assert not is_device_lost(ValueError("CUDA error: an illegal memory access"))
    assert EXIT_DEVICE_LOST != 0


# -- flow ------------------------------------------------------------------------------------


def flow_requests(n: int = 4) -> list[FlowRequest]:
    out = []
    for i, rid in enumerate(IDS[:n]):
        voice, tokens = stream_inputs(40 + i, 8 + 3 * i, 30 + 4 * i)
        v = Voice(
            torch.from_numpy(voice.prompt_token),
            torch.from_numpy(voice.prompt_feat),
            torch.from_numpy(voice.embedding),
        )
        out.append(FlowRequest(v, torch.from_numpy(tokens), 0, True, False, cache_key=rid))
    return out


async def run_flow_batch(model, faults: FaultInjector | None) -> list:
    """The four requests queued before the loop starts, so the first batch holds all four;
    each result is a mel or the exception its call raised."""
    service = FlowService(flow_config(), model=model)
    engine = service.engine
    engine.runner.faults = faults
    calls = [asyncio.ensure_future(engine.submit(r)) for r in flow_requests()]
    await until(lambda: len(engine.scheduler) == len(calls))
    engine.start()
    try:
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await engine.stop()
    return [r if isinstance(r, BaseException) else r.mel for r in results]


async def test_flow_oom_in_a_batch_of_4_splits_and_answers_all_4(models):
    reference = await run_flow_batch(models[0], None)
    sizes = []

    def oom_at_4(rows):
        sizes.append(len(rows))
        return injected_oom() if len(rows) == 4 else None

    splits = metric("t2w_flow_gpu_faults_total", kind="oom_split")
    got = await run_flow_batch(models[0], FaultInjector(oom_at_4))
    assert sizes == [4, 2, 2]
    for mel, ref in zip(got, reference):
        assert isinstance(mel, torch.Tensor), mel
        # Invariant 1: a row's mel does not depend on its batch (here 2 rows instead of 4).
        assert (mel - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert metric("t2w_flow_gpu_faults_total", kind="oom_split") == splits + 1


class FailsHoldingMemory:
    """Wraps a runner's batch function: the first call of `rows` rows allocates a tensor (the
    failed batch's activations) and raises an out-of-memory from the frame holding it; every
    later call records whether that tensor was still alive when it started (a retry next to
    the memory that ran out would run out again on a real GPU)."""

    def __init__(self, run, rows: int):
        self.run, self.rows = run, rows
        self.held = None
        self.alive_at_retry: list[bool] = []

    def __call__(self, batch, *args, **kwargs):
        if self.held is None and len(batch) == self.rows:
            activations = torch.zeros(1 << 16)
            self.held = weakref.ref(activations)
            raise injected_oom()
        if self.held is not None:
            self.alive_at_retry.append(self.held() is not None)
        return self.run(batch, *args, **kwargs)


async def test_flow_oom_retry_runs_after_the_failed_batch_is_freed(models, monkeypatch):
    service = FlowService(flow_config(), model=models[0])
    runner = service.engine.runner
    wrapped = FailsHoldingMemory(runner.generate, 4)
    monkeypatch.setattr(runner, "generate", wrapped)
    got, _, _ = execute_contained(runner, flow_requests())
    assert all(isinstance(m, torch.Tensor) for m in got)
    assert wrapped.alive_at_retry == [False, False]


def test_vocoder_oom_retry_runs_after_the_failed_batch_is_freed(models, monkeypatch):
    runner = HiFTRunner(models[1])
    wrapped = FailsHoldingMemory(runner._run_batch, 4)
    monkeypatch.setattr(runner, "_run_batch", wrapped)
    chunks = mels()
    out = runner.execute([runner.new_state() for _ in chunks], chunks, [False] * 4)
    assert out.errors == [None] * 4
    assert wrapped.alive_at_retry == [False, False]


async def test_flow_row_that_always_fails_fails_alone_naming_its_request(models):
    reference = await run_flow_batch(models[0], None)
    rows_before = metric("t2w_flow_gpu_faults_total", kind="oom_row")
    faults = FaultInjector(
        lambda rows: injected_oom() if any(r.cache_key == "c" for r in rows) else None
    )
    got = await run_flow_batch(models[0], faults)
    for rid, mel, ref in zip(IDS, got, reference):
        if rid == "c":
            assert isinstance(mel, ResourceExhausted), mel
            assert "request c:" in mel.message and "out of GPU memory" in mel.message
        else:
            assert isinstance(mel, torch.Tensor), (rid, mel)
            assert (mel - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert faults.num_batches == 5  # [a b c d] -> [a b] ok, [c d] -> [c] fails, [d] ok
    assert metric("t2w_flow_gpu_faults_total", kind="oom_row") == rows_before + 1


async def _not_serving(server) -> bool:
    reply = await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def _generate_request() -> flow_pb2.GenerateRequest:
    voice, tokens = stream_inputs(50, 8, 30)
    return flow_pb2.GenerateRequest(
        request_id="sticky",
        inline_voice=voice.to_proto(),
        tokens=encode(np.asarray(tokens, np.int32)),
        finalize=True,
    )


async def test_flow_sticky_error_answers_unavailable_and_exits_for_a_restart(models):
    server = await start_flow(models[0])
    exits: list[int] = []
    server.exit = exits.append
    engine = server.service.engine
    engine.runner.faults = FaultInjector(lambda rows: injected_device_error())
    lost_before = metric("t2w_flow_gpu_faults_total", kind="device_lost")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await flow_pb2_grpc.FlowStub(ch).Generate(_generate_request(), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        await until(lambda: exits, what="the replica never exited")
        assert exits == [EXIT_DEVICE_LOST]
        assert await _not_serving(server)
        with pytest.raises(Unavailable):  # and no batch runs again
            await engine.submit(flow_requests(1)[0])
        assert metric("t2w_flow_gpu_faults_total", kind="device_lost") == lost_before + 1
    finally:
        await server.drain()


async def test_gateway_failover_carries_streams_off_a_replica_that_lost_its_gpu(models):
    stack = await start_stack(models, num_flows=2)
    exits: list[int] = []
    broken = stack.flows[0]
    broken.exit = exits.append
    broken.service.engine.runner.faults = FaultInjector(lambda rows: injected_device_error())
    voice, tokens = stream_inputs(60, 10, 60)
    # Request ids whose rendezvous replica is the broken one, so their calls must fail over
    # (with random ids, all three streams miss it one run in eight).
    addrs = [f"127.0.0.1:{port}" for port in stack.flow_ports]
    ids = (f"lost-{i}" for i in itertools.count())
    lost = list(itertools.islice((k for k in ids if rendezvous(k, addrs) == addrs[0]), 3))
    try:
        async with AsyncClient(stack.target) as client:

            async def one(request_id=""):
                stream = client.stream(voice, audio_format="float32", request_id=request_id)
                await stream.send(tokens)
                await stream.end()
                return np.concatenate([c.samples async for c in stream])

            outs = await asyncio.gather(*(one(k) for k in lost))
            await until(lambda: exits, what="the broken replica never exited")
            assert exits == [EXIT_DEVICE_LOST]
            after = await one()  # the healthy replica alone
        for out in outs:
            assert out.size == 60 * SAMPLES_PER_TOKEN
            # Batching differs between the runs: float rounding only (the bar, 1e-4).
            assert np.abs(out - after).max() <= 1e-4
    finally:
        await stack.stop()


# -- vocoder ---------------------------------------------------------------------------------


def mels(n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(-5.0, 2.0, (80, 20 + 6 * i)).astype(np.float32) for i in range(n)]


def test_vocoder_oom_in_a_batch_of_4_splits_and_answers_all_4(models):
    runner = HiFTRunner(models[1])
    chunks, final = mels(), [False, True, False, True]
    ref_states = [runner.new_state() for _ in chunks]
    reference = runner.execute(ref_states, chunks, final)
    sizes = []

    def oom_at_4(rows):
        sizes.append(len(rows))
        return injected_oom() if len(rows) == 4 else None

    runner.faults = FaultInjector(oom_at_4)
    states = [runner.new_state() for _ in chunks]
    out = runner.execute(states, chunks, final)
    assert sizes == [4, 2, 2]
    assert out.errors == [None] * 4
    for got, want in zip(out.audio, reference.audio):
        assert got.shape == want.shape and got.size > 0
        assert np.abs(got - want).max() <= 1e-5  # the model's own bound is ~1e-7
    assert out.state_samples == reference.state_samples


async def test_vocoder_chunk_that_always_fails_fails_alone_naming_its_request(models):
    runner = HiFTRunner(models[1])
    manager = SessionManager(SessionConfig(), runner.new_state, HiFTSessionState.from_bytes)
    batcher = Batcher(manager, runner, BatcherConfig(max_batch_sessions=4, max_wait_ms=0))
    chunks = mels()
    bad = chunks[2]
    runner.faults = FaultInjector(
        lambda rows: injected_oom() if any(m is bad for m in rows) else None
    )
    futures = [manager.submit(MelChunk(rid, 0, m, False)) for rid, m in zip(IDS, chunks)]
    await batcher.run_batch()
    for rid, fut in zip(IDS, futures):
        if rid == "c":
            with pytest.raises(ResourceExhausted, match="^request_id 'c' seq 0: out of GPU memory"):
                fut.result()
        else:
            assert fut.result().audio.size > 0, rid
    # Its session is intact and the seq still open: the chunk applies once it fits.
    runner.faults = None
    retry = manager.submit(MelChunk("c", 0, bad.copy(), False))
    await batcher.run_batch()
    assert (await retry).seq == 0


async def test_vocoder_sticky_error_answers_unavailable_and_exits_for_a_restart(models):
    from token2wav.server import ServerOptions
    from token2wav.service import start

    cfg = VocoderServiceConfig(server=ServerOptions(port=0, grace_period=1))
    server = await start(VocoderService(cfg, model=models[1]))
    exits: list[int] = []
    server.exit = exits.append
    server.service.runner.faults = FaultInjector(lambda rows: injected_device_error())
    chunk = vocoder_pb2.VocoderChunk(request_id="sticky", seq=0, mel=encode(mels(1)[0]))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in vocoder_pb2_grpc.VocoderStub(ch).Session(iter([chunk]), timeout=30):
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        await until(lambda: exits, what="the replica never exited")
        assert exits == [EXIT_DEVICE_LOST]
        assert await _not_serving(server)
    finally:
        await server.drain()


# -- a real out-of-memory on a GPU -----------------------------------------------------------
#
# The injector above proves the containment logic; these prove that a real allocator failure
# reaches it as an out-of-memory (not as a sticky device error) and that the halves then run.
# The device is filled with a ballast tensor until the four-row batch no longer fits but a
# two-row half does (both peaks are measured first, on the same card).


def _peak_bytes(run) -> int:
    """The device memory `run()` reserves beyond what is reserved before it, the second time:
    the first picks kernels (cuDNN tries algorithms with workspaces of their own), which
    inflates its peak past what the batch needs."""
    run()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() - base


class _Ballast:
    """Leaves only `room` bytes of the device free while inside."""

    def __init__(self, room: int):
        self.room = room
        self.ballast = None

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        assert free > self.room, f"only {free} bytes free, the test needs {self.room}"
        self.ballast = torch.empty(free - self.room, dtype=torch.uint8, device="cuda")
        return self

    def __exit__(self, *exc):
        self.ballast = None
        torch.cuda.empty_cache()


def _room_between(two: int, four: int, share: float = 0.5) -> int:
    # The two-row half needs `two`, the whole batch `four`; room `share` of the way between,
    # if the two differ enough to leave the allocator's rounding (2 MiB blocks, 20 MiB
    # segments) a margin. Close to `two` where a library can trade memory for speed (cuDNN
    # picks an algorithm with a smaller workspace when memory is short, so `four` is more than
    # the whole batch must have).
    assert four - two > 256 << 20, f"peaks too close to part: {two} / {four} bytes"
    return two + int(share * (four - two))


def long_flow_requests() -> list[FlowRequest]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(4):
        n_p = 75 + 5 * i
        voice = Voice(
            torch.from_numpy(rng.integers(0, 6561, n_p)),
            torch.from_numpy(rng.normal(size=(2 * n_p, 80)).astype(np.float32)),
            torch.from_numpy(rng.normal(size=192).astype(np.float32)),
        )
        tokens = torch.from_numpy(rng.integers(0, 6561, 700 + 20 * i))
        out.append(FlowRequest(voice, tokens, 0, True, False))
    return out


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")  # TF32 rounds by batch shape: 2e-4 apart, not fp32's 1e-6
def test_gpu_real_oom_splits_a_flow_batch_and_a_lone_row_fails_alone():
    from flow_service.runner import FlowRunner

    model = load_flow(None, device="cuda", preset="cosyvoice3-0.5b")
    runner = FlowRunner(model, cuda_graphs=False)
    requests = long_flow_requests()
    one = _peak_bytes(lambda: runner.execute(requests[:1]))
    two = _peak_bytes(lambda: runner.execute(requests[:2]))
    four = _peak_bytes(lambda: runner.execute(requests))
    reference = runner.execute(requests)[0]
    kinds: list[str] = []
    with _Ballast(_room_between(two, four)):
        got, _, _ = execute_contained(runner, requests, count=kinds.append)
    assert kinds == ["oom_split"]
    for mel, ref in zip(got, reference, strict=True):
        assert isinstance(mel, torch.Tensor), mel
        assert (mel - ref).abs().max() <= 1e-4 * ref.abs().max()
    kinds.clear()
    with _Ballast(one // 2):
        got, _, _ = execute_contained(runner, requests[:1], count=kinds.append)
    assert kinds == ["oom_row"] and isinstance(got[0], RowOutOfMemory)
    after, _, _ = runner.execute(requests[:1])  # the replica serves on
    assert (after[0] - reference[0]).abs().max() <= 1e-4 * reference[0].abs().max()


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_real_oom_splits_a_vocoder_batch():
    runner = HiFTRunner(load_hift(None, device="cuda", preset="cosyvoice3-0.5b"), "cuda")
    rng = np.random.default_rng(5)
    chunks = [rng.normal(-5.0, 2.0, (80, 1500 + 50 * i)).astype(np.float32) for i in range(4)]
    final = [True] * 4

    def run(n: int):
        return runner.execute([runner.new_state() for _ in range(n)], chunks[:n], final[:n])

    two = _peak_bytes(lambda: run(2))
    four = _peak_bytes(lambda: run(4))
    reference = [run(4)]
    splits = metric("t2w_vocoder_gpu_faults_total", kind="oom_split")
    with _Ballast(_room_between(two, four, share=0.125)):
        out = run(4)
    assert out.errors == [None] * 4
    assert metric("t2w_vocoder_gpu_faults_total", kind="oom_split") >= splits + 1, (
        f"4 rows fit in {two + (four - two) // 8} bytes (peaks: 2 rows {two}, 4 rows {four})"
    )
    for got, want in zip(out.audio, reference[0].audio, strict=True):
        assert got.shape == want.shape and got.size > 0
        assert np.abs(got - want).max() <= 1e-4
