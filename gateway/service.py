"""The gateway: replica sets, flow client, voice registry and front end -> servicer, and the
listener whose SERVING also needs a healthy replica of every stage."""

from __future__ import annotations

from gateway.callers import ClientStreams
from gateway.config import GatewayConfig
from gateway.downstream import FlowClient
from gateway.failover import RetryBudget
from gateway.health import GatewayServer, StageHealth
from gateway.routing import ReplicaSet
from gateway.servicer import GatewayServicer, VoiceRegistry
from gateway.voices import VoiceMaker
from gateway.websocket import WebSocketBridge
from token2wav.frontend.audio import FrontendUnavailable
from token2wav.security import channel_credentials
from token2wav.server import GrpcServer
from token2wav.service import Service, UsageError
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc


def load_voice_maker(config: GatewayConfig) -> VoiceMaker | None:
    """The front end if --frontend-dir is set; UsageError says what is missing."""
    if not config.frontend_dir:
        return None
    try:
        return VoiceMaker.from_dir(
            config.frontend_dir, config.frontend_workers, config.frontend_max_pending
        )
    except FrontendUnavailable as exc:
        raise UsageError(f"--frontend-dir: {exc}") from None


class GatewayService(Service):
    prog, log_name, config_class = "gateway", "gateway", GatewayConfig
    grpc_services = (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,)

    def __init__(self, config: GatewayConfig, voice_maker: VoiceMaker | None = None):
        """`voice_maker` overrides loading the front end from --frontend-dir (tests)."""
        super().__init__(config)
        credentials = None
        if config.internal_ca or config.internal_cert:
            credentials = channel_credentials(
                config.internal_ca, config.internal_cert, config.internal_key
            )
        routing = dict(
            refresh_s=config.resolve_interval,
            max_message_mb=config.server.max_message_mb,
            retire_grace_s=config.retire_grace,
            credentials=credentials,
            server_name=config.internal_server_name,
        )
        self.flows = ReplicaSet(config.flow_addr, **routing)
        self.vocoders = ReplicaSet(config.vocoder_addr, **routing)
        self.voice_maker = voice_maker if voice_maker is not None else load_voice_maker(config)
        self.servicer = GatewayServicer(
            FlowClient(
                self.flows,
                config.flow_attempts,
                sticky=config.flow_sticky,
                budget=RetryBudget(config.retry_budget),
            ),
            self.vocoders,
            VoiceRegistry(config.max_voices, config.max_voices_per_client),
            config.limits,
            config.max_streams,
            self.voice_maker,
            config.admission,
            inbound=config.inbound,
            per_client=ClientStreams(config.max_streams_per_client),
        )

    def register(self, server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)

    def make_server(self) -> GrpcServer:
        # no model to warm: SERVING as soon as it listens and its stages answer
        stages = {"flow": self.flows, "vocoder": self.vocoders}
        websocket = None
        if self.config.websocket_port is not None:
            websocket = WebSocketBridge(self.options.host, self.config.websocket_port)
        return GatewayServer(
            self.options,
            self,
            health=StageHealth(stages, self.config.health_check_interval),
            websocket=websocket,
        )

    async def stop(self) -> None:
        await self.flows.close()
        await self.vocoders.close()
        if self.voice_maker is not None:
            self.voice_maker.close()
