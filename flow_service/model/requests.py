"""What the flow model is asked to do: a voice and one chunk of one stream, validated.

A chunk request is self-contained (docs/REFERENCE.md §2.2: the flow keeps no state between calls): the voice,
the whole token prefix so far, how many target tokens were already emitted (`token_offset`),
whether this is the last call (`finalize`) and which attention it uses (`streaming`).

Token bookkeeping for one request (n_p prompt tokens, n target tokens so far):
    emitted tokens  n_emit = n            if finalize
                           = n - 3        otherwise (the last 3 are lookahead context only)
    DiT sequence    T      = 2 (n_p + n_emit)   frames, prompt first, position 0 = prompt start
    new mel         frames [2 (n_p + token_offset), T) of that sequence, i.e.
                    num_out_frames = 2 (n_emit - token_offset) >= 0

A prompt of zero tokens (n_p = 0, prompt_feat of shape (0, 80)) is accepted: the math is
well defined (cond is all zeros, only the speaker vector conditions the voice), though upstream
always has a prompt. A request with nothing new to emit (token_offset == n_emit) is accepted and
returns a (80, 0) tensor.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from flow_service.model.config import (
    MAX_FRAMES,
    MEL_BINS,
    MEL_FRAME_RATE,
    PRE_LOOKAHEAD,
    SPK_EMBED_DIM,
    TOKEN_MEL_RATIO,
    VOCAB_SIZE,
)
from token2wav.invalid import InvalidInput


@dataclass(frozen=True, eq=False)
class Voice:
    """One speaker prompt (docs/REFERENCE.md §1.4). Tensors live on any device; CPU is expected.

    Frozen, and its tensors are values: never modify them in place. A voice is validated and
    hashed once (`validate_voice`, `fingerprint`), not at every call: the flow service's
    VoiceCache hands one object to every call of a voice, and a stream's ~10 block calls would
    otherwise pay ~0.3 ms of host time a row each, while the GPU waits."""

    prompt_token: torch.Tensor  # [n_p] int, ids 0..6560
    prompt_feat: torch.Tensor  # [2 n_p, 80] float, log-mel of the prompt audio
    embedding: torch.Tensor  # [192] float, CAM++ x-vector (normalised inside the model)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token.shape[0])

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """Content hash of everything the voice contributes (prompt ids, prompt mel,
        x-vector): the prefix cache's voice key."""
        h = hashlib.blake2b(digest_size=16)
        for t in (
            self.prompt_token.to(torch.int64),
            self.prompt_feat.float(),
            self.embedding.float(),
        ):
            t = t.detach().cpu().contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
        return h.digest()

    def validate(self, prefix: str = "") -> None:
        validate_voice(self, prefix)


@dataclass
class FlowRequest:
    """One flow call of one stream (docs/REFERENCE.md §6.2/§6.3)."""

    voice: Voice
    tokens: torch.Tensor  # [n] int: the whole target token prefix so far, lookahead included
    token_offset: int = 0  # target tokens already emitted by earlier chunks
    finalize: bool = True  # last call: emit every token, right-pad the lookahead with zeros
    streaming: bool = False  # 50-frame block-causal attention (True) or full attention (False)
    # The stream's identity for the prefix cache ("" = none). Never changes the result: a cached
    # prefix is used only when it was computed from the same voice and token ids.
    cache_key: str = ""

    @property
    def num_emit_tokens(self) -> int:
        """Target tokens whose mel exists after this call (emitted now or before)."""
        return int(self.tokens.shape[0]) - (0 if self.finalize else PRE_LOOKAHEAD)

    @property
    def num_prompt_frames(self) -> int:
        return TOKEN_MEL_RATIO * self.voice.num_prompt_tokens

    @property
    def num_seq_frames(self) -> int:
        """DiT sequence length T (prompt + target): the cost and padding unit for scheduling."""
        return TOKEN_MEL_RATIO * (self.voice.num_prompt_tokens + self.num_emit_tokens)

    @property
    def out_start_frame(self) -> int:
        """First returned frame, as a position in the DiT sequence."""
        return TOKEN_MEL_RATIO * (self.voice.num_prompt_tokens + self.token_offset)

    @property
    def num_out_frames(self) -> int:
        """Mel frames this call returns: 2 (n_emit - token_offset)."""
        return TOKEN_MEL_RATIO * (self.num_emit_tokens - self.token_offset)


