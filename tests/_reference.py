"""The in-process reference pipeline: the same models and chunk schedule as the services, no
gRPC, and upstream's stateless vocoding (re-decode the whole mel history each chunk and cut off
the samples already emitted, docs/REFERENCE.md §6.3). Tests use it as the oracle for the whole stack.
"""

from __future__ import annotations

import numpy as np
import torch

from flow_service.model import FlowModel, FlowRequest, Voice
from gateway.schedule import ChunkPlanner, ScheduleConfig
from token2wav.tensors import VoiceData


def model_voice(voice: VoiceData) -> Voice:
    return Voice(
        torch.from_numpy(voice.prompt_token.copy()),
        torch.from_numpy(voice.prompt_feat.copy()),
        torch.from_numpy(voice.embedding.copy()),
    )


@torch.inference_mode()
def reference_synthesis(
    flow: FlowModel,
    hift,
    voice: VoiceData,
    tokens: np.ndarray,
    schedule: ScheduleConfig = ScheduleConfig(),
) -> list[np.ndarray]:
    """Audio chunks (float32) as upstream's streaming token2wav would emit them."""
    v = model_voice(voice)
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    planner = ChunkPlanner(voice.num_prompt_tokens, schedule)
    mel_history = torch.zeros(80, 0)
    emitted = 0
    chunks: list[np.ndarray] = []
    while (chunk := planner.next_call(len(ids), ended=True)) is not None:
        req = FlowRequest(
            v, ids[: chunk.num_tokens], chunk.token_offset, chunk.finalize, chunk.streaming
        )
        mel = flow.generate([req])[0].float().cpu()
        mel_history = torch.cat([mel_history, mel], dim=1)
        speech = hift.decode(mel_history, finalize=chunk.finalize).float().cpu().numpy()
        chunks.append(speech[emitted:])
        emitted = speech.shape[0]
    return chunks
