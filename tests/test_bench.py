"""bench/: the metric arithmetic on hand-made streams, the sweep plan, and the CPU smoke mode
end to end (two real stacks, small preset, 2.4 s utterances). Never asserts a timing: only
that the harness works and its figures agree with each other and with the tokens sent."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest

from bench.gpu import GpuMemorySampler, hardware
from bench.metrics import StreamRecord, percentiles, simulate_playback, summarize
from bench.report import batching_ratios, load_runs
from bench.sweep import SweepConfig, consistency_problems, estimate_s, plan
from bench.workload import (
    TOKEN_RATE,
    InvalidConfig,
    WorkloadConfig,
    chunk_needs,
    make_bench_voice,
    make_tokens,
    poisson_arrivals,
)
from gateway.schedule import LOOKAHEAD_TOKENS, ChunkPlanner
from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN


def make_record(durations_s, arrivals, ready, end_sent=0.0, num_tokens=None) -> StreamRecord:
    """A finished stream whose chunk k lasts durations_s[k], arrives at arrivals[k] and had
    its tokens sent at ready[k]."""
    samples = [round(d * SAMPLE_RATE) for d in durations_s]
    n_tok = num_tokens or sum(samples) // SAMPLES_PER_TOKEN
    rec = StreamRecord("s", n_tok, needs=[k + 1 for k in range(len(arrivals))])
    rec.token_sent = list(ready)
    rec.end_sent = end_sent
    rec.seqs = list(range(len(arrivals)))
    rec.offsets = list(np.cumsum([0, *samples[:-1]]))
    rec.num_samples = samples
    rec.arrivals = list(arrivals)
    rec.timings = [(1.0, 2.0, 1, 3.0, 4.0, 1, 20.0)] * len(arrivals)
    rec.final_seen = True
    return rec


# -- metric arithmetic ------------------------------------------------------------------------
def test_playback_without_stall():
    # each chunk arrives while the one before it still plays
    rec = make_record([1.0, 2.0, 4.0], arrivals=[0.5, 1.0, 2.5], ready=[0.0, 0.1, 0.2])
    pb = simulate_playback(rec)
    assert pb.underruns == 0 and pb.stall_s == 0.0 and pb.buffer_s == 0.0


def test_playback_stall_split_between_input_and_stack():
    # chunk 0 plays 0.5..1.5; chunk 1 (tokens in at 2.0) arrives at 2.25: 0.75 s of silence.
    # Chunk 1 then plays 2.25..4.25 and chunk 2 arrives at 4.0, in time.
    late_input = make_record([1.0, 2.0, 1.0], arrivals=[0.5, 2.25, 4.0], ready=[0.0, 2.0, 3.0])
    pb = simulate_playback(late_input)
    assert pb.underruns == 1 and pb.stall_s == pytest.approx(0.75)
    # Starting 0.75 s after chunk 0 would have avoided it; but chunk 1's tokens came 2 s after
    # chunk 0's, for 1 s of audio: even an instant stack needs 1 s. The stack added nothing.
    assert pb.buffer_s == pytest.approx(0.75)
    assert pb.input_buffer_s == pytest.approx(1.0)
    assert pb.excess_buffer_s == 0.0
    # the same arrivals with every token in at the start: the whole stall is the stack's
    early = simulate_playback(
        make_record([1.0, 2.0, 1.0], arrivals=[0.5, 2.25, 4.0], ready=[0.0, 0.1, 0.2])
    )
    assert early.stall_s == pytest.approx(0.75) and early.input_buffer_s == 0.0
    assert early.excess_buffer_s == pytest.approx(0.75)
    # late input and a slow chunk 1 (1.5 s after its tokens, chunk 0 took 0.5 s): 1 s extra
    slow = simulate_playback(
        make_record([1.0, 2.0, 1.0], arrivals=[0.5, 3.5, 4.0], ready=[0.0, 2.0, 3.0])
    )
    assert slow.excess_buffer_s == pytest.approx(1.0)


def test_summary_figures_agree():
    recs = [
        make_record([1.0, 2.0, 7.0], [0.3 + i, 1.0 + i, 2.8 + i], [i, i + 0.1, i + 0.2])
        for i in range(5)
    ]
    for i, r in enumerate(recs):
        r.stream_id = f"s{i}"
        r.opened = float(i)
        r.end_sent = i + 0.2
    bad = make_record([1.0], [0.5], [0.0])
    bad.status = "RESOURCE_EXHAUSTED"
    broken = make_record([1.0, 1.0], [0.5, 0.9], [0.0, 0.0])
    broken.offsets[1] += 1  # a gap in the samples: a clean status cannot hide it
    m = summarize([*recs, bad, broken], window_s=8.0)
    assert m["num_ok"] == 5
    assert m["errors"] == {"RESOURCE_EXHAUSTED": 1, "INCONSISTENT": 1}
    assert m["audio_s"] == pytest.approx(5 * 10.0)
    assert m["xrt"] == pytest.approx(m["audio_s"] / 8.0)
    fc = m["first_chunk_ms"]
    assert fc["n"] == 5 and fc["p50"] == pytest.approx(300.0)
    assert m["inter_chunk_gap_ms"]["n"] == 10
    # stage attribution: gateway = gateway_ms minus the four service stages
    assert m["stages"]["gateway_ms"] == pytest.approx(20.0 - (1 + 2 + 3 + 4))


def test_percentiles_are_ordered_and_match_numpy():
    values = np.random.default_rng(1).exponential(100.0, 500)
    p = percentiles(values)
    assert p["p50"] <= p["p95"] <= p["p99"] <= p["max"]
    assert p["p95"] == pytest.approx(np.percentile(values, 95))
    assert percentiles([]) is None


def test_chunk_needs_replays_the_gateway_schedule():
    for n_p, n_tok in ((75, 250), (60, 60), (75, 10), (80, 1000)):
        needs = chunk_needs(n_p, n_tok)
        assert needs[-1] is None  # the final chunk waits for the end of input
        streaming = needs[:-1]
        assert streaming == sorted(streaming) and all(n <= n_tok for n in streaming)
        if streaming:
            assert streaming[0] == ChunkPlanner(n_p).first_hop + LOOKAHEAD_TOKENS


def test_chunk_needs_follow_the_blocks_schedule():
    # 75-token prompt (pad 0), 250 tokens: chunk k goes once 25 (k + 1) + 3 tokens are in,
    # the last of the 10 chunks at the end of input
    needs = chunk_needs(75, 250, WorkloadConfig(schedule="blocks").schedule_config)
    assert needs == [25 * (k + 1) + LOOKAHEAD_TOKENS for k in range(9)] + [None]
    with pytest.raises(InvalidConfig, match="schedule"):
        WorkloadConfig(schedule="hops")


def test_workload_is_seeded_and_validated():
    assert np.array_equal(make_tokens(0, 3, 250), make_tokens(0, 3, 250))
    assert not np.array_equal(make_tokens(0, 3, 250), make_tokens(0, 3, 250, warmup=True))
    v = make_bench_voice(0, 1, 75)
    assert v.num_prompt_tokens == 75 and v.prompt_feat.shape == (150, 80)
    tokens = make_tokens(0, 0, 5000)
    assert tokens.min() >= 0 and tokens.max() <= 6560
    with pytest.raises(InvalidConfig) as err:
        WorkloadConfig(pace=-1)
    assert err.value.field == "pace"
    with pytest.raises(InvalidConfig, match="start_buffer_ms"):
        WorkloadConfig(start_buffer_ms=2001)  # the gateway's bound: caught before any stack
    arrivals = poisson_arrivals(0, 4.0, 100.0)
    assert np.all(np.diff(arrivals) > 0) and arrivals[-1] < 100.0
    assert 300 < arrivals.size < 500  # 400 expected; a Poisson count within ~5 sigma


def test_plan_alternates_and_restricts_batching_off():
    cfg = SweepConfig(
        concurrency=(1, 16, 64),
        off_concurrency=(1, 64),
        utterances_per_stream=2,
        max_utterances_per_level=64,
    )
    specs = plan(cfg, pace=0.0)
    assert [(s.level, s.label) for s in specs] == [
        (1, "on"),
        (1, "off"),
        (16, "on"),  # off is not measured at 16
        (64, "on"),
        (64, "off"),
    ]
    assert [s.utterances_per_stream for s in specs] == [2, 2, 2, 1, 1]
    two = plan(SweepConfig(concurrency=(1, 2)), pace=0.0)
    assert [s.label for s in two] == ["on", "off", "off", "on"]  # ABBA
    with pytest.raises(InvalidConfig) as err:
        SweepConfig(concurrency=(0,))
    assert err.value.field == "concurrency"
    with pytest.raises(InvalidConfig) as err:  # caught at once, not after the closed-loop runs
        SweepConfig(concurrency=(1,), rates=(0.0, 2.0))
    assert err.value.field == "rates"
    # a paced level that repeats a main level (same pace) is not planned twice
    paced = plan(SweepConfig(concurrency=(32,), paced_concurrency=(32, 64)), pace=25.0)
    assert [(s.level, s.pace) for s in paced if s.label == "on"] == [(32, 25.0), (64, 25.0)]


def test_a_sweep_runs_each_level_once_per_start_buffer_on_the_same_stack():
    from bench.report import run_name

    cfg = SweepConfig(concurrency=(), rates=(2.0, 4.0), labels=("on",), start_buffers=(0, 200))
    specs = plan(cfg, pace=0.0)
    assert [(s.level, s.start_buffer_ms) for s in specs] == [(2, 0), (2, 200), (4, 200), (4, 0)]
    assert "start buffer 200 ms" in specs[1].describe()
    run = {"dtype": "bfloat16", "kind": "open", "rate": 2.0, "label": "on"}
    names = {run_name(dict(run, workload={"start_buffer_ms": ms})) for ms in (None, 0, 200)}
    assert names == {"bfloat16-open-r2-on", "bfloat16-open-r2-sb0-on", "bfloat16-open-r2-sb200-on"}
    with pytest.raises(InvalidConfig, match="start_buffer_ms"):
        SweepConfig(start_buffers=(0, 5000))


def test_pass_through_flags_cannot_turn_batching_back_on(tmp_path):
    from bench.stack import Stack, StackConfig

    cfg = StackConfig(
        batching=False,
        flow_args=("--max-batch-size=32",),
        vocoder_args=("--max-batch-sessions=8",),
    )
    cmds = Stack(cfg, tmp_path).commands()
    from flow_service.config import build_parser as flow_parser
    from vocoder_service.config import build_parser as vocoder_parser

    assert flow_parser().parse_args(cmds["flow_service"][3:]).max_batch_size == 1
    assert vocoder_parser().parse_args(cmds["vocoder_service"][3:]).max_batch_sessions == 1


def test_time_budget_estimates():
    wl = WorkloadConfig()  # 10 s utterances
    cfg = SweepConfig(warmup_streams=4)

    def run(label, c, xrt):
        return {
            "label": label,
            "kind": "closed",
            "concurrency": c,
            "workload": {"pace": 0.0},
            "metrics": {"xrt": xrt},
        }

    spec = plan(SweepConfig(concurrency=(64,), utterances_per_stream=1), 0.0)[1]  # off, 64
    assert estimate_s(spec, wl, cfg, []) is None  # nothing to go by: it just runs
    flat = [run("off", 1, 5.0), run("off", 16, 5.0), run("on", 16, 50.0)]
    assert estimate_s(spec, wl, cfg, flat) == pytest.approx(1.1 * (64 + 4) * 10.0 / 5.0)
    on4 = plan(SweepConfig(concurrency=(4,), utterances_per_stream=2), 0.0)[0]
    # one level measured with batching on: assumed to scale linearly (10 -> 40 xRT)
    assert estimate_s(on4, wl, cfg, [run("on", 1, 10.0)]) == pytest.approx(
        1.1 * (8 + 4) * 10.0 / 40.0
    )
    paced = plan(SweepConfig(concurrency=(), paced_concurrency=(4,)), 0.0)[0]
    assert estimate_s(paced, wl, cfg, []) == pytest.approx(2 * 250 / 25.0)  # the input's pace


def test_gpu_memory_from_nvidia_smi(tmp_path, monkeypatch):
    # a stand-in nvidia-smi: two GPUs, two processes of which one is "ours"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=memory.used) printf "1000\\n250\\n" ;;\n'
        '  --query-compute-apps=*) printf "4242, 700\\n999, 300\\n" ;;\n'
        '  --query-gpu=name*) printf "NVIDIA H200, 143771, 580.1\\n" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    sampler = GpuMemorySampler(interval_s=0.05)
    assert sampler.available
    t0 = time.perf_counter()
    sampler.sample()
    peak = sampler.peak(t0, time.perf_counter(), pids=[4242])
    assert peak == {"device_mib": 1250, "stack_mib": 700}
    assert sampler.peak(t0, time.perf_counter(), pids=[1])["stack_mib"] is None
    assert hardware()["gpus"][0]["name"] == "NVIDIA H200"


# -- the smoke mode, end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    from bench.__main__ import smoke

    out = tmp_path_factory.mktemp("bench")
    runs, problems = smoke(str(out), quiet=True)
    return out, runs, problems


@pytest.mark.slow
def test_smoke_runs_every_mode_without_errors(smoke_runs):
    out, runs, problems = smoke_runs
    assert problems == []
    kinds = {(r["kind"], r["label"], r["workload"]["pace"] > 0) for r in runs}
    assert ("closed", "on", False) in kinds and ("closed", "off", False) in kinds
    assert ("closed", "on", True) in kinds and ("open", "on", False) in kinds
    on_disk = load_runs([out])
    assert len(on_disk) == len(runs)
    for run in on_disk:
        m = run["metrics"]
        assert m["errors"] == {} and m["num_ok"] == m["num_streams"] > 0
        assert m["completion_rate"] == 1.0 and run["warmup"]["errors"] == {}
        for key in ("first_chunk_ms", "inter_chunk_gap_ms", "e2e_ms", "chunk_latency_ms"):
            p = m[key]
            assert p["p50"] <= p["p95"] <= p["p99"] <= p["max"]
        assert set(m["stages"]) >= {"flow_queue_ms", "flow_compute_ms", "vocoder_compute_ms"}
        assert m["underruns"]["streams"] <= m["num_ok"]
        assert run["gpu_memory"] is None or run["gpu_memory"]["device_mib"] > 0


@pytest.mark.slow
def test_smoke_audio_matches_tokens_sent(smoke_runs):
    _, runs, _ = smoke_runs
    for run in runs:
        n_tok = run["workload"]["utterance_tokens"]
        expected_chunks = len(chunk_needs(run["workload"]["prompt_tokens"], n_tok))
        for s in run["streams"]:
            assert s["tokens"] == n_tok
            assert s["audio_s"] == pytest.approx(n_tok / TOKEN_RATE, abs=1e-9)
            assert sum(s["chunk_samples"]) == SAMPLES_PER_TOKEN * n_tok
            assert s["chunks"] == expected_chunks == len(s["chunk_arrivals_ms"])
            assert s["first_chunk_ms"] > 0
            assert s["e2e_ms"] == pytest.approx(s["chunk_arrivals_ms"][-1], abs=1e-3)  # rounded
        m = run["metrics"]
        assert m["audio_s"] == pytest.approx(len(run["streams"]) * n_tok / TOKEN_RATE)
        assert m["xrt"] * m["window_s"] == pytest.approx(m["audio_s"])
        assert consistency_problems(run) == []


@pytest.mark.slow
def test_smoke_writes_results_and_ratios(smoke_runs):
    out, runs, _ = smoke_runs
    text = (out / "results.md").read_text()
    assert text.count("| float32 |") >= len(runs)  # one row per run (and stage rows)
    ratios = batching_ratios(runs)
    assert {(x["level"], x["pace"]) for x in ratios} >= {("1", 0.0), ("2", 0.0)}
    for x in ratios:
        assert x["xrt"] > 0 and x["first_chunk_p50"] > 0
    everything = json.loads((out / "bench.json").read_text())
    assert len(everything["runs"]) == len(runs)
    assert everything["environment"]["command"].startswith("python -m bench sweep")


@pytest.mark.slow
def test_replicated_stack_spreads_flow_calls_over_every_replica(tmp_path):
    """--flow-replicas/--vocoder-replicas: gateways over several processes of each service
    (the one-GPU stand-in for the multi-GPU scaling run). Every flow replica computes batches
    and every stream still gets all of its audio. With --gateways 2 --client-procs 2 the
    streams come from two load-generator processes and go through both gateways."""
    from bench.__main__ import build_parser, run_benchmark

    argv = [
        "sweep",
        "--device=cpu",
        "--preset=small",
        "--batching=on",
        "--concurrency=4",
        "--utterances-per-stream=1",
        "--utterance-tokens=60",
        "--warmup-streams=0",
        "--flow-replicas=2",
        "--vocoder-replicas=2",
        "--flow-arg=--log-batches=true",
        "--gateway-arg=--flow-affinity=call",  # every replica gets calls, whatever the hash
        "--gateways=2",
        "--client-procs=2",
        "--startup-timeout=180",
        f"--out-dir={tmp_path}",
        "--quiet",
    ]
    runs, _ = run_benchmark(build_parser().parse_args(argv), argv, threads=1)
    (run,) = runs
    assert run["flow_replicas"] == 2 and run["vocoder_replicas"] == 2
    assert run["metrics"]["errors"] == {} and run["metrics"]["num_ok"] == 4
    assert consistency_problems(run) == []
    assert run["gateways"] == 2 and run["client_procs"] == 2
    gateways = run["target"].split(",")
    assert len(set(gateways)) == 2
    assert sorted(s["target"] for s in run["streams"]) == sorted(gateways * 2)
    assert all(s["start_s"] >= 0 for s in run["streams"])  # nobody opened before the start
    logs = sorted((tmp_path / "logs").glob("batching-on-flow_service*.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert " reqs, T " in text, f"{log.name} computed no batch"
        assert ", cpu, " in text and " (own " in text  # the runner's path and own time
    assert len(list((tmp_path / "logs").glob("batching-on-gateway*.log"))) == 2
    gateway_cmd = (tmp_path / "logs" / "batching-on-gateway.1.log").read_text().splitlines()[0]
    flow_addrs = gateway_cmd.split("--flow-addr ")[1].split()[0].split(",")
    vocoder_addrs = gateway_cmd.split("--vocoder-addr ")[1].split()[0].split(",")
    assert len(flow_addrs) == len(vocoder_addrs) == 2


def test_flow_service_bench_smoke(tmp_path):
    """bench/flow_service_bench.py --smoke (3 s prompt, 60-token utterances): both modes run
    every level, and the figures agree with the work, counted by hand: the gateway schedule
    makes 2 calls per utterance (25 tokens + 3 lookahead streaming, then the final call), DiT
    sequences of 2 x (75 + 25) = 200 and 2 x (75 + 60) = 270 frames, 120 mel frames back."""
    from bench.flow_service_bench import main

    result = main(["--smoke", "--out", str(tmp_path)])
    rows = result["rows"]
    assert {(r["batching"], r["streams"]) for r in rows} == {
        (b, n) for b in ("on", "off") for n in (1, 3)
    }
    for r in rows:
        assert r["errors"] == {} and r["utterances_completed"] == r["utterances"] == r["streams"]
        assert r["calls"] == 2 * r["utterances"]
        assert r["mel_frames_out"] == 120 * r["utterances"]  # what the service sent back
        assert r["audio_s_per_s"] * r["wall_s"] == pytest.approx(2.4 * r["utterances"], rel=1e-2)
        steps = (200 + 270) * 10 * r["utterances"]
        assert r["frame_steps_per_s"] * r["wall_s"] == pytest.approx(steps, rel=1e-2)
        assert (r["batch_size_mean"] == 1.0) if r["batching"] == "off" else r["batch_size_mean"]
    assert set(result["on_off_ratio"]) == {1, 3}
    on_disk = json.loads((tmp_path / "flow_service_bench.json").read_text())
    assert len(on_disk["rows"]) == len(rows)


def test_flow_service_bench_counts_failed_calls_and_goes_on(tmp_path):
    """Calls that fail (here: a deadline no call can meet) are counted by status code; the
    level and the run go on, and no audio is credited for unfinished utterances."""
    from bench.flow_service_bench import main

    result = main(
        ["--smoke", "--batching", "on", "--call-timeout", "0.001", "--out", str(tmp_path)]
    )
    for r in result["rows"]:
        assert r["errors"].get("DEADLINE_EXCEEDED", 0) == 2 * r["utterances"]
        assert r["utterances_completed"] == 0 and r["audio_s_per_s"] == 0


def test_vocoder_dtype_overrides_only_the_vocoder(tmp_path):
    from bench.stack import Stack, StackConfig
    from flow_service.config import build_parser as flow_parser
    from vocoder_service.config import build_parser as vocoder_parser

    def dtypes(cfg):
        cmds = Stack(cfg, tmp_path).commands()
        flow = flow_parser().parse_args(cmds["flow_service"][3:]).dtype
        return flow, vocoder_parser().parse_args(cmds["vocoder_service"][3:]).dtype

    assert dtypes(StackConfig(dtype="bfloat16")) == ("bfloat16", "bfloat16")  # as before
    assert dtypes(StackConfig(dtype="bfloat16", vocoder_dtype="float32")) == (
        "bfloat16",
        "float32",
    )


def test_gateway_overhead_bench_runs_streams_through_a_real_gateway():
    """bench/gateway_overhead.py: a real gateway process between instant stand-ins; every
    stream gets its audio (the stand-ins' shapes satisfy the gateway's checks)."""
    from bench.gateway_overhead import main

    (rnd,) = main(["--streams", "3", "--tokens", "60", "--rounds", "1"])
    assert len(rnd["first_ms"]) == 3 and all(ms > 0 for ms in rnd["first_ms"])
    assert rnd["wall_ms"] >= max(rnd["first_ms"])


# -- several gateways, several load-generator processes ---------------------------------------
def test_stack_starts_gateway_groups_with_their_own_flags(tmp_path):
    """--gateways N: N gateway processes with the same flags in front of the same services;
    bench capacity's admission gateway stays single, its no-deadline gateways match N."""
    from bench.capacity import CapacityStack
    from bench.stack import Stack, StackConfig
    from gateway.config import build_parser as gateway_parser

    plain = Stack(StackConfig(gateways=3, flow_replicas=2), tmp_path)
    assert len(set(plain.targets())) == 3 and plain.target == plain.targets()[0]
    cmds = plain.commands()
    assert sorted(n for n in cmds if n.startswith("gateway")) == [
        "gateway",
        "gateway.1",
        "gateway.2",
    ]
    assert len({tuple(cmds[n][5:]) for n in plain.gateway_groups["gateway"]}) == 1  # same flags
    with pytest.raises(ValueError, match="gateways"):
        StackConfig(gateways=0)

    cap = CapacityStack(StackConfig(gateways=2), tmp_path, ("--admission-wait-ms=5",))
    assert len(set(cap.ports.values())) == len(cap.ports) == 2 + 2 + 1
    assert len(set(cap.metrics_ports.values())) == len(cap.ports)
    cmds = cap.commands()
    groups = {
        g: [gateway_parser().parse_args(cmds[n][3:]) for n in names]
        for g, names in cap.gateway_groups.items()
    }
    assert [len(v) for v in groups.values()] == [2, 1]
    assert [f.admission for f in groups["gateway"]] == [False] * 2
    (admit,) = groups[cap.ADMIT]
    assert admit.admission and admit.admission_wait_ms == 5
    assert {f.flow_addr for fs in groups.values() for f in fs} == {
        f"127.0.0.1:{cap.ports['flow_service']}"
    }


