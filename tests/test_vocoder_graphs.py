"""Vocoder batch padding to shape buckets and CUDA-graph replay (issue 17, item 3): padded
batches equal unpadded ones on the CPU, the graph wrapper's bookkeeping (static inputs, LRU,
eager fallback) with a stand-in graph on the CPU, and graphed vs eager on a GPU."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.vocoder_model import batched_and_solo, make_mel, upstream_schedule
from tests.test_vocoder_model import _one_thread  # noqa: F401 - autouse: one CPU thread
from vocoder_service.metrics import GRAPH_CALLS
from vocoder_service.model import load_hift
from vocoder_service.model.graphs import GraphedCore, ShapeBuckets
from vocoder_service.model.layers import Snake

BUCKETS = ShapeBuckets(row_sizes=(1, 2, 4, 8), frame_multiple=16, max_frames=256)
# Padded vs unpadded is the same math; only the kernels oneDNN/cuDNN pick by shape differ. In
# float64 that is 0 here; in float32 ~1.3e-7 absolute (~2e-6 of the random model's 0.07 peak),
# so the fp32 bound is 1e-6 of full scale (|audio| <= 0.99), as for batched vs solo.
TOL_FP32 = 1e-6
TOL_FP64 = 1e-12


@pytest.fixture(scope="module")
def small():
    return load_hift(None, preset="small")


def padded_model(dtype=torch.float32):
    model = load_hift(None, preset="small", dtype=dtype)
    model.buckets = BUCKETS  # what set_cuda_graphs does, without needing CUDA
    return model


@pytest.fixture(scope="module")
def padded():
    return padded_model()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def run_schedule(model, mels, schedules, finals):
    """All streams advanced together, one batch per step: per stream the concatenated audio."""
    states = [model.new_session() for _ in mels]
    pos, out = [0] * len(mels), [[] for _ in mels]
    for step in range(max(len(s) for s in schedules)):
        rows = [i for i, s in enumerate(schedules) if step < len(s)]
        chunks, fins = [], []
        for i in rows:
            n = schedules[i][step]
            chunks.append(mels[i][:, pos[i] : pos[i] + n])
            fins.append(finals[i] and step == len(schedules[i]) - 1)
            pos[i] += n
        for i, a in zip(rows, model.decode_batch([states[i] for i in rows], chunks, fins)):
            out[i].append(a)
    return [torch.cat(a) for a in out], states


def test_shape_buckets():
    assert [BUCKETS.rows(n) for n in (1, 2, 3, 5, 8, 9, 40)] == [1, 2, 4, 8, 8, 9, 40]
    assert [BUCKETS.frames(t) for t in (1, 16, 17, 43, 138, 238, 256, 257, 900)] == [
        16, 16, 32, 48, 144, 240, 256, 257, 900,
    ]  # fmt: skip
    assert BUCKETS.bucketed(4, 48) and not BUCKETS.bucketed(3, 48)
    assert not BUCKETS.bucketed(4, 43) and not BUCKETS.bucketed(16, 48)
    assert not BUCKETS.bucketed(4, 272)  # past max_frames: eager, unpadded
    none = ShapeBuckets()
    assert none.rows(5) == 5 and none.frames(43) == 43 and not none.bucketed(1, 16)
    for bad in ({"row_sizes": (4, 2)}, {"row_sizes": (0, 1)}, {"frame_multiple": 0}):
        with pytest.raises(ValueError):
            ShapeBuckets(**bad)


@pytest.mark.slow
def test_padded_streams_equal_unpadded(small, padded):
    """Upstream's schedule (50, 100, 200, ...) and ragged ones, 5 streams batched together,
    flushed and held back: padding rows and frames changes no sample beyond rounding, and
    leaves every session state bit for bit the same."""
    rng = random.Random(5)
    mels = [make_mel(330 + 40 * i, seed=60 + i) for i in range(5)]
    schedules = [upstream_schedule(mels[0].shape[1])]
    for m in mels[1:]:
        sizes, n = [], 0
        while n < m.shape[1]:
            sizes.append(min(rng.randint(1, 120), m.shape[1] - n))
            n += sizes[-1]
        schedules.append(sizes)
    finals = [True, False, True, True, False]
    ref, ref_states = run_schedule(small, mels, schedules, finals)
    got, got_states = run_schedule(padded, mels, schedules, finals)
    for a, b, sa, sb in zip(got, ref, got_states, ref_states):
        assert a.shape == b.shape
        assert max_abs(a, b) <= TOL_FP32
        assert sa.to_bytes() == sb.to_bytes()
    # and the padded model still equals the full-history decode (invariant 3)
    full = small.decode(mels[0], finalize=True)
    assert max_abs(got[0], full) <= 1e-5


@pytest.mark.slow
def test_padding_is_exact_in_float64():
    """In float64 the rounding differences vanish: padding changes nothing a row reads."""
    mels = [make_mel(260 + 30 * i, seed=65 + i) for i in range(3)]
    schedules = [upstream_schedule(260), [1] * 20 + [77, 100, 93], [13] * 22 + [34]]
    finals = [True, False, True]
    ref, _ = run_schedule(
        load_hift(None, preset="small", dtype=torch.float64), mels, schedules, finals
    )
    got, _ = run_schedule(padded_model(torch.float64), mels, schedules, finals)
    for a, b in zip(got, ref):
        assert max_abs(a, b) <= TOL_FP64 * float(b.abs().max())


def test_padded_ragged_batch_equals_solo(small, padded):
    mels = [make_mel(320, seed=70 + i) for i in range(6)]
    history, chunk = [0, 3, 20, 60, 150, 240], [50, 7, 100, 1, 13, 80]
    finalize = [False, True, False, False, True, True]
    batched, _, _, _ = batched_and_solo(padded, mels, history, chunk, finalize)
    _, solo, _, _ = batched_and_solo(small, mels, history, chunk, finalize)
    for a, b in zip(batched, solo):
        assert max_abs(a, b) <= TOL_FP32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_snake_equals_plain(dtype):
    """Same values up to the rounding of a fused multiply-add (CPU kernels use FMA too)."""
    torch.manual_seed(0)
    snake = Snake(64).to(dtype)
    snake.alpha.uniform_(0.05, 3.0)
    x = (torch.randn(3, 64, 500) * 4).to(dtype)
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 2 * torch.finfo(dtype).eps * 16}

    def both():
        snake.fused = False
        plain = snake(x)
        snake.fused = True
        fused = snake(x)
        assert fused.dtype == dtype
        torch.testing.assert_close(fused, plain, **tol)

    both()
    snake.alpha.mul_(2)  # a new weight version: the cached 1/alpha must follow
    both()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_snake_decode_equals_plain(small, dtype):
    """The whole model with fused Snakes (what --cuda-graphs turns on) against the current
    path: float64 within 1e-12 of the peak (the same math), float32 within 1e-6 of full scale
    like padding (measured 1.3e-7: FMA roundings through 72 Snakes and the convs after them)."""
    plain = small if dtype == torch.float32 else load_hift(None, preset="small", dtype=dtype)
    model = load_hift(None, preset="small", dtype=dtype)
    model.fuse_snake(True)
    assert all(m.fused for m in model.modules() if isinstance(m, Snake))
    mels = [make_mel(300, seed=85 + i) for i in range(2)]
    schedules, finals = [upstream_schedule(300), [37, 1, 150, 112]], [True, False]
    ref, _ = run_schedule(plain, mels, schedules, finals)
    got, _ = run_schedule(model, mels, schedules, finals)
    for a, b in zip(got, ref):
        bound = TOL_FP32 if dtype == torch.float32 else TOL_FP64 * float(b.abs().max())
        assert max_abs(a, b) <= bound
    model.fuse_snake(False)
    assert not any(m.fused for m in model.modules() if isinstance(m, Snake))


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay re-runs the core on the static
    inputs it was recorded with and writes into the same output tensor, as a graph does."""

    def __init__(self, core, static):
        self.core, self.static = core, static
        self.output = core(*static)

    def replay(self):
        self.output.copy_(self.core(*self.static))


