"""DiT kernel options: each computes the plain path's function.

The fused norms and rotary: the eager structure is bit-identical to the plain layer (same ops,
same order); compiled (inductor on the CPU here, `slow`; on CUDA, `gpu`) within 1e-6 relative in
fp32 and within bf16 rounding, through a whole solve within 1e-5.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from test_flow_model import make_voice, ragged_requests
from test_prefix_cache import new_cache, stream_calls

from flow_service.config import FlowConfig, build_parser
from flow_service.model import DiTKernels, FlowModel, FlowRequest, load_flow
from flow_service.model.dit import (
    DiTLayer,
    apply_rotary_,
    norm_modulate,
    residual_norm_modulate,
)
from flow_service.service import service_kernels

FUSED = {"fused_norms": True, "fused_rotary": True, "triton_conv": True}  # every fused kernel
REL = 1e-5  # a kernel variant vs the plain path through a whole solve: max |diff| <= REL x max |mel| (fp32)
FUSED_REL = 1e-6  # a compiled fused function vs the same function eagerly (fp32)


@pytest.fixture(scope="module")
def model() -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(None, preset="small", seed=0)


@contextlib.contextmanager
def kernels(model: FlowModel, **options):
    dit = model.decoder.estimator
    before = dit.kernels
    dit.kernels = DiTKernels(**options)
    try:
        yield
    finally:
        dit.kernels = before


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.abs().max()), 1e-12)


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        err = rel_err(g, w)
        assert err <= tol, f"output {i}: {err:.2e} > {tol:.0e}"


# -- fused norms ------------------------------------------------------------------------------
def layer_inputs(model: FlowModel, layer: int, rows: int = 4, frames: int = 37, seed: int = 0):
    cfg = model.cfg.dit
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, frames, cfg.dim, generator=g)
    temb_act = F.silu(torch.randn(rows, cfg.dim, generator=g))
    lens = torch.tensor([frames, 20, 1, 0][:rows])
    streaming = torch.tensor([True, False, True, False][:rows])
    dit = model.decoder.estimator
    bias = dit.attention_mask(lens, streaming, frames, x.dtype)
    mask = (torch.arange(frames)[None] < lens[:, None]).float()[..., None]
    with torch.inference_mode():
        mod = dit.modulations(temb_act, x.dtype)[0][layer]  # the layer's (r, 1, 6d)
    return x, mod, dit.rotary_embed.tables(frames), bias, mask


def test_fused_structure_is_bit_identical_to_the_plain_layer(model):
    layer: DiTLayer = model.decoder.estimator.transformer_blocks[1]
    args = layer_inputs(model, 1)
    with torch.inference_mode():
        plain = layer(*args)
        fused = layer(*args, kernels=DiTKernels(**FUSED))  # CPU: uncompiled
    assert torch.equal(plain, fused)
    assert float(plain.abs().max()) > 0


SIZES = ((2, 50, 128), (6, 131, 128), (3, 7, 256))  # rows, frames, width
RAGGED = ((4, 77, 128), (10, 300, 128), (2, 13, 128))  # rows and lengths vary, width fixed


def fused_cases(dtype: torch.dtype, device: str, seed: int = 3, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    for rows, frames, dim in sizes:
        x, y = rand(rows, frames, dim) * 3.0, rand(rows, frames, dim)
        gate, shift, scale = rand(rows, 1, dim), rand(rows, 1, dim), rand(rows, 1, dim) * 0.1
        mask = (torch.rand(rows, frames, 1, generator=g) > 0.2).to(device, dtype)
        yield x, gate, y, mask, shift, scale


def check_compiled_fused(dtype: torch.dtype, device: str) -> None:
    from torch._dynamo.utils import counters

    from flow_service.model.dit import _Compiled

    torch._dynamo.reset()  # dynamo caches per code object: start from no graph
    first = _Compiled(norm_modulate)
    between = _Compiled(residual_norm_modulate)
    # the first compile covers ragged batches: other row counts and lengths compile nothing
    graphs = None
    for x, gate, y, mask, shift, scale in fused_cases(dtype, device, seed=4, sizes=RAGGED):
        with torch.inference_mode():
            first(x, shift, scale, 1e-6)
            between(x, gate, y, mask, shift, scale, 1e-6)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    for x, gate, y, mask, shift, scale in fused_cases(dtype, device):
        with torch.inference_mode():
            got = [first(x, shift, scale, 1e-6), *between(x, gate, y, mask, shift, scale, 1e-6)]
            got_nomask = between(x, gate, y, None, shift, scale, 1e-6)
        # the reference in fp32 from the rounded inputs: the compiled function keeps its
        # intermediates in fp32, the eager bf16 one rounds each of them
        x32, args32 = x.float(), [a.float() for a in (gate, y, mask, shift, scale)]
        want = [norm_modulate(x32, args32[3], args32[4], 1e-6)]
        want += residual_norm_modulate(x32, *args32, 1e-6)
        want_nomask = residual_norm_modulate(x32, args32[0], args32[1], None, *args32[3:], 1e-6)
        if dtype == torch.float32:
            tol = FUSED_REL
        else:  # within bf16 rounding: what the eager bf16 path itself is off by
            eager = [norm_modulate(x, shift, scale, 1e-6)]
            eager += residual_norm_modulate(x, gate, y, mask, shift, scale, 1e-6)
            tol = 2 * max(rel_err(e, w) for e, w in zip(eager, want))
            assert tol < 0.05
        assert_all_close(got, want, tol)
        assert_all_close(list(got_nomask), list(want_nomask), tol)


def check_compiled_rotary(dtype: torch.dtype, device: str) -> None:
    """Compiled `apply_rotary_` against the eager one, on q and k of a projection: both table
    layouts (positions 0..t-1, and per-row positions of a prefix-cache window), ragged shapes
    compiling once per layout."""
    from torch._dynamo.utils import counters

    from flow_service.model.dit import RotaryEmbedding, _Compiled

    torch._dynamo.reset()
    fused = _Compiled(apply_rotary_)
    rope = RotaryEmbedding(64).to(device)
    g = torch.Generator().manual_seed(5)
    graphs = None
    for i, (rows, frames) in enumerate(((2, 100), (6, 37), (2, 250), (4, 77))):  # r = 2b
        qkv = (torch.randn(rows, frames, 3, 256, generator=g) * 2).to(device, dtype)
        pos = torch.randint(0, 3000, (rows, frames), generator=g).to(device)
        for tables in (rope.tables(frames), rope.tables_at(pos)):
            want, got = qkv.clone(), qkv.clone()
            with torch.inference_mode():
                apply_rotary_(want[:, :, :2], *tables)
                fused(got[:, :, :2], *tables)
            assert not torch.equal(want, qkv)  # it rotated
            assert torch.equal(got[:, :, 2], qkv[:, :, 2])  # v untouched
            assert torch.equal(got[..., 64:], qkv[..., 64:])  # heads 1.. of q and k untouched
            # fp32: rounding (an FMA); bf16: at most one rounding step of the stored value
            tol = 1e-6 if dtype == torch.float32 else 2.0**-7
            assert rel_err(got, want) <= tol
        if i == 1:  # the first two shapes compiled each layout; later ones reuse them
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


# inductor's CPU backend (needs a C compiler), and CUDA
COMPILE_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", COMPILE_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("check", [check_compiled_fused, check_compiled_rotary])
def test_compiled_functions(check, dtype, device):
    check(dtype, device)


@pytest.mark.slow
def test_compiled_fused_generate_on_cpu(model):
    reqs = ragged_requests()[:4]
    want = model.generate(reqs)
    with kernels(model, **FUSED, compile_cpu=True):
        got = model.generate(reqs)
    assert_all_close(got, want, REL)


@pytest.mark.slow
def test_warm_up_compiles_what_serving_meets(model):
    """After `warm_up_kernels` (load_flow runs it), ragged batches and prefix-cache windows
    compile nothing more (no batch waits for a compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    dit = model.decoder.estimator
    before = counters["stats"]["unique_graphs"]
    with kernels(model, **FUSED, compile_cpu=True):
        dit.warm_up_kernels()
        warmed = counters["stats"]["unique_graphs"]
        assert warmed > before
        got = model.generate(ragged_requests()[:5])
        cache = new_cache(model)
        for call in stream_calls(make_voice(8, 35), "w", 230, seed=30)[:3]:
            model.generate([call], prefix_cache=cache)  # prefix windows: other lengths
        assert cache.stats["hits"] >= 1
    assert counters["stats"]["unique_graphs"] == warmed
    assert_all_close(got, model.generate(ragged_requests()[:5]), REL)


# -- flags ------------------------------------------------------------------------------------
def test_the_service_fuses_kernels_on_cuda_only():
    default = FlowConfig.from_args(build_parser().parse_args([]))
    # measured faster on CUDA; on the CPU the service runs the plain path
    assert service_kernels(default) == DiTKernels()
    on_cuda = FlowConfig.from_args(build_parser().parse_args(["--device", "cuda"]))
    assert service_kernels(on_cuda) == DiTKernels(**FUSED)
    m = load_flow(None, preset="small", kernels=service_kernels(on_cuda))
    assert m.decoder.estimator.kernels == DiTKernels(**FUSED)
    assert load_flow(None, preset="small").decoder.estimator.kernels == DiTKernels()


# -- CUDA -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_cuda_kernels_match_the_plain_path():
    """Full size, TF32 off: compiled fused norms, eager and under CUDA graphs, and with the
    prefix cache."""
    from flow_service.model import GraphedEstimator, PrefixCache

    m = load_flow(None, preset="cosyvoice3-0.5b", device="cuda", seed=0)
    reqs: list[FlowRequest] = ragged_requests()
    want = m.generate(reqs)
    for options in ({"fused_norms": True}, FUSED):
        with kernels(m, **options):
            assert_all_close(m.generate(reqs), want, REL)
            graphed = GraphedEstimator(m.decoder.estimator)
            got = m.generate(reqs[:3], estimator=graphed, frame_multiple=100)
            assert_all_close(got, m.generate(reqs[:3]), REL)
    calls = stream_calls(make_voice(12, 75), "gpu", 300, seed=60)[:-1]
    plain = [m.generate([c])[0] for c in calls]
    with kernels(m, **FUSED):
        cache = PrefixCache.for_model(m, 4 << 30)
        got = [m.generate([c], prefix_cache=cache)[0] for c in calls]
    assert cache.stats["hits"] >= 2
    assert_all_close(got, plain, REL)


def check_bf16_against_fp32(preset: str, device: str, reqs, **extra) -> None:
    """bf16 variants round differently from plain bf16, so both are compared through their
    distance to fp32 (TF32 off): no farther than plain bf16, within a margin."""
    m = load_flow(None, preset=preset, device=device, seed=0)
    ref = m.generate(reqs)
    del m
    m = load_flow(None, preset=preset, device=device, dtype=torch.bfloat16, seed=0)
    plain = m.generate(reqs)

    def rms(x: torch.Tensor) -> float:
        return float(x.pow(2).mean().sqrt())

    for options in ({"fused_norms": True}, FUSED):
        with kernels(m, **options, **extra):
            got = m.generate(reqs)
        for i, (g, p, r) in enumerate(zip(got, plain, ref, strict=True)):
            assert rms(g - r) <= 1.1 * rms(p - r) + 1e-6, f"{options} output {i}"
            assert float((g - r).abs().max()) <= 1.5 * float((p - r).abs().max()) + 1e-6


@pytest.mark.slow
def test_compiled_bf16_kernels_on_cpu_stay_as_close_to_fp32():
    check_bf16_against_fp32("small", "cpu", ragged_requests()[:5], compile_cpu=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_cuda_bf16_kernels_stay_as_close_to_fp32_as_the_plain_path():
    check_bf16_against_fp32("cosyvoice3-0.5b", "cuda", ragged_requests())


# -- python -m bench kernels ------------------------------------------------------------------
def test_kernels_bench_cpu_dry_run(tmp_path):
    """The GPU bench's CPU dry run: every variant runs, agrees with the baseline, and its
    figures are consistent (no timing is asserted)."""
    from bench import flow_kernels
    from bench.__main__ import main as bench

    out = tmp_path / "kernels_bench.json"
    argv = ["kernels", "--device", "cpu", "--preset", "small", "--dtype", "fp32"]
    argv += ["--rows", "1", "--frames", "206", "--kinds", "streaming", "--repeats", "1"]
    assert bench([*argv, "--budget-s", "120", "--out", str(tmp_path)]) == 0
    res = json.loads(out.read_text())
    assert not res["errors"] and not res["skipped"]
    (case,) = res["cases"]
    assert set(case["variants"]) == set(flow_kernels.VARIANTS)
    for row in case["variants"].values():
        assert row["rel_max_diff_vs_baseline"] <= REL
        assert row["frame_steps_per_s"] == pytest.approx(206 * 10 / (row["ms"] / 1e3), rel=0.01)
        assert row["mfu"] == pytest.approx(row["tflops"] / 67.0, rel=0.01, abs=1e-4)


def test_kernels_bench_counts_visible_keys():
    from bench.flow_kernels import visible_pairs

    assert visible_pairs(100, False, 50) == 100 * 100
    assert visible_pairs(100, True, 50) == 50 * 50 + 50 * 100  # block 0 sees 50 keys, block 1 100
    assert visible_pairs(120, True, 50) == 50 * 50 + 50 * 100 + 20 * 120


def test_kernels_bench_runs_only_the_variants_asked_for(tmp_path):
    from bench.__main__ import main as bench

    out = tmp_path / "kernels_bench.json"
    argv = ["kernels", "--device", "cpu", "--preset", "small", "--dtype", "fp32"]
    argv += ["--rows", "1", "--frames", "206", "--kinds", "final", "--repeats", "1"]
    argv += ["--variants", "fused", "--budget-s", "120", "--out", str(tmp_path)]
    assert bench(argv) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert set(case["variants"]) == {"baseline", "fused"}  # the reference always runs
    assert bench([*argv[:-4], "--variants", "fussed"]) == 2
