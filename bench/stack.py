"""Start and stop a whole stack (flow, vocoder, gateway) as subprocesses on loopback.

The demo launcher's pattern (gateway/demo.py) with free ports, so that two stacks can run
side by side: one with batching on, one with it off (`--max-batch-size 1` for the flow and
`--max-batch-sessions 1` for the vocoder, the same code path). Both stay up for the whole sweep
and the sweep alternates between them, so the two modes see the same machine state; an idle
stack costs GPU memory, not compute.

`gateways` > 1 starts that many gateway processes in front of the same flow and vocoder replicas,
as a deployment runs several behind a load balancer (the gateway keeps no state across streams);
the load generator spreads its streams over `Stack.targets()` round robin.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from token2wav.healthcheck import check

REPO_ROOT = Path(__file__).resolve().parent.parent


class StackError(RuntimeError):
    """A service exited or never became healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class StackConfig:
    device: str = "cpu"
    dtype: str = "float32"
    vocoder_dtype: str = ""  # the vocoder's --dtype; empty: `dtype` (e.g. bf16 flow, fp32 HiFT)
    preset: str = "small"
    batching: bool = True
    model_dir: str = ""  # official flow.pt / hift.pt; empty: seeded random weights of `preset`
    flow_args: tuple[str, ...] = ()  # extra flags, e.g. ("--max-wait-ms", "2")
    vocoder_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0  # full-size weights on a cold GPU take a while
    threads: int = 0  # OMP_NUM_THREADS for the services; 0: inherit
    # Replicas behind the one gateway (all on `device`): the gateway spreads flow calls round
    # robin and pins each stream's vocoder session by rendezvous hashing, as in production.
    flow_replicas: int = 1
    vocoder_replicas: int = 1
    # Gateway processes in front of those replicas, each with the same flags; the load generator
    # spreads streams over them (a deployment's load balancer). One gateway is one Python
    # event loop: it serialises the CPU work of every stream it carries.
    gateways: int = 1

    def __post_init__(self):
        for name in ("flow_replicas", "vocoder_replicas", "gateways"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)}, want >= 1")

    @property
    def label(self) -> str:
        return "on" if self.batching else "off"