@pytest.fixture
def fake_graphed(monkeypatch):
    def record(self, static):
        graph = _FakeGraph(self.core, static)
        return graph, graph.output

    monkeypatch.setattr(GraphedCore, "_record", record)
    model = load_hift(None, preset="small")
    model.buckets = BUCKETS
    model.graphed_core = GraphedCore(
        model.synthesize_core, model.device, BUCKETS, model.cfg.conv_pre_look_right, max_graphs=2
    )
    return model


def test_graph_wrapper_replays_with_fresh_inputs(small, fake_graphed):
    core = fake_graphed.graphed_core
    mels = [make_mel(300, seed=80 + i) for i in range(3)]
    schedules = [[50, 100, 100, 50]] * 3  # shapes: first chunk, then twice the same 100-frame one
    ref, _ = run_schedule(small, mels, schedules, [False] * 3)
    got, _ = run_schedule(fake_graphed, mels, schedules, [False] * 3)
    for a, b in zip(got, ref):
        assert max_abs(a, b) <= TOL_FP32  # a replay that kept old inputs would differ here
    # 3 rows pad to 4; shapes 50 -> 48 frames, 100 -> 144 (twice), 50 -> 96: three graphs, one
    # evicted (max_graphs=2), every call a replay.
    assert core.captures == 3 and len(core) == 2 and core.replays == 4


