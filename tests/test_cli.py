"""The newcomer's path (issue 19): inputs checked before sending, a failing feeder ends the call
instead of hanging it, and every start-up failure is one line naming the flag or the file."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import test_gateway
import torch
from _stack import until, wait_until
from prometheus_client import REGISTRY
from test_gateway import _call, cfg_msg, start_stack, stream_inputs, tok

from flow_service.model.loading import CheckpointError as FlowCheckpointError
from flow_service.model.loading import read_state_dict
from gateway import client as cli
from gateway.client.cli import main as cli_main
from token2wav.cli import check_device, one_line, run_main
from token2wav.errors import InvalidArgument, StartupError
from token2wav.server import GrpcServer, ServerOptions
from token2wav.service import Service
from vocoder_service.model.errors import CheckpointError as HiftCheckpointError
from vocoder_service.model.loading import read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
models = test_gateway.models  # the small models, loaded once per module (a fixture)


# -- token ids and voice files -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([1, 2, -1], "tokens[2]: id -1 outside 0..6560"),
        ([6561], "tokens[0]: id 6561 outside 0..6560"),
        ([2**40], "tokens[0]: id 1099511627776 outside 0..6560"),
        ([2**70], f"tokens[0]: id {2**70} outside 0..6560"),
        (np.array([2**64 - 1], np.uint64), f"tokens[0]: id {2**64 - 1} outside 0..6560"),
        ([1.7, 2.0], "tokens: float64 values; token ids must be integers"),
        ([1.0, float("nan")], "tokens: float64 values (non-finite at index 1)"),
        ([1, "a"], "tokens: <U21 values"),
    ],
)
def test_token_ids_refuses_what_the_wire_would_mangle(tokens, message):
    with pytest.raises(InvalidArgument) as info:
        cli.token_ids(tokens)
    assert str(info.value).startswith(message), str(info.value)


def test_token_ids_accepts_integers_of_any_width():
    for arr in (np.array([[0, 6560]], np.int16), np.array([0, 6560], np.uint64), [0, 6560], []):
        ids = cli.token_ids(arr)
        assert ids.dtype == np.int64 and ids.tolist() == ([0, 6560] if len(arr) else [])


def _cli_error(capsys, *argv) -> str:
    assert cli_main(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_cli_refuses_bad_files_in_one_line(tmp_path, capsys):
    voice, tokens = cli.make_sample(tmp_path, prompt_tokens=10, tokens=20)
    bad = {
        "neg.npy": np.array([1, 2, -1]),
        "nan.npy": np.array([1.0, np.nan]),
        "float.npy": np.array([1.7]),
        "huge.npy": np.array([2**40]),
    }
    for name, arr in bad.items():
        np.save(tmp_path / name, arr)
    np.save(tmp_path / "pickled.npy", np.array([1, "a"], object), allow_pickle=True)
    np.savez(tmp_path / "novoice.npz", prompt_token=np.zeros(3, np.int32))
    (tmp_path / "notes.txt").write_text("prompt_token: 1 2 3\n")
    # No gateway listens at --target: every one of these must fail before connecting.
    run = ("synthesize", "--target", "127.0.0.1:1", "--out", str(tmp_path / "o.wav"))
    for name, expect in [
        ("neg.npy", "neg.npy[2]: id -1 outside 0..6560"),
        ("nan.npy", "nan.npy: float64 values (non-finite at index 1)"),
        ("float.npy", "float.npy: float64 values"),
        ("huge.npy", "huge.npy[0]: id 1099511627776 outside"),
        ("pickled.npy", "pickled.npy: not an .npy array of token ids (pickled data"),
        ("notes.txt", "notes.txt: a text file; want an .npy array of token ids"),
        ("missing.npy", "missing.npy: No such file or directory"),
    ]:
        err = _cli_error(capsys, *run, "--voice", str(voice), "--tokens", str(tmp_path / name))
        assert err.startswith("token2wav: error: ") and expect in err, err
    err = _cli_error(
        capsys, *run, "--voice", str(tmp_path / "novoice.npz"), "--tokens", str(tokens)
    )
    assert "novoice.npz: missing arrays ['embedding', 'prompt_feat']" in err
    err = _cli_error(capsys, *run, "--voice", str(tmp_path / "notes.txt"), "--tokens", str(tokens))
    assert "notes.txt: a text file; want an .npz voice file" in err
    err = _cli_error(capsys, *run, "--voice", str(tokens), "--tokens", str(tokens))
    assert "tokens.npy: one .npy array; a voice is an .npz" in err
    err = _cli_error(capsys, *run, "--voice", str(voice), "--tokens", str(tokens))
    assert "UNAVAILABLE" in err and "--target 127.0.0.1:1" in err


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["synthesize", "--bogus"], ["synthesize", "--bogus=1", "--out", "o.wav"]],
)
def test_cli_names_an_unknown_flag(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--bogus" in err.splitlines()[-1], err


def _gauge(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class TokensThatBreakMidStream(list):
    """Good ids, then (once the gateway holds the stream open) a -1 the feeder chokes on."""

    def __iter__(self):
        yield from self[:-1]
        wait_until(lambda: _gauge("t2w_gateway_active_streams") >= 1, 10, "no stream opened")
        yield -1


def test_feeder_failure_cancels_the_call_instead_of_hanging(models, tmp_path, capsys):
    voice, _ = stream_inputs(5, 10, 30)
    cancelled = "t2w_gateway_streams_total"

    async def main():
        stack = await start_stack(models)
        try:
            before = _gauge(cancelled, outcome="CancelledError")
            tokens = TokensThatBreakMidStream(range(100, 130))
            started = time.monotonic()
            with pytest.raises(InvalidArgument, match=r"tokens\[0\]: id -1 outside"):
                await asyncio.wait_for(
                    asyncio.to_thread(
                        cli.run_synthesis, stack.target, voice, tokens, None, 200.0, "pcm16", False
                    ),
                    timeout=30,
                )
            assert time.monotonic() - started < 20
            # The gateway saw the stream, then its cancellation: nothing stays open.
            await until(lambda: _gauge("t2w_gateway_active_streams") == 0, 10, "stream left open")
            assert _gauge(cancelled, outcome="CancelledError") == before + 1
            # The wire: an id past 2^32 arrives whole (uint64) and is refused, not truncated.
            code, msg = await _call(stack.target, [cfg_msg(voice), tok([1, 2**40])])
            assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
            assert msg.startswith("tokens.tokens[1]: id 1099511627776 outside"), msg
        finally:
            await stack.stop()

    asyncio.run(main())


# -- start-up failures -------------------------------------------------------------------------


def _taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _server(port: int, metrics_port: int | None = None) -> GrpcServer:
    return GrpcServer(ServerOptions(port=port, metrics_port=metrics_port), Service(None))


async def test_taken_ports_fail_at_start_naming_the_flag():
    with _taken_port() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(StartupError, match=rf"^--port {port}: 127.0.0.1:{port} is already in"):
            await _server(port).start()
        with pytest.raises(StartupError, match=rf"^--metrics-port {port}: cannot listen on"):
            await _server(0, metrics_port=port).start()
    # Another of our own servers on the port: no SO_REUSEPORT, so no silent second bind.
    first = _server(0)
    port = await first.start()
    try:
        with pytest.raises(StartupError, match=rf"^--port {port}: .* already in use"):
            await _server(port).start()
    finally:
        await first.server.stop(None)


def test_service_start_up_failure_is_one_line_and_debug_has_the_traceback(tmp_path):
    with _taken_port() as sock:
        port = str(sock.getsockname()[1])
        cmd = [sys.executable, "-m", "gateway", "--port", port, "--metrics-port", "0"]
        quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        loud = subprocess.run(
            [*cmd, "--log-level", "debug"], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
    assert quiet.returncode == 1 and loud.returncode == 1
    lines = quiet.stderr.strip().splitlines()
    assert lines == [
        f"gateway: error: --port {port}: 127.0.0.1:{port} is already in use "
        "(another process listens there)"
    ], quiet.stderr
    assert "Traceback" in loud.stderr and "StartupError" in loud.stderr


def test_flow_service_bad_checkpoint_and_taken_port_are_one_line(tmp_path):
    (tmp_path / "flow.pt").write_bytes(b"not a checkpoint")
    cmd = [sys.executable, "-m", "flow_service", "--model-dir", str(tmp_path), "--port", "0"]
    with _taken_port() as sock:
        port = sock.getsockname()[1]
        taken = subprocess.run(
            [*cmd, "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    bad = subprocess.run(
        [*cmd, "--metrics-port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    # The port is checked before the weights load (minutes for the real ones).
    assert taken.returncode == 1 and taken.stderr.splitlines() == [
        f"flow_service: error: --metrics-port {port}: 127.0.0.1:{port} is already in use "
        "(another process listens there)"
    ]
    assert bad.returncode == 1 and bad.stderr.splitlines() == [
        f"flow_service: error: {tmp_path / 'flow.pt'}: not a torch checkpoint (corrupt, or "
        "another format)"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_device_without_cuda_is_one_line():
    with pytest.raises(StartupError, match=r"^--device cuda: ") as info:
        check_device("cuda")
    assert "\n" not in str(info.value)
    with pytest.raises(StartupError, match=r"^--device 'tpu': "):
        check_device("tpu")
    check_device("cpu")


@pytest.mark.parametrize(
    "reader, error",
    [(read_state_dict, FlowCheckpointError), (read_checkpoint, HiftCheckpointError)],
)
def test_bad_checkpoints_are_one_line_and_never_advise_unsafe_loading(tmp_path, reader, error):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2)}, good)
    files = {
        "truncated.pt": good.read_bytes()[: good.stat().st_size // 2],
        "random.pt": np.random.default_rng(0).bytes(4096),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    torch.save({"w": np.zeros(3)}, tmp_path / "objects.pt")  # needs unpickling: refused
    for name in (*files, "objects.pt", "absent.pt"):
        with pytest.raises(error) as info:
            reader(tmp_path / name)
        text = one_line(info.value)
        assert text.startswith(str(tmp_path / name)), text
        assert "\n" not in text and "weights_only=False" not in text.replace(" ", "")
        assert "weights_only` set to `False" not in str(info.value)


def test_run_main_reports_unexpected_errors_with_their_type(capsys):
    def boom():
        raise KeyError("x")

    assert run_main("prog", boom) == 1
    err = capsys.readouterr().err
    assert err == "prog: error: KeyError: 'x' (--log-level debug shows the details)\n"
    assert run_main("prog", lambda: 3) == 3


def test_make_run_refuses_a_taken_port_naming_it(tmp_path, monkeypatch, capsys):
    from gateway import demo

    with _taken_port() as sock:
        port = sock.getsockname()[1]
        # The vocoder's metrics port is taken: nothing may start, and the port is named.
        monkeypatch.setattr(
            demo, "SERVICES", [("flow_service", 0, 0), ("vocoder_service", 0, port)]
        )
        assert demo.main(["--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"make run: vocoder_service --metrics-port {port}: 127.0.0.1:{port} is already in use "
        "(another process listens there); stop it first"
    )
    assert not (tmp_path / "logs" / "flow_service.log").exists()  # nothing was started


def test_console_scripts_resolve_to_entry_points_with_help(capsys):
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"token2wav", "token2wav-gateway", "token2wav-flow", "token2wav-vocoder"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        main = getattr(__import__(module, fromlist=[func]), func)
        with pytest.raises(SystemExit) as info:
            main(["--help"])
        assert info.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name
