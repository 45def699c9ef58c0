"""The per-stream chunk schedule against the worked example of docs/REFERENCE.md §6.4."""

import numpy as np
import pytest

from gateway.schedule import LOOKAHEAD_TOKENS, BlockPlanner, ChunkPlanner, ScheduleConfig
from token2wav.errors import InvalidArgument
from token2wav.v1 import gateway_pb2


def drain(planner, n, ended):
    out = []
    while (c := planner.next_call(n, ended)) is not None:
        out.append(c)
    return out


def test_upstream_schedule_for_a_3s_prompt():
    p = ChunkPlanner(75)
    assert p.first_hop == 25  # 75 + 25 = 100 tokens: whole blocks, no pad
    assert drain(p, 27, False) == []  # 25 + 3 lookahead not there yet
    chunks = drain(p, 300, False)
    assert [(c.num_tokens, c.token_offset) for c in chunks] == [
        (28, 0),
        (78, 25),
        (178, 75),
        (278, 175),
    ]
    assert all(c.streaming and not c.finalize for c in chunks)
    final = drain(p, 300, True)
    assert [(c.num_tokens, c.token_offset, c.finalize, c.streaming) for c in final] == [
        (300, 275, True, False)
    ]
    assert [c.seq for c in chunks + final] == [0, 1, 2, 3, 4]
    assert sum(c.num_emit_tokens for c in chunks + final) == 300
    assert p.next_call(400, True) is None  # done


@pytest.mark.parametrize("n_p", [1, 24, 26, 49, 80, 200])
def test_prompt_pad_aligns_first_chunk_to_blocks(n_p):
    p = ChunkPlanner(n_p)
    assert (n_p + p.first_hop) % 25 == 0 and 25 <= p.first_hop < 50


def test_incremental_arrival_gives_the_same_chunks_as_all_at_once():
    rng = np.random.default_rng(0)
    for n in (1, 3, 27, 28, 29, 103, 250, 600):
        whole = drain(ChunkPlanner(30), n, True)
        p, got, have = ChunkPlanner(30), [], 0
        while have < n:
            have = min(n, have + int(rng.integers(1, 12)))
            got += drain(p, have, False)
        got += drain(p, n, True)
        assert got == whole
        assert sum(c.num_emit_tokens for c in got) == n


def test_short_stream_is_one_final_call_and_empty_stream_is_none():
    assert [(c.num_tokens, c.finalize) for c in drain(ChunkPlanner(75), 10, True)] == [(10, True)]
    assert drain(ChunkPlanner(75), 0, True) == []


def test_overrides_and_their_validation():
    cfg = ScheduleConfig(first_hop_tokens=10, prompt_pad=False)  # internal use may go off-grid
    assert not cfg.is_exact() and ScheduleConfig().is_exact()
    p = ChunkPlanner(75, cfg)
    assert [c.num_tokens for c in drain(p, 100, False)] == [13, 33, 73]
    with pytest.raises(InvalidArgument) as info:
        ScheduleConfig.from_proto(gateway_pb2.ChunkSchedule(hop_scale=9))
    assert info.value.field == "config.schedule.hop_scale"


@pytest.mark.parametrize(
    "fields, bad",
    [
        (dict(first_hop_tokens=10), "first_hop_tokens"),  # off the 50-frame grid
        (dict(max_hop_tokens=110), "max_hop_tokens"),
        (dict(disable_prompt_pad=True), "disable_prompt_pad"),
        (dict(kind=7), "kind"),
        (dict(final_attention=9), "final_attention"),
    ],
)
def test_client_schedules_off_the_block_grid_are_refused(fields, bad):
    with pytest.raises(InvalidArgument) as info:
        ScheduleConfig.from_proto(gateway_pb2.ChunkSchedule(**fields))
    assert info.value.field == f"config.schedule.{bad}"


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(first_hop_tokens=50),
        dict(max_hop_tokens=200, hop_scale=4),
        dict(hop_scale=8),
        # smaller hops than upstream's: each block is computed once, so they cost no more
        dict(max_hop_tokens=50),
        dict(hop_scale=1),
    ],
)
def test_client_schedules_on_the_block_grid_are_accepted(fields):
    cfg = ScheduleConfig.from_proto(gateway_pb2.ChunkSchedule(**fields))
    assert cfg.is_exact()
    BlockPlanner(75, cfg)


