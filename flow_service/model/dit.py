"""DiT velocity estimator `decoder.estimator` (docs/REFERENCE.md §4), batched over ragged masked rows.

Attribute names mirror the upstream state-dict keys (docs/REFERENCE.md §9), so flow.pt loads with
strict matching; the code itself is written for batched inference and few kernels a step:
channel-last tensors, one attention mask per call built outside the layer loop (a dense
additive bias), one GEMM for a layer's q, k and v, the rotary on q and k in one in-place pass,
one GEMM for every AdaLN's modulation (the weights concerned are views of one tensor each:
flow_service/model/shared_storage.py). `DiTKernels` picks fused/compiled kernels for the same
function.

Dimensions (the legend of docs/DESIGN.md "Shape letters"):
    b  batch rows: flow calls
    r  solver rows, 2b: [b conditional; b unconditional]
    t  mel frames, padded to the longest row
    c  channels; the 80 mel bins: x, cond, mu and the speaker vector all have c channels
    d  DiT width (1024)
    h  attention heads (16), e head width (64); rotary covers the first e channels of q/k =
       head 0 only
    f  FFN width (2048 = 2d)
    z  time-feature width (256)
The flow time is `tau` (shape (r,)), never `t`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flow_service.model import causal_conv
from flow_service.model.config import DiTConfig
from flow_service.model.shared_storage import SharesStorage, share_storage_

logger = logging.getLogger(__name__)

ROPE_BASE = 10000.0
TIME_SCALE = 1000.0  # tau in [0, 1] is stretched before the sinusoid (F5-TTS convention)
BIAS_ALIGN = 16  # SDPA's fused kernels want the bias rows 16-element aligned


def modulate(x: torch.Tensor, shift: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """x (1 + scale) + shift, with gain = 1 + scale already added (`DiT.modulations`)."""
    return torch.addcmul(shift, x, gain)


def attention_bias(
    seq_lens: torch.Tensor,
    streaming: torch.Tensor,
    num_frames: int,
    block_frames: int,
    dtype: torch.dtype,
    mask_padding: bool = True,
) -> torch.Tensor:
    """Additive attention bias (r, 1, t, t): 0 where query i may read key j, -inf elsewhere.

    seq_lens [r] valid frames per row; streaming [r] bool. A streaming row's query i sees keys
    j < (i // block + 1) * block, blocks aligned to frame 0 (docs/REFERENCE.md §4.5); a full row sees every
    valid key. Padded keys are hidden from every row (`mask_padding=False` exists only to show
    that the batch-invariance test catches a leak).
    """
    pos = torch.arange(num_frames, device=seq_lens.device)
    query_pos = pos.expand(seq_lens.shape[0], -1)
    return ragged_attention_bias(
        query_pos, seq_lens, streaming, num_frames, block_frames, dtype, mask_padding
    )


def ragged_attention_bias(
    query_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    streaming: torch.Tensor,
    num_keys: int,
    block_frames: int,
    dtype: torch.dtype,
    mask_padding: bool = True,
) -> torch.Tensor:
    """`attention_bias` for queries at any absolute positions: (r, 1, q, num_keys).

    query_pos [r, q] is the absolute frame of each query row (the prefix cache computes only
    the new frames of a row, against keys at absolute positions 0..num_keys-1)."""
    device = seq_lens.device
    num_rows, num_queries = query_pos.shape
    keys = torch.arange(num_keys, device=device)
    block_end = (query_pos // block_frames + 1) * block_frames  # (r, q)
    allowed = keys[None, None, :] < block_end[:, :, None]  # (r, q, num_keys)
    allowed = allowed | ~streaming[:, None, None]
    if mask_padding:
        # A row of length 0 would leave its queries no key (NaN); give it key 0, never read.
        lens = seq_lens.clamp(min=1)
        allowed = allowed & (keys[None, None, :] < lens[:, None, None])
    return bias_from_allowed(allowed, dtype)


def bias_from_allowed(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(r, q, k) bool -> the additive bias (r, 1, q, k): 0 where allowed, -inf elsewhere."""
    num_rows, num_queries, num_keys = allowed.shape
    width = -(-num_keys // BIAS_ALIGN) * BIAS_ALIGN
    bias = torch.full(
        (num_rows, 1, num_queries, width), float("-inf"), dtype=dtype, device=allowed.device
    )
    bias = bias[..., :num_keys]  # aligned row stride: SDPA uses it without a padded copy
    return bias.masked_fill_(allowed[:, None], 0.0)


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, gain: torch.Tensor, eps: float):
    """AdaLN: layer norm without affine, then modulate. (r, t, d) -> (r, t, d)."""
    return modulate(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, gain)


def residual_norm_modulate(x, gate, y, frame_mask, shift, gain, eps: float):
    """Between sublayers: x + gate * (y * frame_mask), then its AdaLN for the next sublayer.
    Returns (new residual stream, normed); the same ops, in the same order, as the plain
    layer (where the attention applies the frame mask to its own output)."""
    if frame_mask is not None:
        y = y * frame_mask
    x = torch.addcmul(x, gate, y)
    return x, norm_modulate(x, shift, gain, eps)


# Each function compiled here recompiles a few times at most (per dtype); dynamo's default limit of 8 per function could
# be reached by a process running both dtypes, after which new shapes would run uncompiled.
RECOMPILE_LIMIT = 32


class _Compiled:
    """`fn` through torch.compile (inductor), compiled lazily on first use; every call that
    compiled a graph is logged with its time.

    `ragged=True`: every dim of a tensor argument but its last (the width) is symbolic from
    the first compile (dim 0 always, the others where they are not a broadcast 1), so
    every ragged batch reuses the graph compiled at warm-up. Otherwise dynamo's automatic
    dynamic shapes: static first, one recompile with the dims that changed symbolic. Either way
    recompiles are bounded by dynamo's recompile limit, past which it runs `fn` eagerly (same
    numbers, unfused)."""

    def __init__(self, fn, ragged: bool = True):
        self.fn = fn
        self.ragged = ragged
        self._compiled = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        from torch._dynamo.utils import counters

        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    # torch <= 2.6 calls the limit cache_size_limit
                    config = torch._dynamo.config
                    new_name = "recompile_limit"
                    name = new_name if hasattr(config, new_name) else "cache_size_limit"
                    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
                    self._compiled = torch.compile(self.fn, dynamic=None)
        if self.ragged:  # on every call (a few attribute writes): dynamo may have been reset
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() >= 2:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
                    for dim in range(1, a.dim() - 1):
                        if a.shape[dim] != 1:
                            torch._dynamo.maybe_mark_dynamic(a, dim)
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = self._compiled(*args)
        if counters["stats"]["unique_graphs"] != graphs:
            shapes = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            logger.info(
                "compiled %s for %s in %.1f s",
                self.fn.__name__,
                shapes,
                time.perf_counter() - start,
            )
        return out


_fused_norm_modulate = _Compiled(norm_modulate)
_fused_residual_norm_modulate = _Compiled(residual_norm_modulate)


@dataclass(frozen=True)
class DiTKernels:
    """Which kernels the DiT runs; every choice computes the same function (within rounding).

    fused_norms: gate + residual (+ the frame mask) + layer norm + AdaLN modulate as one
        compiled function between sublayers (torch.compile on CUDA; the same function eagerly
        elsewhere unless `compile_cpu`, which exists for tests).
    fused_rotary: the rotary on q and k (`apply_rotary_`, five elementwise kernels eagerly, on
        a 64-channel slice: launch-bound) compiled into one; compiled where `fused_norms` is.
    triton_conv: each position conv stage (grouped conv, bias, Mish, mask, residual) as one
        Triton kernel on the (r, t, d) layout (flow_service/model/causal_conv.py) in 16-bit
        dtypes where Triton runs (CUDA; the CPU under TRITON_INTERPRET=1), in place of cuDNN's
        per-group launches.
    """

    fused_norms: bool = False
    fused_rotary: bool = False
    triton_conv: bool = False
    compile_cpu: bool = False

    def compiled(self, x: torch.Tensor) -> bool:
        return x.is_cuda or self.compile_cpu

    def conv_in_triton(self, x: torch.Tensor) -> bool:
        """Whether the position convs of x run as `triton_conv`'s kernels. 16-bit only: in fp32
        (TF32) the kernel measured 0.55-0.7x cuDNN's speed from 16 rows x 250 frames up on an
        H100, where bf16 measured 1.2-5x faster at every shape."""
        return self.triton_conv and x.dtype != torch.float32 and causal_conv.available(x.device)

    def rotate(self, x: torch.Tensor):
        """The rotary function for a layer whose input is x."""
        return _fused_apply_rotary_ if self.fused_rotary and self.compiled(x) else apply_rotary_


PLAIN_KERNELS = DiTKernels()
FUSED_KERNELS = DiTKernels(fused_norms=True, fused_rotary=True, triton_conv=True)  # on CUDA


class TimestepEmbedding(nn.Module):
    """tau (r,) -> (r, d): sinusoid of 1000 tau (z features, [sin | cos]) then a SiLU MLP."""

    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, tau: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        step = math.log(10000.0) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=tau.device, dtype=torch.float32) * -step)
        # fp32 whatever the weights: in bf16, 1000 tau would lose the small steps of the schedule
        angles = TIME_SCALE * tau.float()[:, None] * freqs[None, :]  # (r, z/2)
        feats = torch.cat((angles.sin(), angles.cos()), dim=-1)  # (r, z)
        return self.time_mlp(feats.to(self.time_mlp[0].weight.dtype))


