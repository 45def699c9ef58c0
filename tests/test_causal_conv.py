"""The position convs' Triton kernel (flow_service/model/causal_conv.py) against ATen's conv1d +
Mish, stage by stage and through the module. On the CPU the kernel runs under Triton's
interpreter (TRITON_INTERPRET=1 with Triton installed; otherwise these skip, as on CI); the
`gpu` tests run it on the card, and tests/test_kernels.py runs it through whole solves (its
FUSED kernels include it) eagerly, in CUDA graphs and over the prefix cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import rel_err

from flow_service.model import causal_conv
from flow_service.model.dit import CausalConvPositionEmbedding

REL = 2e-6  # fp32: the kernel sums the 31 taps x c_in products in another order than ATen

interpreted = pytest.mark.skipif(
    not causal_conv.available(torch.device("cpu")),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1, Triton installed)",
)


def reference(x, weight, bias, groups, keep=None, residual=None):
    """mish(conv1d(left zero pad k - 1 of x)) [x keep] [+ residual], in x's (r, t, d) layout."""
    taps = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (taps - 1, 0)), weight, bias, groups=groups)
    y = F.mish(y).transpose(1, 2)
    if keep is not None:
        y = y * keep
    return y if residual is None else y + residual


def stage_case(rows, frames, width, groups, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(width, width // groups, 31, generator=g) * 0.05
    bias = torch.randn(width, generator=g) * 0.5
    # a view whose frame stride is not the width: the kernel takes the strides it is given
    x = torch.randn(rows, frames + 5, width, generator=g)[:, 2 : 2 + frames] * 2.0
    keep = (torch.rand(rows, frames, 1, generator=g) > 0.3).float()
    residual = torch.randn(rows, frames, width, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, weight, bias, keep, residual)]


@interpreted
@pytest.mark.parametrize(
    "rows,frames,width,groups,with_keep,with_residual",
    [
        (2, 70, 128, 16, False, False),  # the small preset: 8 channels a group, padded to 16
        (1, 3, 128, 16, True, True),  # fewer frames than taps: the pad alone on the left
        (3, 65, 256, 4, True, False),  # 64 channels a group (the full model's), 2 frame tiles
        (1, 64, 256, 4, False, True),  # exactly one tile
    ],
)
def test_stage_matches_conv_and_mish(rows, frames, width, groups, with_keep, with_residual):
    x, weight, bias, keep, residual = stage_case(rows, frames, width, groups)
    keep = keep if with_keep else None
    residual = residual if with_residual else None
    packed = causal_conv.pack_weight(weight, groups)
    got = causal_conv.conv_mish(x, packed, bias, keep=keep, residual=residual)
    assert got.shape == (rows, frames, width) and got.is_contiguous()
    assert rel_err(got, reference(x, weight, bias, groups, keep, residual)) <= REL


@interpreted
def test_mish_matches_aten_over_its_whole_range():
    """The kernel's Mish (x n / (n + 2), n = e^x (e^x + 2); x above 20) on pre-activations
    from -60 to 60: one tap, one channel, weight 1, so the conv passes x through."""
    x = torch.linspace(-60, 60, 4001).reshape(1, -1, 1).repeat(1, 1, 16)
    weight = torch.zeros(16, 1, 31)
    weight[:, 0, -1] = 1.0  # the last tap reads the frame itself
    got = causal_conv.conv_mish(x, causal_conv.pack_weight(weight, 16), torch.zeros(16))
    want = F.mish(x)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


@interpreted
def test_module_fused_equals_the_residual_plus_forward():
    """`fused` (both stages, keep on the first, the residual folded into the second) against
    hidden + forward, with and without a prefix window's keep mask."""
    torch.manual_seed(0)
    conv = CausalConvPositionEmbedding(128, 31, 16)
    hidden = torch.randn(2, 40, 128)
    keep = torch.ones(2, 40, 1)
    keep[0, :12] = 0.0  # row 0's first 12 frames lie before its position 0
    hidden_kept = hidden * keep
    with torch.no_grad():
        assert rel_err(conv.fused(hidden), hidden + conv(hidden)) <= REL
        want = hidden_kept + conv(hidden_kept, keep)
        assert rel_err(conv.fused(hidden_kept, keep), want) <= REL


@interpreted
def test_packed_weights_follow_a_weight_update():
    """Packing happens once per weight version: an in-place load repacks, a repeat call does
    not."""
    conv = CausalConvPositionEmbedding(128, 31, 16)
    first = conv.packed()
    assert conv.packed()[0] is first[0]
    with torch.no_grad():
        conv.conv1[0].weight.mul_(2.0)
    again = conv.packed()
    assert again[0] is not first[0]
    assert torch.equal(again[0], causal_conv.pack_weight(conv.conv1[0].weight, 16))


def test_bad_layout_is_refused_in_one_line():
    """Checked before any Triton call, so this runs without Triton too."""
    x = torch.zeros(1, 10, 128).transpose(1, 2)  # (r, d, t) given where (r, t, d) is wanted
    with pytest.raises(ValueError, match=r"want \(r, t, 128\)"):
        causal_conv.conv_mish(x, torch.zeros(16, 31, 8, 8), torch.zeros(128))


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("frames", [1, 110, 650])
def test_gpu_stage_matches_cudnn(frames):
    """The full model's conv (d 1024, 16 groups of 64) on the card: fp32 (TF32 off) within
    rounding of cuDNN; bf16 no farther from fp32 than cuDNN's bf16 conv is."""
    x, weight, bias, keep, residual = stage_case(4, frames, 1024, 16, device="cuda")
    packed = causal_conv.pack_weight(weight, 16)
    ref = reference(x, weight, bias, 16, keep, residual)
    # 1e-5: at full width a frame sums 31 x 64 products, in another order than cuDNN's
    assert rel_err(causal_conv.conv_mish(x, packed, bias, keep, residual), ref) <= 1e-5
    lo = [t.bfloat16() for t in (x, weight, bias, keep, residual)]
    got = causal_conv.conv_mish(lo[0], causal_conv.pack_weight(lo[1], 16), *lo[2:])
    plain = reference(lo[0], lo[1], lo[2], 16, lo[3], lo[4])
    err, plain_err = got.float() - ref, plain.float() - ref
    assert float(err.pow(2).mean().sqrt()) <= 1.1 * float(plain_err.pow(2).mean().sqrt())
    assert float(err.abs().max()) <= 1.5 * float(plain_err.abs().max())
