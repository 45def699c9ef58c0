"""Voices from audio through the gateway and the CLI: RegisterVoice with a recording (file or
PCM), synthesis with the voice it made, the refusals and their status codes, the bounded
front-end pool off the event loop, and the make-voice / import-speakers / export-speakers
commands. Tiny stand-in ONNX models (tests/_frontend_fixtures.py)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch
from _frontend_fixtures import voiced_signal, wav_bytes, write_tiny_models
from _reference import reference_synthesis
from test_gateway import check_exactly_once, run_stream, snr_db, start_stack

from flow_service.model import load_flow
from gateway.client import AsyncClient, load_voice
from gateway.client.cli import main
from token2wav.frontend import Frontend, load_speakers
from token2wav.tensors import make_voice
from vocoder_service.model import load_hift

pytest.importorskip("onnxruntime")
pytest.importorskip("kaldi_native_fbank")
IA = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_models(tmp_path_factory.mktemp("frontend"))


def prompt_wav(seconds=2.0, rate=44100, seed=0) -> bytes:
    return wav_bytes(voiced_signal(seconds, rate, channels=2, seed=seed), rate)


def local_voice(model_dir, data: bytes):
    v = Frontend.from_dir(model_dir).voice_from_file(data)
    return make_voice(v.prompt_token, v.prompt_feat, v.embedding)


async def test_voice_from_audio_synthesizes(models, model_dir):
    stack = await start_stack(models, "--frontend-dir", str(model_dir))
    try:
        data = prompt_wav(seed=1)
        expected = local_voice(model_dir, data)
        async with AsyncClient(stack.target) as client:
            made = await client.register_audio(audio_file=data)
            assert made.voice_id == expected.voice_id  # the same voice as made locally
            np.testing.assert_array_equal(made.prompt_token, expected.prompt_token)
            assert made.voice.voice_id == made.voice_id
            tokens = np.random.default_rng(1).integers(0, 6561, 40)
            chunks = await run_stream(client, made.voice_id, tokens, seed=1)
            check_exactly_once(chunks, len(tokens))
            ref = np.concatenate(reference_synthesis(*models, expected, tokens))
            assert snr_db(np.concatenate([c.samples for c in chunks]), ref) >= 60
            # PCM (int16, mono 24 kHz) works too, and registering again is not "created".
            pcm = np.round(voiced_signal(1.5, 24000, seed=2) * 32767).astype(np.int16)
            a = await client.register_audio(pcm=pcm, sample_rate=24000)
            b = await client.register_audio(pcm=pcm, sample_rate=24000)
            assert a.voice_id == b.voice_id and a.prompt_token.shape == (37,)
    finally:
        await stack.stop()


async def test_bad_audio_is_invalid_argument_naming_the_problem(models, model_dir):
    stack = await start_stack(models, "--frontend-dir", str(model_dir))
    try:
        async with AsyncClient(stack.target) as client:
            cases = [
                (
                    dict(audio_file=wav_bytes(voiced_signal(2, 8000), 8000)),
                    "audio_file: sample rate 8000 Hz",
                ),
                (
                    dict(audio_file=wav_bytes(voiced_signal(31, 16000), 16000)),
                    "longer than the 30 s",
                ),
                (
                    dict(audio_file=wav_bytes(np.zeros(32000, np.float32), 16000)),
                    "audio_file: silent",
                ),
                (
                    dict(audio_file=b"RIFF\x00\x00\x00\x00WAVEjunk" * 4),
                    "audio_file: not a readable",
                ),
                (
                    dict(audio_file=wav_bytes(voiced_signal(2, 16000), 16000, fmt="AIFF")),
                    "container AIFF",
                ),
                (dict(pcm=voiced_signal(1, 16000), sample_rate=0), "audio_pcm.sample_rate"),
                (
                    dict(pcm=voiced_signal(1, 16000)[:, None, None], sample_rate=16000),
                    "audio_pcm.samples",
                ),
            ]
            for kwargs, problem in cases:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.register_audio(**kwargs)
                assert info.value.code() == IA and problem in info.value.details(), info.value
            # Voice arrays and audio together: refused, naming the field.
            from gateway.client import audio_request

            req = audio_request(audio_file=prompt_wav())
            req.voice.CopyFrom(local_voice(model_dir, prompt_wav()).to_proto())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.stub.RegisterVoice(req)
            assert info.value.code() == IA and info.value.details().startswith("voice:")
    finally:
        await stack.stop()


async def test_audio_without_frontend_dir_names_the_flag(models):
    stack = await start_stack(models)
    try:
        async with AsyncClient(stack.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.register_audio(audio_file=prompt_wav())
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--frontend-dir" in info.value.details()
    finally:
        await stack.stop()


async def test_wrong_model_folder_is_failed_precondition(models, tmp_path):
    """A tokenizer that gives ids past 6560 is the deployment's problem, not the client's."""
    stack = await start_stack(
        models, "--frontend-dir", str(write_tiny_models(tmp_path, 10**9, 1e6))
    )
    try:
        async with AsyncClient(stack.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.register_audio(audio_file=prompt_wav(seed=8))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--frontend-dir: speech tokenizer gave id" in info.value.details()
    finally:
        await stack.stop()


async def test_slow_frontend_call_does_not_delay_other_streams(models, model_dir, monkeypatch):
    """A front-end call held inside its worker thread (a gate, no sleeps) while another
    client's whole stream runs: the stream gets all its audio while the call is still held.
    The pool's bound answers RESOURCE_EXHAUSTED for a second recording meanwhile."""
    entered, gate = threading.Event(), threading.Event()
    original = Frontend.voice_from_file

    def held(self, *args, **kwargs):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Frontend, "voice_from_file", held)
    stack = await start_stack(
        models,
        "--frontend-dir",
        str(model_dir),
        "--frontend-workers",
        "1",
        "--frontend-max-pending",
        "1",
    )
    try:
        async with AsyncClient(stack.target) as client:
            slow = asyncio.ensure_future(client.register_audio(audio_file=prompt_wav(seed=3)))
            assert await asyncio.to_thread(entered.wait, 30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.register_audio(audio_file=prompt_wav(seed=4))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            voice = make_voice(
                np.arange(20), np.zeros((40, 80), np.float32) - 4, np.ones(192, np.float32)
            )
            tokens = np.random.default_rng(5).integers(0, 6561, 40)
            chunks = await run_stream(client, voice, tokens, seed=5)
            check_exactly_once(chunks, len(tokens))
            assert not slow.done()  # all that audio came while the front end was busy
            gate.set()
            made = await slow
            assert made.voice_id.startswith("v1-")
    finally:
        gate.set()
        await stack.stop()


def test_cli_make_voice_and_speakers(models, model_dir, tmp_path, capsys):
    audio = tmp_path / "prompt.flac"
    audio.write_bytes(wav_bytes(voiced_signal(2.0, 48000, seed=6), 48000, fmt="FLAC"))
    out = tmp_path / "voice.npz"
    argv = ["make-voice", "--audio", str(audio), "--frontend-dir", str(model_dir)]
    assert main([*argv, "--out", str(out)]) == 0
    voice = load_voice(out)
    assert voice.voice_id in capsys.readouterr().out and voice.num_prompt_tokens == 50
    # Export to upstream's layout and import back, by name.
    spk = tmp_path / "spk2info.pt"
    assert main(["export-speakers", "--out", str(spk), f"anna/1={out}"]) == 0
    assert torch.load(spk, weights_only=True)["anna/1"]["flow_embedding"].shape == (1, 192)
    capsys.readouterr()
    assert main(["import-speakers", str(spk), "--out-dir", str(tmp_path / "voices")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("anna/1\t") and voice.voice_id in line
    back = load_voice(tmp_path / "voices" / "anna_1.npz")
    assert back.voice_id == voice.voice_id
    assert list(load_speakers(spk)) == ["anna/1"]
    # Bad input: a one-line error and exit 1.
    assert (
        main(
            ["make-voice", "--audio", str(spk), "--frontend-dir", str(model_dir), "--out", str(out)]
        )
        == 1
    )
    assert "make-voice failed:" in capsys.readouterr().err


def test_cli_synthesize_with_audio(models, model_dir, tmp_path):
    async def run():
        stack = await start_stack(models, "--frontend-dir", str(model_dir))
        try:
            audio = tmp_path / "prompt.wav"
            audio.write_bytes(prompt_wav(1.5, 16000, seed=7))
            np.save(tmp_path / "t.npy", np.arange(30))
            argv = ["synthesize", "--target", stack.target, "--audio", str(audio)]
            argv += [
                "--tokens",
                str(tmp_path / "t.npy"),
                "--out",
                str(tmp_path / "o.wav"),
                "--quiet",
            ]
            return await asyncio.to_thread(main, argv)
        finally:
            await stack.stop()

    assert asyncio.run(run()) == 0
    import wave

    with wave.open(str(tmp_path / "o.wav")) as w:
        assert w.getnframes() == 30 * 960