MIN_FP32_CONV_FRAMES = 256


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs (k=31), each after a left zero-pad of k-1 and followed by Mish.

    Strictly causal, so right padding never reaches a valid frame."""

    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self._packed: tuple | None = None  # (weight versions, packed weights): not state

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep` (r, t, 1) is 0 on frames before position 0 (a prefix-cache window): zero
        there, both stages' inputs are what the left zero pad would give."""
        num_frames = hidden.shape[1]
        y = hidden.transpose(1, 2)  # (r, d, t)
        # cuDNN's heuristic picks, for this fp32 grouped conv at t <= ~210 frames (a first chunk),
        # an algorithm with a 17 GB workspace that runs 100x slower (98 vs 0.9 ms per call on an
        # H200, cuDNN 9). The conv is causal, so zero frames on the right leave every output
        # frame before them unchanged: run short inputs at MIN_FP32_CONV_FRAMES and cut back.
        floor = MIN_FP32_CONV_FRAMES if hidden.is_cuda and hidden.dtype == torch.float32 else 0
        extra = max(0, floor - num_frames)
        y = self.conv1(F.pad(y, (self.kernel - 1, extra)))
        if keep is not None:
            y = y * F.pad(keep.transpose(1, 2), (0, extra), value=1.0)
        y = self.conv2(F.pad(y, (self.kernel - 1, 0)))
        return y[..., :num_frames].transpose(1, 2)  # (r, t, d)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both stages' weights as `causal_conv.conv_mish` reads them, packed once per weight
        version (a load or a dtype change repacks). Packing inside a CUDA graph capture would
        record the copy without running it, so the eager warm-up before a capture packs."""
        convs = (self.conv1[0], self.conv2[0])
        key = tuple((c.weight.data_ptr(), c.weight._version, c.weight.dtype) for c in convs)
        if self._packed is None or self._packed[0] != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("position conv weights first packed inside a CUDA graph capture")
            weights = tuple(causal_conv.pack_weight(c.weight, c.groups) for c in convs)
            self._packed = (key, weights)
        return self._packed[1]

    def fused(self, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """hidden + forward(hidden, keep), two Triton kernels (`DiTKernels.triton_conv`)."""
        w1, w2 = self.packed()
        y = causal_conv.conv_mish(hidden, w1, self.conv1[0].bias, keep=keep)
        return causal_conv.conv_mish(y, w2, self.conv2[0].bias, residual=hidden.contiguous())


class InputEmbedding(nn.Module):
    """[x | cond | mu | spk] (4c) -> d, plus the causal conv position embedding."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(
            cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups
        )

    def forward(self, x, cond, mu, spks, keep=None, kernels=PLAIN_KERNELS) -> torch.Tensor:
        spks = spks[:, None, :].expand(-1, x.shape[1], -1)  # (r, t, c)
        hidden = self.proj(torch.cat((x, cond, mu, spks), dim=-1))  # (r, t, d)
        if keep is not None:  # (r, t, 1): 0 on frames before position 0 (the conv's zero pad)
            hidden = hidden * keep
        if kernels.conv_in_triton(hidden):
            return self.conv_pos_embed.fused(hidden, keep)
        if keep is not None:
            return hidden + self.conv_pos_embed(hidden, keep)
        # hidden first: the sum takes its first operand's memory layout, and the conv's output is
        # channel-first. With it first, the whole residual stream was channel-first: every
        # layer_norm copied its input and every AdaLN/residual kernel ran strided (bf16, b=64:
        # a third of the device time on an H200).
        return hidden + self.conv_pos_embed(hidden)


