"""The `token2wav` command (`python -m gateway.client`): synthesize through a gateway, make a
sample voice and tokens, and the voice commands of `gateway.client.voices`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import grpc

from gateway.audio_format import OPUS_RATES, OUTPUT_RATES
from gateway.client import (
    ENCODED_FILES,
    OPUS_FILE_SUFFIXES,
    load_tokens,
    load_voice,
    make_sample,
    run_synthesis,
)
from gateway.client.voices import (
    VOICE_COMMANDS,
    add_voice_commands,
    run_voice_command,
    voice_from_gateway,
)
from token2wav import SAMPLE_RATE
from token2wav.cli import prog, run_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog("gateway.client"),
        description=sys.modules["gateway.client"].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default=os.environ.get("T2W_LOG_LEVEL", "WARNING"),
        help="logging level; DEBUG also prints the traceback of a failure [env T2W_LOG_LEVEL]",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "synthesize", parents=[common], help="stream tokens through the gateway into a WAV file"
    )
    s.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="gateway HOST:PORT, or several comma-separated: a stream whose gateway fails "
        "resumes on the next",
    )
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--voice", help=".npz with prompt_token, prompt_feat, embedding")
    which.add_argument(
        "--audio",
        help="prompt recording (WAV/FLAC/OGG) the gateway makes the voice from "
        "(it needs --frontend-dir)",
    )
    s.add_argument("--tokens", required=True, help=".npy of speech token ids (int, 0..6560)")
    s.add_argument(
        "--out",
        required=True,
        help="output file by its extension: .wav (16-bit PCM mono), .ogg/.opus (Opus in Ogg) "
        "or .mp3 (the encoded ones as the gateway streams them)",
    )
    s.add_argument(
        "--sample-rate",
        type=int,
        default=SAMPLE_RATE,
        choices=OUTPUT_RATES,
        help=f"output sample rate, Hz (default {SAMPLE_RATE}, the model's; Opus takes "
        f"{', '.join(map(str, OPUS_RATES))}); the gateway resamples",
    )
    s.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="send tokens at this rate per second, like an LLM (0: all at once)",
    )
    s.add_argument(
        "--format",
        choices=("pcm16", "float32"),
        default="pcm16",
        help="wire audio format for a .wav output (.ogg/.opus/.mp3: that codec on the wire)",
    )
    s.add_argument("--timeout", type=float, default=None, help="deadline for the whole stream, s")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    m = sub.add_parser(
        "make-sample", parents=[common], help="write a random sample voice.npz and tokens.npy"
    )
    m.add_argument("--out-dir", default="out/sample", help="where to write them")
    m.add_argument("--prompt-tokens", type=int, default=75, help="prompt length (3 s = 75)")
    m.add_argument("--num-tokens", type=int, default=250, help="utterance length (10 s = 250)")
    m.add_argument("--seed", type=int, default=0, help="random seed")
    add_voice_commands(sub)
    _refuse_unknown_options(p, sub, sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.cmd in VOICE_COMMANDS:
        return run_voice_command(a)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Bad input files, an unreachable gateway, a failed stream: one line and exit status 1.
    return run_main("token2wav", lambda: _run_command(a))


def _refuse_unknown_options(p: argparse.ArgumentParser, sub, argv: list[str]) -> None:
    """argparse reports a missing command or required flag before an unknown flag, so
    `token2wav --bogus` would only say that a command is required: name the flag first."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = sub.choices.get(command, p)
    known = {opt for parser_ in (p, parser) for a in parser_._actions for opt in a.option_strings}
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        abbreviated = name.startswith("--") and any(k.startswith(name) for k in known)
        if arg.startswith("-") and not arg[1:2].isdigit() and not abbreviated:
            parser.error(f"unrecognized arguments: {arg}")


def _run_command(a: argparse.Namespace) -> int:
    if a.cmd == "make-sample":
        v, t = make_sample(a.out_dir, a.prompt_tokens, a.num_tokens, a.seed)
        print(f"wrote {v} and {t}")
        return 0
    suffix = Path(a.out).suffix.lower()
    if suffix not in (".wav", *ENCODED_FILES):
        raise ValueError(f"--out {a.out}: want a .wav, .ogg, .opus or .mp3 file")
    if suffix in OPUS_FILE_SUFFIXES and a.sample_rate not in OPUS_RATES:
        raise ValueError(
            f"--sample-rate {a.sample_rate}: Opus ({suffix}) takes "
            f"{', '.join(map(str, OPUS_RATES))} Hz"
        )
    tokens = load_tokens(a.tokens)  # the files are checked before anything is sent
    voice = load_voice(a.voice) if a.voice else None
    try:
        if voice is None:
            voice = voice_from_gateway(a.target, a.audio)
        r = run_synthesis(
            a.target,
            voice,
            tokens,
            a.out,
            a.pace,
            a.format,
            not a.quiet,
            timeout=a.timeout,
            sample_rate=a.sample_rate,
        )
    except grpc.RpcError as exc:
        hint = f" (is a gateway listening at --target {a.target}?)"
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            hint = ""
        details = (exc.details() or "").splitlines()[0] if exc.details() else ""
        print(f"token2wav: synthesis failed: {exc.code().name}: {details}{hint}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}: {r['audio_seconds']:.2f} s of audio in {r['chunks']} chunks")
    print(
        f"first-chunk latency {r['first_chunk_ms']:.0f} ms, real-time factor {r['rtf']:.3f} "
        f"({r['xrt']:.1f}x real time)"
    )
    return 0
