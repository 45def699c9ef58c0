"""The DiT's position convs (a grouped causal conv1d, bias, Mish) as one Triton kernel a stage,
on the residual stream's own layout (r, t, d).

cuDNN ran each 16-group conv as 16 launches plus two layout transposes (an H100 trace of a
B=2 block call: 32 conv launches a solver step, 35 % of its GPU time;
docs/bench/triton-conv-h100-2026-12-08/). Here one program computes BLOCK_T frames x one
group's output channels: 31 shifted (frames x c_in) @ (c_in x c_out) products accumulated in
fp32, then the bias, Mish, the optional per-frame keep mask (a prefix-cache window's frames
before position 0) and the optional residual, stored once.

Shapes: r rows, t frames, d = g x c channels (g groups of c), k taps. The conv is causal: frame
i reads input frames i - k + 1 .. i, zero before 0 (the left pad).

Triton only, so CUDA only: the module keeps cuDNN where Triton is not there (the CPU, CI), and
the tests compare the two (the kernel also runs on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: the kernel's decoration did

try:  # not a dependency: the CPU install has no Triton, and the CPU path does not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_T = 64  # frames a program


def available(device: torch.device) -> bool:
    """Whether `conv_mish` runs on `device`: Triton is installed and the device is CUDA (or
    Triton's interpreter is on, for tests)."""
    return triton is not None and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


def pack_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """nn.Conv1d's (d, c, k) weight -> (g, k, c_in, c_out) contiguous: each tap's tile is one
    dense (c_in x c_out) read."""
    d, c, k = weight.shape
    return weight.view(groups, d // groups, c, k).permute(0, 3, 2, 1).contiguous()


if triton is not None:

    @triton.jit(do_not_specialize=["num_frames", "stride_xr", "stride_xt", "stride_kr"])
    def _conv_mish_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        keep_ptr,
        res_ptr,
        out_ptr,
        num_frames,
        stride_xr,
        stride_xt,
        stride_kr,
        CHANNELS: tl.constexpr,  # per group, in and out
        BLOCK_C: tl.constexpr,  # CHANNELS rounded up to a power of two >= 16 (tl.dot's floor)
        TAPS: tl.constexpr,
        WIDTH: tl.constexpr,  # d: the row stride of out and res (both contiguous)
        HAS_KEEP: tl.constexpr,
        HAS_RES: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        frames = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        group, row = tl.program_id(1), tl.program_id(2)
        chans = tl.arange(0, BLOCK_C)
        real_c = chans < CHANNELS
        x_row = x_ptr + row * stride_xr + group * CHANNELS + chans[None, :]
        w_group = w_ptr + group * TAPS * CHANNELS * CHANNELS
        w_tile = chans[:, None] * CHANNELS + chans[None, :]
        w_mask = real_c[:, None] & real_c[None, :]
        acc = tl.zeros((BLOCK, BLOCK_C), dtype=tl.float32)
        for tap in range(TAPS):
            src = frames + tap - (TAPS - 1)
            x_mask = ((src >= 0) & (src < num_frames))[:, None] & real_c[None, :]
            xs = tl.load(x_row + src[:, None] * stride_xt, mask=x_mask, other=0.0)
            ws = tl.load(w_group + tap * CHANNELS * CHANNELS + w_tile, mask=w_mask, other=0.0)
            acc += tl.dot(xs, ws, input_precision=PRECISION)
        acc += tl.load(b_ptr + group * CHANNELS + chans, mask=real_c, other=0.0).to(tl.float32)
        # Mish: x tanh(softplus(x)) = x n / (n + 2) with n = e^x (e^x + 2); above 20 torch's
        # softplus returns x, and tanh of it is 1 in fp32
        e = tl.exp(tl.minimum(acc, 20.0))
        n = e * (e + 2.0)
        y = tl.where(acc > 20.0, acc, acc * n / (n + 2.0))
        real_t = frames < num_frames
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row * stride_kr + frames, mask=real_t, other=0.0)
            y = y * keep.to(tl.float32)[:, None]
        at = row * num_frames * WIDTH + frames[:, None] * WIDTH + group * CHANNELS + chans[None, :]
        mask = real_t[:, None] & real_c[None, :]
        if HAS_RES:
            y += tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


def conv_mish(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor,
    keep: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """mish(causal grouped conv(x) + bias) [x keep] [+ residual]: x (r, t, d) with unit channel
    stride, `packed` from `pack_weight`, keep (r, t, 1), residual (r, t, d) contiguous ->
    (r, t, d) contiguous in x's dtype. fp32 follows torch.backends.cudnn.allow_tf32, as the
    cuDNN conv it replaces does."""
    rows, frames, width = x.shape
    groups, taps, channels, _ = packed.shape
    if x.stride(2) != 1 or width != groups * channels:
        raise ValueError(
            f"x {tuple(x.shape)} stride {x.stride()}: want (r, t, {groups * channels})"
        )
    out = torch.empty(rows, frames, width, dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != out.shape or not residual.is_contiguous()):
        raise ValueError(f"residual {tuple(residual.shape)}: want contiguous {tuple(out.shape)}")
    if keep is not None:
        keep = keep.reshape(rows, frames)
        if keep.stride(1) != 1:
            keep = keep.contiguous()
    exact = x.dtype == torch.float32 and not torch.backends.cudnn.allow_tf32
    precision = "ieee" if exact else "tf32"  # 16-bit inputs ignore it
    grid = (triton.cdiv(frames, BLOCK_T), groups, rows)
    _conv_mish_kernel[grid](
        x,
        packed,
        bias,
        keep if keep is not None else x,
        residual if residual is not None else x,
        out,
        frames,
        x.stride(0),
        x.stride(1),
        keep.stride(0) if keep is not None else 0,
        CHANNELS=channels,
        BLOCK_C=max(16, triton.next_power_of_2(channels)),
        TAPS=taps,
        WIDTH=width,
        HAS_KEEP=keep is not None,
        HAS_RES=residual is not None,
        PRECISION=precision,
        BLOCK=BLOCK_T,
    )
    return out
