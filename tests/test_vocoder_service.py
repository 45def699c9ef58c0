"""vocoder_service over real gRPC on loopback (small HiFT preset, CPU): session order, retries,
lifetime, batching across sessions, export/import, bad input; plus the batcher and runner
without gRPC."""

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from _stack import until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from token2wav import SAMPLES_PER_FRAME
from token2wav.server import ServerOptions
from token2wav.service import start
from token2wav.tensors import decode, encode
from token2wav.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.batcher import Batcher
from vocoder_service.chunks import MelChunk
from vocoder_service.config import BatcherConfig, SessionConfig, VocoderServiceConfig
from vocoder_service.export import RetryEntry, SessionSnapshot, pack_session, unpack_session
from vocoder_service.manager import SessionManager
from vocoder_service.model import (
    HOLDBACK_FRAMES,
    HiFTSessionState,
    InvalidInput,
    load_hift,
)
from vocoder_service.runner import BatchOutput, HiFTRunner
from vocoder_service.service import VocoderService

ROOT = Path(__file__).resolve().parent.parent
Code = grpc.StatusCode


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return load_hift(None, preset="small")


def make_mel(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(-5.0, 2.0, (80, frames)).astype(np.float32)


def split(mel: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    edges = np.cumsum([0, *sizes])
    assert edges[-1] == mel.shape[1]
    return [mel[:, a:b] for a, b in zip(edges[:-1], edges[1:])]


def chunk(rid: str, seq: int, mel: np.ndarray | None, finalize: bool = False):
    msg = vocoder_pb2.VocoderChunk(request_id=rid, seq=seq, finalize=finalize)
    if mel is not None:
        msg.mel.CopyFrom(encode(mel))
    return msg


def chunks_of(rid: str, parts: list[np.ndarray]) -> list:
    return [chunk(rid, i, p, i == len(parts) - 1) for i, p in enumerate(parts)]


def audio(msg) -> np.ndarray:
    return decode(msg.audio, "audio", shape=(None,))


def stitch(answers) -> np.ndarray:
    """Samples in order, checking invariant 4: contiguous offsets, each sample once."""
    offset, pieces = 0, []
    for msg in sorted(answers, key=lambda m: m.seq):
        assert msg.sample_offset == offset, (msg.seq, msg.sample_offset, offset)
        a = audio(msg)
        pieces.append(a)
        offset += a.shape[0]
    return np.concatenate(pieces)


def reference(model, mel: np.ndarray) -> np.ndarray:
    return model.decode(torch.from_numpy(mel), True).numpy()


class Client:
    def __init__(self, server, channel):
        self.server = server
        self.manager = server.service.manager
        self.stub = vocoder_pb2_grpc.VocoderStub(channel)

    async def run(self, msgs, timeout: float = 30) -> list:
        return [m async for m in self.stub.Session(iter(msgs), timeout=timeout)]

    async def fails(self, msgs, code, timeout: float = 30) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.run(msgs, timeout)
        assert info.value.code() == code, info.value.details()
        return info.value.details()


@pytest.fixture
async def serve(model):
    made = []

    async def make(hift=None, **kw) -> Client:
        batch = {k: kw.pop(k) for k in ("max_batch_sessions", "max_wait_ms") if k in kw}
        cfg = VocoderServiceConfig(
            sessions=SessionConfig(**kw),
            batcher=BatcherConfig(**batch),
            server=ServerOptions(port=0, grace_period=1),
        )
        srv = await start(VocoderService(cfg, model=hift or model))
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
        made.append((srv, ch))
        return Client(srv, ch)

    yield make
    for srv, ch in made:
        await ch.close()
        await srv.drain()


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- order, retries, end of stream ---------------------------------------------------------------


async def test_in_order_session_equals_full_history_decode(serve, model):
    c = await serve()
    mel = make_mel(1, 140)
    sizes = [20, 37, 50, 33]
    answers = await c.run(chunks_of("in-order", split(mel, sizes)))
    assert [m.seq for m in answers] == [0, 1, 2, 3]
    assert [m.is_final for m in answers] == [False, False, False, True]
    assert {m.request_id for m in answers} == {"in-order"}
    # Holdback: 8 frames stay back until finalize flushes them (docs/REFERENCE.md §5.5).
    lengths = [audio(m).shape[0] for m in answers]
    emitted = np.cumsum(sizes[:-1]) - HOLDBACK_FRAMES
    assert lengths[:-1] == list(np.diff([0, *emitted]) * SAMPLES_PER_FRAME)
    assert all(m.timing.batch_size >= 1 and m.timing.compute_ms > 0 for m in answers)
    got, ref = stitch(answers), reference(model, mel)
    assert got.shape == ref.shape == (140 * SAMPLES_PER_FRAME,)
    assert np.abs(got - ref).max() <= 1e-3  # invariant 3


async def test_out_of_order_chunks_wait_and_answer_in_seq_order(serve, model):
    c = await serve()
    mel = make_mel(2, 100)
    msgs = chunks_of("ooo", split(mel, [25, 25, 25, 25]))
    # seq 0 opens the session (a later seq of an unknown id is NOT_FOUND); then any order.
    answers = await c.run([msgs[0], msgs[3], msgs[2], msgs[1]])
    assert [m.seq for m in answers] == [0, 1, 2, 3]
    assert np.abs(stitch(answers) - reference(model, mel)).max() <= 1e-3


async def test_duplicates_get_the_same_audio_and_do_not_advance(serve, model):
    c = await serve()
    mel = make_mel(3, 90)
    msgs = chunks_of("dup", split(mel, [30, 30, 30]))
    first = await c.run(msgs[:2])
    again = await c.run([msgs[1], msgs[0]])  # retries of applied chunks, on a new stream
    assert [(m.seq, m.sample_offset) for m in again] == [(1, first[1].sample_offset), (0, 0)]
    assert np.array_equal(audio(again[0]), audio(first[1]))
    assert np.array_equal(audio(again[1]), audio(first[0]))
    # A duplicate of a chunk still waiting for its turn shares its answer: both are answered.
    last = await c.run([msgs[2], msgs[2]])
    assert [m.seq for m in last] == [2, 2] and np.array_equal(audio(last[0]), audio(last[1]))
    assert np.abs(stitch(first + last[:1]) - reference(model, mel)).max() <= 1e-3


async def test_conflicting_duplicate_is_aborted_and_the_session_goes_on(serve, model):
    c = await serve()
    mel = make_mel(4, 80)
    parts = split(mel, [40, 20, 20])
    msgs = chunks_of("conflict", parts)
    first = await c.run(msgs[:2])
    details = await c.fails([chunk("conflict", 1, make_mel(5, 20))], Code.ABORTED)
    assert details.startswith("seq 1:")
    # The same frames with another finalize flag are a different payload too.
    await c.fails([chunk("conflict", 1, parts[1], finalize=True)], Code.ABORTED)
    rest = await c.run(msgs[2:])  # the first payload stood; the state is intact
    assert np.abs(stitch(first + rest) - reference(model, mel)).max() <= 1e-3


async def test_gap_that_fills_in_time_is_applied(serve, model):
    c = await serve(gap_timeout_s=0.3, sweep_interval_s=600)  # sweeps only when the test says
    mel = make_mel(6, 60)
    msgs = chunks_of("gap-fills", split(mel, [20, 20, 20]))
    call = c.stub.Session(timeout=30)
    await call.write(msgs[0])
    await call.write(msgs[2])  # seq 1 is missing: seq 2 waits
    first = await call.read()
    s = c.manager._active["gap-fills"]
    await until(lambda: s.blocked_since is not None)  # seq 0 applied, seq 2 waits on the gap
    assert list(s.pending) == [2]
    c.manager.sweep(now=s.blocked_since + 0.29)  # just short of the gap timeout
    assert c.manager._active.get("gap-fills") is s and s.error is None
    await call.write(msgs[1])
    await call.done_writing()
    rest = [await call.read(), await call.read()]
    assert await call.read() == grpc.aio.EOF
    assert [m.seq for m in [first, *rest]] == [0, 1, 2]
    assert np.abs(stitch([first, *rest]) - reference(model, mel)).max() <= 1e-3


async def test_gap_that_never_fills_fails_the_session(serve):
    c = await serve(gap_timeout_s=0.3, sweep_interval_s=0.05)
    before = metric("t2w_vocoder_evictions_total", reason="error")
    mel = make_mel(7, 60)
    msgs = chunks_of("gap-times-out", split(mel, [20, 20, 20]))
    start = time.monotonic()
    details = await c.fails([msgs[0], msgs[2]], Code.ABORTED)
    assert 0.3 <= time.monotonic() - start < 5
    assert "seq 1 did not arrive" in details
    # The session stays failed: the missing chunk, arriving late, is refused too.
    assert "failed" in await c.fails([msgs[1]], Code.ABORTED)
    assert metric("t2w_vocoder_evictions_total", reason="error") == before + 1


async def test_chunk_after_finalize_is_aborted_and_final_retry_is_answered(serve):
    c = await serve()
    mel = make_mel(8, 50)
    msgs = chunks_of("fin", split(mel, [30, 20]))
    answers = await c.run(msgs)
    assert answers[-1].is_final
    assert "finalized at seq 1" in await c.fails([chunk("fin", 2, make_mel(9, 10))], Code.ABORTED)
    retry = await c.run([msgs[1]])  # the final answer was lost: a retry gets it again
    assert retry[0].is_final and np.array_equal(audio(retry[0]), audio(answers[1]))
    # A finalize that would end the stream before a later seq already sent is refused.
    c2 = [chunk("fin2", 0, make_mel(10, 10)), chunk("fin2", 2, make_mel(11, 10))]
    call = c.stub.Session(timeout=30)
    for m in c2:
        await call.write(m)
    await call.read()
    await call.write(chunk("fin2", 1, make_mel(12, 10), finalize=True))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == Code.ABORTED and "seq 2 was already sent" in info.value.details()


async def test_caps_answer_resource_exhausted(serve):
    c = await serve(max_num_sessions=2, reorder_window=3, reorder_bytes=80 * 4 * 25)
    m10 = make_mel(13, 10)
    await c.run([chunk("cap-a", 0, m10)])
    await c.run([chunk("cap-b", 0, m10)])
    assert "session cap" in await c.fails([chunk("cap-c", 0, m10)], Code.RESOURCE_EXHAUSTED)
    await c.run([chunk("cap-a", 1, m10, finalize=True)])  # a finished session frees its place
    await c.run([chunk("cap-c", 0, m10)])
    # Reorder window: seq may lead the next expected one (1) by at most 2 more.
    details = await c.fails([chunk("cap-c", 4, m10)], Code.RESOURCE_EXHAUSTED)
    assert "reorder window" in details
    # Reorder bytes: 25 frames may wait; 20 + 10 may not.
    call = c.stub.Session(timeout=30)
    await call.write(chunk("cap-c", 2, make_mel(14, 20)))
    await call.write(chunk("cap-c", 3, m10))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == Code.RESOURCE_EXHAUSTED and "reorder buffer" in info.value.details()
    # The session is unharmed: the waiting chunk is applied once the gap fills.
    call = c.stub.Session(timeout=30)
    await call.write(chunk("cap-c", 1, m10))
    answers = [await call.read()]
    # Seq 2's answer went to the stream that sent it, which failed: retry it (applied by now).
    await call.write(chunk("cap-c", 2, make_mel(14, 20)))
    answers.append(await call.read())
    await call.write(chunk("cap-c", 3, m10, finalize=True))
    answers.append(await call.read())
    assert [m.seq for m in answers] == [1, 2, 3] and answers[-1].is_final


def active_after(manager, request_id: str, idle_s: float) -> int:
    """Open sessions after a sweep `idle_s` seconds after `request_id`'s last chunk."""
    manager.sweep(now=manager._active[request_id].last_active + idle_s)
    return manager.stats()["num_active"]


async def test_idle_session_is_evicted_and_unknown_ids_are_not_found(serve):
    c = await serve(idle_timeout_s=0.3, sweep_interval_s=600)  # sweeps only when the test says
    before = metric("t2w_vocoder_evictions_total", reason="idle")
    m10 = make_mel(15, 10)
    await c.run([chunk("idle", 0, m10)])
    await until(lambda: "idle" not in c.manager._streams)  # the server saw the stream end
    assert active_after(c.manager, "idle", 0.29) == 1
    assert active_after(c.manager, "idle", 0.31) == 0
    assert metric("t2w_vocoder_evictions_total", reason="idle") == before + 1
    assert "no session" in await c.fails([chunk("idle", 1, m10)], Code.NOT_FOUND)
    await c.fails([chunk("never-opened", 3, m10)], Code.NOT_FOUND)


async def test_open_stream_keeps_its_session_past_the_idle_timeout(serve, model):
    """A caller whose stream stays open is waiting on upstream work (a busy flow service),
    not gone: its session is not evicted; once the stream ends, the idle clock runs."""
    c = await serve(idle_timeout_s=0.3, sweep_interval_s=600)  # sweeps only when the test says
    mel = make_mel(18, 40)
    msgs = chunks_of("slow", split(mel, [20, 20]))
    call = c.stub.Session(timeout=30)
    await call.write(msgs[0])
    first = await call.read()
    assert active_after(c.manager, "slow", 0.7) == 1  # > 2 idle timeouts, the stream open
    await call.write(msgs[1])
    last = await call.read()
    assert last.is_final
    assert np.abs(stitch([first, last]) - reference(model, mel)).max() <= 1e-3
    await call.done_writing()
    # a second session whose stream ends without finalize: evicted one timeout later
    call = c.stub.Session(timeout=30)
    await call.write(chunk("left", 0, make_mel(19, 10)))
    await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    await until(lambda: "left" not in c.manager._streams)  # the server saw the stream end
    assert active_after(c.manager, "left", 0.1) == 1
    assert active_after(c.manager, "left", 0.31) == 0


async def test_resume_after_the_transport_stream_is_cut(serve, model):
    c = await serve()
    mel = make_mel(16, 120)
    msgs = chunks_of("resume", split(mel, [30, 30, 30, 30]))
    call = c.stub.Session(timeout=30)
    await call.write(msgs[0])
    first = await call.read()
    await call.write(msgs[1])  # its answer is lost with the stream
    s = c.manager._active["resume"]
    await until(lambda: s.next_seq == 2 and s.inflight is None)  # seq 1 applied
    call.cancel()
    await until(lambda: "resume" not in c.manager._streams)  # the server saw the stream end
    assert c.manager.stats()["num_active"] == 1  # the session outlives its transport
    rest = await c.run(msgs[1:])  # resend the unanswered seq 1, then go on
    assert [m.seq for m in rest] == [1, 2, 3]
    assert np.abs(stitch([first, *rest]) - reference(model, mel)).max() <= 1e-3


async def test_cancel_drops_the_session(serve):
    c = await serve()
    before = metric("t2w_vocoder_evictions_total", reason="cancel")
    m10 = make_mel(17, 10)
    await c.run([chunk("cancel-me", 0, m10)])
    resp = await c.stub.CancelSession(vocoder_pb2.CancelSessionRequest(request_id="cancel-me"))
    assert resp.cancelled
    assert metric("t2w_vocoder_evictions_total", reason="cancel") == before + 1
    await c.fails([chunk("cancel-me", 1, m10)], Code.NOT_FOUND)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CancelSession(vocoder_pb2.CancelSessionRequest(request_id="cancel-me"))
    assert info.value.code() == Code.NOT_FOUND


async def test_export_import_moves_a_session_between_replicas(serve, model):
    a, b = await serve(), await serve()
    mel = make_mel(18, 110)
    msgs = chunks_of("move", split(mel, [40, 30, 20, 20]))
    first = await a.run(msgs[:2])
    exported = await a.stub.ExportSession(
        vocoder_pb2.ExportSessionRequest(request_id="move", remove=True)
    )
    assert exported.next_seq == 2 and exported.sample_offset == sum(audio(m).size for m in first)
    await a.fails([msgs[2]], Code.NOT_FOUND)  # gone from the old replica
    imp = vocoder_pb2.ImportSessionRequest(request_id="move", state=exported.state, next_seq=2)
    await b.stub.ImportSession(imp)
    retry = await b.run([msgs[1]])  # an answer lost in the move is retried on the new replica
    assert np.array_equal(audio(retry[0]), audio(first[1]))
    rest = await b.run(msgs[2:])
    assert np.abs(stitch(first + rest) - reference(model, mel)).max() <= 1e-3


async def test_sessions_do_not_move_between_phase_modes(serve):
    """A session's phase state is in its mode's own units: an "exact" session imported into an
    "upstream" replica would continue with a wrong phase, so the import is refused up front."""
    a = await serve()
    b = await serve(hift=load_hift(None, preset="small", phase_mode="upstream"))
    assert a.manager.model_tag == "small:phase-exact"
    assert b.manager.model_tag == "small:phase-upstream"
    await a.run([chunk("mode", 0, make_mel(31, 20))])
    exported = await a.stub.ExportSession(vocoder_pb2.ExportSessionRequest(request_id="mode"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await b.stub.ImportSession(
            vocoder_pb2.ImportSessionRequest(request_id="mode", state=exported.state, next_seq=1)
        )
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert "phase-exact" in info.value.details(), info.value.details()
    # Behind the envelope, the state itself is bound to the mode too (its fingerprint).
    snap = unpack_session(exported.state, a.manager.model_tag)
    st = HiFTSessionState.from_bytes(snap.state)
    assert st.fingerprint.endswith("phase-exact")
    with pytest.raises(InvalidInput, match="another model"):
        b.server.service.model.check_mel_chunk(st, torch.zeros(80, 10), False)


@pytest.mark.parametrize("max_batch", [1, 32], ids=["steps-of-one", "batched-steps"])
async def test_32_interleaved_shuffled_sessions_equal_serial_runs(serve, model, max_batch):
    """Interleaving and reordering change nothing: with one session per HiFT step the audio is
    bit-identical to serial runs; with steps shared by sessions it agrees to rounding."""
    c = await serve(max_batch_sessions=max_batch, reorder_window=4, max_wait_ms=5)
    rng = random.Random(0)
    sessions = {}
    for i in range(32):
        sizes = [rng.randint(9, 16) for _ in range(3)]
        sessions[f"s{i:02d}"] = split(make_mel(100 + i, sum(sizes)), sizes)
    # Serial: one session at a time, one chunk per step.
    serial = {}
    for rid, parts in sessions.items():
        st = model.new_session()
        outs = [
            model.decode_batch([st], [torch.from_numpy(p)], [k == 2])[0]
            for k, p in enumerate(parts)
        ]
        serial[rid] = torch.cat(outs).numpy()
    # Interleaved on one multiplexed stream, each session's chunks shuffled within its window.
    msgs = []
    for rid, parts in sessions.items():
        later = chunks_of(rid, parts)[1:]
        rng.shuffle(later)
        msgs.append([chunk(rid, 0, parts[0]), *later])
    order = [m for k in range(3) for m in (s[k] for s in msgs)]
    answers = await c.run(order)
    assert len(answers) == 32 * 3
    biggest = max(m.timing.batch_size for m in answers)
    assert biggest == 1 if max_batch == 1 else biggest > 1  # steps shared only when allowed
    identical = True
    for rid in sessions:
        got = stitch([m for m in answers if m.request_id == rid])
        assert got.shape == serial[rid].shape, rid
        # A slot or state mix-up would be off by O(0.1); rounding is O(1e-7).
        assert np.abs(got - serial[rid]).max() <= 1e-5, rid
        identical &= bool(np.array_equal(got, serial[rid]))
    if max_batch == 1:
        assert identical, "steps of one session each must reproduce serial runs bit for bit"
    elif not identical:
        # The service hands each row the same inputs and state either way; the model's batched
        # step differs from a batch of one by float rounding on this backend (oneDNN picks
        # another conv kernel for batch 1). Bit identity needs a batch-invariant model.step.
        pytest.xfail("model.step is not bit-identical across batch sizes on this backend")


# -- bad input -----------------------------------------------------------------------------------


def _tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=(80, 4), data=None):
    n = int(np.prod(shape)) * 4
    return common_pb2.Tensor(
        dtype=dtype, shape=list(shape), data=b"\0" * n if data is None else data
    )


def _with_tensor(rid, seq, tensor, finalize=False):
    return vocoder_pb2.VocoderChunk(request_id=rid, seq=seq, mel=tensor, finalize=finalize)


def _nan_mel():
    mel = make_mel(20, 4)
    mel[3, 2] = np.nan
    return mel


BAD_CHUNKS = {
    "empty id": ("request_id", chunk("", 0, make_mel(20, 4))),
    "bad char": ("request_id", chunk("no spaces allowed", 0, make_mel(20, 4))),
    "long id": ("request_id", chunk("x" * 129, 0, make_mel(20, 4))),
    "huge seq": ("seq", chunk("bad-seq", 10**9, make_mel(20, 4))),
    "no mel": ("mel", chunk("bad-mel", 0, None)),
    "int mel": ("mel", _with_tensor("bad-mel", 0, _tensor(common_pb2.DTYPE_INT32))),
    "no dtype": ("mel", _with_tensor("bad-mel", 0, _tensor(common_pb2.DTYPE_UNSPECIFIED))),
    "rank 1": ("mel", _with_tensor("bad-mel", 0, _tensor(shape=(320,)))),
    "81 bins": ("mel", _with_tensor("bad-mel", 0, _tensor(shape=(81, 4)))),
    "short data": ("mel", _with_tensor("bad-mel", 0, _tensor(data=b"\0" * 12))),
    "nan": ("mel", chunk("bad-mel", 0, _nan_mel())),
    "0 frames": ("mel", chunk("bad-mel", 0, np.zeros((80, 0), np.float32))),
    "too long": ("mel", chunk("bystander", 1, make_mel(21, 15000))),
}


async def test_bad_input_names_the_field_and_leaves_other_sessions_alone(serve, model):
    c = await serve()
    mel = make_mel(22, 60)
    parts = split(mel, [20, 20, 20])
    first = await c.run([chunk("bystander", 0, parts[0])])
    for name, (field, msg) in BAD_CHUNKS.items():
        details = await c.fails([msg], Code.INVALID_ARGUMENT)
        assert details.startswith(f"{field}:"), (name, details)
    # On a multiplexed stream the bad chunk ends the stream; the good one before it still
    # applies (its answer is retried on the next stream).
    bad_nan = BAD_CHUNKS["nan"][1]
    await c.fails([chunk("bystander", 1, parts[1]), bad_nan], Code.INVALID_ARGUMENT)
    rest = await c.run([chunk("bystander", 1, parts[1]), chunk("bystander", 2, parts[2], True)])
    assert np.abs(stitch(first + rest) - reference(model, mel)).max() <= 1e-3
    # No session was opened by any bad chunk; a flush-only finalize (no mel) is valid.
    assert c.manager.stats()["num_active"] == 0
    flush = await c.run([chunk("flush", 0, make_mel(23, 12)), chunk("flush", 1, None, True)])
    assert flush[-1].is_final and audio(flush[-1]).size == HOLDBACK_FRAMES * SAMPLES_PER_FRAME


async def test_bad_control_requests_name_the_field(serve):
    c = await serve()
    calls = [
        c.stub.CancelSession(vocoder_pb2.CancelSessionRequest(request_id="a b")),
        c.stub.ExportSession(vocoder_pb2.ExportSessionRequest(request_id="")),
        c.stub.ImportSession(vocoder_pb2.ImportSessionRequest(request_id="ok", state=b"junk")),
        c.stub.ImportSession(vocoder_pb2.ImportSessionRequest(request_id="ok")),
        c.stub.ImportSession(vocoder_pb2.ImportSessionRequest(request_id="é", state=b"x")),
    ]
    fields = ["request_id", "request_id", "state", "state", "request_id"]
    for call, field in zip(calls, fields):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == Code.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}:"), info.value.details()
    await c.run([chunk("exp", 0, make_mel(24, 20))])
    exported = await c.stub.ExportSession(vocoder_pb2.ExportSessionRequest(request_id="exp"))
    state = exported.state
    for req, field in [
        (vocoder_pb2.ImportSessionRequest(request_id="i", state=state, next_seq=5), "next_seq"),
        (vocoder_pb2.ImportSessionRequest(request_id="i", state=state[:-3], next_seq=1), "state"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.ImportSession(req)
        assert info.value.details().startswith(f"{field}:"), info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ExportSession(vocoder_pb2.ExportSessionRequest(request_id="nobody"))
    assert info.value.code() == Code.NOT_FOUND
    # A state exported by another architecture is refused, not misread.
    snap = unpack_session(exported.state, c.manager.model_tag)
    alien = pack_session(type(snap)(**{**snap.__dict__, "model_tag": "cosyvoice3-0.5b"}))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ImportSession(
            vocoder_pb2.ImportSessionRequest(request_id="imp", state=alien, next_seq=1)
        )
    assert info.value.code() == Code.INVALID_ARGUMENT and "cosyvoice3-0.5b" in info.value.details()


# -- bounds and metrics --------------------------------------------------------------------------


async def test_session_memory_is_bounded_and_reported(serve):
    c = await serve(retry_window=3, sweep_interval_s=0.05)
    sizes = []
    for seq in range(10):
        await c.run([chunk("long", seq, make_mel(30 + seq, 12))])
        sizes.append(c.manager.session_bytes("long"))
    s = c.manager._active["long"]
    assert len(s.applied) == 3  # the retry cache keeps the last 3 answers only
    # Once the HiFT window and the retry cache are full, the session stops growing.
    assert max(sizes[5:]) <= sizes[5] and s.state.nbytes < 200_000
    # the sweeper (every 0.05 s) publishes the gauges
    await until(lambda: metric("t2w_vocoder_state_bytes") >= sizes[-1], timeout=10)
    assert metric("t2w_vocoder_active_sessions") >= 1
    assert metric("t2w_vocoder_batch_sessions_count") > 0
    assert metric("t2w_vocoder_chunk_latency_seconds_count") > 0


# -- batcher and runner without gRPC -------------------------------------------------------------


class FakeState:
    def __init__(self):
        self.num_samples_emitted = 0
        self.nbytes = 64


class FakeRunner:
    """Answers each slot with 480 samples per frame, valued by the chunk's first mel value."""

    def __init__(self, drop_last_slot=False):
        self.batches = []
        self.drop_last_slot = drop_last_slot

    def execute(self, states, mels, finalize):
        self.batches.append([float(m[0, 0]) for m in mels])
        audio = []
        for st, m in zip(states, mels):
            n = m.shape[1] * SAMPLES_PER_FRAME
            st.num_samples_emitted += n
            audio.append(np.full(n, m[0, 0], np.float32))
        if self.drop_last_slot:
            audio = audio[:-1]
        return BatchOutput(audio, [None] * len(audio), [False] * len(audio), compute_ms=1.0)


def _fake_manager(**kw):
    return SessionManager(SessionConfig(**kw), FakeState, lambda b: FakeState())


def _tag(value: float, frames: int = 2) -> np.ndarray:
    return np.full((80, frames), value, np.float32)


async def test_batcher_takes_one_chunk_per_session_per_step():
    manager, runner = _fake_manager(), FakeRunner()
    batcher = Batcher(manager, runner, BatcherConfig(max_batch_sessions=2, max_wait_ms=0))
    futs = [manager.submit(MelChunk("A", seq, _tag(10 + seq), False)) for seq in range(3)]
    futs += [manager.submit(MelChunk("B", 0, _tag(20), False))]
    futs += [manager.submit(MelChunk("C", 0, _tag(30), False))]
    while manager.num_ready:
        await batcher.run_batch()
    # Oldest first, at most 2 sessions, never two chunks of one session in a step.
    assert runner.batches == [[10, 20], [30, 11], [12]]
    results = [f.result() for f in futs]
    assert [r.sample_offset for r in results[:3]] == [0, 960, 1920]
    assert all(float(r.audio[0]) == float(10 + i) for i, r in enumerate(results[:3]))
    assert [r.batch_size for r in results] == [2, 2, 1, 2, 2]
    batcher.close()


async def test_missing_slot_fails_the_step_loudly():
    manager = _fake_manager()
    batcher = Batcher(manager, FakeRunner(drop_last_slot=True), BatcherConfig(max_wait_ms=0))
    futs = [manager.submit(MelChunk(rid, 0, _tag(v), False)) for rid, v in (("A", 1), ("B", 2))]
    await batcher.run_batch()
    for fut in futs:  # neither slot may take the other's audio
        assert isinstance(fut.exception(), RuntimeError)
    assert manager.stats()["num_active"] == 0  # both sessions failed, as tombstones
    with pytest.raises(Exception, match="failed earlier"):
        manager.submit(MelChunk("A", 1, _tag(1), False))
    batcher.close()


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _urgent_batcher(clock, **batch):
    manager = SessionManager(SessionConfig(), FakeState, lambda b: FakeState(), clock=clock)
    runner = FakeRunner()
    return manager, runner, Batcher(manager, runner, BatcherConfig(max_wait_ms=0, **batch))


async def _drain(manager, batcher) -> None:
    while manager.num_ready:
        await batcher.run_batch()


def _submit(manager, rid: str, tag: float, due: float, frames: int = 2, seq: int = 0):
    return manager.submit(MelChunk(rid, seq, _tag(tag, frames), False, due=due))


async def test_urgent_chunks_run_alone_and_the_others_next():
    clock = FakeClock(10.0)
    manager, runner, batcher = _urgent_batcher(clock, urgent_slack_ms=100, urgent_max_frames=0)
    # two long chunks with seconds of slack, an old client's chunk without a deadline, and two
    # first chunks: one with 80 ms of slack, one already 20 ms late
    futs = [
        _submit(manager, "long1", 1, due=15.0, frames=100),
        _submit(manager, "long2", 2, due=13.0, frames=100),
        _submit(manager, "old", 3, due=math.inf, frames=100),
        _submit(manager, "first1", 4, due=10.08, frames=50),
        _submit(manager, "first2", 5, due=9.98, frames=50),
    ]
    before = metric("t2w_vocoder_urgent_batches_total")
    await _drain(manager, batcher)
    # the urgent ones alone, least slack first; then the rest by slack, no deadline last
    assert runner.batches == [[5, 4], [2, 1, 3]]
    assert [f.result().batch_size for f in futs] == [3, 3, 3, 2, 2]
    assert metric("t2w_vocoder_urgent_batches_total") == before + 1
    batcher.close()


async def test_a_waiting_chunk_becomes_urgent_as_its_deadline_nears():
    clock = FakeClock(0.0)
    manager, runner, batcher = _urgent_batcher(clock, urgent_slack_ms=100)
    _submit(manager, "long", 1, due=1.0, frames=100)
    _submit(manager, "relaxed", 2, due=10.0, frames=100)
    _submit(manager, "first", 3, due=0.05)
    await batcher.run_batch()
    assert runner.batches == [[3]]
    clock.now = 0.95  # "long" has 50 ms left now: it runs with the next first chunk, by slack
    _submit(manager, "first2", 4, due=1.03)
    await batcher.run_batch()
    assert runner.batches[-1] == [1, 4]
    await _drain(manager, batcher)
    assert runner.batches[-1] == [2]  # nothing urgent left: the relaxed chunk runs
    batcher.close()


async def test_an_urgent_batch_stops_at_its_frame_budget():
    clock = FakeClock(0.0)
    manager, runner, batcher = _urgent_batcher(clock, urgent_slack_ms=100, urgent_max_frames=150)
    _submit(manager, "late_long", 1, due=0.0, frames=200)  # least slack, over the budget alone
    _submit(manager, "first1", 2, due=0.01, frames=50)
    _submit(manager, "first2", 3, due=0.02, frames=50)
    _submit(manager, "first3", 4, due=0.03, frames=60)
    _submit(manager, "relaxed", 5, due=9.0, frames=200)
    await _drain(manager, batcher)
    # 200 frames go alone (the least slack always goes); 2 x 50 fit in 150 frames, a third
    # padded to 60 (3 x 60 = 180) does not; the relaxed chunk waits for the urgent ones
    assert runner.batches == [[1], [2, 3], [4], [5]]
    batcher.close()


@pytest.mark.parametrize("case", ["threshold_0", "no_deadlines"])
async def test_without_threshold_or_deadlines_batches_are_as_before(case):
    clock = FakeClock(0.0)
    manager, runner, batcher = _urgent_batcher(
        clock, urgent_slack_ms=0 if case == "threshold_0" else 100
    )
    dues = [5.0, 0.01, math.inf, -1.0] if case == "threshold_0" else [math.inf] * 4
    for i, due in enumerate(dues):
        _submit(manager, f"s{i}", i, due=due)
    before = metric("t2w_vocoder_urgent_batches_total")
    await _drain(manager, batcher)
    # one batch of everything: least slack first, no deadline last (all FIFO without any)
    assert runner.batches == ([[3, 1, 0, 2]] if case == "threshold_0" else [[0, 1, 2, 3]])
    assert metric("t2w_vocoder_urgent_batches_total") == before
    batcher.close()


def test_runner_rejects_a_bad_row_and_runs_the_others(model):
    runner = HiFTRunner(model)
    states = [model.new_session() for _ in range(3)]
    mels = [make_mel(40, 12), _nan_mel(), make_mel(41, 12)]
    out = runner.execute(states, mels, [True, True, True])
    assert out.errors[0] is None and out.errors[2] is None
    assert str(out.errors[1]).startswith("mel:") and out.fatal[1] is False
    assert states[1].num_frames == 0  # the bad row's state is untouched
    for i in (0, 2):
        alone = model.decode(torch.from_numpy(mels[i]), True).numpy()
        assert np.abs(out.audio[i] - alone).max() <= 1e-5


def test_export_envelope_round_trips_and_rejects_damage(model):
    st = model.new_session()
    model.decode_batch([st], [torch.from_numpy(make_mel(42, 12))], [False])
    entry = RetryEntry(0, bytes(range(16)), 0, False, np.arange(1920, dtype=np.float32))
    snap = SessionSnapshot("small", 1, 12, st.num_samples_emitted, st.to_bytes(), [entry])
    blob = pack_session(snap)
    back = unpack_session(blob, "small")
    assert (back.next_seq, back.num_frames, back.num_samples) == (1, 12, 1920)
    assert back.state == snap.state and back.applied[0].digest == entry.digest
    assert np.array_equal(back.applied[0].audio, entry.audio)
    for damaged in (blob[:3], blob[:-1], blob + b"\0", b"XXXX" + blob[4:]):
        with pytest.raises(ValueError) as info:
            unpack_session(damaged, "small")
        assert info.value.field == "state"
    manager = SessionManager(
        SessionConfig(), model.new_session, HiFTSessionState.from_bytes, model_tag="small"
    )
    manager.import_session("round-trip", back, 1)
    assert manager.session_bytes("round-trip") >= st.nbytes + entry.audio.nbytes


# -- the process ---------------------------------------------------------------------------------


def test_cli_flags_mirror_env(monkeypatch):
    from vocoder_service.config import build_parser

    monkeypatch.setenv("VOCODER_MAX_BATCH_SESSIONS", "1")
    monkeypatch.setenv("VOCODER_MODEL_DIR", "")  # compose writes empty values for "unset"
    monkeypatch.setenv("VOCODER_PRESET", "")
    monkeypatch.setenv("VOCODER_PHASE_MODE", "upstream")
    parser = build_parser()
    args = parser.parse_args(["--idle-timeout", "7"])
    cfg = VocoderServiceConfig.from_args(args)
    assert cfg.batcher.max_batch_sessions == 1 and cfg.sessions.idle_timeout_s == 7
    assert cfg.model.model_dir is None and cfg.model.preset is None
    assert cfg.model.phase_mode == "upstream"
    assert cfg.batcher.urgent_slack_ms == 100 and cfg.batcher.urgent_max_frames == 1600
    with pytest.raises(ValueError, match="urgent_max_frames -1: want >= 0"):
        BatcherConfig(urgent_max_frames=-1)
    assert VocoderServiceConfig.from_args(
        parser.parse_args(["--phase-mode", "exact"])
    ).model.phase_mode == ("exact")
    assert args.port == 50053 and args.metrics_port == 9103
    text = " ".join(parser.format_help().split())
    flags = "--model-dir --preset --device --dtype --phase-mode --max-sessions --gap-timeout"
    flags += " --reorder-window --max-batch-sessions --max-wait-ms"
    for flag in flags.split():
        assert flag in text and f"[env {parser.env_name(flag)}]" in text


@pytest.mark.parametrize("mode", ["exact", "upstream"])
def test_phase_mode_reaches_the_model(mode):
    from vocoder_service.config import build_parser

    cfg = VocoderServiceConfig.from_args(build_parser().parse_args(["--phase-mode", mode]))
    service = VocoderService(cfg)  # loads the model as `python -m vocoder_service` does
    assert service.model.cfg.phase_mode == mode
    assert service.model.new_session().fingerprint.endswith(f"phase-{mode}")
    assert service.manager.model_tag == f"small:phase-{mode}"


def test_bad_phase_mode_is_named(monkeypatch, capsys):
    from vocoder_service.__main__ import main

    monkeypatch.setenv("VOCODER_PHASE_MODE", "cuda")  # env values skip argparse's choices
    with pytest.raises(SystemExit):
        main([])
    assert "phase_mode 'cuda'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--phase-mode", "fast"])
    assert "--phase-mode" in capsys.readouterr().err


def test_python_m_vocoder_service_serves_and_drains():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vocoder_service", "--port", "0", "--metrics-port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        port = None
        for line in proc.stderr:
            if "listening on" in line:
                port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
            if "SERVING" in line and "NOT" not in line:
                break
        assert port, "no listening line"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            status = health.Check(
                health_pb2.HealthCheckRequest(service="token2wav.v1.Vocoder"), timeout=5
            ).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = vocoder_pb2_grpc.VocoderStub(ch)
            answers = list(stub.Session(iter(chunks_of("proc", [make_mel(50, 20)])), timeout=30))
            assert answers[0].is_final and audio(answers[0]).size == 20 * SAMPLES_PER_FRAME
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_digest_of_received_bytes_equals_digest_of_decoded_mel():
    """The servicer hashes the bytes it received; a chunk built from an array (tests, import)
    must get the same digest, or a retry would look like a different chunk."""
    from vocoder_service.chunks import mel_chunk_digest, mel_digest
    from vocoder_service.servicer import mel_chunk_from_proto

    mel = np.random.default_rng(3).standard_normal((80, 7)).astype(np.float32)
    wire = encode(mel)
    assert mel_digest(7, wire.data, False) == mel_chunk_digest(mel, False)
    assert mel_digest(7, wire.data, True) != mel_chunk_digest(mel, False)
    msg = vocoder_pb2.VocoderChunk(request_id="r", seq=0, mel=wire)
    assert mel_chunk_from_proto(msg, SessionConfig(), 10).digest == mel_chunk_digest(mel, False)
