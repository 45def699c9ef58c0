"""Upstream's saved speakers (`spk2info.pt`) <-> voices.

Upstream's `CosyVoice.add_zero_shot_spk` stores, per speaker name, the model inputs of
`frontend_zero_shot` (tensors with a leading batch dimension of 1), and `save_spkinfo` writes
the dict with `torch.save`. The three the flow needs: `flow_prompt_speech_token` int32 (1, N),
`prompt_speech_feat` float32 (1, 2N, 80), `flow_embedding` float32 (1, 192).

Export writes those three with their `*_len` companions and `llm_embedding` (upstream sets it
equal to `flow_embedding`). It leaves out `prompt_text` and `llm_prompt_speech_token`: a voice
has no transcript, and upstream's `tts()` defaults both to empty, which is its cross-lingual
mode (the LLM gets no prompt; the flow gets the full voice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from token2wav import MEL_BINS, SPK_EMBED_DIM
from token2wav.frontend.frontend import Voice, align

NEEDED_KEYS = ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")


def _array(entry: dict, key: str) -> np.ndarray:
    value = entry[key]
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").numpy()
    return np.asarray(value)


def voice_from_entry(name: str, entry) -> Voice:
    """One speaker's entry -> Voice (aligned 2:1 by upstream's rule if it was not)."""
    if not isinstance(entry, dict):
        raise ValueError(f"speaker {name!r}: entry is {type(entry).__name__}, want a dict")
    missing = [k for k in NEEDED_KEYS if k not in entry]
    if missing:
        raise ValueError(
            f"speaker {name!r}: no {', '.join(missing)} (has {', '.join(sorted(entry))}); "
            "only zero-shot speakers (add_zero_shot_spk) carry a prompt"
        )
    tokens = _array(entry, "flow_prompt_speech_token").reshape(-1)
    feat = _array(entry, "prompt_speech_feat")
    feat = feat.reshape(-1, feat.shape[-1]) if feat.ndim else feat
    emb = _array(entry, "flow_embedding").reshape(-1)
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"speaker {name!r}: flow_prompt_speech_token is {tokens.dtype}, want int")
    if feat.ndim != 2 or feat.shape[1] != MEL_BINS:
        raise ValueError(
            f"speaker {name!r}: prompt_speech_feat shape {feat.shape}, want (1, T, 80)"
        )
    if emb.shape != (SPK_EMBED_DIM,):
        raise ValueError(f"speaker {name!r}: flow_embedding has {emb.size} values, want 192")
    tokens, feat = align(tokens, feat)
    return Voice(tokens.astype(np.int32), feat.astype(np.float32), emb.astype(np.float32))


def load_speakers(path: str | Path, names: list[str] | None = None) -> dict[str, Voice]:
    """Voices by speaker name from a spk2info.pt (all speakers, or those in `names`)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a {type(data).__name__}, want a dict of speakers")
    if names:
        unknown = [n for n in names if n not in data]
        if unknown:
            raise ValueError(f"{path}: no speaker {unknown[0]!r} (has {', '.join(map(str, data))})")
    return {str(n): voice_from_entry(str(n), data[n]) for n in (names or list(data))}


def speaker_entry(voice: Voice) -> dict[str, torch.Tensor]:
    """A voice in upstream's per-speaker layout (batch dimension 1, int32 lengths)."""
    n = int(voice.prompt_token.shape[0])
    tokens = torch.from_numpy(voice.prompt_token.astype(np.int32))[None]  # (1, N)
    feat = torch.from_numpy(voice.prompt_feat.astype(np.float32))[None]  # (1, 2N, 80)
    emb = torch.from_numpy(voice.embedding.astype(np.float32))[None]  # (1, 192)
    return {
        "flow_prompt_speech_token": tokens,
        "flow_prompt_speech_token_len": torch.tensor([n], dtype=torch.int32),
        "prompt_speech_feat": feat,
        "prompt_speech_feat_len": torch.tensor([feat.shape[1]], dtype=torch.int32),
        "llm_embedding": emb.clone(),
        "flow_embedding": emb,
    }


def save_speakers(path: str | Path, voices: dict[str, Voice], merge: bool = True) -> None:
    """Write voices by name into a spk2info.pt; with `merge`, keep the file's other speakers."""
    data = {}
    if merge and Path(path).exists():
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: holds a {type(data).__name__}, want a dict of speakers")
    data.update({name: speaker_entry(v) for name, v in voices.items()})
    torch.save(data, path)