def test_a_model_service_dying_in_warm_up_starts_once_more(tmp_path, monkeypatch, capsys):
    """wait_ready: a model service that died after it was listening (a warm-up on the GPU
    gone wrong) is spawned once more and the stack comes up; a second death fails it, and so
    does a death before listening (bad flags or weights) or a gateway's, at once."""
    import bench.stack
    from bench.stack import Stack, StackConfig, StackError

    class Proc:
        def __init__(self, alive: bool):
            self.returncode = None if alive else 1

        def poll(self):
            return self.returncode

    def stack_where(dead: str, log: str, deaths: int) -> tuple[Stack, list[str]]:
        stack = Stack(StackConfig(), tmp_path)
        stack.procs = {name: Proc(name != dead) for name in stack.ports}
        stack.log_path(dead).write_text(log)
        spawned: list[str] = []

        def spawn(module, restart=False):
            assert restart
            spawned.append(module)
            stack.procs[module] = Proc(alive=len(spawned) >= deaths)
            return stack.procs[module]

        monkeypatch.setattr(stack, "spawn", spawn)
        return stack, spawned

    def serving(stack):  # a process is SERVING while it is alive
        port_of = {f"127.0.0.1:{p}": n for n, p in stack.ports.items()}
        return lambda addr, timeout: stack.procs[port_of[addr]].poll() is None

    warm_up_death = "listening on 127.0.0.1:1\nvocoder_service: error: AcceleratorError: x\n"
    stack, spawned = stack_where("vocoder_service", warm_up_death, deaths=1)
    monkeypatch.setattr(bench.stack, "check", serving(stack))
    stack.wait_ready()
    assert spawned == stack.restarted == ["vocoder_service"]
    assert "vocoder_service exited with 1 while warming up" in capsys.readouterr().err

    stack, spawned = stack_where("flow_service", warm_up_death, deaths=2)
    monkeypatch.setattr(bench.stack, "check", serving(stack))
    with pytest.raises(StackError, match="flow_service exited with 1"):
        stack.wait_ready()
    assert spawned == ["flow_service"]  # once, not again

    for dead, log in (
        ("vocoder_service", "vocoder_service: error: --model-dir x: no hift.pt\n"),
        ("gateway", warm_up_death),
    ):
        stack, spawned = stack_where(dead, log, deaths=1)
        monkeypatch.setattr(bench.stack, "check", serving(stack))
        with pytest.raises(StackError, match=f"{dead} exited with 1"):
            stack.wait_ready()
        assert spawned == []


