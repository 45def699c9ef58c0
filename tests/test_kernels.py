"""DiT kernel options (issue 17 item 2): each computes the plain path's function.

- fused norms: the eager structure is bit-identical to the plain layer (same ops, same order);
  compiled (inductor on the CPU here, `slow`; on CUDA, `gpu`) within 1e-6 relative in fp32 and
  within bf16 rounding.
- FlexAttention block masks: the same visibility as the dense additive bias (full, streaming,
  ragged, empty rows, prefix-cache query offsets), and the same mel through `generate` with
  and without the prefix cache (fp32 <= 1e-5 relative; flex's eager reference on the CPU,
  compiled on CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from test_flow_model import make_voice, ragged_requests
from test_prefix_cache import new_cache, stream_calls

from flow_service.config import FlowConfig, build_parser
from flow_service.model import DiTKernels, FlowModel, FlowRequest, load_flow
from flow_service.model import dit as dit_module
from flow_service.model.dit import (
    DiTLayer,
    FlexMask,
    flex_block_mask,
    norm_modulate,
    ragged_attention_bias,
    residual_norm_modulate,
)
from flow_service.service import service_kernels

REL = 1e-5  # flex vs bias through a whole solve: max |diff| <= REL x max |mel| (fp32)
FUSED_REL = 1e-6  # a compiled fused function vs the same function eagerly (fp32)


@pytest.fixture(scope="module")
def model() -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(None, preset="small", seed=0)


@pytest.fixture
def flex_calls(monkeypatch) -> list[int]:
    """Counts the (eager, CPU) FlexAttention calls, to show the flex path really ran."""
    calls = []
    eager = dit_module._flex_eager

    def counting(*args):
        calls.append(1)
        return eager(*args)

    monkeypatch.setattr(dit_module, "_flex_eager", counting)
    return calls


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
def layer_inputs(model: FlowModel, rows: int = 4, frames: int = 37, seed: int = 0):
    cfg = model.cfg.dit
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, frames, cfg.dim, generator=g)
    temb_act = F.silu(torch.randn(rows, cfg.dim, generator=g))
    lens = torch.tensor([frames, 20, 1, 0][:rows])
    streaming = torch.tensor([True, False, True, False][:rows])
    dit = model.decoder.estimator
    bias = dit.attention_mask(lens, streaming, frames, x.dtype)
    mask = (torch.arange(frames)[None] < lens[:, None]).float()[..., None]
    return x, temb_act, dit.rotary_embed.tables(frames), bias, mask


def test_fused_structure_is_bit_identical_to_the_plain_layer(model):
    layer: DiTLayer = model.decoder.estimator.transformer_blocks[1]
    args = layer_inputs(model)
    with torch.inference_mode():
        plain = layer(*args)
        fused = layer(*args, kernels=DiTKernels(fused_norms=True))  # CPU: uncompiled
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_functions_on_cpu(dtype):
    """Inductor's CPU backend (needs a C compiler); the CUDA twin is below."""
    check_compiled_fused(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_functions_on_cuda(dtype):
    check_compiled_fused(dtype, "cuda")


@pytest.mark.slow
def test_compiled_fused_generate_on_cpu(model):
    reqs = ragged_requests()[:4]
    want = model.generate(reqs)
    with kernels(model, fused_norms=True, compile_cpu=True):
        got = model.generate(reqs)
    assert_all_close(got, want, REL)


# -- FlexAttention ----------------------------------------------------------------------------
def attention_case(query_start, seq_lens, streaming, num_queries, num_keys, seed=0, heads=2, e=16):
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    # (r, h, t, e) views of (r, t, h, e), as the DiT's Attention makes them
    q = torch.randn(rows, num_queries, heads, e, generator=g).transpose(1, 2)
    k = torch.randn(rows, num_keys, heads, e, generator=g).transpose(1, 2)
    v = torch.randn(rows, num_keys, heads, e, generator=g).transpose(1, 2)
    start = torch.tensor(query_start)
    lens, stream = torch.tensor(seq_lens), torch.tensor(streaming)
    qpos = start[:, None] + torch.arange(num_queries)
    bias = ragged_attention_bias(qpos, lens, stream, num_keys, 50, torch.float32)
    mask = flex_block_mask(lens, stream, num_keys, 50, start, num_queries)
    return q, k, v, bias, mask


FLEX_CASES = [
    ([0] * 5, [200, 130, 0, 1, 77], [False, True, True, False, True], 200, 200),
    ([0, 50, 100, 50], [180, 140, 230, 90], [True, True, True, False], 130, 230),
    ([0, 0], [257, 3], [True, True], 257, 257),
    ([0, 0, 0], [40, 0, 13], [True, False, True], 40, 40),  # one tile of queries and keys
]


@pytest.mark.parametrize(
    "query_start, seq_lens, streaming, num_queries, num_keys",
    # full and streaming rows of ragged lengths, an empty row, a 1-frame row; prefix-cache
    # windows (queries after cached prefixes of 0, 50, 100 frames); lengths that are no
    # multiple of flex's 128-frame tiles; a single tile
    FLEX_CASES,
)
def test_flex_attention_equals_sdpa_with_the_bias(
    query_start, seq_lens, streaming, num_queries, num_keys
):
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, bias, mask = attention_case(query_start, seq_lens, streaming, num_queries, num_keys)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    got = flex_attention(q, k, v, block_mask=mask.block_mask)
    assert not got.isnan().any()
    assert rel_err(got, want) <= REL


@pytest.mark.slow
def test_compiled_flex_on_cpu(caplog):
    """The compiled FlexAttention path (inductor's CPU template here; the CUDA twin runs in the
    gpu tests), with a fresh BlockMask per call as the solver makes them: correct, no NaN,
    compiles logged, and a bounded number of graphs across lengths."""
    import logging

    from torch._dynamo.utils import counters

    from flow_service.model.dit import _Compiled, _flex_eager

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]  # a process-wide count
    flex = _Compiled(_flex_eager, ragged=False)
    with caplog.at_level(logging.INFO, logger="flow_service.model.dit"):
        for case in FLEX_CASES * 2:
            q, k, v, bias, mask = attention_case(*case)
            with torch.inference_mode():
                got = flex(q, k, v, mask.block_mask)
            assert not got.isnan().any()
            assert rel_err(got, F.scaled_dot_product_attention(q, k, v, attn_mask=bias)) <= REL
    graphs = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs <= len(FLEX_CASES)  # the second round compiled nothing
    assert sum("compiled _flex_eager" in r.getMessage() for r in caplog.records) == graphs


