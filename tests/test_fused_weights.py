"""The DiT's fused weights (issue 28): one GEMM for a layer's q, k and v, the rotary on q and k
in one pass, one GEMM for every AdaLN's modulation. They compute what the unfused model does
(a reference written here from the per-linear parameters, in fp32 and fp64, one DiT call, a
whole solve and a prefix-cache solve); upstream-named state dicts load into them; the
parameters stay views of the fused tensors through conversions, loading, deepcopy and
pickling; a step launches one GEMM per projection group and concatenates no weights."""

from __future__ import annotations

import copy
import io
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from test_flow_model import make_voice, ragged_requests, upstream_flow_keys
from test_prefix_cache import new_cache, stream_calls

from flow_service.model import FlowModel, load_flow
from flow_service.model.prefix_cache import PrefixStep
from flow_service.model.shared_storage import shares_storage

# fused vs unfused: max |diff| <= tol x max |out|; fp32 GEMMs may block the sums differently
CALL_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# a whole solve: the Euler state and the rotary are fp32 whatever the weights (as upstream)
SOLVE_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
EST = "decoder.estimator."


@pytest.fixture(scope="module")
def model() -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(None, preset="small", seed=0)


def in_dtype(model: FlowModel, dtype: torch.dtype) -> FlowModel:
    return copy.deepcopy(model).to(dtype)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


# -- the unfused reference --------------------------------------------------------------------
def _linear(x: torch.Tensor, m: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, m.weight, m.bias)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift, x, 1.0 + scale)


