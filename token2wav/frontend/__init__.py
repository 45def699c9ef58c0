"""The voice front end: a prompt recording (or upstream's saved speakers) -> a voice.

No gRPC here: the gateway and the CLI call it. Needs the optional packages of
`pip install 'token2wav[frontend]'` (onnxruntime, kaldi-native-fbank, soundfile) and the two
ONNX files of the Fun-CosyVoice3-0.5B-2512 folder; `FrontendUnavailable` says what is missing.
"""

from token2wav.frontend.audio import (
    BadAudio,
    FrontendUnavailable,
    PromptAudio,
    prompt_from_file,
    prompt_from_pcm,
)
from token2wav.frontend.frontend import Frontend, FrontendConfig, Voice, align
from token2wav.frontend.speakers import load_speakers, save_speakers

__all__ = [
    "BadAudio",
    "Frontend",
    "FrontendConfig",
    "FrontendUnavailable",
    "PromptAudio",
    "Voice",
    "align",
    "load_speakers",
    "prompt_from_file",
    "prompt_from_pcm",
    "save_speakers",
]