class RotaryEmbedding(nn.Module):
    """Interleaved rotary tables for positions 0..t-1 (x-transformers layout: frequency i fills
    channels 2i and 2i+1). `inv_freq` is a checkpoint key and always stays fp32."""

    def __init__(self, dim_head: int):
        super().__init__()
        self.register_buffer("inv_freq", self.frequencies(dim_head))

    @staticmethod
    def frequencies(dim_head: int) -> torch.Tensor:
        return 1.0 / (ROPE_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head))

    def reset_buffers(self) -> None:
        self.inv_freq = self.frequencies(2 * self.inv_freq.shape[0]).to(self.inv_freq.device)

    def _apply(self, fn, *args, **kwargs):
        # `.to(bfloat16)` would round the frequencies, and with them the phase at far positions.
        keep = (
            self.inv_freq.detach().clone().float() if self.inv_freq.device.type != "meta" else None
        )
        super()._apply(fn, *args, **kwargs)
        if keep is not None and self.inv_freq.dtype != torch.float32:
            self.inv_freq = keep.to(self.inv_freq.device)
        return self

    def tables(self, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables_at(torch.arange(num_frames, device=self.inv_freq.device))

    def tables_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin (..., e) for absolute positions `pos` (any shape, e.g. (r, q) per
        row): sin is negated on the first channel of each pair, so that `apply_rotary_` needs
        no negation of its own (x1 (-s) is (-x1) s to the bit)."""
        freqs = pos.float()[..., None] * self.inv_freq.float()  # (..., e/2)
        freqs = freqs.repeat_interleave(2, dim=-1)  # (..., e)
        sin = freqs.sin()
        sin[..., 0::2].neg_()
        return freqs.cos(), sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate channel pairs (2i, 2i+1) of the first e channels of each projection stacked in
    x (r, t, n, d) in place: q and k (n = 2) in one pass. cos, sin (t, e) or (r, t, e).

    Applied before the head split, as upstream: only head 0 gets a position signal. Upstream's
    x cos + rotate_half(x) sin, rotate_half(x) = (-x1, x0) per pair, with the sign in the table
    (`RotaryEmbedding.tables_at`): x cos + (x1, x0) sin_signed. As upstream, the products with
    the fp32 tables promote a bf16 x to fp32 (exactly, no cast kernel of its own); the sum is
    rounded back into x."""
    rot = x[..., : cos.shape[-1]]  # (r, t, n, e)
    swapped = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (r, t, n, e): (x1, x0) per pair
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., t, 1, e): the same for q and k
    rot.copy_(rot * cos + swapped * sin)


