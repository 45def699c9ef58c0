"""The per-stream chunk schedule (docs/REFERENCE.md §6.2), as a pure state machine.

Upstream (CosyVoice2Model.tts, inherited by CosyVoice3): the first hop is 25 tokens plus the
prompt pad, so that prompt + first hop fill whole 25-token (50-frame) attention blocks; the hop
then doubles up to 100. A streaming chunk goes out once `offset + hop + 3` tokens exist (3 tokens
of lookahead), with block-causal attention. After the end of input, whole hops that are still
available go out the same way, then one final call takes every remaining token with full
attention. Upstream keeps the hop on the model instance, so it leaks across requests; here it is
per stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from token2wav import TOKEN_MEL_RATIO
from token2wav.errors import InvalidArgument

BLOCK_TOKENS = 25  # a 50-frame attention block
LOOKAHEAD_TOKENS = 3


@dataclass(frozen=True)
class ScheduleConfig:
    first_hop_tokens: int = 25  # before the prompt pad
    max_hop_tokens: int = 100
    hop_scale: int = 2
    prompt_pad: bool = True  # align prompt + first hop to whole blocks (exact chunking)

    @classmethod
    def from_proto(cls, msg) -> ScheduleConfig:
        """Overrides from StreamConfig.schedule; 0 means the default.

        A client may only choose schedules that keep every chunk boundary on a 50-frame block
        (exact chunking) and cost at most the default's flow compute: each call re-runs the
        stream's prefix, so hops smaller than upstream's multiply the work for the same audio
        (hop 1 on 100 tokens costs 26x)."""
        d = cls()
        cfg = cls(
            msg.first_hop_tokens or d.first_hop_tokens,
            msg.max_hop_tokens or d.max_hop_tokens,
            msg.hop_scale or d.hop_scale,
            not msg.disable_prompt_pad,
        )
        if not 1 <= cfg.first_hop_tokens <= 1000:
            raise InvalidArgument("config.schedule.first_hop_tokens", "want 1..1000")
        if not 1 <= cfg.max_hop_tokens <= 1000:
            raise InvalidArgument("config.schedule.max_hop_tokens", "want 1..1000")
        if not 1 <= cfg.hop_scale <= 8:
            raise InvalidArgument("config.schedule.hop_scale", "want 1..8")
        if not cfg.prompt_pad:
            raise InvalidArgument(
                "config.schedule.disable_prompt_pad",
                "would move chunk boundaries off 50-frame blocks",
            )
        for name in ("first_hop_tokens", "max_hop_tokens"):
            if getattr(cfg, name) % BLOCK_TOKENS:
                raise InvalidArgument(
                    f"config.schedule.{name}",
                    f"want a multiple of {BLOCK_TOKENS} (a 50-frame block)",
                )
        field = cfg.first_smaller_hop(d)
        if field is not None:
            raise InvalidArgument(
                f"config.schedule.{field}",
                "gives smaller hops than the default schedule (25, 50, 100, 100, ...), which "
                "costs more flow compute for the same audio",
            )
        return cfg

    def hops(self, n: int) -> list[int]:
        """The first `n` hop sizes (before the prompt pad)."""
        out, hop = [], self.first_hop_tokens
        for _ in range(n):
            out.append(hop)
            hop = min(self.max_hop_tokens, hop * self.hop_scale)
        return out

    def first_smaller_hop(self, other: ScheduleConfig) -> str | None:
        """The field that makes some hop of this schedule smaller than `other`'s, or None.
        Hops settle at the max hop within log2(1000) steps, so 12 steps decide it."""
        for k, (mine, theirs) in enumerate(zip(self.hops(12), other.hops(12))):
            if mine < theirs:
                if k == 0:
                    return "first_hop_tokens"
                return "max_hop_tokens" if mine == self.max_hop_tokens else "hop_scale"
        return None

    def is_exact(self) -> bool:
        """Whether chunk boundaries stay on 50-frame blocks (the upstream guarantee)."""
        return (
            self.prompt_pad
            and self.first_hop_tokens % BLOCK_TOKENS == 0
            and (self.max_hop_tokens % BLOCK_TOKENS == 0)
        )


@dataclass(frozen=True)
class FlowCall:
    seq: int
    num_tokens: int  # prefix length the flow call sees (lookahead included when not final)
    token_offset: int  # tokens already emitted before this chunk
    finalize: bool
    streaming: bool

    @property
    def num_emit_tokens(self) -> int:
        """Tokens whose mel this chunk adds."""
        end = self.num_tokens if self.finalize else self.num_tokens - LOOKAHEAD_TOKENS
        return end - self.token_offset

    def num_seq_frames(self, num_prompt_tokens: int) -> int:
        """The call's DiT sequence length (prompt + every target frame up to this chunk's end;
        lookahead tokens are context, not frames): the unit of the flow's cost model and of
        the capacity it reports (FlowRequest.num_seq_frames)."""
        return TOKEN_MEL_RATIO * (num_prompt_tokens + self.token_offset + self.num_emit_tokens)


class ChunkPlanner:
    """Turns a growing token count into chunk calls. Feed it `next_call(n, ended)` repeatedly."""

    def __init__(self, num_prompt_tokens: int, config: ScheduleConfig = ScheduleConfig()):
        self.config = config
        pad = 0
        if config.prompt_pad:
            # upstream: ceil(n_p / hop) * hop - n_p with the stream's initial hop
            hop = config.first_hop_tokens
            pad = -num_prompt_tokens % hop
        self.hop = config.first_hop_tokens
        self.first_hop = config.first_hop_tokens + pad
        self.offset = 0
        self.seq = 0
        self.done = False

    def next_call(self, num_tokens: int, ended: bool) -> FlowCall | None:
        """The next call the stream can make with `num_tokens` received, or None to wait."""
        if self.done:
            return None
        this_hop = self.first_hop if self.seq == 0 else self.hop
        if num_tokens >= self.offset + this_hop + LOOKAHEAD_TOKENS:
            chunk = FlowCall(
                self.seq,
                self.offset + this_hop + LOOKAHEAD_TOKENS,
                self.offset,
                finalize=False,
                streaming=True,
            )
            self.offset += this_hop
            self.hop = min(self.config.max_hop_tokens, self.hop * self.config.hop_scale)
            self.seq += 1
            return chunk
        if ended:
            self.done = True
            if num_tokens == 0:
                return None
            chunk = FlowCall(self.seq, num_tokens, self.offset, finalize=True, streaming=False)
            self.seq += 1
            return chunk
        return None
