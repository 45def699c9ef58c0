"""Wiring: model -> runner -> session manager + batcher -> servicer -> GrpcServer.

`create_server(options, config)` starts a warmed-up, SERVING server and returns it with its port
(tests, benchmarks); `python -m vocoder_service` runs the same object under signal handling.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from token2wav.server import GrpcServer, ServerOptions
from token2wav.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.batcher import Batcher
from vocoder_service.config import ModelConfig, VocoderServiceConfig
from vocoder_service.manager import SessionManager
from vocoder_service.runner import DTYPES, HiFTRunner
from vocoder_service.servicer import VocoderServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name


def resolve_preset(cfg: ModelConfig) -> str:
    """No preset given: the official architecture when weights are loaded, else the small one."""
    return cfg.preset or ("cosyvoice3-0.5b" if cfg.model_dir else "small")


def load_model(cfg: ModelConfig) -> Any:
    from vocoder_service.model import load_hift

    return load_hift(
        cfg.model_dir,
        device=cfg.device,
        dtype=DTYPES[cfg.dtype],
        preset=resolve_preset(cfg),
        phase_mode=cfg.phase_mode,
    )


def model_tag(cfg: ModelConfig, model: Any) -> str:
    """What an exported session may only continue on: the architecture and the phase rounding
    (a session carries its phase state in the mode's own units). The model's own mode wins
    over the config's when a model is passed in."""
    phase = getattr(getattr(model, "cfg", None), "phase_mode", cfg.phase_mode)
    return f"{resolve_preset(cfg)}:phase-{phase}"


class VocoderService:
    """The service's parts and their background tasks (batcher loop, session sweeper)."""

    def __init__(self, config: VocoderServiceConfig, model: Any | None = None):
        from vocoder_service.model import HOP_SAMPLES, MAX_SAMPLES, HiFTSessionState

        self.config = config
        self.model = model if model is not None else load_model(config.model)
        self.runner = HiFTRunner(self.model, config.model.device)
        self.manager = SessionManager(
            config.sessions,
            self.runner.new_state,
            HiFTSessionState.from_bytes,
            # Exported state carries this model's f0, phase and mel tail: it may only continue
            # on the same architecture and phase mode (the state's fingerprint checks both too).
            model_tag=model_tag(config.model, self.model),
            max_session_frames=MAX_SAMPLES // HOP_SAMPLES,
        )
        self.batcher = Batcher(self.manager, self.runner, config.batcher)
        self.servicer = VocoderServicer(self.manager)
        self._tasks: list[asyncio.Task] = []

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()
        ms = await loop.run_in_executor(self.batcher.executor, self.runner.warmup)
        logger.info("HiFT warm-up step %.1f ms", ms)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self.batcher.run(), name="vocoder-batcher"),
                asyncio.create_task(self.manager.run_sweeper(), name="vocoder-sweeper"),
            ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await asyncio.to_thread(self.batcher.close)  # lets a running step finish


class VocoderServer(GrpcServer):
    """GrpcServer plus the vocoder's background work, stopped after the drain."""

    def __init__(self, options: ServerOptions, service: VocoderService):
        self.service = service
        super().__init__(
            options,
            [SERVICE_NAME],
            lambda server: vocoder_pb2_grpc.add_VocoderServicer_to_server(service.servicer, server),
        )

    async def warmup(self) -> None:
        await self.service.warmup()
        self.service.start()

    async def drain(self) -> None:
        await super().drain()
        await self.service.stop()


async def create_server(
    options: ServerOptions, config: VocoderServiceConfig, *, model: Any | None = None
) -> tuple[VocoderServer, int]:
    """A started, warmed-up, SERVING server; `await server.drain()` stops it."""
    server = VocoderServer(options, VocoderService(config, model))
    port = await server.start()
    await server.warmup()
    await server.set_serving(True)
    return server, port