# Compiled on the (r, t, 2, h e) view of q and k, not on the whole projection: given the
# projection, inductor copies all of it (3 h e channels) to write the 64 rotated ones back,
# slower than eager at 64 rows (docs/DESIGN.md, "Fused rotary").
_fused_apply_rotary_ = _Compiled(apply_rotary_)


class Attention(SharesStorage):
    """Multi-head self-attention. q, k and v come from one GEMM: to_q, to_k and to_v keep their
    parameters (upstream's keys), which are the row blocks of `qkv_weight` / `qkv_bias`
    (3 h e, d) / (3 h e,) (`share_storage_`)."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # key `to_out.0` (1 was dropout)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.share_storage()

    def share_storage(self) -> None:
        linears = (self.to_q, self.to_k, self.to_v)
        self.qkv_weight = share_storage_([m.weight for m in linears], self.qkv_weight)
        self.qkv_bias = share_storage_([m.bias for m in linears], self.qkv_bias)

    def forward(
        self, hidden, rope, attn_bias, frame_mask, kv=None, rotate=apply_rotary_
    ) -> torch.Tensor:
        r, t, _ = hidden.shape
        inner = self.heads * self.dim_head
        qkv = F.linear(hidden, self.qkv_weight, self.qkv_bias)  # (r, t, 3 h e): [q | k | v]
        rotate(qkv.view(r, t, 3, inner)[:, :, :2], *rope)  # q and k, in place
        q, key, v = qkv.split(inner, dim=-1)  # (r, t, h*e) each, strided views
        if kv is not None:  # prefix cache: keys/values of the cached prefix, then these
            key, v = kv(key, v)  # (r, t_keys, h*e) each, at absolute positions 0..t_keys-1
        t_keys = key.shape[1]
        q = q.view(r, t, self.heads, self.dim_head).transpose(1, 2)  # (r, h, t, e)
        key = key.view(r, t_keys, self.heads, self.dim_head).transpose(1, 2)  # (r, h, t_keys, e)
        v = v.view(r, t_keys, self.heads, self.dim_head).transpose(1, 2)  # (r, h, t_keys, e)
        o = F.scaled_dot_product_attention(q, key, v, attn_mask=attn_bias)  # (r, h, t, e)
        o = o.transpose(1, 2).reshape(r, t, self.heads * self.dim_head)  # (r, t, h*e)
        o = self.to_out[0](o)
        # Upstream zeroes padded query frames; keeps padded garbage bounded, valid frames unchanged.
        return o if frame_mask is None else o * frame_mask


class AdaLayerNormZero(nn.Module):
    """Holds a block's modulation linear (key `attn_norm.linear`, d -> 6d): shift, scale,
    gate (attn) then shift, scale, gate (FFN), in that order. Its weights are rows of the
    DiT's `adaln_weight`: the DiT projects every block's modulation in one GEMM
    (`DiT.modulations`). The norm itself (no affine, eps 1e-6) is applied by the layer."""

    NUM_CHUNKS = 6

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, self.NUM_CHUNKS * dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        # keys ff.0.0 and ff.2: index 1 was dropout upstream
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ff(hidden)


class DiTLayer(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.dim * cfg.ff_mult)

    def forward(
        self, x, mod, rope, attn_bias, frame_mask, kv=None, kernels=PLAIN_KERNELS
    ) -> torch.Tensor:
        """x (r, t, d); mod (r, 1, 6d): this block's slice of `DiT.modulations` (gains, not
        scales: 1 + scale is added there)."""
        shift_a, gain_a, gate_a, shift_f, gain_f, gate_f = mod.chunk(6, dim=-1)  # (r, 1, d)
        rotate = kernels.rotate(x)
        if kernels.fused_norms:
            compiled = kernels.compiled(x)
            first = _fused_norm_modulate if compiled else norm_modulate
            between = _fused_residual_norm_modulate if compiled else residual_norm_modulate
            normed = first(x, shift_a, gain_a, self.eps)
            y = self.attn(normed, rope, attn_bias, None, kv, rotate)  # frame mask: in `between`
            x, normed = between(x, gate_a, y, frame_mask, shift_f, gain_f, self.eps)
            return torch.addcmul(x, gate_f, self.ff(normed))
        d = x.shape[-1]
        normed = modulate(F.layer_norm(x, (d,), eps=self.eps), shift_a, gain_a)
        x = torch.addcmul(x, gate_a, self.attn(normed, rope, attn_bias, frame_mask, kv, rotate))
        normed = modulate(F.layer_norm(x, (d,), eps=self.eps), shift_f, gain_f)
        return torch.addcmul(x, gate_f, self.ff(normed))


class FinalNorm(nn.Module):
    """AdaLayerNormZero_Final: chunks in the order scale, then shift (reverse of the blocks).
    Its linear (key `norm_out.linear`, d -> 2d) is the last rows of the DiT's `adaln_weight`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        """x (r, t, d); mod (r, 1, 2d), the final slice of `DiT.modulations` (its scale
        already 1 + scale). In mod's dtype (x is cast once)."""
        gain, shift = mod.chunk(2, dim=-1)  # (r, 1, d)
        return modulate(F.layer_norm(x.to(mod.dtype), (x.shape[-1],), eps=self.eps), shift, gain)