def free_port() -> int:
    # The port could be taken between close() and the child's bind; the health wait would
    # then report the child's "cannot bind" from its log.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`start()` spawns, `wait_ready()` blocks until all three are SERVING, `stop()` drains."""

    def __init__(self, config: StackConfig, log_dir: str | Path, name: str | None = None):
        self.config = config
        self.name = name or f"batching-{config.label}"
        self.log_dir = Path(log_dir)
        # process name -> port; names are the module, plus ".N" for replicas after the first
        self.ports = {
            name: free_port()
            for module, n in (
                ("flow_service", config.flow_replicas),
                ("vocoder_service", config.vocoder_replicas),
            )
            for name in replica_names(module, n)
        }
        # gateway group -> its processes' names ("gateway": the stack's own gateways; subclasses
        # add groups with other flags in front of the same services, e.g. bench capacity's)
        self.gateway_groups: dict[str, list[str]] = {}
        self.add_gateways("gateway", config.gateways)
        self.procs: dict[str, subprocess.Popen] = {}  # process name -> process
        self.restarted: list[str] = []  # model services started again after dying in warm-up
        self._logs: list = []

    def add_gateways(self, group: str, n: int) -> list[str]:
        """Name (and give ports to) `n` more gateway processes; `group` starts with "gateway"."""
        if _module(group) != "gateway" or group in self.gateway_groups:
            raise ValueError(f"gateway group {group!r}: taken, or not named gateway[.NAME]")
        names = replica_names(group, n)
        self.ports.update({name: free_port() for name in names})
        self.gateway_groups[group] = names
        return names

    def targets(self, group: str = "gateway") -> list[str]:
        """The addresses of a gateway group, in order (the load generator's round robin)."""
        return [f"127.0.0.1:{self.ports[name]}" for name in self.gateway_groups[group]]

    @property
    def target(self) -> str:
        """The first gateway (all there is with `gateways` = 1)."""
        return self.targets()[0]

    @property
    def gpu_pids(self) -> list[int]:
        return [p.pid for m, p in self.procs.items() if _module(m) != "gateway"]

    def commands(self) -> dict[str, list[str]]:
        c = self.config
        common = ["--host", "127.0.0.1", "--metrics-port", "0", "--grace-period", "5"]
        model = ["--device", c.device, "--dtype", c.dtype, "--preset", c.preset]
        if c.model_dir:
            model += ["--model-dir", c.model_dir]
        # The forced "off" flags come last: argparse keeps the last value, so a pass-through
        # --flow-arg=--max-batch-size=32 (meant for the "on" stack) cannot re-enable batching.
        flow = [*model, *c.flow_args, *([] if c.batching else ["--max-batch-size", "1"])]
        vocoder = [
            *model,
            *(["--dtype", c.vocoder_dtype] if c.vocoder_dtype else []),
            *c.vocoder_args,
            *([] if c.batching else ["--max-batch-sessions", "1"]),
        ]
        gateway = [
            "--flow-addr",
            self._addrs("flow_service"),
            "--vocoder-addr",
            self._addrs("vocoder_service"),
            *c.gateway_args,
        ]
        extra = {"flow_service": flow, "vocoder_service": vocoder, "gateway": gateway}
        return {
            name: [sys.executable, "-m", _module(name), "--port", str(port), *common]
            + extra[_module(name)]
            for name, port in self.ports.items()
        }

    def _addrs(self, module: str) -> str:
        return ",".join(f"127.0.0.1:{p}" for n, p in self.ports.items() if _module(n) == module)

    def start(self) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for module in self.commands():
            self.spawn(module)
        return self

    def spawn(self, module: str, restart: bool = False) -> subprocess.Popen:
        """Start one process, or restart it on the same port after it died (its log appends)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        if self.config.threads:
            env["OMP_NUM_THREADS"] = str(self.config.threads)
        cmd = self.commands()[module]
        log = open(self.log_path(module), "a" if restart else "w")  # noqa: SIM115 - child's
        self._logs.append(log)
        log.write(" ".join(cmd) + "\n")
        log.flush()
        self.procs[module] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
        )
        return self.procs[module]

    def log_path(self, module: str) -> Path:
        return self.log_dir / f"{self.name}-{module}.log"

    def _tail(self, module: str, lines: int = 25) -> str:
        try:
            text = self.log_path(module).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        for module, port in self.ports.items():
            while not check(f"127.0.0.1:{port}", timeout=1.0):
                proc = self.procs[module]
                if proc.poll() is not None:
                    if self._may_restart(module):
                        print(
                            f"{self.name}: {module} exited with {proc.returncode} while warming "
                            f"up; starting it once more (log {self.log_path(module)}: "
                            f"{self._tail(module, 1)})",
                            file=sys.stderr,
                            flush=True,
                        )
                        self.restarted.append(module)
                        self.spawn(module, restart=True)
                        continue
                    raise StackError(
                        f"{self.name}: {module} exited with {proc.returncode}; log "
                        f"{self.log_path(module)}:\n{self._tail(module)}"
                    )
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{self.name}: {module} not SERVING after "
                        f"{self.config.startup_timeout_s:.0f} s; log tail:\n{self._tail(module)}"
                    )
                time.sleep(0.25)

    def _may_restart(self, module: str) -> bool:
        """A model service that died after it was listening, for the first time. On an H100
        the vocoder's warm-up has twice died in a HiFT graph capture (cuFFT, then a sticky
        CUDA error; docs/bench/2026-12-07-h100-main-against-a166548.md) and taken a whole
        benchmark run with it. One more start costs a warm-up; a service that dies on its
        flags or weights, before listening, fails at once."""
        if _module(module) == "gateway" or module in self.restarted:
            return False
        return "listening on" in self._tail(module, 200)

    def check_alive(self) -> None:
        """Between runs: a service that died mid-sweep fails the sweep loudly."""
        for module, proc in self.procs.items():
            if proc.poll() is not None:
                raise StackError(
                    f"{self.name}: {module} died with {proc.returncode}:\n{self._tail(module)}"
                )

    def stop(self) -> None:
        # Gateway first (and waited for), so no new work reaches the model services while
        # they drain; then the model services together.
        gateways = [p for n, p in self.procs.items() if _module(n) == "gateway"]
        others = [p for n, p in self.procs.items() if _module(n) != "gateway"]
        for group in (gateways, others):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                _reap(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _module(name: str) -> str:
    return name.split(".", 1)[0]


def replica_names(base: str, n: int) -> list[str]:
    """`base`, then `base.1` ... `base.{n-1}`: the process names of n replicas."""
    return [base] + [f"{base}.{i}" for i in range(1, n)]


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a signalled process; kill it past 20 s. Never raises."""
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel; nothing more a user process can do


def start_stacks(configs: list[StackConfig], log_dir: str | Path) -> list[Stack]:
    """Start several stacks at once (model loading overlaps), then wait for all; on failure
    the ones already started are stopped."""
    stacks = [Stack(c, log_dir) for c in configs]
    try:
        for s in stacks:
            s.start()
        for s in stacks:
            s.wait_ready()
    except BaseException:
        for s in stacks:
            s.stop()
        raise
    return stacks