@pytest.mark.slow
def test_warm_up_compiles_what_serving_meets(model):
    """After `warm_up_kernels` (load_flow runs it), ragged batches, full and streaming rows
    and prefix-cache windows compile nothing more (no batch waits for a compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    dit = model.decoder.estimator
    cfg = model.cfg.dit
    before = counters["stats"]["unique_graphs"]
    with kernels(model, fused_norms=True, flex_attention=True, compile_cpu=True):
        dit.warm_up_kernels()
        warmed = counters["stats"]["unique_graphs"]
        assert warmed > before
        for case in FLEX_CASES:
            with torch.inference_mode():  # as in generate: dynamo guards on inference tensors
                q, k, v, bias, mask = attention_case(*case, heads=cfg.heads, e=cfg.dim_head)
                got = dit_module._flex_compiled(q, k, v, mask.block_mask)
            assert rel_err(got, F.scaled_dot_product_attention(q, k, v, attn_mask=bias)) <= REL
    # the fused norms through generate (flex on the CPU runs its eager reference, not warmed)
    with kernels(model, fused_norms=True, compile_cpu=True):
        got = model.generate(ragged_requests()[:5])
        cache = new_cache(model)
        for call in stream_calls(make_voice(8, 35), "w", 230, seed=30)[:3]:
            model.generate([call], prefix_cache=cache)  # prefix windows: other lengths
        assert cache.stats["hits"] >= 1
    assert counters["stats"]["unique_graphs"] == warmed
    assert_all_close(got, model.generate(ragged_requests()[:5]), REL)


def test_generate_with_flex_equals_the_bias_path(model, flex_calls):
    reqs = ragged_requests()[:8]  # full, streaming, ragged, final and non-final rows
    want = model.generate(reqs)
    with kernels(model, flex_attention=True):
        got = model.generate(reqs)
        steps, layers = len(model.decoder.steps), model.cfg.dit.depth
        assert len(flex_calls) == steps * layers
        # a replacement estimator (a CUDA-graph runner) gets the FlexMask too
        seen = []

        def estimator(*args):
            seen.append(args[5])
            return model.decoder.estimator(*args)

        got_replaced = model.generate(reqs[:3], estimator=estimator)
    assert_all_close(got, want, REL)
    assert_all_close(got_replaced, want[:3], REL)
    assert seen and all(isinstance(mask, FlexMask) for mask in seen)


@pytest.mark.parametrize(
    "case_a, case_b, compiled",
    # compiled flex reads the block tables (the eager reference may evaluate the mask densely)
    [(0, 1, False), (1, 0, False), pytest.param(0, 1, True, marks=pytest.mark.slow)],
)
def test_flex_mask_static_copy_refills_like_a_graph_runner(case_a, case_b, compiled):
    """What GraphedEstimator does with a FlexMask: a static copy at capture, refilled from each
    later batch of the same shape (block tables and the per-row numbers the mask function
    reads). The refilled copy must attend exactly as the later batch's own mask."""
    cases = [
        ([0, 0, 0, 0], [300, 120, 0, 260], [True, False, True, True], 300, 300),
        ([0, 0, 0, 0], [77, 300, 180, 5], [False, True, True, False], 300, 300),
    ]
    from flow_service.model.dit import _Compiled, _flex_eager

    flex = _Compiled(_flex_eager, ragged=False) if compiled else _flex_eager
    with torch.inference_mode():
        check_refill(flex, *(attention_case(*cases[i], seed=i) for i in (case_a, case_b)))