class DiT(SharesStorage):
    """Velocity v(x, tau | mu, cond, spk) for r rows; channel-last in and out.

    Every AdaLN (the blocks' and the final norm's) projects the same SiLU(time embedding), so
    one GEMM makes them all: `adaln_weight` ((6 depth + 2) d, d) and `adaln_bias` hold the
    blocks' `attn_norm.linear` rows in block order, then `norm_out.linear`'s, and those
    linears' parameters are views of them (`share_storage_`)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTLayer(cfg) for _ in range(cfg.depth))
        self.norm_out = FinalNorm(cfg.dim, cfg.norm_eps)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)
        self.kernels = PLAIN_KERNELS  # not state: set from flags (flow_service/config.py)
        self.adaln_weight: torch.Tensor | None = None
        self.adaln_bias: torch.Tensor | None = None
        self.share_storage()

    def share_storage(self) -> None:
        linears = [layer.attn_norm.linear for layer in self.transformer_blocks]
        linears.append(self.norm_out.linear)
        self.adaln_weight = share_storage_([m.weight for m in linears], self.adaln_weight)
        self.adaln_bias = share_storage_([m.bias for m in linears], self.adaln_bias)

    def modulations(
        self, temb_act: torch.Tensor, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """SiLU(time embedding) (r, d) -> (each block's (r, 1, 6d) in `dtype`, the residual
        stream's; the final norm's (r, 1, 2d) in the weights' dtype): one GEMM, views of it,
        every scale already made the gain 1 + scale (two kernels for all the norms, where
        each norm added its own; the same sums)."""
        depth, d = self.cfg.depth, self.cfg.dim
        mods = F.linear(temb_act.to(self.adaln_weight.dtype), self.adaln_weight, self.adaln_bias)
        width = depth * AdaLayerNormZero.NUM_CHUNKS * d
        blocks, final = mods[:, :width].to(dtype), mods[:, width:]  # (r, 6 depth d), (r, 2d)
        # chunks 1 and 4 of each block's six (shift, scale, gate; shift, scale, gate)
        blocks.view(-1, depth, 2, 3, d)[:, :, :, 1].add_(1.0)
        final[:, :d].add_(1.0)  # the final norm's chunks: scale, shift
        return list(blocks[:, None, :].chunk(depth, dim=-1)), final[:, None, :]

    def warm_up_kernels(self) -> None:
        """Compile the enabled kernels now (on CUDA, or on the CPU with `compile_cpu`) for the
        shapes they will meet, so that no batch waits for a compile: each fused function once per
        argument layout (their ragged dims are symbolic). Each compile is logged."""
        kernels, cfg = self.kernels, self.cfg
        weight = self.input_embed.proj.weight
        dtype, device, d = weight.dtype, weight.device, cfg.dim
        if kernels.conv_in_triton(weight):
            with torch.inference_mode():  # packs the weights and compiles the three variants
                x = torch.zeros(2, 100, d, dtype=dtype, device=device)
                self.input_embed.conv_pos_embed.fused(x)
                self.input_embed.conv_pos_embed.fused(x, torch.ones_like(x[..., :1]))
        if not kernels.compiled(weight):
            return
        with torch.inference_mode():
            if kernels.fused_norms:
                # as the layers call them: chunks of each block's slice of the modulations, in
                # its order (dynamo specialises a storage offset of 0, block 0's shift), distinct
                # x and y
                mods = self.modulations(torch.zeros(2, d, dtype=dtype, device=device), dtype)[0]
                x = torch.zeros(2, 100, d, dtype=dtype, device=device)
                y = torch.zeros(2, 100, d, dtype=dtype, device=device)
                mask = torch.ones(2, 100, 1, dtype=dtype, device=device)
                for mod in mods:
                    shift_a, gain_a, gate_a, shift_f, gain_f, _ = mod.chunk(6, dim=-1)
                    _fused_norm_modulate(x, shift_a, gain_a, cfg.norm_eps)
                    _fused_residual_norm_modulate(x, gate_a, y, mask, shift_f, gain_f, cfg.norm_eps)
            if kernels.fused_rotary:
                # the two table layouts: positions 0..t-1 (t, e), and per-row positions (r, q, e)
                # of a prefix-cache window
                inner = cfg.heads * cfg.dim_head
                qkv = torch.zeros(2, 100, 3, inner, dtype=dtype, device=device)
                pos = torch.zeros(2, 100, device=device)
                for tables in (self.rotary_embed.tables(100), self.rotary_embed.tables_at(pos)):
                    _fused_apply_rotary_(qkv[:, :, :2], *tables)

    def attention_mask(
        self,
        seq_lens: torch.Tensor,
        streaming: torch.Tensor,
        num_keys: int,
        dtype: torch.dtype,
        query_pos: torch.Tensor | None = None,
        mask_padding: bool = True,
    ):
        """The attention mask of one solve, built once outside the layer loop: the additive bias
        (r, 1, q, num_keys). `query_pos` (r, q) gives each row's absolute
        query frames, consecutive from its first (the prefix cache); None: 0..num_keys-1."""
        block = self.cfg.block_frames
        if query_pos is None:
            return attention_bias(seq_lens, streaming, num_keys, block, dtype, mask_padding)
        return ragged_attention_bias(
            query_pos, seq_lens, streaming, num_keys, block, dtype, mask_padding
        )

    def forward(
        self,
        x: torch.Tensor,  # (r, t, c) noisy mel, compute dtype
        mu: torch.Tensor,  # (r, t, c) token features; zero in unconditional rows
        cond: torch.Tensor,  # (r, t, c) prompt mel in the prompt frames, else zero
        spks: torch.Tensor,  # (r, c) projected speaker vector; zero in unconditional rows
        tau: torch.Tensor,  # (r,) fp32 flow time per row
        attn_bias,  # from `attention_mask`: (r, 1, t, t) additive bias
        frame_mask: torch.Tensor | None = None,  # (r, t, 1) 1 valid / 0 padded, compute dtype
        prefix=None,  # a prefix_cache.DiTPrefix: queries only for the frames after the context
    ) -> torch.Tensor:
        temb_act = F.silu(self.time_embed(tau))  # (r, d); every AdaLN applies SiLU first
        if prefix is None:
            hidden = self.input_embed(x, cond, mu, spks, kernels=self.kernels)  # (r, t, d)
            rope = self.rotary_embed.tables(x.shape[1])
        else:
            # x, mu, cond hold `prefix.context` frames before the queries: the conv position
            # embedding's left receptive field. Only the queries go through the blocks.
            hidden = self.input_embed(x, cond, mu, spks, prefix.keep, self.kernels)[
                :, prefix.context :
            ].contiguous()
            rope = prefix.rope
        mods, final_mod = self.modulations(temb_act, hidden.dtype)
        for i, (layer, mod) in enumerate(zip(self.transformer_blocks, mods, strict=True)):
            kv = None if prefix is None else prefix.layer(i)
            hidden = layer(hidden, mod, rope, attn_bias, frame_mask, kv, self.kernels)
        out = self.norm_out(hidden, final_mod)  # (r, q, d)
        return self.proj_out(out.to(self.proj_out.weight.dtype))  # (r, q, c)
