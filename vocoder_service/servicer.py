"""gRPC edge of the vocoder service: proto <-> plain objects, then await the manager.

Session stream. One transport stream may carry chunks of several sessions. A reader task admits
requests as they arrive while this coroutine writes answers as chunks are applied: in seq order
per session (chunks of a session apply in seq order), duplicates answered at once. When the
client half-closes, the stream ends after the last outstanding answer.

Errors on a multiplexed stream: the first chunk that fails (bad field, admission refused, its
session failed) ends the transport stream with that chunk's status; the interceptor maps it.
Sessions are not ended by it: their other chunks still apply, and the caller may open a new
stream and retry (applied seqs are answered again from the retry cache). The gateway opens one
transport stream per session, so in practice the status is the session's.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from token2wav import MEL_BINS
from token2wav.errors import InvalidArgument, check_request_id
from token2wav.server import request_id_var
from token2wav.tensors import decode, encode
from token2wav.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.chunks import AudioChunk, MelChunk, mel_digest
from vocoder_service.config import MEL_FRAME_BYTES, SessionConfig
from vocoder_service.export import pack_session, unpack_session
from vocoder_service.manager import SessionManager

logger = logging.getLogger(__name__)

_END = object()  # the reader saw the client's half-close


def mel_chunk_from_proto(
    msg: vocoder_pb2.VocoderChunk, cfg: SessionConfig, max_seq: int
) -> MelChunk:
    """Validate every field of one VocoderChunk; InvalidArgument names the first bad one."""
    request_id = check_request_id(msg.request_id)
    if msg.seq > max_seq:
        raise InvalidArgument(
            "seq", f"{msg.seq} exceeds {max_seq}, the most chunks a session can hold"
        )
    if not msg.HasField("mel") and msg.finalize:
        mel = np.zeros((MEL_BINS, 0), dtype=np.float32)  # flush only
    else:
        mel = decode(
            msg.mel,
            "mel",
            shape=(MEL_BINS, None),
            max_bytes=cfg.max_chunk_frames * MEL_FRAME_BYTES,
        )
        if mel.shape[1] == 0 and not msg.finalize:
            raise InvalidArgument("mel", "0 frames; only a finalize chunk may be empty")
    finalize = bool(msg.finalize)
    # the digest of the bytes received: the same as mel_chunk_digest(mel), without re-encoding
    digest = mel_digest(int(mel.shape[1]), msg.mel.data, finalize)
    return MelChunk(request_id, int(msg.seq), mel, finalize, digest)


def audio_to_proto(out: AudioChunk) -> vocoder_pb2.VocoderAudio:
    return vocoder_pb2.VocoderAudio(
        request_id=out.request_id,
        seq=out.seq,
        sample_offset=out.sample_offset,
        audio=encode(out.audio.astype(np.float32, copy=False)),
        is_final=out.is_final,
        timing=common_pb2.StageTiming(
            queue_ms=out.queue_ms, compute_ms=out.compute_ms, batch_size=out.batch_size
        ),
    )


class VocoderServicer(vocoder_pb2_grpc.VocoderServicer):
    def __init__(self, manager: SessionManager):
        self.manager = manager
        # Every non-final chunk carries >= 1 frame, so a legal session has at most this many.
        self.max_seq = manager.max_session_frames

    async def Session(self, request_iterator, context):
        done: asyncio.Queue = asyncio.Queue()  # finished futures, reader errors, _END
        waiting: dict[asyncio.Future, int] = {}  # future -> answers owed (duplicates share one)

        attached: set[str] = set()  # request ids this stream keeps from idle eviction

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    chunk = mel_chunk_from_proto(msg, self.manager.config, self.max_seq)
                    if msg.HasField("slack_ms"):  # relative to the send: starts on arrival
                        chunk.due = self.manager.clock() + msg.slack_ms / 1e3
                    request_id_var.set(chunk.request_id)
                    fut = self.manager.submit(chunk)
                    if chunk.request_id not in attached:
                        attached.add(chunk.request_id)
                        self.manager.attach(chunk.request_id)
                    waiting[fut] = waiting.get(fut, 0) + 1
                    fut.add_done_callback(done.put_nowait)
            except Exception as exc:  # noqa: BLE001 - handed to the writer, which raises it
                done.put_nowait(exc)
            else:
                done.put_nowait(_END)

        reader = asyncio.create_task(read())
        reading = True
        try:
            while reading or waiting:
                item = await done.get()
                if item is _END:
                    reading = False
                    continue
                if isinstance(item, BaseException):
                    raise item
                if waiting.get(item, 0) <= 0:
                    continue
                waiting[item] -= 1
                if not waiting[item]:
                    del waiting[item]
                exc = item.exception()
                if exc is not None:
                    raise exc
                yield audio_to_proto(item.result())
        finally:
            reader.cancel()
            for fut in waiting:
                fut.remove_done_callback(done.put_nowait)
            for rid in attached:
                self.manager.detach(rid)

    async def CancelSession(self, request, context):
        request_id = check_request_id(request.request_id)
        request_id_var.set(request_id)
        return vocoder_pb2.CancelSessionResponse(cancelled=self.manager.cancel(request_id))

    async def ExportSession(self, request, context):
        request_id = check_request_id(request.request_id)
        request_id_var.set(request_id)
        snap = await self.manager.export(request_id, remove=request.remove)
        return vocoder_pb2.ExportSessionResponse(
            state=pack_session(snap), next_seq=snap.next_seq, sample_offset=snap.num_samples
        )

    async def ImportSession(self, request, context):
        request_id = check_request_id(request.request_id)
        request_id_var.set(request_id)
        if not request.state:
            raise InvalidArgument("state", "empty; pass ExportSessionResponse.state unchanged")
        snap = unpack_session(request.state, self.manager.model_tag)
        self.manager.import_session(request_id, snap, int(request.next_seq))
        return vocoder_pb2.ImportSessionResponse()
