"""The flow service: model -> engine -> servicer, and the engine's life cycle."""

from __future__ import annotations

import torch

from flow_service import metrics
from flow_service.config import FlowConfig, PrefixCacheConfig
from flow_service.costmodel import CostModel, num_solver_steps
from flow_service.engine import FlowEngine
from flow_service.model import FUSED_KERNELS, DiTKernels, FlowModel, PrefixCache, load_flow
from flow_service.servicer import FlowServicer
from flow_service.voices import VoiceCache
from flow_service.warmup import warmup_requests
from token2wav.cli import check_device
from token2wav.dtypes import DTYPES
from token2wav.service import Service
from token2wav.v1 import flow_pb2, flow_pb2_grpc


def load_model(config: FlowConfig) -> FlowModel:
    return load_flow(
        config.model_dir,
        device=config.device,
        dtype=DTYPES[config.dtype],
        preset=config.preset,
        kernels=service_kernels(config),
    )


def service_kernels(config: FlowConfig) -> DiTKernels:
    """The fused kernels (measured faster on CUDA) only where they compile: on the CPU the
    fused functions would run eagerly, the same arithmetic as the plain path in more ops."""
    return FUSED_KERNELS if torch.device(config.device).type == "cuda" else DiTKernels()


def make_prefix_cache(config: PrefixCacheConfig, model) -> PrefixCache | None:
    if config.mb == 0 or not isinstance(model, FlowModel):  # test doubles wrapping a model: none
        return None
    if config.mb == -1:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(0.4 * free)
        else:
            budget = 1024 << 20
    else:
        budget = config.mb << 20
    return PrefixCache.for_model(
        model,
        budget,
        share_voice_blocks=config.share_voices,
        evict_idle_s=config.evict_idle_s,
        observe=metrics.observe_prefix_cache,
    )


class FlowService(Service):
    prog, log_name, config_class = "flow_service", "flow", FlowConfig
    grpc_services = (flow_pb2.DESCRIPTOR.services_by_name["Flow"].full_name,)

    def __init__(self, config: FlowConfig, model=None):
        """`model` overrides loading (tests, benchmarks)."""
        super().__init__(config)
        self.model = model if model is not None else load_model(config)
        self.engine = FlowEngine(
            self.model,
            config.policy,
            log_batches=config.log_batches,
            cuda_graphs=config.cuda_graphs,
            graph_max_batch=config.graph_max_batch,
            graph_max_frames=config.graph_max_frames,
            cost=CostModel(num_solver_steps(self.model), config.cost_prior),
            prefix_cache=make_prefix_cache(config.prefix_cache, self.model),
        )
        self.servicer = FlowServicer(self.engine, VoiceCache(config.max_voices))
        self.engine.on_device_lost = self.device_lost  # NOT_SERVING, exit for a restart

    @staticmethod
    def check(config: FlowConfig) -> None:
        check_device(config.device)

    def register(self, server) -> None:
        flow_pb2_grpc.add_FlowServicer_to_server(self.servicer, server)

    def start(self) -> None:
        self.engine.start()

    async def warmup(self) -> None:
        await self.engine.warmup(warmup_requests())

    async def stop(self) -> None:
        await self.engine.stop()
