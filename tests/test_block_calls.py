"""Block calls (gateway/schedule.py "Block calls"): a stream's flow work made per run of
25-token blocks as tokens arrive, each block computed once against the cached keys/values of
the earlier ones, and upstream's chunks assembled from the blocks. Every case here must give
each chunk's mel of today's per-chunk path (one self-contained call per upstream chunk, no
cache; tests/test_gateway.py ties that path to upstream's audio through the stack) within fp32
rounding: prompt pads 0/5/15/24, token arrivals one by one, in bursts and at once, streams
shorter than a chunk, input ending inside a chunk, a retried block, an entry evicted
mid-stream, a stream moved to another replica, and the `blocks` schedule against upstream's
code path run with a constant hop of 25.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_flow_model import make_voice
from test_prefix_cache import assert_close, new_cache

from flow_service.model import FlowModel, FlowRequest, Voice, load_flow
from gateway.schedule import LOOKAHEAD_TOKENS, BlockPlanner, ChunkPlanner, ScheduleConfig


@pytest.fixture(scope="module")
def model() -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(None, preset="small", seed=0)


def tokens_for(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(500 + seed))


def per_chunk(model, voice: Voice, tokens: torch.Tensor, cfg: ScheduleConfig):
    """Today's path: one call per upstream chunk, each recomputing its prefix."""
    planner, out = ChunkPlanner(voice.num_prompt_tokens, cfg), []
    while (c := planner.next_call(len(tokens), True)) is not None:
        req = FlowRequest(voice, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming)
        out.append(model.generate([req])[0])
    return out


class Stream:
    """The gateway's side of one stream, as gateway/pipeline.py runs it, without gRPC: block
    calls as tokens arrive, chunks assembled when the chunk schedule says they are due, the
    final call as upstream's. `replica(call)` picks the cache a call runs against."""

    def __init__(self, model, voice, tokens, cfg=ScheduleConfig(), key="s", caches=None):
        self.model, self.voice, self.tokens, self.key = model, voice, tokens, key
        self.chunks = ChunkPlanner(voice.num_prompt_tokens, cfg)
        self.blocks = BlockPlanner(voice.num_prompt_tokens, cfg)
        self.caches = caches or [new_cache(model)]
        self.block_out: dict[int, tuple[torch.Tensor, int]] = {}  # start -> (mel, end)
        self.num_block_calls = 0
        self.out: list[torch.Tensor] = []

    def call(self, req: FlowRequest, index: int) -> torch.Tensor:
        cache = self.caches[min(index, len(self.caches) - 1)]
        return self.model.generate([req], prefix_cache=cache)[0]

    def feed(self, n: int, ended: bool, replica: int = 0) -> None:
        upto = n
        if ended:  # only the blocks of streaming chunks still to come
            probe, upto = copy.copy(self.chunks), 0
            while (c := probe.next_call(n, True)) is not None:
                upto = c.num_tokens if not c.finalize else upto
        while (c := self.blocks.next_call(upto)) is not None:
            req = FlowRequest(
                self.voice, self.tokens[: c.num_tokens], c.token_offset, False, True, self.key
            )
            self.block_out[c.token_offset] = (self.call(req, replica), c.num_tokens - 3)
            self.num_block_calls += 1
        while (c := self.chunks.next_call(n, ended)) is not None:
            if c.finalize:
                req = FlowRequest(
                    self.voice,
                    self.tokens[: c.num_tokens],
                    c.token_offset,
                    True,
                    c.streaming,
                    self.key,
                )
                self.out.append(self.call(req, replica))
                continue
            parts, start = [], c.token_offset
            while start < c.num_tokens - LOOKAHEAD_TOKENS:
                mel, start = self.block_out[start]
                parts.append(mel)
            self.out.append(torch.cat(parts, dim=1))

    def run(self, arrivals: list[int]) -> list[torch.Tensor]:
        for n in arrivals:
            self.feed(n, False)
        self.feed(len(self.tokens), True)
        return self.out


ARRIVALS = {
    "one_by_one": lambda n: list(range(1, n + 1)),
    "bursts": lambda n: list(range(7, n + 1, 17)),
    "at_once": lambda n: [n],
}


@pytest.mark.parametrize(
    "num_prompt, arrival",
    # prompt pads 0, 5, 15, 24 in bursts, one by one (pads 0 and 24) and all at once
    [(75, "one_by_one"), (51, "one_by_one"), (70, "bursts"), (60, "bursts"), (51, "at_once")]
    + [pytest.param(n, "one_by_one", marks=pytest.mark.slow) for n in (70, 60)],
)
def test_block_calls_equal_the_per_chunk_path(model, num_prompt, arrival):
    voice, tokens = make_voice(num_prompt, num_prompt), tokens_for(num_prompt, 190)
    stream = Stream(model, voice, tokens)
    got = stream.run(ARRIVALS[arrival](len(tokens)))
    assert_close(got, per_chunk(model, voice, tokens, ScheduleConfig()))
    cache = stream.caches[0]
    assert cache.stats["hits"] >= 1
    assert cache.num_entries <= 1  # the final call ended the stream's entry (voice entry left)
    if arrival != "at_once":  # each block once: no frame computed twice before the final call
        assert stream.num_block_calls >= 5


@pytest.mark.parametrize("n", [1, 3, 20, 27, 28, 29])  # shorter than the first chunk + 3
def test_streams_shorter_than_a_chunk(model, n):
    voice, tokens = make_voice(3, 75), tokens_for(3, n)
    got = Stream(model, voice, tokens).run(list(range(1, n + 1)))
    assert_close(got, per_chunk(model, voice, tokens, ScheduleConfig()))


