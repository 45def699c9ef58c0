"""The per-stream chunk schedule against the worked example of docs/REFERENCE.md §6.4."""

import numpy as np
import pytest

from gateway.schedule import ChunkPlanner, ScheduleConfig
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
        (dict(max_hop_tokens=50), "max_hop_tokens"),  # 25, 50, 50, ... < 25, 50, 100
        (dict(hop_scale=1), "hop_scale"),  # 25, 25, ... < 25, 50
        (dict(first_hop_tokens=50, hop_scale=1), "hop_scale"),  # 50, 50, 50 < 100 at step 2
    ],
)
def test_client_schedules_keep_blocks_and_cost(fields, bad):
    with pytest.raises(InvalidArgument) as info:
        ScheduleConfig.from_proto(gateway_pb2.ChunkSchedule(**fields))
    assert info.value.field == f"config.schedule.{bad}"


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(first_hop_tokens=50), dict(max_hop_tokens=200, hop_scale=4), dict(hop_scale=8)],
)
def test_client_schedules_that_cost_no_more_are_accepted(fields):
    cfg = ScheduleConfig.from_proto(gateway_pb2.ChunkSchedule(**fields))
    assert cfg.is_exact()
    assert cfg.first_smaller_hop(ScheduleConfig()) is None