def _is_int_tensor(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and not x.dtype.is_floating_point
        and not x.dtype.is_complex
        and x.dtype != torch.bool
    )


def _check_ids(name: str, ids, vocab_size: int) -> None:
    if not _is_int_tensor(ids):
        raise InvalidInput(name, f"expected an integer torch.Tensor, got {_describe(ids)}")
    if ids.dim() != 1:
        raise InvalidInput(name, f"expected shape (n,), got {tuple(ids.shape)}")
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidInput(f"{name}[{i}]", f"id {int(ids[i])} outside 0..{vocab_size - 1}")


def _check_finite(name: str, x: torch.Tensor) -> None:
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        index = tuple(int(v) for v in (~finite).nonzero()[0])
        where = ", ".join(str(v) for v in index)
        raise InvalidInput(f"{name}[{where}]", f"value {float(x[index])} is not finite")


def _check_float(name: str, x, shape: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise InvalidInput(name, f"expected a float torch.Tensor, got {_describe(x)}")
    if tuple(x.shape) != shape:
        raise InvalidInput(name, f"expected shape {shape}, got {tuple(x.shape)}")
    _check_finite(name, x)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype}"
    return type(x).__name__


def validate_voice(voice: Voice, prefix: str = "", vocab_size: int = VOCAB_SIZE) -> None:
    """Raise InvalidInput naming the bad field (prompt_token, prompt_feat or embedding). A
    voice that passed once for this vocabulary is not checked again (its tensors are values)."""
    if not isinstance(voice, Voice):
        raise InvalidInput(
            prefix.rstrip(".") or "voice", f"expected a Voice, got {_describe(voice)}"
        )
    if voice.__dict__.get("_valid_for_vocab") == vocab_size:
        return
    _check_ids(f"{prefix}prompt_token", voice.prompt_token, vocab_size)
    feat = voice.prompt_feat
    if isinstance(feat, torch.Tensor) and feat.dim() == 2 and feat.shape[1] == MEL_BINS:
        num_tokens = voice.num_prompt_tokens
        if feat.shape[0] != TOKEN_MEL_RATIO * num_tokens:
            raise InvalidInput(
                f"{prefix}prompt_feat",
                f"{feat.shape[0]} frames, expected {TOKEN_MEL_RATIO} x {num_tokens} prompt tokens"
                f" = {TOKEN_MEL_RATIO * num_tokens}",
            )
    _check_float(
        f"{prefix}prompt_feat", feat, (TOKEN_MEL_RATIO * voice.num_prompt_tokens, MEL_BINS)
    )
    _check_float(f"{prefix}embedding", voice.embedding, (SPK_EMBED_DIM,))
    voice.__dict__["_valid_for_vocab"] = vocab_size  # frozen: the memo goes around __setattr__


def validate_request(req: FlowRequest, vocab_size: int = VOCAB_SIZE) -> None:
    """Raise InvalidInput naming the bad field of one chunk request (voice fields included)."""
    if not isinstance(req, FlowRequest):
        raise InvalidInput("chunk", f"expected a FlowRequest, got {_describe(req)}")
    validate_voice(req.voice, "voice.", vocab_size)
    _check_ids("tokens", req.tokens, vocab_size)
    for name in ("finalize", "streaming"):
        if not isinstance(getattr(req, name), bool):
            raise InvalidInput(name, f"expected a bool, got {_describe(getattr(req, name))}")
    n = int(req.tokens.shape[0])
    if n == 0:
        raise InvalidInput("tokens", "empty: a chunk needs at least one token")
    if not req.finalize and n < PRE_LOOKAHEAD:
        raise InvalidInput(
            "tokens",
            f"{n} tokens on a non-final chunk, need at least the {PRE_LOOKAHEAD} lookahead",
        )
    offset = req.token_offset
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise InvalidInput("token_offset", f"expected an int, got {_describe(offset)}")
    if offset < 0 or offset > req.num_emit_tokens:
        kind = "final" if req.finalize else "non-final"
        raise InvalidInput(
            "token_offset",
            f"{offset} outside 0..{req.num_emit_tokens} ({n} tokens, {kind} chunk)",
        )
    if req.num_seq_frames > MAX_FRAMES:
        raise InvalidInput(
            "tokens",
            f"prompt + target = {req.num_seq_frames} frames, over the {MAX_FRAMES}-frame"
            f" ({MAX_FRAMES // MEL_FRAME_RATE} s) noise buffer",
        )
