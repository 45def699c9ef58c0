"""The vocoder service: model -> runner -> session manager + batcher -> servicer, and the
background work's life cycle (batcher loop, session sweeper)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from token2wav import SAMPLES_PER_FRAME
from token2wav.cli import check_device
from token2wav.dtypes import DTYPES
from token2wav.service import Service
from token2wav.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.batcher import Batcher
from vocoder_service.config import ModelConfig, VocoderServiceConfig
from vocoder_service.manager import SessionManager
from vocoder_service.runner import HiFTRunner
from vocoder_service.servicer import VocoderServicer

logger = logging.getLogger(__name__)


def resolve_preset(cfg: ModelConfig) -> str:
    """No preset given: the official architecture when weights are loaded, else the small one."""
    return cfg.preset or ("cosyvoice3-0.5b" if cfg.model_dir else "small")


def load_model(cfg: ModelConfig) -> Any:
    from vocoder_service.model import load_hift

    model = load_hift(
        cfg.model_dir,
        device=cfg.device,
        dtype=DTYPES[cfg.dtype],
        preset=resolve_preset(cfg),
        phase_mode=cfg.phase_mode,
    )
    buckets = graph_buckets(cfg)
    if buckets is not None:
        model.fuse_snake(True)  # fewer kernels in each graph (and in its eager fallback)
        model.set_cuda_graphs(buckets)
    return model


def graph_buckets(cfg: ModelConfig):
    """The CUDA-graph shape buckets the config asks for; None when graphs are off or not on
    CUDA (the flag is ignored on CPU)."""
    from vocoder_service.model.graphs import ShapeBuckets

    if not cfg.cuda_graphs or not cfg.device.startswith("cuda"):
        return None
    return ShapeBuckets.for_limits(
        cfg.graph_max_rows, cfg.graph_frame_multiple, cfg.graph_max_frames
    )


def model_tag(cfg: ModelConfig, model: Any) -> str:
    """What an exported session may only continue on: the architecture and the phase rounding
    (a session carries its phase state in the mode's own units). The model's own mode wins
    over the config's when a model is passed in."""
    phase = getattr(getattr(model, "cfg", None), "phase_mode", cfg.phase_mode)
    return f"{resolve_preset(cfg)}:phase-{phase}"


class VocoderService(Service):
    prog, log_name, config_class = "vocoder_service", "vocoder", VocoderServiceConfig
    grpc_services = (vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name,)

    def __init__(self, config: VocoderServiceConfig, model: Any | None = None):
        """`model` overrides loading (tests, benchmarks)."""
        from vocoder_service.model import MAX_SAMPLES, HiFTSessionState

        super().__init__(config)
        self.model = model if model is not None else load_model(config.model)
        self.runner = HiFTRunner(self.model, config.model.device)
        self.manager = SessionManager(
            config.sessions,
            self.runner.new_state,
            HiFTSessionState.from_bytes,
            # Exported state carries this model's f0, phase and mel tail: it may only continue
            # on the same architecture and phase mode (the state's fingerprint checks both too).
            model_tag=model_tag(config.model, self.model),
            max_session_frames=MAX_SAMPLES // SAMPLES_PER_FRAME,
        )
        self.batcher = Batcher(self.manager, self.runner, config.batcher)
        self.batcher.on_device_lost = self.device_lost  # NOT_SERVING, exit for a restart
        self.servicer = VocoderServicer(self.manager)
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def check(config: VocoderServiceConfig) -> None:
        check_device(config.model.device)

    def register(self, server) -> None:
        vocoder_pb2_grpc.add_VocoderServicer_to_server(self.servicer, server)

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()
        ms = await loop.run_in_executor(self.batcher.executor, self.runner.warmup)
        logger.info("HiFT warm-up batch %.1f ms", ms)

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
        await asyncio.to_thread(self.batcher.close)  # lets a running batch finish
