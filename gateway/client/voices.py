"""The CLI's voice commands (`python -m gateway.client make-voice | import-speakers |
export-speakers`): prompt recordings and upstream's spk2info.pt to voice files, and back."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import grpc
import numpy as np

VOICE_COMMANDS = ("make-voice", "import-speakers", "export-speakers")


def add_voice_commands(sub) -> None:
    m = sub.add_parser(
        "make-voice",
        help="make a voice .npz from a prompt recording, as upstream's front end does",
        description="Runs the front end here (--frontend-dir) or in a gateway (--target).",
    )
    m.add_argument("--audio", required=True, help="prompt recording: WAV, FLAC or OGG, <= 30 s")
    where = m.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--frontend-dir", help="folder with speech_tokenizer_v3.onnx and campplus.onnx"
    )
    where.add_argument("--target", help="a gateway HOST:PORT started with --frontend-dir")
    m.add_argument("--out", required=True, help="voice file to write (.npz)")
    i = sub.add_parser(
        "import-speakers",
        help="upstream's spk2info.pt -> one voice .npz per speaker (and register them)",
    )
    i.add_argument("spk2info", help="path of upstream's spk2info.pt")
    i.add_argument(
        "--speaker", action="append", help="import only this speaker (repeatable); default all"
    )
    i.add_argument("--out-dir", default="voices", help="where NAME.npz files go")
    i.add_argument("--target", help="also register each voice with this gateway HOST:PORT")
    e = sub.add_parser(
        "export-speakers", help="voice .npz files -> upstream's spk2info.pt layout, by name"
    )
    e.add_argument("voices", nargs="+", metavar="NAME=VOICE.npz", help="speaker name and voice")
    e.add_argument("--out", required=True, help="spk2info.pt to write (other speakers are kept)")


def safe_filename(name: str) -> str:
    """A speaker name as a file name: letters (any script), digits, '.', '_', '-' only."""
    cleaned = re.sub(r"[^\w.-]", "_", name).strip(".") or "speaker"
    return cleaned[:100]


def _voice_data(v):
    from token2wav.tensors import make_voice

    return make_voice(v.prompt_token, v.prompt_feat, v.embedding, field="voice")


def voice_from_gateway(target: str, audio_path: str):
    """Have the gateway at `target` make the voice from a recording; returns VoiceData."""
    from gateway.client import Client

    with Client(target) as client:
        return client.register_audio(audio_file=Path(audio_path).read_bytes()).voice


def _save(voice, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        prompt_token=voice.prompt_token.astype(np.int32),
        prompt_feat=voice.prompt_feat,
        embedding=voice.embedding,
    )


def make_voice_cmd(a) -> str:
    if a.frontend_dir:
        from token2wav.frontend import Frontend

        voice = _voice_data(
            Frontend.from_dir(a.frontend_dir).voice_from_file(
                Path(a.audio).read_bytes(), field=a.audio
            )
        )
    else:
        voice = voice_from_gateway(a.target, a.audio)
    _save(voice, Path(a.out))
    return (
        f"wrote {a.out}: {voice.num_prompt_tokens} prompt tokens "
        f"({voice.num_prompt_tokens / 25:.2f} s), voice id {voice.voice_id}"
    )


def import_speakers_cmd(a) -> str:
    from token2wav.frontend import load_speakers

    voices = load_speakers(a.spk2info, a.speaker)
    out = Path(a.out_dir)
    files = {name: out / f"{safe_filename(name)}.npz" for name in voices}
    if len(set(files.values())) != len(files):
        raise ValueError("two speaker names map to one file name; import them with --speaker")
    lines = []
    client = None
    if a.target:
        from gateway.client import Client

        client = Client(a.target)
    try:
        for name, v in voices.items():
            voice = _voice_data(v)
            _save(voice, files[name])
            vid = client.register_voice(voice) if client else voice.voice_id
            lines.append(f"{name}\t{files[name]}\t{vid}\t{voice.num_prompt_tokens} tokens")
    finally:
        if client:
            client.channel.close()
    return "\n".join(lines)


def export_speakers_cmd(a) -> str:
    from gateway.client import load_voice
    from token2wav.frontend import Voice, save_speakers

    voices = {}
    for item in a.voices:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: want NAME=VOICE.npz")
        v = load_voice(path)
        voices[name] = Voice(v.prompt_token.astype(np.int32), v.prompt_feat, v.embedding)
    save_speakers(a.out, voices)
    return f"wrote {len(voices)} speakers into {a.out}: {', '.join(voices)}"


def run_voice_command(a: argparse.Namespace) -> int:
    from token2wav.frontend.audio import FrontendUnavailable

    run = {
        "make-voice": make_voice_cmd,
        "import-speakers": import_speakers_cmd,
        "export-speakers": export_speakers_cmd,
    }[a.cmd]
    try:
        print(run(a))
    except grpc.RpcError as exc:
        print(f"{a.cmd} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ValueError, OSError, FrontendUnavailable) as exc:
        print(f"{a.cmd} failed: {exc}", file=sys.stderr)
        return 1
    return 0
