"""Making voices from prompt audio inside the gateway: the front end runs in a bounded thread
pool, off the event loop, so a long recording never stalls a stream's audio."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway import metrics
from token2wav.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from token2wav.frontend.audio import FrontendUnavailable
from token2wav.tensors import VoiceData, decode, decode_voice, make_voice
from token2wav.v1 import common_pb2, gateway_pb2

NO_FRONTEND = (
    "making a voice from audio needs the gateway started with --frontend-dir (env "
    "GATEWAY_FRONTEND_DIR): the folder with speech_tokenizer_v3.onnx and campplus.onnx"
)


class VoiceMaker:
    """Runs `Frontend` calls in `num_workers` threads; at most `max_pending` accepted at once
    (running or waiting), past that RESOURCE_EXHAUSTED at once."""

    def __init__(self, frontend, num_workers: int = 2, max_pending: int = 8):
        self.frontend = frontend
        self.max_pending = max_pending
        self.num_pending = 0
        self._lock = threading.Lock()  # num_pending: +1 on the loop, -1 from a pool thread
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="voice-frontend")

    @classmethod
    def from_dir(cls, model_dir: str | Path, num_workers: int, max_pending: int) -> VoiceMaker:
        from token2wav.frontend import Frontend  # optional dependencies: only when asked for

        return cls(Frontend.from_dir(model_dir), num_workers, max_pending)

    async def make(self, request: gateway_pb2.RegisterVoiceRequest) -> VoiceData:
        which = request.WhichOneof("audio")
        if which == "audio_file":
            call, args = self.frontend.voice_from_file, (request.audio_file, "audio_file")
        else:
            pcm = request.audio_pcm
            samples = decode(
                pcm.samples,
                "audio_pcm.samples",
                dtypes=(common_pb2.DTYPE_INT16, common_pb2.DTYPE_FLOAT32),
            )
            if samples.ndim not in (1, 2):
                raise InvalidArgument(
                    "audio_pcm.samples",
                    f"want (samples,) or (samples, channels), got {samples.shape}",
                )
            call, args = self.frontend.voice_from_pcm, (samples, pcm.sample_rate, "audio_pcm")
        with self._lock:
            if self.num_pending >= self.max_pending:
                metrics.FRONTEND_CALLS.labels("busy").inc()
                raise ResourceExhausted(
                    f"{self.num_pending} recordings are being made into voices already "
                    f"(--frontend-max-pending {self.max_pending})"
                )
            self.num_pending += 1
            metrics.FRONTEND_PENDING.set(self.num_pending)
        future = self._pool.submit(self._timed, call, *args)
        future.add_done_callback(self._finished)  # counts down when the work ends, not the call
        try:
            made = await asyncio.wrap_future(future)
        except ValueError:
            metrics.FRONTEND_CALLS.labels("bad_audio").inc()
            raise
        except FrontendUnavailable as exc:  # e.g. a model that gives ids out of range
            metrics.FRONTEND_CALLS.labels("error").inc()
            raise FailedPrecondition(f"--frontend-dir: {exc}") from None
        except Exception:
            metrics.FRONTEND_CALLS.labels("error").inc()
            raise
        metrics.FRONTEND_CALLS.labels("ok").inc()
        return make_voice(made.prompt_token, made.prompt_feat, made.embedding, which)

    @staticmethod
    def _timed(call, *args):
        started = time.monotonic()
        try:
            return call(*args)
        finally:
            metrics.FRONTEND_SECONDS.observe(time.monotonic() - started)

    def _finished(self, _future) -> None:
        with self._lock:
            self.num_pending -= 1
            metrics.FRONTEND_PENDING.set(self.num_pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def voice_from_request(
    request: gateway_pb2.RegisterVoiceRequest, maker: VoiceMaker | None
) -> tuple[VoiceData, bool]:
    """The request's voice, and whether it was made from audio."""
    if request.WhichOneof("audio") is None:
        return decode_voice(request.voice, "voice"), False
    if request.HasField("voice"):
        raise InvalidArgument("voice", "send either the voice's arrays or audio, not both")
    if maker is None:
        raise FailedPrecondition(NO_FRONTEND)
    return await maker.make(request), True
