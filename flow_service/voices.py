"""The replica's voice cache: content-addressed ids -> validated model-ready voices (LRU)."""

from __future__ import annotations

import torch

from flow_service import metrics
from flow_service.model import Voice, validate_voice
from token2wav.errors import NotFound
from token2wav.lru import LRU
from token2wav.tensors import VoiceData


class VoiceCache:
    def __init__(self, max_voices: int = 1024):
        if max_voices < 1:
            raise ValueError("max_voices must be >= 1")
        self.max_voices = max_voices
        self._voices = LRU(max_voices)  # voice_id -> Voice

    def __len__(self) -> int:
        return len(self._voices)

    def put(self, data: VoiceData) -> tuple[str, Voice]:
        """Store a wire-validated voice (model validation runs once, on first sight)."""
        voice_id = data.voice_id
        voice = self._voices.get(voice_id)
        if voice is None:
            voice = Voice(
                prompt_token=torch.from_numpy(data.prompt_token.copy()),
                prompt_feat=torch.from_numpy(data.prompt_feat.copy()),
                embedding=torch.from_numpy(data.embedding.copy()),
            )
            validate_voice(voice, "inline_voice.")
            self._voices.put(voice_id, voice)
            metrics.VOICE_CACHE.set(len(self._voices))
        return voice_id, voice

    def get(self, voice_id: str) -> Voice:
        voice = self._voices.get(voice_id)
        if voice is None:
            raise NotFound(f"voice_id {voice_id!r} is not cached on this replica; send it inline")
        return voice