def _rotary_tables(dit, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's interleaved cos, sin (..., e) at positions `pos`, fp32."""
    freqs = (pos.float()[..., None] * dit.rotary_embed.inv_freq.float()).repeat_interleave(2, -1)
    return freqs.cos(), freqs.sin()


def _rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary on one projection (r, t, h e), upstream's way: x cos + rotate_half(x) sin on
    the first e channels, rotate_half(x) = (-x1, x0) per channel pair, promoted to the fp32
    tables' dtype (fp64 stays fp64), cast back."""
    rot = x[..., : cos.shape[-1]]
    pairs = rot.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rot.copy_(rot * cos + swapped * sin)


def unfused_velocity(dit, x, mu, cond, spks, tau, bias, frame_mask=None, prefix=None):
    """`DiT.forward` the unfused way, from each linear's own parameters: q, k, v and every
    AdaLN projection a GEMM of its own (and its 1 + scale), the rotary on q and on k apart."""
    d = dit.cfg.dim
    temb_act = F.silu(dit.time_embed(tau))
    if prefix is None:
        hidden = dit.input_embed(x, cond, mu, spks)
        rope = _rotary_tables(dit, torch.arange(x.shape[1], device=x.device))
    else:
        hidden = dit.input_embed(x, cond, mu, spks, prefix.keep)[:, prefix.context :].contiguous()
        cos, sin = prefix.rope  # the service's tables: sin signed for its one-pass rotary
        sin = sin.clone()
        sin[..., 0::2].neg_()  # back to upstream's sin (an exact negation)
        rope = cos, sin
    r, t, _ = hidden.shape
    for i, layer in enumerate(dit.transformer_blocks):
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = _linear(
            temb_act, layer.attn_norm.linear
        )[:, None, :].chunk(6, dim=-1)
        attn = layer.attn
        normed = _modulate(F.layer_norm(hidden, (d,), eps=layer.eps), shift_a, scale_a)
        q, k, v = (_linear(normed, m) for m in (attn.to_q, attn.to_k, attn.to_v))
        _rotary_(q, *rope)
        _rotary_(k, *rope)
        if prefix is not None:
            k, v = prefix.layer(i)(k, v)
        q, k, v = (z.unflatten(-1, (attn.heads, attn.dim_head)).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        o = _linear(o.transpose(1, 2).reshape(r, t, d), attn.to_out[0])
        if frame_mask is not None:
            o = o * frame_mask
        hidden = torch.addcmul(hidden, gate_a, o)
        normed = _modulate(F.layer_norm(hidden, (d,), eps=layer.eps), shift_f, scale_f)
        hidden = torch.addcmul(hidden, gate_f, layer.ff(normed))
    scale, shift = _linear(temb_act, dit.norm_out.linear)[:, None, :].chunk(2, dim=-1)
    out = _modulate(F.layer_norm(hidden, (d,), eps=dit.norm_out.eps), shift, scale)
    return _linear(out, dit.proj_out)


class UnfusedPrefixStep(PrefixStep):
    """The prefix graphs' step (`IndexedKV` layout) through the unfused reference."""

    def __call__(self, x, mu, cond, spks, tau, bias, frame_mask, keep, cos, sin, gather, store):
        from flow_service.model.prefix_cache import DiTPrefix, IndexedKV

        kv = IndexedKV(self.cache.pool(), gather, store)
        ctx = DiTPrefix(self.context, keep, (cos, sin), kv)
        return unfused_velocity(self.dit, x, mu, cond, spks, tau, bias, frame_mask, ctx)


def dit_inputs(model: FlowModel, rows: int = 4, frames: int = 70, seed: int = 0):
    dit, dtype = model.decoder.estimator, model.dtype
    g = torch.Generator().manual_seed(seed)
    c = model.cfg.mel_dim
    x, mu, cond = (torch.randn(rows, frames, c, generator=g).to(dtype) for _ in range(3))
    spks = torch.randn(rows, c, generator=g).to(dtype)
    tau = torch.rand(rows, generator=g)
    lens = torch.tensor([frames, 51, 13, 1][:rows])
    streaming = torch.tensor([True, False, True, False][:rows])
    bias = dit.attention_mask(lens, streaming, frames, dtype)
    mask = (torch.arange(frames)[None] < lens[:, None]).to(dtype)[..., None]
    return x, mu, cond, spks, tau, bias, mask


# -- numerics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_dit_call_equals_the_unfused_reference(model, dtype):
    m = in_dtype(model, dtype)
    dit = m.decoder.estimator
    args = dit_inputs(m)
    with torch.inference_mode():
        got, want = dit(*args), unfused_velocity(dit, *args)
    assert got.dtype == dtype and float(want.abs().max()) > 0.1
    assert rel_err(got, want) <= CALL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_solve_equals_the_unfused_reference(model, dtype):
    m = in_dtype(model, dtype)
    reqs = ragged_requests()
    got = m.generate(reqs)
    want = m.generate(reqs, estimator=partial(unfused_velocity, m.decoder.estimator))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(g, w) <= SOLVE_TOL[dtype], f"request {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_prefix_cache_solve_equals_the_unfused_reference(model, dtype):
    """The streams' calls, batched by call index, through the cache three ways: eager
    (assembled K/V), the prefix graphs' step and that step through the unfused reference;
    each equals unfused recomputation, and the fused step the unfused one."""
    m = in_dtype(model, dtype)
    dit = m.decoder.estimator
    streams = [stream_calls(make_voice(90 + i, 35), f"f{i}", 230, seed=170 + i) for i in range(2)]
    eager, fused, unfused = new_cache(m), new_cache(m), new_cache(m)
    fused_step, unfused_step = PrefixStep(dit, fused), UnfusedPrefixStep(dit, unfused)
    for k in range(3):
        batch = [s[k] for s in streams]
        want = m.generate(batch, estimator=partial(unfused_velocity, dit))
        got = {
            "eager": m.generate(batch, prefix_cache=eager),
            "fused step": m.generate(batch, prefix_cache=fused, prefix_step=fused_step),
            "unfused step": m.generate(batch, prefix_cache=unfused, prefix_step=unfused_step),
        }
        for name, outs in got.items():
            for g, w in zip(outs, want, strict=True):
                assert rel_err(g, w) <= SOLVE_TOL[dtype], f"call {k}, {name}"
        for g, w in zip(got["fused step"], got["unfused step"], strict=True):
            assert rel_err(g, w) <= SOLVE_TOL[dtype], f"call {k}: fused vs unfused step"
    assert fused.stats["hits"] == unfused.stats["hits"] == 4


# -- the views --------------------------------------------------------------------------------
def fused_groups(model: FlowModel):
    """(parameters, the tensor they must be views of) for every fused group."""
    dit = model.decoder.estimator
    for layer in dit.transformer_blocks:
        a = layer.attn
        yield [a.to_q.weight, a.to_k.weight, a.to_v.weight], a.qkv_weight
        yield [a.to_q.bias, a.to_k.bias, a.to_v.bias], a.qkv_bias
    adaln = [layer.attn_norm.linear for layer in dit.transformer_blocks] + [dit.norm_out.linear]
    yield [m.weight for m in adaln], dit.adaln_weight
    yield [m.bias for m in adaln], dit.adaln_bias


def assert_shared(model: FlowModel) -> None:
    for params, fused in fused_groups(model):
        assert shares_storage(params, fused)
        assert torch.equal(torch.cat([p.detach() for p in params]), fused)
    # a write through a parameter is a write into the fused tensor, and back
    attn = model.decoder.estimator.transformer_blocks[-1].attn
    inner = attn.to_q.out_features
    with torch.no_grad():
        old = attn.to_k.weight[1, 2].clone()
        attn.to_k.weight[1, 2] = 0.5
        assert float(attn.qkv_weight[inner + 1, 2]) == 0.5
        attn.qkv_weight[inner + 1, 2] = old
        assert torch.equal(attn.to_k.weight[1, 2], old)


def _state(model: FlowModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_new_model_shares_and_its_keys_are_upstreams(model):
    assert_shared(model)
    state = model.state_dict()
    assert set(state) == set(upstream_flow_keys(model.cfg.dit.depth))
    assert not any("qkv" in k or "adaln" in k for k in state)


def _pickled(m: FlowModel) -> FlowModel:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


CONVERSIONS = {  # name: (the module conversion, what it does to each floating tensor)
    "to(float64)": (lambda m: m.to(torch.float64), lambda t: t.double()),
    "double()": (lambda m: m.double(), lambda t: t.double()),
    "half()": (lambda m: m.half(), lambda t: t.half()),
    "to(bfloat16).float()": (
        lambda m: m.to(torch.bfloat16).float(),
        lambda t: t.bfloat16().float(),
    ),
    "_apply(clone)": (lambda m: m._apply(lambda t: t.clone()), _same),  # all new, as a move
    "deepcopy": (copy.deepcopy, _same),
    "pickle": (_pickled, _same),
}


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_the_views_survive_conversion(model, name):
    m = copy.deepcopy(model)
    before = _state(m)
    convert, tensor = CONVERSIONS[name]
    out = convert(m)
    assert_shared(out)
    for k, v in out.state_dict().items():
        keep = k.endswith("inv_freq") or not v.is_floating_point()  # rotary stays fp32
        assert torch.equal(v, before[k] if keep else tensor(before[k])), k


def test_a_conversion_to_the_same_dtype_and_device_copies_nothing(model):
    m = copy.deepcopy(model)
    fused = [t for _, t in fused_groups(m)]
    m.to("cpu", torch.float32)
    assert all(a is b for a, b in zip(fused, (t for _, t in fused_groups(m)), strict=True))


def test_to_empty_from_meta_then_random_init_shares(model):
    """load_flow's path without a checkpoint: built on meta, to_empty, filled in place."""
    from flow_service.model.loading import init_random_

    with torch.device("meta"):
        m = FlowModel(model.cfg)
    m = m.to_empty(device="cpu")
    assert all(shares_storage(params, fused) for params, fused in fused_groups(m))
    init_random_(m, seed=0)
    assert_shared(m)
    for k, v in model.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_an_upstream_named_state_dict_loads_into_the_views(model, tmp_path):
    """flow.pt holds upstream's keys (to_q/to_k/to_v, attn_norm.linear, norm_out.linear) as
    separate tensors: load_flow, load_state_dict (copying into the views) and
    load_state_dict(assign=True) (new parameters, shared again) all make the fused tensors
    of exactly those weights, and the model computes what the unfused reference does."""
    src = load_flow(None, preset="small", seed=7)
    state = _state(src)  # separate tensors, upstream's keys
    assert set(state) == set(upstream_flow_keys(src.cfg.dit.depth))
    torch.save(state, tmp_path / "flow.pt")
    depth = src.cfg.dit.depth
    qkv = [
        torch.cat([state[f"{EST}transformer_blocks.{i}.attn.to_{n}.weight"] for n in "qkv"])
        for i in range(depth)
    ]
    adaln = [state[f"{EST}transformer_blocks.{i}.attn_norm.linear.bias"] for i in range(depth)]
    adaln = torch.cat([*adaln, state[f"{EST}norm_out.linear.bias"]])

    loaded = {"load_flow": load_flow(tmp_path)}
    for assign in (False, True):
        m = load_flow(None, preset="small", seed=0)
        m.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True, assign=assign)
        loaded[f"load_state_dict(assign={assign})"] = m
    reqs = ragged_requests()[:4]
    want = src.generate(reqs, estimator=partial(unfused_velocity, src.decoder.estimator))
    for name, m in loaded.items():
        assert_shared(m)
        dit = m.decoder.estimator
        for i, layer in enumerate(dit.transformer_blocks):
            assert torch.equal(layer.attn.qkv_weight, qkv[i]), (name, i)
        assert torch.equal(dit.adaln_bias, adaln), name
        for g, w in zip(m.generate(reqs), want, strict=True):
            assert rel_err(g, w) <= SOLVE_TOL[torch.float32], name


# -- what a step launches -----------------------------------------------------------------------
def test_a_step_runs_one_gemm_per_projection_group_and_no_weight_concat(model):
    """Per layer: q/k/v, out, FFN in and out (4 GEMMs), one rotary pass (its one pair swap, no
    negation: the sign is in the table); per step: the time MLP
    (2), the input projection, all modulations (1) and the output projection. The only
    concatenations are the time sinusoid and the input features, and the fused weights are
    the same tensors after a solve (a CUDA graph bakes in their addresses)."""
    from bench.flow_profile import step_ops

    fused = [(t, t.data_ptr()) for _, t in fused_groups(model)]
    model.generate(ragged_requests()[:2])
    assert all(t is u and t.data_ptr() == p for (t, p), (_, u) in zip(fused, fused_groups(model)))
    for preset, depth in (("small", 3), ("cosyvoice3-0.5b", 22)):
        for name, ops in step_ops(preset, torch.float32, "meta", 1, 100).items():
            assert ops["linear"] == 4 * depth + 5, (preset, name)
            assert ops["flip"] == depth and ops["neg"] == 0, (preset, name)  # the rotary
            assert ops["cat"] == 2, (preset, name)


def test_count_ops_option_of_profile_batch(tmp_path, capsys):
    from bench.flow_profile import profile_batch

    argv = ["--count-ops", "--device", "meta", "--preset", "small", "--batch", "1"]
    assert profile_batch([*argv, "--frames", "120", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "step_ops.json").read_text())
    assert record["total"]["DiT"] == sum(record["ops"]["DiT"].values()) > 0
    assert record["ops"]["prefix step"]["index_select"] == 3  # one gather a layer
    assert "total" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_fused_weights(model):
    """On CUDA (fp32 without TF32): .cuda() keeps the views, and a DiT call, eager and
    replayed from a CUDA graph, equals the unfused reference."""
    from flow_service.model.graphs import GraphedEstimator

    m = copy.deepcopy(model).cuda()
    assert_shared(m)
    dit = m.decoder.estimator
    args = [a.cuda() for a in dit_inputs(m)]
    with torch.inference_mode():
        want = unfused_velocity(dit, *args)
        eager = dit(*args)
        graphed = GraphedEstimator(dit)(*args).clone()
    assert rel_err(eager, want) <= CALL_TOL[torch.float32]
    assert rel_err(graphed, want) <= CALL_TOL[torch.float32]