def test_graph_wrapper_runs_unbucketed_shapes_eagerly(fake_graphed):
    core = fake_graphed.graphed_core
    st = fake_graphed.new_session()
    y = fake_graphed.decode_one(st, make_mel(300, seed=90), finalize=True)  # 300 frames > 256
    assert y.shape == (300 * 480,) and core.captures == 0 and core.replays == 0


def test_set_cuda_graphs_needs_cuda(small):
    with pytest.raises(ValueError, match="CUDA"):
        small.set_cuda_graphs(BUCKETS)
    small.set_cuda_graphs(None)  # off is always allowed
    assert small.graphed_core is None and small.buckets == ShapeBuckets()


def test_failed_capture_falls_back_to_eager(small, monkeypatch, caplog):
    def broken(self, static):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedCore, "_record", broken)
    model = load_hift(None, preset="small")
    model.buckets = BUCKETS
    model.graphed_core = core = GraphedCore(model.synthesize_core, "cpu", BUCKETS, 4)
    mels = [make_mel(150, seed=97 + i) for i in range(2)]
    ref, _ = run_schedule(small, mels, [[50, 100]] * 2, [False, True])
    got, _ = run_schedule(model, mels, [[50, 100]] * 2, [False, True])
    for a, b in zip(got, ref):
        assert max_abs(a, b) <= TOL_FP32
    assert "not permitted" in core.failed and core.eager == 2 and core.replays == 0
    assert "capture failed" in caplog.text


@pytest.mark.slow
def test_runner_warmup_captures_every_bucket_shape(fake_graphed, small):
    from vocoder_service.runner import HiFTRunner

    buckets = ShapeBuckets(row_sizes=(1, 2), frame_multiple=16, max_frames=256)
    fake_graphed.buckets = fake_graphed.graphed_core.buckets = buckets
    fake_graphed.graphed_core.max_graphs = buckets.num_graph_shapes
    assert buckets.num_graph_shapes == 2 * 2 * 16

    def calls():
        return {p: GRAPH_CALLS.labels(p)._value.get() for p in ("capture", "replay", "eager")}

    before = calls()
    runner = HiFTRunner(fake_graphed, "cpu")
    runner.warmup()
    # every (rows, frames, source frames) the buckets produce, the dummy batch's among them
    keys = sorted(
        (k[0][0][0], k[0][0][2] - 4, k[1][0][1]) for k in fake_graphed.graphed_core._graphs
    )
    want = sorted((r, t, t + e) for r in (1, 2) for t in range(16, 257, 16) for e in (0, 1))
    assert keys == want
    # Serving then captures nothing: the upstream schedule of a 10 s utterance (first, middle
    # and final chunks; the final one is the shape the old warm-up missed) and odd chunk sizes,
    # one and two rows at a time, replay held graphs with the same audio as the eager model.
    mels = [make_mel(520, seed=95 + i) for i in range(2)]
    schedules = [[50, 100, 200, 150], [37, 1, 150, 112, 200]]
    ref, _ = run_schedule(small, mels, schedules, [True, False])
    core = fake_graphed.graphed_core
    captures, replays, eager = core.captures, core.replays, core.eager
    assert captures == buckets.num_graph_shapes
    assert calls()["capture"] - before["capture"] == captures  # the runner counts them
    got, _ = run_schedule(fake_graphed, mels, schedules, [True, False])
    for a, b in zip(got, ref):
        assert max_abs(a, b) <= TOL_FP32
    assert (core.captures, core.eager) == (captures, eager)
    assert core.replays - replays == 5
    out = runner.execute([runner.new_state()], [make_mel(300, seed=97).numpy()], [True])
    assert out.errors == [None] and out.audio[0].shape == (300 * 480,)  # past the buckets
    assert core.eager - eager == 1


