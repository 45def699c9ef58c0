"""`make run`: start flow, vocoder and gateway on loopback with the default small random-weight
models, stream a sample utterance through the gateway, write a WAV, print first-chunk latency
and real-time factor, and shut everything down cleanly."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.client import load_tokens, load_voice, make_sample, run_synthesis
from token2wav.cli import prog, run_main
from token2wav.healthcheck import check
from token2wav.server import bind_problem

SERVICES = [  # (module, port, metrics port)
    ("flow_service", 50052, 9102),
    ("vocoder_service", 50053, 9103),
    ("gateway", 50051, 9101),
]


def _free_ports() -> list[tuple[str, int, int]]:
    """SERVICES on ports the kernel says are free now (tests run `make run` beside others)."""
    socks = [socket.socket() for _ in range(2 * len(SERVICES))]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    return [(m, ports[2 * i], ports[2 * i + 1]) for i, (m, *_) in enumerate(SERVICES)]


def _exited(services, procs: list[subprocess.Popen]) -> str | None:
    """Which of our services is no longer running, in words; None when all are."""
    for (module, *_), proc in zip(services, procs):
        if proc.poll() is not None:
            return f"make run: {module} exited with status {proc.returncode}; see its log"
    return None


def main(argv: list[str] | None = None) -> int:
    return run_main("make run", lambda: _demo(argv))


def _demo(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog=prog("gateway.demo"), description=__doc__)
    p.add_argument("--out-dir", default="out", help="where the sample inputs and WAV go")
    p.add_argument("--device", default="cpu", help="device for flow and vocoder")
    p.add_argument("--pace", type=float, default=0.0, help="tokens/s sent (0: all at once)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to get healthy")
    p.add_argument(
        "--free-ports",
        action="store_true",
        help="use free ports instead of the defaults (50051-50053, metrics 9101-9103)",
    )
    a = p.parse_args(argv)
    services = _free_ports() if a.free_ports else SERVICES
    out = Path(a.out_dir)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Our own services must answer: a port already taken (an earlier `make run` still up,
    # another program) would let the health checks below reach someone else's server.
    for module, *ports in services:
        for flag, port in zip(("--port", "--metrics-port"), ports):
            problem = bind_problem("127.0.0.1", port)
            if problem is not None:
                print(
                    f"make run: {module} {flag} {port}: {problem}; stop it first", file=sys.stderr
                )
                return 1
    procs: list[subprocess.Popen] = []
    try:
        for module, port, mport in services:
            cmd = [sys.executable, "-m", module, "--port", str(port), "--metrics-port", str(mport)]
            if module != "gateway":
                cmd += ["--device", a.device]
            else:  # the flow and vocoder started above, wherever they listen
                ports = {m: p for m, p, _ in services}
                cmd += ["--flow-addr", f"127.0.0.1:{ports['flow_service']}"]
                cmd += ["--vocoder-addr", f"127.0.0.1:{ports['vocoder_service']}"]
            log = open(logs / f"{module}.log", "w")  # noqa: SIM115 - lives as long as the child
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                )
            )
            print(f"started {module} on 127.0.0.1:{port} (log {logs / (module + '.log')})")
        deadline = time.monotonic() + a.startup_timeout
        for (module, port, _), proc in zip(services, procs):
            while not check(f"127.0.0.1:{port}", timeout=1.0):
                if proc.poll() is not None:
                    log_path = logs / f"{module}.log"
                    last = (log_path.read_text().strip().splitlines() or [""])[-1]
                    print(
                        f"make run: {module} exited with {proc.returncode}: {last}", file=sys.stderr
                    )
                    return 1
                if time.monotonic() > deadline:
                    print(f"{module} not healthy after {a.startup_timeout:.0f} s", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            print(f"{module} SERVING")
        if dead := _exited(services, procs):
            print(dead, file=sys.stderr)
            return 1
        voice_path, tokens_path = make_sample(out / "sample")
        voice, tokens = load_voice(voice_path), load_tokens(tokens_path)
        wav = out / "sample.wav"
        print(
            f"synthesizing {len(tokens)} tokens ({len(tokens) / 25:.1f} s) with a "
            f"{voice.num_prompt_tokens}-token prompt through the gateway ..."
        )
        r = run_synthesis(f"127.0.0.1:{services[-1][1]}", voice, tokens, str(wav), pace=a.pace)
        if dead := _exited(services, procs):  # the audio came from somewhere else: not a success
            print(dead, file=sys.stderr)
            return 1
        print(f"wrote {wav}: {r['audio_seconds']:.2f} s of 24 kHz audio in {r['chunks']} chunks")
        print(f"first-chunk latency: {r['first_chunk_ms']:.0f} ms")
        print(f"real-time factor:    {r['rtf']:.3f} ({r['xrt']:.1f}x faster than real time)")
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("services stopped")


if __name__ == "__main__":
    sys.exit(main())