def test_schedule_kinds_and_the_gateway_default():
    blocks = ScheduleConfig.blocks()
    assert blocks.hops(4) == [25, 25, 25, 25]
    kind = gateway_pb2.ChunkSchedule
    assert ScheduleConfig.from_proto(None) == ScheduleConfig()
    assert ScheduleConfig.from_proto(None, blocks) == blocks
    assert ScheduleConfig.from_proto(kind(), blocks) == blocks  # unspecified: the default
    assert ScheduleConfig.from_proto(kind(kind=gateway_pb2.SCHEDULE_KIND_UPSTREAM), blocks) == (
        ScheduleConfig()
    )
    assert ScheduleConfig.from_proto(kind(kind=gateway_pb2.SCHEDULE_KIND_BLOCKS)) == blocks
    chunked = ScheduleConfig.from_proto(kind(final_attention=gateway_pb2.FINAL_ATTENTION_CHUNKED))
    assert chunked.chunked_final and not ScheduleConfig().chunked_final
    final = drain(ChunkPlanner(75, chunked), 40, True)[-1]
    assert final.finalize and final.streaming  # upstream's finalize=True, streaming=True
    # the gateway's --schedule and --final-attention, as the gateway and the simulator read them
    assert ScheduleConfig.named("upstream") == ScheduleConfig()
    assert ScheduleConfig.named("blocks", "full") == blocks
    assert ScheduleConfig.named("upstream", "chunked") == chunked
    assert ScheduleConfig.named("blocks", "chunked").chunked_final


def block_calls(num_prompt: int, cfg: ScheduleConfig, arrivals: list[int]):
    """(token count when made, first token, end token) of each block call, tokens arriving
    in the given cumulative counts."""
    planner, out = BlockPlanner(num_prompt, cfg), []
    for n in arrivals:
        while (call := planner.next_call(n)) is not None:
            assert not call.finalize and call.streaming
            out.append((n, call.token_offset, call.num_tokens - LOOKAHEAD_TOKENS))
    return out


@pytest.mark.parametrize("num_prompt", [75, 70, 60, 51])  # prompt pads 0, 5, 15, 24
def test_block_calls_tile_every_chunk_one_block_at_a_time(num_prompt):
    pad = -num_prompt % 25
    calls = block_calls(num_prompt, ScheduleConfig(), list(range(400)))
    # one call per block, made the moment its tokens + 3 lookahead are in
    ends = [pad + 25 * (j + 1) for j in range(len(calls))]
    assert [c[2] for c in calls] == ends
    assert [c[0] for c in calls] == [e + LOOKAHEAD_TOKENS for e in ends]
    assert [c[1] for c in calls] == [0, *ends[:-1]]
    # the blocks tile upstream's chunks: every chunk boundary is a block boundary
    chunks = drain(ChunkPlanner(num_prompt), 400, False)
    bounds = {c[1] for c in calls} | {c[2] for c in calls}
    assert all(c.token_offset in bounds for c in chunks)


def test_block_calls_group_what_is_there_but_never_cross_a_chunk():
    # tokens all at once: one call per chunk (25 + 5, 50, 100, 100)
    calls = block_calls(70, ScheduleConfig(), [400])
    assert [(c[1], c[2]) for c in calls] == [(0, 30), (30, 80), (80, 180), (180, 280), (280, 380)]
    # bursts: what is complete, up to the chunk's end
    calls = block_calls(70, ScheduleConfig(), [40, 130, 400])
    assert [(c[1], c[2]) for c in calls][:4] == [(0, 30), (30, 80), (80, 105), (105, 180)]
    # the blocks schedule: one block per call even at once
    calls = block_calls(70, ScheduleConfig.blocks(), [400])
    assert all(c[2] - c[1] == 25 for c in calls[1:]) and calls[0][1:] == (0, 30)