def check_refill(flex, case_a, case_b) -> None:
    *_, first = case_a
    static = first.static_copy()  # at capture
    q, k, v, bias, later = case_b
    block_tables = [static.block_mask.kv_indices.data_ptr(), static.key_len.data_ptr()]
    static.copy_(later)
    assert [static.block_mask.kv_indices.data_ptr(), static.key_len.data_ptr()] == block_tables
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert rel_err(flex(q, k, v, static.block_mask), want) <= REL
    assert rel_err(flex(q, k, v, first.block_mask), want) > 1e-3
    with pytest.raises(ValueError, match="FlexMask.copy_"):
        static.copy_(attention_case(*FLEX_CASES[1])[-1])


def test_generate_with_flex_and_fused_and_the_prefix_cache(model, flex_calls):
    """Prefix-cache rows mixing hits and misses: query offsets and key lengths per row."""
    v1, v2 = make_voice(8, 35), make_voice(9, 13)
    s1 = stream_calls(v1, "k1", 230, seed=30)
    s2 = stream_calls(v2, "k2", 120, seed=31)
    batch = [
        s1[2],  # hit
        s2[0],  # first chunk: a miss that stores
        s2[-2],  # final, full attention
        dataclasses.replace(s1[1], cache_key=""),  # no key: voice blocks only
    ]
    want = model.generate(batch)
    with kernels(model, flex_attention=True, fused_norms=True):
        cache = new_cache(model)
        model.generate([s1[0], s1[1]], prefix_cache=cache)
        got = model.generate(batch, prefix_cache=cache)
    assert cache.stats["hits"] >= 1 and cache.stats["reused_frames"] > 0
    assert len(flex_calls) == 2 * len(model.decoder.steps) * model.cfg.dit.depth
    assert_all_close(got, want, REL)


# -- flags ------------------------------------------------------------------------------------
def test_flags_reach_the_model(monkeypatch):
    monkeypatch.setenv("FLOW_FLEX_ATTENTION", "true")
    cfg = FlowConfig.from_args(build_parser().parse_args(["--fused-norms", "true"]))
    assert cfg.fused_norms and cfg.flex_attention
    monkeypatch.delenv("FLOW_FLEX_ATTENTION")
    default = FlowConfig.from_args(build_parser().parse_args([]))
    assert default.fused_norms and not default.flex_attention  # fused: measured faster on CUDA
    # ... and compiled only there: on the CPU the service runs the plain path
    assert service_kernels(default) == DiTKernels()
    on_cuda = FlowConfig.from_args(build_parser().parse_args(["--device", "cuda"]))
    assert service_kernels(on_cuda) == DiTKernels(fused_norms=True)
    m = load_flow(None, preset="small", kernels=DiTKernels(cfg.fused_norms, cfg.flex_attention))
    assert m.decoder.estimator.kernels == DiTKernels(fused_norms=True, flex_attention=True)
    assert load_flow(None, preset="small").decoder.estimator.kernels == DiTKernels()