@pytest.mark.slow
async def test_load_spreads_over_gateways_and_merges_client_processes():
    """Two gateways in front of one flow and one vocoder (in process). The same closed-loop
    and open-loop plans run from one process and from two: every stream is there once, goes
    to the gateway its index says (whatever the process count), and the two processes' records
    share the parent's clock: none opens before the shared start (open loop: before its
    arrival time), none after the parent saw the run end."""
    from _stack import start_stack

    from bench.loadgen import LoadPlan, Progress, peak_in_flight, run_load
    from flow_service.model import load_flow
    from vocoder_service.model import load_hift

    stack = await start_stack((load_flow(None, preset="small"), load_hift(None, preset="small")))
    second = await stack.another_gateway()
    targets = (f"127.0.0.1:{stack.gateway.port}", f"127.0.0.1:{second.port}")
    workload = WorkloadConfig(utterance_tokens=30, prompt_tokens=25)
    try:
        for kind, level in (("closed", 3), ("open", 4.0)):
            results = {}
            for procs in (1, 2):
                plan = LoadPlan(
                    kind,
                    targets,
                    workload,
                    level,
                    f"{kind}{procs}",
                    warmup_streams=1,
                    stream_timeout_s=120,
                    timeout_s=120,
                    utterances_per_stream=2,
                    duration_s=1.0,
                    procs=procs,
                )
                progress = Progress("", 0, enabled=False)
                before = time.perf_counter()
                res = await asyncio.to_thread(run_load, plan, progress)
                after = time.perf_counter()
                results[procs] = res
                assert res.warmup_errors == {} and not res.timed_out and res.procs == procs
                assert progress.done == len(res.records) and progress.failed == 0
                for r in res.records:
                    assert r.ok and r.problems() == [], (r.stream_id, r.status, r.detail)
                    assert before < res.t0 <= r.opened <= r.arrivals[0] <= r.closed < after
                assert 1 <= res.max_in_flight == peak_in_flight(res.records)
                assert res.t0 + res.window_s <= after
                if kind == "open":
                    arrivals = plan.arrivals()
                    owners = set(plan.owners(len(arrivals)))
                    assert len(arrivals) >= 2 and owners == set(range(procs))
                    for r in res.records:
                        i = int(r.stream_id.rsplit("-", 1)[1])
                        start = res.t0 - arrivals[0]  # t0 of an open loop: the first arrival
                        assert r.opened >= start + arrivals[i]
            one, two = (
                {r.stream_id.split("-", 1)[1]: (r.target, r.num_tokens) for r in results[p].records}
                for p in (1, 2)
            )
            assert one == two  # the same streams, to the same gateways
            assert len(one) == (3 * 2 if kind == "closed" else len(plan.arrivals()))
            assert {t for t, _ in one.values()} == set(targets)
            if kind == "closed":  # utterance k of worker w: stream 2w + k, gateway (3k + w) % 2
                for w in range(3):
                    for k in range(2):
                        assert one[str(2 * w + k)][0] == targets[(3 * k + w) % 2]
    finally:
        await second.drain()
        await stack.stop()


