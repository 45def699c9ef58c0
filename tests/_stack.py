"""The one loopback stack for the tests: any subset of N flow servers, M vocoder replicas and a
gateway, each started through its service's flags, config and `Service`, as `python -m` does.

Replicas can be killed (the listener stops at once, in-flight calls end) and restarted on the
same port, as a crashed pod would be."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from flow_service.config import FlowConfig
from flow_service.config import build_parser as flow_parser
from flow_service.service import FlowService
from gateway.config import GatewayConfig
from gateway.config import build_parser as gateway_parser
from gateway.service import GatewayService
from token2wav.server import GrpcServer
from token2wav.service import start
from token2wav.tensors import make_voice
from vocoder_service.config import VocoderServiceConfig
from vocoder_service.config import build_parser as vocoder_parser
from vocoder_service.service import VocoderService

LOOPBACK = ("--port", "0", "--metrics-port", "0")


async def until(condition, timeout: float = 30.0, what: str = "condition not reached") -> None:
    """Yield to the loop until `condition()` holds; fail with `what` after `timeout` seconds.
    The tests wait with this (or `wait_until` off the loop), never with a bare sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def wait_until(condition, timeout: float = 30.0, what: str = "condition not reached") -> None:
    """`until` for a test that blocks its thread (sync gRPC, a subprocess)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def flow_config(*flags: str, port: int = 0) -> FlowConfig:
    args = flow_parser().parse_args([*LOOPBACK, "--max-wait-ms", "2", *flags, "--port", str(port)])
    return FlowConfig.from_args(args)


def vocoder_config(*flags: str, port: int = 0) -> VocoderServiceConfig:
    args = vocoder_parser().parse_args([*LOOPBACK, *flags, "--port", str(port)])
    return VocoderServiceConfig.from_args(args)


def gateway_config(*flags: str) -> GatewayConfig:
    return GatewayConfig.from_args(gateway_parser().parse_args([*LOOPBACK, *flags]))


async def start_flow(flow_model, *flags: str, port: int = 0, around=None) -> GrpcServer:
    """A SERVING flow server, not warmed up (the model's calls stay the test's).

    `around(request, submit)`, a coroutine, stands between each call and the engine: it awaits
    `submit()` (the engine's answer) when it chooses, so a test holds calls on its own events
    (ordering under uneven latency, calls kept in flight) and sees them come back."""
    service = FlowService(flow_config(*flags, port=port), model=flow_model)
    if around is not None:
        submit = service.engine.submit

        async def held(request, *args, **kw):
            return await around(request, lambda: submit(request, *args, **kw))

        service.engine.submit = held
    return await start(service, warmup=False)


async def start_vocoder(hift, *flags: str, port: int = 0) -> GrpcServer:
    return await start(VocoderService(vocoder_config(*flags, port=port), model=hift))


@dataclass
class Stack:
    models: tuple
    flows: list[GrpcServer | None]  # None: killed
    flow_ports: list[int]
    vocoders: list[GrpcServer | None]
    vocoder_ports: list[int]
    gateway: GrpcServer | None
    vocoder_flags: tuple = ()
    flow_flags: tuple = ()

    @property
    def flow_server(self) -> GrpcServer:
        return self.flows[0]

    @property
    def engine(self):
        return self.flows[0].service.engine

    @property
    def vocoder_server(self) -> GrpcServer:
        return self.vocoders[0]

    @property
    def gateway_server(self) -> GrpcServer:
        return self.gateway

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def gateway_server_streams(self) -> int:
        from gateway import metrics

        return int(metrics.ACTIVE_STREAMS._value.get())

    def sessions(self, i: int = 0) -> set[str]:
        """Open sessions on vocoder i, by the client request id they serve (keys add a nonce)."""
        v = self.vocoders[i]
        return set() if v is None else {k.rsplit(":", 1)[0] for k in v.service.manager._active}

    def serving(self, rid: str) -> int:
        (i,) = [i for i in range(len(self.vocoders)) if rid in self.sessions(i)]
        return i

    async def kill_vocoder(self, i: int) -> None:
        v, self.vocoders[i] = self.vocoders[i], None
        await v.kill()

    async def start_vocoder(self, i: int) -> None:
        self.vocoders[i] = await start_vocoder(
            self.models[1], *self.vocoder_flags, port=self.vocoder_ports[i]
        )

    async def kill_flow(self, i: int) -> None:
        f, self.flows[i] = self.flows[i], None
        await f.kill()

    async def start_flow(self, i: int) -> None:
        self.flows[i] = await start_flow(self.models[0], *self.flow_flags, port=self.flow_ports[i])

    async def another_gateway(self) -> GrpcServer:
        """A second gateway in front of this stack's first flow and vocoder replica (the
        caller drains it)."""
        routes = ["--flow-addr", f"127.0.0.1:{self.flow_ports[0]}"]
        routes += ["--vocoder-addr", f"127.0.0.1:{self.vocoder_ports[0]}"]
        return await start(GatewayService(gateway_config(*routes)))

    async def stop(self) -> None:
        for server in [self.gateway, *self.vocoders, *self.flows]:
            if server is not None:
                await server.drain()


async def start_stack(
    models,
    *gateway_flags,
    num_flows=1,
    num_vocoders=1,
    gateway=True,
    vocoder_flags=(),
    flow_flags=(),
    flow_around=None,
) -> Stack:
    """`num_flows` flow servers, `num_vocoders` vocoders and (with `gateway`) a gateway routed
    to them; `flow_around`: see start_flow."""
    flow_model, hift = models
    flows = [
        await start_flow(flow_model, *flow_flags, around=flow_around) for _ in range(num_flows)
    ]
    vocoders = [await start_vocoder(hift, *vocoder_flags) for _ in range(num_vocoders)]
    gserver = None
    if gateway:
        routes = []
        if flows:
            routes += ["--flow-addr", ",".join(f"127.0.0.1:{f.port}" for f in flows)]
        if vocoders:
            routes += ["--vocoder-addr", ",".join(f"127.0.0.1:{v.port}" for v in vocoders)]
        gserver = await start(GatewayService(gateway_config(*routes, *gateway_flags)))
    return Stack(
        models,
        flows,
        [f.port for f in flows],
        vocoders,
        [v.port for v in vocoders],
        gserver,
        tuple(vocoder_flags),
        tuple(flow_flags),
    )


def stream_inputs(seed: int, n_prompt: int, n_tokens: int):
    rng = np.random.default_rng(seed)
    voice = make_voice(
        rng.integers(0, 6561, n_prompt),
        (rng.standard_normal((2 * n_prompt, 80)) - 4).astype(np.float32),
        rng.standard_normal(192).astype(np.float32),
    )
    return voice, rng.integers(0, 6561, n_tokens)