def test_input_ending_inside_a_chunk_drops_its_blocks(model):
    # chunks of a 75-token prompt: [0, 25), [25, 75), [75, 175); the input ends at 140, so the
    # blocks [75, 100) and [100, 125) computed ahead are dropped and the final call is upstream's
    voice, tokens = make_voice(4, 75), tokens_for(4, 140)
    stream = Stream(model, voice, tokens)
    got = stream.run(list(range(1, 141)))
    assert {75, 100} <= set(stream.block_out)
    assert len(got) == 3 and got[-1].shape[1] == 2 * (140 - 75)
    assert_close(got, per_chunk(model, voice, tokens, ScheduleConfig()))


def test_a_retried_block_gives_the_same_frames(model):
    voice, tokens = make_voice(5, 60), tokens_for(5, 120)
    stream = Stream(model, voice, tokens)
    stream.feed(70, False)
    first = dict(stream.block_out)
    # the gateway retries the last block call (its answer was lost): the flow recomputes it
    (start,) = [s for s in first if first[s][1] == max(e for _, e in first.values())]
    req = FlowRequest(voice, tokens[: first[start][1] + 3], start, False, True, "s")
    again = stream.call(req, 0)
    assert_close([again], [first[start][0]])
    got = stream.run(list(range(71, 121)))
    assert_close(got, per_chunk(model, voice, tokens, ScheduleConfig()))


def test_an_entry_evicted_mid_stream_is_a_miss_with_the_same_result(model):
    voice, tokens = make_voice(6, 70), tokens_for(6, 230)
    stream = Stream(model, voice, tokens)
    for n in range(1, 120):
        stream.feed(n, False)
    cache = stream.caches[0]
    misses = cache.stats["misses"]
    cache.clear()  # evicted (memory pressure) between two block calls
    got = stream.run(list(range(120, 231)))
    assert cache.stats["misses"] > misses
    assert_close(got, per_chunk(model, voice, tokens, ScheduleConfig()))


def test_a_stream_moved_to_another_replica(model):
    voice, tokens = make_voice(7, 51), tokens_for(7, 200)
    stream = Stream(model, voice, tokens, caches=[new_cache(model), new_cache(model)])
    for n in range(1, 90):
        stream.feed(n, False)
    for n in range(90, 201):  # the first replica went away: the rest runs on the second
        stream.feed(n, False, replica=1)
    stream.feed(200, True, replica=1)
    assert stream.caches[1].stats["misses"] >= 1
    assert_close(stream.out, per_chunk(model, voice, tokens, ScheduleConfig()))


@pytest.mark.parametrize("num_prompt", [75, pytest.param(62, marks=pytest.mark.slow)])
def test_the_blocks_schedule_is_upstream_with_a_constant_hop_of_25(model, num_prompt):
    cfg = ScheduleConfig.blocks()
    voice, tokens = make_voice(8, num_prompt), tokens_for(8, 180)
    stream = Stream(model, voice, tokens, cfg)
    got = stream.run(list(range(1, 181)))
    # one chunk per block: the first with the prompt pad, then 25 tokens each, then the final
    pad = -num_prompt % 25
    assert [g.shape[1] for g in got[:3]] == [2 * (25 + pad), 50, 50]
    assert stream.num_block_calls == len(got) - 1
    assert_close(got, per_chunk(model, voice, tokens, cfg))


def test_chunked_final_reads_the_cache_and_differs_in_the_last_chunk_only(model):
    voice, tokens = make_voice(9, 75), tokens_for(9, 190)
    exact = per_chunk(model, voice, tokens, ScheduleConfig())
    cfg = dataclasses.replace(ScheduleConfig(), chunked_final=True)
    stream = Stream(model, voice, tokens, cfg)
    got = stream.run(list(range(1, 191)))
    hits = stream.caches[0].stats["hits"]
    assert_close(got[:-1], exact[:-1])
    assert got[-1].shape == exact[-1].shape
    assert not torch.allclose(got[-1], exact[-1], atol=1e-4)  # block-causal, not full
    # ... and equals upstream's finalize=True, streaming=True call without any cache
    c = ChunkPlanner(75, cfg)
    calls = []
    while (call := c.next_call(190, True)) is not None:
        calls.append(call)
    last = calls[-1]
    req = FlowRequest(voice, tokens, last.token_offset, True, True)
    assert_close([got[-1]], [model.generate([req])[0]])
    assert hits >= len(got) - 1  # the final call read the cached blocks too


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_block_calls_fp32_exact_and_bf16_as_close_as_per_chunk():
    """Full-size preset on CUDA: fp32 block calls equal the per-chunk path; bf16 block calls
    stay as close to fp32 as bf16's per-chunk path does (the two bf16 paths round
    differently, so each is compared through its distance to fp32)."""
    results = _block_calls_on_cuda()
    assert_close(*results[torch.float32])
    for i, (g, w, r) in enumerate(zip(*results[torch.bfloat16], results[torch.float32][1])):
        blocks, plain = float((g - r).pow(2).mean().sqrt()), float((w - r).pow(2).mean().sqrt())
        assert blocks <= 1.1 * plain, f"chunk {i}: bf16 block calls {blocks:.3g} vs {plain:.3g} rms"


def _block_calls_on_cuda() -> dict:
    voice, tokens, arrivals = make_voice(21, 70), tokens_for(21, 330), list(range(9, 331, 23))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = load_flow(None, preset="cosyvoice3-0.5b", device="cuda", dtype=dtype, seed=0)
        got = Stream(m, voice, tokens).run(arrivals)
        results[dtype] = (
            [g.float() for g in got],
            [w.float() for w in per_chunk(m, voice, tokens, ScheduleConfig())],
        )
        del m
        torch.cuda.empty_cache()
    return results