def test_a_failing_load_process_fails_the_run_and_leaves_no_process():
    """A load-generator process that fails (here: a plan it cannot run) ends the run with its
    traceback, the others are stopped, and nothing waits for a start that never comes."""
    import multiprocessing

    from bench.loadgen import LoadgenError, LoadPlan, Progress, run_load

    plan = LoadPlan(
        "closed", ("127.0.0.1:1",), WorkloadConfig(utterance_tokens=30), 2, "x", procs=2
    )
    object.__setattr__(plan, "utterances_per_stream", "two")  # frozen; the processes get a copy
    with pytest.raises(LoadgenError, match="(?s)load-generator process . failed.*TypeError"):
        run_load(plan, Progress("", 0, enabled=False))
    assert multiprocessing.active_children() == []


def test_the_mixed_workload_has_the_issues_shape():
    """Six voices of 2-8 s prompts, utterances of 1-30 s with a median near 6 s, three in four
    streams paced at 40-120 tokens/s in bursts of 1-5, the rest at once; seeded per stream."""
    from bench.workload import MIX_PROMPT_TOKENS

    wl = WorkloadConfig(mix="mixed")
    shapes = [wl.shape(i) for i in range(2000)]
    assert shapes[7] == WorkloadConfig(mix="mixed").shape(7)
    assert shapes[7] != WorkloadConfig(mix="mixed", seed=1).shape(7)
    assert {s.voice for s in shapes} == set(range(6))
    assert all(s.prompt_tokens == MIX_PROMPT_TOKENS[s.voice] for s in shapes)
    assert {s.prompt_tokens for s in shapes} == {50, 75, 100, 125, 150, 200}  # 2 to 8 s
    lengths = np.array([s.utterance_tokens for s in shapes])
    assert lengths.min() == 25 and lengths.max() == 750  # 1 and 30 s, both reached
    assert 130 <= np.median(lengths) <= 170  # ~6 s
    paced = [s for s in shapes if s.pace > 0]
    assert 0.7 <= len(paced) / len(shapes) <= 0.8
    assert all(40 <= s.pace <= 120 and 1 <= s.burst <= 5 for s in paced)
    assert abs(wl.mean_utterance_seconds - lengths.mean() / 25) < 0.5
    assert wl.longest_input_seconds == 750 / 40
    # uniform: the flags' values for every stream
    u = WorkloadConfig(prompt_tokens=50, utterance_tokens=100, pace=30).shape(3)
    assert (u.prompt_tokens, u.utterance_tokens, u.pace, u.burst) == (50, 100, 30, 1)
    with pytest.raises(InvalidConfig) as err:
        WorkloadConfig(mix="bursty")
    assert err.value.field == "mix"


