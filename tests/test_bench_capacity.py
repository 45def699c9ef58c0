"""The capacity benchmark's arithmetic (bench/capacity.py): on-time figures from hand-made run
records, the rate search driven by fake probes, the idle check. No stack, no timing."""

from __future__ import annotations

import math

import pytest

from bench.capacity import (
    Criteria,
    back_to_idle,
    highest_passing_without_floors,
    on_time_figures,
    passes,
    render,
    search,
)


def stream(status="OK", excess_ms=0.0, closed_ms=None):
    s = {"status": status}
    if status == "OK":
        s["excess_buffer_ms"] = excess_ms
    if closed_ms is not None:
        s["closed_ms"] = closed_ms
    return s


def run(streams, rate=2.0, first_p95=100.0):
    return {
        "rate": rate,
        "workload": {"pace": 0.0},
        "streams": streams,
        "metrics": {
            "first_chunk_ms": {"p50": first_p95 / 2, "p95": first_p95},
            "e2e_ms": {"mean": 4000.0},
            "underruns": {"excess_buffer_ms": {"p99": 30.0}},
            "xrt": 19.0,
            "errors": {},
        },
    }


def test_on_time_counts_stack_added_buffer_and_refusals():
    r = run(
        [stream(), stream(excess_ms=20.0), stream(excess_ms=21.0), stream("DEADLINE_EXCEEDED")]
        + [stream("RESOURCE_EXHAUSTED", closed_ms=ms) for ms in (3.0, 5.0)]
    )
    f = on_time_figures(r, utterance_s=10.0)
    assert (f["streams"], f["admitted"], f["refused"], f["on_time"]) == (6, 4, 2, 2)
    assert f["on_time_share"] == pytest.approx(2 / 6)
    assert f["admitted_on_time_share"] == pytest.approx(2 / 4)
    assert f["refusal_ms"]["max"] == 5.0
    assert f["offered_audio_s_per_s"] == 20.0
    assert f["concurrent_streams"] == pytest.approx(8.0)  # 2/s x 4 s (Little's law)


def test_pass_needs_both_on_time_share_and_first_chunk_p95():
    ok = on_time_figures(run([stream()] * 100), 10.0)
    assert passes(ok, Criteria())
    slow = on_time_figures(run([stream()] * 100, first_p95=251.0), 10.0)
    assert not passes(slow, Criteria())
    one_late = on_time_figures(run([stream()] * 98 + [stream(excess_ms=50.0)] * 2), 10.0)
    assert not passes(one_late, Criteria())  # 98 % < 99 %
    empty = on_time_figures(run([]), 10.0)
    assert not passes(empty, Criteria())


def fake_probe(limit: float):
    def probe(rate: float) -> dict:
        good = rate <= limit
        return {"rate": rate, "on_time_share": 1.0 if good else 0.5, "first_chunk_p95_ms": 100.0}

    return probe


def test_search_steps_up_then_bisects_between_pass_and_fail():
    cap, probes = search(fake_probe(7.3), Criteria(), 4.0, 64.0, growth=1.5, refine=2)
    rates = [p["rate"] for p in probes]
    assert rates[:3] == [4.0, 6.0, 9.0]  # up until the first failure
    assert rates[3] == pytest.approx(math.sqrt(54.0))  # 7.35: fails
    assert rates[4] == pytest.approx(math.sqrt(6.0 * math.sqrt(54.0)))  # 6.64: passes
    assert cap == pytest.approx(rates[4]) and cap <= 7.3
    assert [p["passed"] for p in probes] == [True, True, False, False, True]


def test_search_steps_down_when_the_start_fails_and_respects_the_budget():
    cap, probes = search(fake_probe(1.0), Criteria(), 4.0, 64.0, growth=2.0, refine=0)
    assert [p["rate"] for p in probes] == [4.0, 2.0, 1.0]
    assert cap == 1.0
    budget = iter([True, False])
    cap, probes = search(fake_probe(100), Criteria(), 4.0, 64.0, can_probe=lambda: next(budget))
    assert cap == 4.0 and len(probes) == 1
    cap, probes = search(fake_probe(0.01), Criteria(), 4.0, 64.0, growth=2.0, refine=0)
    assert cap is None and min(p["rate"] for p in probes) >= 4.0 / 8


def test_back_to_idle_and_report():
    before = {"t2w_flow_queue_depth": 0.0, "t2w_gateway_active_streams": 0.0, "gpu_used_mib": 9}
    assert back_to_idle(before, dict(before, gpu_used_mib=12))
    assert not back_to_idle(before, dict(before, t2w_flow_queue_depth=3.0))
    probes = [dict(on_time_figures(run([stream()] * 10), 10.0), passed=True)]
    text = render(
        {
            "dtype": "bfloat16",
            "preset": "small",
            "device": "cpu",
            "command": "python -m bench capacity",
            "started_at": "now",
            "workload": "w",
            "gateways": 4,
            "client_procs": 1,
            "closed": [
                {
                    "gateway": "deadlines",
                    "concurrency": 64,
                    "streams": 64,
                    "xrt": 130.0,
                    "first_p50": 500.0,
                    "first_p95": 700.0,
                    "stack_streams": 3,
                    "excess_p95": 20.0,
                    "errors": {},
                    "first_stages": {
                        "flow_queue_ms": 103.0,
                        "flow_compute_ms": 201.0,
                        "vocoder_queue_ms": 3.0,
                        "vocoder_compute_ms": 124.0,
                        "gateway_ms": 101.0,
                        "wire_ms": 80.0,
                    },
                }
            ],
            "capacity": {
                "all at once": {
                    "capacity_rate": 2.0,
                    "capacity_audio_s_per_s": 20.0,
                    "capacity_concurrent": 8.0,
                    "probes": probes,
                }
            },
        }
    )
    assert "2.00 streams/s = 20 audio s/s" in text and "10/10 (100.0 %)" in text
    assert "4 gateways" in text and "load from 1 client process." in text
    assert "| 500 / 700 | 3 of 64 | 20 | - | 103 + 201, 3 + 124, 101, 80 |" in text