def test_flags_reach_the_config_and_cpu_ignores_them():
    from vocoder_service.config import ModelConfig, build_parser
    from vocoder_service.config import VocoderServiceConfig as Config
    from vocoder_service.service import VocoderService, graph_buckets

    argv = ["--cuda-graphs", "true", "--graph-max-rows", "20"]
    cfg = Config.from_args(build_parser().parse_args(argv)).model
    assert cfg.cuda_graphs and cfg.graph_max_rows == 20 and cfg.graph_max_frames == 256
    assert graph_buckets(cfg) is None  # device cpu: the flag is ignored
    cuda = ModelConfig(device="cuda:1", cuda_graphs=True, graph_max_rows=20, graph_frame_multiple=8)
    assert graph_buckets(cuda) == ShapeBuckets((1, 2, 4, 8, 12, 16, 20), 8, 256)
    assert graph_buckets(ModelConfig(device="cuda", cuda_graphs=False)) is None
    default = graph_buckets(ModelConfig(device="cuda"))  # on by default
    assert default == ShapeBuckets.for_limits()  # what the benchmark uses (without grpc)
    assert default.row_sizes == (1, 2, 4, 8, 12, 16, 24, 32)
    assert VocoderService(Config(model=cfg)).model.graphed_core is None
    for bad in ({"graph_max_rows": 0}, {"graph_frame_multiple": 0}, {"graph_max_frames": 8}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ModelConfig(**bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager(dtype):
    """Graphed vs eager at the same padded shapes with fused Snakes (same kernels: rounding
    only), and in fp32 vs the unpadded, unfused eager path of the flag off."""
    torch.backends.cudnn.allow_tf32 = False
    eager = load_hift(None, preset="small", device="cuda", dtype=dtype)
    eager_padded = load_hift(None, preset="small", device="cuda", dtype=dtype)
    eager_padded.buckets = BUCKETS
    graphed = load_hift(None, preset="small", device="cuda", dtype=dtype)
    for model in (eager_padded, graphed):  # as the service's --cuda-graphs does
        model.fuse_snake(True)
    graphed.set_cuda_graphs(BUCKETS)
    assert graphed.warmup_graphs() == BUCKETS.num_graph_shapes  # every bucket shape
    mels = [make_mel(400, seed=100 + i) for i in range(3)]
    schedules = [upstream_schedule(400), [50, 100, 7, 200, 43], [1] * 30 + [120, 250]]
    finals = [True, True, False]
    got, got_states = run_schedule(graphed, mels, schedules, finals)
    assert graphed.graphed_core.replays > 0
    same, _ = run_schedule(eager_padded, mels, schedules, finals)
    for a, b in zip(got, same):
        assert a.shape == b.shape and max_abs(a, b) <= (
            TOL_FP32 if dtype == torch.float32 else 1e-3
        )
    if dtype == torch.float32:
        ref, ref_states = run_schedule(eager, mels, schedules, finals)
        for a, b, sa, sb in zip(got, ref, got_states, ref_states):
            assert a.shape == b.shape and max_abs(a, b) <= 1e-5
            assert sa.to_bytes() == sb.to_bytes()


@pytest.mark.slow
def test_latency_bench_smoke(tmp_path):
    """python -m bench vocoder-latency --smoke: every case measured off and on (on the CPU the
    service ignores --cuda-graphs: the same path twice), the same audio."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "bench", "vocoder-latency", "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads((tmp_path / "vocoder_latency_gpu.json").read_text())
    cases = [k for k in res if k.startswith(("fp32 ", "bf16 "))]
    assert len(cases) == 8 and "first x1" in done.stdout
    for k in cases:
        assert res[k]["off_p50_ms"] > 0 and res[k]["on_p50_ms"] > 0
        assert res[k]["max_abs_diff"] <= (TOL_FP32 if k.startswith("fp32") else 1e-2)