# -- CUDA -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_kernels_match_the_plain_path(monkeypatch):
    """Full size, TF32 off: compiled fused norms and compiled flex, eager and under CUDA
    graphs, and with the prefix cache."""
    from flow_service.model import GraphedEstimator, PrefixCache

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    m = load_flow(None, preset="cosyvoice3-0.5b", device="cuda", seed=0)
    reqs: list[FlowRequest] = ragged_requests()
    want = m.generate(reqs)
    for options in (
        {"fused_norms": True},
        {"flex_attention": True},
        {"fused_norms": True, "flex_attention": True},
    ):
        with kernels(m, **options):
            assert_all_close(m.generate(reqs), want, REL)
            graphed = GraphedEstimator(m.decoder.estimator)
            got = m.generate(reqs[:3], estimator=graphed, frame_multiple=100)
            assert_all_close(got, m.generate(reqs[:3]), REL)
    calls = stream_calls(make_voice(12, 75), "gpu", 300, seed=60)[:-1]
    plain = [m.generate([c])[0] for c in calls]
    with kernels(m, fused_norms=True, flex_attention=True):
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

    for options in ({"fused_norms": True}, {"fused_norms": True, "flex_attention": True}):
        with kernels(m, **options, **extra):
            got = m.generate(reqs)
        for i, (g, p, r) in enumerate(zip(got, plain, ref, strict=True)):
            assert rms(g - r) <= 1.1 * rms(p - r) + 1e-6, f"{options} output {i}"
            assert float((g - r).abs().max()) <= 1.5 * float((p - r).abs().max()) + 1e-6


@pytest.mark.slow
def test_compiled_bf16_kernels_on_cpu_stay_as_close_to_fp32():
    check_bf16_against_fp32("small", "cpu", ragged_requests()[:5], compile_cpu=True)


@pytest.mark.gpu
def test_cuda_bf16_kernels_stay_as_close_to_fp32_as_the_plain_path(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    check_bf16_against_fp32("cosyvoice3-0.5b", "cuda", ragged_requests())


# -- bench/kernels_bench.py -------------------------------------------------------------------
def test_kernels_bench_cpu_dry_run(tmp_path, monkeypatch):
    """The GPU bench's CPU dry run: every variant runs, agrees with the baseline, and its
    figures are consistent (no timing is asserted)."""
    import sys

    from bench import kernels_bench

    out = tmp_path / "kernels.json"
    argv = ["kernels_bench", "--device", "cpu", "--preset", "small", "--dtypes", "fp32"]
    argv += ["--rows", "1", "--frames", "206", "--kinds", "streaming", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--budget-s", "120", "--out", str(out)])
    kernels_bench.main()
    res = json.loads(out.read_text())
    assert not res["errors"] and not res["skipped"]
    (case,) = res["cases"]
    assert set(case["variants"]) == set(kernels_bench.VARIANTS)
    for row in case["variants"].values():
        assert row["rel_max_diff_vs_baseline"] <= REL
        assert row["frame_steps_per_s"] == pytest.approx(206 * 10 / (row["ms"] / 1e3), rel=0.01)
        assert row["mfu"] == pytest.approx(row["tflops"] / 67.0, rel=0.01, abs=1e-4)


def test_kernels_bench_counts_visible_keys():
    from bench.kernels_bench import visible_pairs

    assert visible_pairs(100, False, 50) == 100 * 100
    assert visible_pairs(100, True, 50) == 50 * 50 + 50 * 100  # block 0 sees 50 keys, block 1 100
    assert visible_pairs(120, True, 50) == 50 * 50 + 50 * 100 + 20 * 120


def test_kernels_bench_runs_only_the_variants_asked_for(tmp_path, monkeypatch):
    import sys

    from bench import kernels_bench

    out = tmp_path / "kernels.json"
    argv = ["kernels_bench", "--device", "cpu", "--preset", "small", "--dtypes", "fp32"]
    argv += ["--rows", "1", "--frames", "206", "--kinds", "final", "--repeats", "1"]
    argv += ["--variants", "fused", "--budget-s", "120", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    kernels_bench.main()
    (case,) = json.loads(out.read_text())["cases"]
    assert set(case["variants"]) == {"baseline", "fused"}  # the reference always runs
    monkeypatch.setattr(sys, "argv", [*argv[:-4], "--variants", "fussed"])
    with pytest.raises(SystemExit):
        kernels_bench.main()
