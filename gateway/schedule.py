"""The per-stream chunk schedule (docs/REFERENCE.md §6.2), as a pure state machine.

Upstream (CosyVoice2Model.tts, inherited by CosyVoice3): the first hop is 25 tokens plus the
prompt pad, so that prompt + first hop fill whole 25-token (50-frame) attention blocks; the hop
then doubles up to 100. A streaming chunk goes out once `offset + hop + 3` tokens exist (3 tokens
of lookahead), with block-causal attention. After the end of input, whole hops that are still
available go out the same way, then one final call takes every remaining token with full
attention. Upstream keeps the hop on the model instance, so it leaks across requests; here it is
per stream.

Block calls: a chunk's mel is not computed when the chunk is due but block by block as tokens
arrive. A non-final streaming call's frames never read a later block (block-causal attention,
left-causal convs, 3 real lookahead tokens, position-locked noise), so the frames of a block
computed as soon as its tokens + 3 are in equal the ones upstream's chunk call computes later
(tests/test_block_calls.py checks it against the per-chunk path). `BlockPlanner` cuts the
stream into units on the 50-frame grid (the first unit also takes the prompt pad) and says
which flow calls to make; a chunk is then the concatenation of its units' frames.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from token2wav import TOKEN_MEL_RATIO
from token2wav.errors import InvalidArgument
from token2wav.v1 import gateway_pb2

BLOCK_TOKENS = 25  # a 50-frame attention block
LOOKAHEAD_TOKENS = 3


@dataclass(frozen=True)
class ScheduleConfig:
    first_hop_tokens: int = 25  # before the prompt pad
    max_hop_tokens: int = 100
    hop_scale: int = 2
    prompt_pad: bool = True  # align prompt + first hop to whole blocks (exact chunking)
    # The final call block-causal (upstream's finalize + streaming) instead of full attention.
    chunked_final: bool = False

    @classmethod
    def blocks(cls) -> ScheduleConfig:
        """The `blocks` schedule: every 25-token block goes out as soon as it is computed.
        Upstream's own code computes this with a constant hop of 25 (stream_scale_factor 1)."""
        return cls(first_hop_tokens=BLOCK_TOKENS, max_hop_tokens=BLOCK_TOKENS, hop_scale=1)

    @classmethod
    def named(cls, kind: str, final_attention: str = "full") -> ScheduleConfig:
        """The schedule the gateway's --schedule (`upstream`, `blocks`) and --final-attention
        (`full`, `chunked`) name."""
        base = cls.blocks() if kind == "blocks" else cls()
        return replace(base, chunked_final=final_attention == "chunked")

    @classmethod
    def from_proto(cls, msg, default: ScheduleConfig | None = None) -> ScheduleConfig:
        """StreamConfig.schedule: `kind` picks `upstream` or `blocks` (unset: `default`, the
        gateway's --schedule); the hop fields override it, 0 meaning unchanged.

        A client may choose any schedule that keeps every chunk boundary on a 50-frame block
        (exact chunking). Small hops cost no extra flow compute: each block is computed once
        (block calls), whatever the chunk it goes out in."""
        d = default if default is not None else cls()
        if msg is None:
            return d
        if msg.kind == gateway_pb2.SCHEDULE_KIND_UPSTREAM:
            d = replace(cls(), chunked_final=d.chunked_final)
        elif msg.kind == gateway_pb2.SCHEDULE_KIND_BLOCKS:
            d = replace(cls.blocks(), chunked_final=d.chunked_final)
        elif msg.kind != gateway_pb2.SCHEDULE_KIND_UNSPECIFIED:
            raise InvalidArgument("config.schedule.kind", f"unknown value {msg.kind}")
        chunked = d.chunked_final
        if msg.final_attention == gateway_pb2.FINAL_ATTENTION_FULL:
            chunked = False
        elif msg.final_attention == gateway_pb2.FINAL_ATTENTION_CHUNKED:
            chunked = True
        elif msg.final_attention != gateway_pb2.FINAL_ATTENTION_UNSPECIFIED:
            raise InvalidArgument(
                "config.schedule.final_attention", f"unknown value {msg.final_attention}"
            )
        cfg = cls(
            msg.first_hop_tokens or d.first_hop_tokens,
            msg.max_hop_tokens or d.max_hop_tokens,
            msg.hop_scale or d.hop_scale,
            not msg.disable_prompt_pad,
            chunked,
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
        return cfg

    def hops(self, n: int) -> list[int]:
        """The first `n` hop sizes (before the prompt pad)."""
        out, hop = [], self.first_hop_tokens
        for _ in range(n):
            out.append(hop)
            hop = min(self.max_hop_tokens, hop * self.hop_scale)
        return out

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
            chunk = FlowCall(
                self.seq,
                num_tokens,
                self.offset,
                finalize=True,
                streaming=self.config.chunked_final,
            )
            self.seq += 1
            return chunk
        return None


class BlockPlanner:
    """The block calls of one stream. Units lie on the 50-frame grid of prompt + target: unit 0
    is the first hop's tokens [0, pad + 25), unit j > 0 is [pad + 25 j, pad + 25 (j + 1)); every
    chunk of an exact schedule covers whole units. `next_call(upto)` gives the next streaming
    call for the units not asked for yet whose tokens + 3 lie within `upto` tokens, as one
    call per run of them but never past the end of the chunk the run starts in (so a chunk's
    last unit does not wait for later ones)."""

    def __init__(self, num_prompt_tokens: int, config: ScheduleConfig = ScheduleConfig()):
        if not config.is_exact():
            raise ValueError("block calls need an exact schedule (chunks on 50-frame blocks)")
        self.num_prompt_tokens = num_prompt_tokens
        self.pad = -num_prompt_tokens % BLOCK_TOKENS
        hops = ChunkPlanner(num_prompt_tokens, config)
        self._first_chunk_end = hops.first_hop
        self._hops = config
        self.next_unit = 0
        self.seq = 0  # calls made, the flow call's seq

    def unit_start(self, unit: int) -> int:
        return 0 if unit == 0 else self.pad + BLOCK_TOKENS * unit

    def chunk_at(self, token: int) -> tuple[int, int, int]:
        """(seq, first token, end token) of the chunk containing target token `token`."""
        seq, start, end, hop = 0, 0, self._first_chunk_end, self._hops.first_hop_tokens
        while end <= token:
            hop = min(self._hops.max_hop_tokens, hop * self._hops.hop_scale)
            seq, start, end = seq + 1, end, end + hop
        return seq, start, end

    def chunk_of(self, token: int) -> FlowCall:
        """The streaming chunk that target token `token` goes out in."""
        seq, start, end = self.chunk_at(token)
        return FlowCall(seq, end + LOOKAHEAD_TOKENS, start, finalize=False, streaming=True)

    def streaming_end(self, num_tokens: int) -> int:
        """For an input that ended at `num_tokens`: the tokens its streaming chunks cover,
        which the block calls compute (the rest go to the final call)."""
        planner, end = ChunkPlanner(self.num_prompt_tokens, self._hops), 0
        while (chunk := planner.next_call(num_tokens, True)) is not None:
            if not chunk.finalize:
                end = chunk.num_tokens
        return end

    def next_call(self, upto: int) -> FlowCall | None:
        start = self.unit_start(self.next_unit)
        limit = min(self.chunk_at(start)[2], upto - LOOKAHEAD_TOKENS)
        units = (limit - self.pad) // BLOCK_TOKENS  # units whose end is within `limit`
        if units <= self.next_unit:
            return None
        end = self.unit_start(units)
        call = FlowCall(self.seq, end + LOOKAHEAD_TOKENS, start, finalize=False, streaming=True)
        self.next_unit, self.seq = units, self.seq + 1
        return call
