"""A loopback stack for the reliability tests: one flow server, N vocoder replicas, a gateway.

Vocoder replicas can be killed (the listener stops at once, in-flight calls end) and restarted
on the same port, as a crashed pod would be."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flow_service.app import build_parser as flow_parser
from flow_service.app import create_server as create_flow
from gateway.app import build_parser as gateway_parser
from gateway.app import create_server as create_gateway
from token2wav.tensors import make_voice
from vocoder_service.__main__ import build_parser as vocoder_parser
from vocoder_service.__main__ import config_from_args, server_options
from vocoder_service.server import create_server as create_vocoder


@dataclass
class Stack:
    models: tuple
    flows: list  # (flow server, engine) or None (killed)
    flow_ports: list[int]
    vocoders: list  # VocoderServer or None (killed)
    vocoder_ports: list[int]
    gateway_server: object
    close_gateway: object
    vocoder_flags: tuple = ()
    flow_flags: tuple = ()

    @property
    def flow_server(self):
        return self.flows[0][0]

    @property
    def engine(self):
        return self.flows[0][1]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway_server.port}"

    def gateway_server_streams(self) -> int:
        from gateway import metrics

        return int(metrics.ACTIVE_STREAMS._value.get())

    def sessions(self, i: int) -> set[str]:
        """Open sessions on vocoder i, by the client request id they serve."""
        v = self.vocoders[i]
        return set() if v is None else {k.rsplit(":", 1)[0] for k in v.service.manager._active}

    def serving(self, rid: str) -> int:
        (i,) = [i for i in range(len(self.vocoders)) if rid in self.sessions(i)]
        return i

    async def kill_vocoder(self, i: int) -> None:
        v, self.vocoders[i] = self.vocoders[i], None
        await v.server.stop(None)  # no grace: every call on it ends now
        await v.service.stop()

    async def start_vocoder(self, i: int) -> None:
        self.vocoders[i] = await _vocoder(self.models[1], self.vocoder_ports[i], self.vocoder_flags)

    async def kill_flow(self, i: int) -> None:
        (server, engine), self.flows[i] = self.flows[i], None
        await server.server.stop(None)
        await engine.stop()

    async def start_flow(self, i: int) -> None:
        self.flows[i] = await _flow(self.models[0], self.flow_ports[i], self.flow_flags)

    async def stop(self) -> None:
        await self.gateway_server.drain()
        await self.close_gateway()
        for v in self.vocoders:
            if v is not None:
                await v.drain()
        for f in self.flows:
            if f is not None:
                await f[0].drain()
                await f[1].stop()


async def _vocoder(hift, port: int, flags=()):
    vargs = vocoder_parser().parse_args(["--port", str(port), "--metrics-port", "0", *flags])
    server, _ = await create_vocoder(server_options(vargs), config_from_args(vargs), model=hift)
    return server


async def _flow(flow_model, port: int, flags=()):
    fargs = flow_parser().parse_args(
        ["--port", str(port), "--metrics-port", "0", "--max-wait-ms", "2", *flags]
    )
    server, engine, _ = create_flow(fargs, model=flow_model)
    await server.start()
    engine.start()
    await server.set_serving(True)
    return server, engine


async def start_stack(
    models, *gateway_flags, num_vocoders=1, num_flows=1, vocoder_flags=(), flow_flags=()
):
    flow_model, hift = models
    flows = [await _flow(flow_model, 0, flow_flags) for _ in range(num_flows)]
    flow_ports = [f[0].port for f in flows]
    vocoders = [await _vocoder(hift, 0, vocoder_flags) for _ in range(num_vocoders)]
    ports = [v.port for v in vocoders]
    gargs = gateway_parser().parse_args(
        [
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--flow-addr",
            ",".join(f"127.0.0.1:{p}" for p in flow_ports),
            "--vocoder-addr",
            ",".join(f"127.0.0.1:{p}" for p in ports),
            *gateway_flags,
        ]
    )
    gserver, close = create_gateway(gargs)
    await gserver.start()
    await gserver.set_serving(True)
    return Stack(
        models,
        flows,
        flow_ports,
        vocoders,
        ports,
        gserver,
        close,
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