def test_zero_compute_capacity_is_the_highest_probe_passing_without_floors():
    def probe(rate, on_time_no_floors, streams=40, p95=150.0):
        return {
            "rate": rate,
            "streams": streams,
            "on_time_no_floors": on_time_no_floors,
            "first_chunk_p95_ms": p95,
        }

    probes = [
        probe(1.3, 40),
        probe(2.6, 39),
        probe(5.0, 40),
        probe(7.0, 32),
        probe(9.0, 40, p95=300),
    ]
    assert highest_passing_without_floors(probes, Criteria()) == 5.0  # 39/40 < 99 %; p95 > 250
    assert highest_passing_without_floors(probes[1:2], Criteria()) is None
    result = {
        "dtype": "bfloat16",
        "preset": "small",
        "device": "cpu",
        "command": "c",
        "started_at": "now",
        "workload": "w",
        "capacity": {
            "at 50/s": {
                "capacity_rate": None,
                "capacity_audio_s_per_s": None,
                "capacity_concurrent": None,
                "compute_floors_ms": [150.0, 50.0],
                "zero_compute_rate": 5.0,
                "zero_compute_audio_s_per_s": 50.0,
                "probes": [
                    dict(
                        p,
                        passed=False,
                        on_time=0,
                        on_time_share=0.0,
                        offered_audio_s_per_s=10 * p["rate"],
                        first_chunk_p50_ms=100.0,
                        excess_buffer_p99_ms=50.0,
                        xrt=1.0,
                        concurrent_streams=1.0,
                    )
                    for p in probes
                ],
            }
        },
    }
    text = render(result)
    assert "highest probed rate that passes: **5.00 streams/s = 50 audio s/s**" in text
    assert "on time and first chunk p95 <= 250 ms." in text  # no criteria kept: the defaults
    result["criteria"] = {"on_time_share": 0.95, "first_chunk_p95_ms": 300.0}
    assert ">= 95 % of streams on time and first chunk p95 <= 300 ms." in render(result)


def test_stall_post_mortem_names_the_chunk_that_sets_the_stall_and_its_stages():
    from bench.metrics import stall_chunk, stall_post_mortem

    sec = 24000  # samples of one second of audio
    # chunk 0 at 100 ms plays 1 s; chunk 1 is needed at 1100 ms and comes at 1180 (80 ms
    # short), chunk 2 is needed at 3100 and comes at 3130 (30 ms): chunk 1 sets the buffer.
    s = {
        "chunk_arrivals_ms": [100.0, 1180.0, 3130.0],
        "chunk_latency_ms": [50.0, 130.0, 80.0],
        "chunk_samples": [sec, 2 * sec, sec],
        "chunk_timing_ms": [
            [1.0, 30.0, 1, 2.0, 10.0, 1, 45.0],
            [60.0, 40.0, 8, 3.0, 12.0, 4, 120.0],
            [5.0, 35.0, 2, 2.0, 11.0, 1, 60.0],
        ],
    }
    assert stall_chunk(s) == 1
    late_final = dict(s, chunk_arrivals_ms=[100.0, 1100.0, 3300.0])
    assert stall_chunk(late_final) == 2
    pm = stall_post_mortem([s, late_final, {"status": "OK"}])
    assert pm["streams"] == 2
    assert pm["chunk"] == {"1": 1, "final": 1}
    assert pm["flow_queue_ms"] == pytest.approx((60.0 + 5.0) / 2)
    assert pm["latency_ms"] == pytest.approx((130.0 + 80.0) / 2)
    assert pm["first_chunk_latency_ms"] == 50.0
    assert stall_post_mortem([{"status": "OK"}]) is None
    # a sweep's results.md lists the same per run, for its stack-stalled streams only
    from bench.report import stalled_lines

    r = {"dtype": "bfloat16", "kind": "open", "rate": 2.0, "label": "on"}
    r |= {"workload": {"pace": 0.0}, "concurrency": 0}
    r["streams"] = [dict(s, status="OK", excess_buffer_ms=80.0), dict(s, status="OK")]
    (line,) = stalled_lines([r])
    assert line.startswith("- bfloat16, Poisson 2/s, on: 1 stream (chunk 1: 1); 130 ms")
    assert stalled_lines([dict(r, streams=r["streams"][1:])]) == []
    # and capacity.md, under its probe table, from the probe's own stalled streams
    fig = on_time_figures(run([dict(s, status="OK", excess_buffer_ms=80.0), stream()]), 10.0)
    assert fig["stalled"]["streams"] == 1
    result = {"dtype": "bfloat16", "preset": "small", "device": "cpu", "command": "c"}
    result |= {"started_at": "now", "workload": "w"}
    probe = dict(fig, passed=False)
    result["capacity"] = {
        "all at once": {
            "capacity_rate": None,
            "capacity_audio_s_per_s": None,
            "capacity_concurrent": None,
            "probes": [probe],
        }
    }
    assert "- 2.00/s: 1 stream (chunk 1: 1); 130 ms against 50" in render(result)