async def test_paced_tokens_go_out_in_bursts():
    from bench.loadgen import _feed

    class Sink:
        def __init__(self):
            self.sizes = []

        async def send(self, tokens):
            self.sizes.append(len(tokens))

        async def end(self):
            self.sizes.append("end")

    sink = Sink()
    rec = StreamRecord("s", 12, [None])
    rec.token_sent = [0.0] * 12
    await _feed(sink, np.arange(12), 2000.0, rec, burst=5)
    sizes = sink.sizes[:-1]
    assert sink.sizes[-1] == "end" and sum(sizes) == 12
    assert all(n >= 5 for n in sizes[:-1])  # a burst waits for its last token (or more came)
    assert all(b >= a for a, b in zip(rec.token_sent, rec.token_sent[1:]))  # sent in order


@pytest.mark.slow
def test_soak_with_gateway_faults_passes_and_its_report_adds_up(tmp_path):
    """The real soak, short: 2 gateways, one SIGKILLed and one SIGTERMed under the clients;
    every bar holds and the JSON's figures agree with each other."""
    from bench.soak import main as soak_main

    out = tmp_path / "out"
    argv = [
        "--duration", "25", "--fault-interval", "2", "--faults", "kill_gateway,term_gateway",
        "--num-inputs", "2", "--clients", "3", "--sample-interval", "5",
        "--log-dir", str(tmp_path / "logs"), "--out-dir", str(out),
    ]  # fmt: skip
    assert soak_main(argv) == 0
    data = json.loads((out / "soak.json").read_text())
    assert data["missed_bars"] == []
    assert data["faults"].get("kill_gateway", 0) + data["faults"].get("term_gateway", 0) >= 1
    assert data["streams"] == sum(data["outcomes"].values()) > 0
    assert data["samples_lost"] == data["samples_duplicated"] == data["audio_mismatch"] == 0
    events = [e for e in data["events"] if e["kind"].endswith("_gateway")]
    assert events and all(e["process"].startswith("gateway") for e in events)
    assert all(e["new_stream_ok_after_s"] is not None for e in events)
    assert all(set(r["rss_mib"]) == {"gateway", "gateway.1", "flow_service", "flow_service.1",
               "vocoder_service", "vocoder_service.1"} for r in data["series"])  # fmt: skip
