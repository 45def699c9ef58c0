"""Causal HiFT generator (docs/REFERENCE.md §5) with bounded incremental sessions batched across streams.

`decode(mel, finalize)` has upstream's full-history semantics (`CausalHiFTGenerator.inference`).
`decode_batch(states, mels, finalize)` advances several sessions by one chunk each in one batched pass:

  1. f0 for the new frames only (float64, 8 frames of mel context, frozen once computed), and
     the per-frame phase, carried across chunks in float64 (layers.SourceModule, both modes);
  2. the decoder re-runs on a bounded window that starts `context_frames()` frames before the
     first new output frame; outputs whose receptive field reaches the window's artificial left
     edge are discarded, so the emitted samples equal the full-history decode;
  3. rows are left-aligned (every window starts at position 0, so a window starting at frame 0
     gets upstream's true left edge) and right-padded; everything in the decoder is causal
     except conv_pre's right context (given as data), the source STFT and the iSTFT (both
     handled per row in spectral.py), so padding never reaches a row's valid outputs.

`decode()` is one such batch of one on a fresh session, so both paths share every line of model math.

Dimensions (docs/DESIGN.md "Shape letters"):
    b  rows (sessions in the batch)
    c  mel bins (80), or channels
    t  mel frames in a row's decoder window (t + 4 with conv_pre's right context)
    u  source-STFT frames = last-stage positions (120 t + 1)
    t_f0  frames with f0 / phase values in a row's window
    l  samples (480 per frame)
    m  sine components (9)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from token2wav import MAX_FRAMES, SAMPLES_PER_FRAME
from token2wav.invalid import InvalidInput
from vocoder_service.model.config import F0_LOOK_RIGHT, HOLDBACK_FRAMES, HiFTConfig
from vocoder_service.model.graphs import GraphedCore, ShapeBuckets
from vocoder_service.model.layers import (
    CausalF0Predictor,
    CausalUpsample,
    ResBlock,
    Snake,
    SourceDown,
    SourceModule,
    causal_conv,
    run_causal,
)
from vocoder_service.model.noise import sine_noise_on
from vocoder_service.model.session import (
    DecodeWindow,
    HiFTSessionState,
    decode_window,
    model_fingerprint,
)
from vocoder_service.model.spectral import dft_bases, hann_window, istft_head, source_stft

CONV_POST_KERNEL = 7


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        n_stages = len(cfg.upsample_rates)
        spec_ch = cfg.istft_n_fft + 2  # [real | imag] of n_fft/2 + 1 bins
        self.m_source = SourceModule(cfg)
        self.conv_pre = weight_norm(
            nn.Conv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1)
        )
        self.ups = nn.ModuleList(
            weight_norm(
                CausalUpsample(
                    cfg.stage_channels(i - 1) if i else cfg.base_channels,
                    cfg.stage_channels(i),
                    k,
                    u,
                )
            )
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        self.source_downs = nn.ModuleList(
            SourceDown(spec_ch, cfg.stage_channels(i), r)
            for i, r in enumerate(cfg.source_down_rates())
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(cfg.stage_channels(i), k, d)
            for i, (k, d) in enumerate(
                zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilations)
            )
        )
        self.resblocks = nn.ModuleList(
            ResBlock(cfg.stage_channels(i), k, d)
            for i in range(n_stages)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilations)
        )
        self.conv_post = weight_norm(
            causal_conv(cfg.stage_channels(n_stages - 1), spec_ch, CONV_POST_KERNEL)
        )
        self.f0_predictor = CausalF0Predictor(cfg).double()  # f0 precision sets seam phase
        self.register_buffer("stft_window", hann_window(cfg.istft_n_fft), persistent=False)
        forward, inverse = dft_bases(self.stft_window)
        self.register_buffer("stft_forward", forward, persistent=False)
        self.register_buffer("stft_inverse", inverse, persistent=False)
        self.buckets = ShapeBuckets()  # batch padding; none unless CUDA graphs are on
        self.graphed_core: GraphedCore | None = None

    # -- properties and dtype handling -----------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.conv_pre.bias.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the decoder (the f0 predictor always runs in float64)."""
        return self.conv_pre.bias.dtype

    @property
    def source_dtype(self) -> torch.dtype:
        """f0 and the excitation: float32 like upstream's mel dtype (float64 for fp64 checks)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def set_dtype(self, dtype: torch.dtype) -> HiFTGenerator:
        """Cast the decoder to `dtype`; the f0 predictor stays float64 and the STFT float32."""
        for name, child in self.named_children():
            child.to(torch.float64 if name == "f0_predictor" else dtype)
        return self

    def fold_weight_norm(self) -> HiFTGenerator:
        """Replace every weight-norm parametrisation by its current weight g v / ||v|| (same
        values, computed once instead of on every call). The state_dict then has plain
        `.weight` keys; load checkpoints before folding."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self

    def set_cuda_graphs(self, buckets: ShapeBuckets | None, max_graphs: int | None = None) -> None:
        """Replay CUDA graphs for batches padded to `buckets` (graphs.py); None: back to the
        eager path with no padding. Load and cast the model first; needs a CUDA device.
        `max_graphs` (LRU) defaults to every shape the buckets produce (`warmup_graphs`)."""
        if buckets is None:
            self.buckets, self.graphed_core = ShapeBuckets(), None
            return
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.buckets = buckets
        self.graphed_core = GraphedCore(
            self.synthesize_core,
            self.device,
            buckets,
            self.cfg.conv_pre_look_right,
            max_graphs or max(1, buckets.num_graph_shapes),
        )

    def fuse_snake(self, on: bool) -> None:
        """Snake activations in 4 kernels instead of 7 (layers.Snake.fused; same values up to
        rounding). Part of `--cuda-graphs`; switch it on before graphs are captured (they read the
        cached 1/alpha tensors, which stay the same objects until the weights change)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Snake):
                    module.fused = on
                    if on:  # now, outside any graph capture; kept (same tensor) while the
                        module.inverse_alpha(module.alpha[None, :, None])  # weights stay

    def warmup_graphs(self) -> int:
        """Capture a graph for every shape the buckets produce (`ShapeBuckets.num_graph_shapes`:
        each row bucket x frame bucket, with the source as long as the window (final chunks)
        or one frame longer (the others)), so serving never captures: a capture stalls the
        vocoder 0.1-0.2 s on an H200, and when only the 50/100/200-frame chunks were warmed
        the final chunks' shapes (a 10 s utterance ends with 150 frames: a 195-frame window)
        were captured in the middle of a benchmark. Inputs: `_core_inputs`, what a batch's
        rows are written into (a graph keeps only their shapes and its own buffers). Returns
        the number of graphs held. Does nothing without CUDA graphs."""
        core = self.graphed_core
        if core is None:
            return 0
        for rows in self.buckets.row_sizes:
            for t in self.buckets.frame_sizes:
                for t_f0 in (t, t + 1):
                    core(*self._core_inputs(rows, t, t_f0))
        return len(core)

    # -- public API -----------------------------------------------------------------------------

    def warmup(self) -> None:
        """Draw and place the noise buffers and run every kernel once (before serving)."""
        mel = torch.zeros(self.cfg.in_channels, 2 * HOLDBACK_FRAMES) - 5
        self.decode_one(self.new_session(), mel, finalize=True)

    def new_session(self) -> HiFTSessionState:
        return HiFTSessionState(
            model_fingerprint(self.cfg), self.cfg.in_channels, self.cfg.num_harmonics
        )

    @torch.no_grad()
    def decode(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Full-history decode, upstream `inference(mel, finalize)`: mel (80, T) or (1, 80, T)
        -> (L,) float32 on CPU (float64 for a float64 model), L = 480 T with finalize, else
        480 max(T - 8, 0)."""
        if isinstance(mel, torch.Tensor) and mel.dim() == 3 and mel.shape[0] == 1:
            mel = mel[0]
        if isinstance(mel, torch.Tensor) and mel.dim() == 2 and mel.shape[-1] == 0:
            raise InvalidInput("mel", "zero frames; decode needs at least 1")
        return self.decode_one(self.new_session(), mel, finalize)

    def decode_one(
        self, state: HiFTSessionState, mel: torch.Tensor, finalize: bool
    ) -> torch.Tensor:
        """One session, one chunk; errors name `mel`, `finalize` or `session` without index."""
        self.check_mel_chunk(state, mel, finalize)
        return self.decode_batch([state], [mel], [finalize])[0]

    def check_mel_chunk(self, state: HiFTSessionState, mel: torch.Tensor, finalize: bool) -> None:
        """Raise InvalidInput (field `mel`, `finalize` or `session`) if this chunk is not valid
        for this session; the state is not touched. A runner can call this per row before
        batching, so one bad request never fails the others."""
        if not isinstance(state, HiFTSessionState):
            raise InvalidInput(
                "session", f"expected a HiFTSessionState, got {type(state).__name__}"
            )
        if state.fingerprint != model_fingerprint(self.cfg):
            raise InvalidInput("session", f"state from another model ({state.fingerprint})")
        if state.finalized:
            raise InvalidInput("session", "already finalized; no chunk may follow finalize")
        if not isinstance(finalize, bool):
            raise InvalidInput("finalize", f"expected a bool, got {type(finalize).__name__}")
        if not isinstance(mel, torch.Tensor):
            raise InvalidInput("mel", f"expected a torch.Tensor, got {type(mel).__name__}")
        if mel.dim() != 2 or mel.shape[0] != self.cfg.in_channels:
            raise InvalidInput(
                "mel", f"shape {tuple(mel.shape)}, expected ({self.cfg.in_channels}, frames)"
            )
        if not mel.dtype.is_floating_point:
            raise InvalidInput("mel", f"dtype {mel.dtype}, expected a floating type")
        n = mel.shape[1]
        if n == 0 and not finalize:
            raise InvalidInput("mel", "zero frames; only a finalize chunk may be empty")
        total = state.num_frames + n
        if total > MAX_FRAMES:
            raise InvalidInput(
                "mel",
                f"session would reach {total} frames ({total / 50:.2f} s), past the "
                f"{MAX_FRAMES}-frame (300 s) noise buffers",
            )
        bad = ~torch.isfinite(mel).all(dim=0)
        if bool(bad.any()):
            raise InvalidInput("mel", f"NaN or Inf at frame {int(bad.nonzero()[0, 0])}")
        plan = decode_window(state, n, finalize, self.cfg)  # an imported state must cover it
        if state.mel_start > min(plan.window, plan.f0_mel[0]) or state.f0_start > plan.window:
            raise InvalidInput("session", "state holds too little history for this model")

    @torch.no_grad()
    def decode_batch(
        self,
        states: list[HiFTSessionState],
        mels: list[torch.Tensor],
        finalize: list[bool],
    ) -> list[torch.Tensor]:
        """Advance each session by one chunk in one batched computation.

        mels[i] (80, n_i), n_i >= 1 (0 allowed with finalize); returns exactly the new samples of
        each session, (480 k_i,) float32 on CPU (float64 for a float64 model), and updates the
        states in place. Chunks may be ragged; a chunk without finalize returns nothing until
        more than 8 frames are in. Every row is validated before anything runs: a bad row raises
        InvalidInput with field `mels[i]`, `finalize[i]` or `states[i]` and `row = i`, and no
        state changes. Output rows equal batches of one up to kernel rounding (~1e-7 in fp32:
        oneDNN/cuDNN pick kernels by shape), never another row's data.
        """
        if not (len(states) == len(mels) == len(finalize)):
            raise InvalidInput(
                "mels", f"{len(states)} states, {len(mels)} mels, {len(finalize)} finalize flags"
            )
        seen: dict[int, int] = {}  # id(state) -> row
        for i, (st, mel, fin) in enumerate(zip(states, mels, finalize)):
            if id(st) in seen:
                raise InvalidInput(f"states[{i}]", f"same session as row {seen[id(st)]}", i)
            seen[id(st)] = i
            try:
                self.check_mel_chunk(st, mel, fin)
            except InvalidInput as exc:
                name = {"mel": "mels", "finalize": "finalize"}.get(exc.field, "states")
                raise InvalidInput(f"{name}[{i}]", exc.problem, i) from None
        plans = [
            decode_window(st, m.shape[1], fin, self.cfg)
            for st, m, fin in zip(states, mels, finalize)
        ]
        mel_rows = [  # (c, frames [mel_start, total))
            torch.cat([st.mel, m.detach().to("cpu", torch.float32)], dim=1)
            for st, m in zip(states, mels)
        ]
        f0_rows, phase_rows, carry_rows = self._advance_f0(states, plans, mel_rows)
        audio = self._synthesize(states, plans, mel_rows, f0_rows, phase_rows)
        for st, plan, mel_row, f0, phase, carry, out in zip(
            states, plans, mel_rows, f0_rows, phase_rows, carry_rows, audio
        ):
            _commit(st, plan, mel_row, f0, phase, carry, out.shape[0])
        return audio

    # -- f0 and phase ---------------------------------------------------------------------------

    def _advance_f0(self, states, plans: list[DecodeWindow], mel_rows):
        """f0 and phase state of frames [state.f0_start, F') (old frames kept bit for bit), and
        the phase carry after frame F' - 1."""
        todo = [i for i, p in enumerate(plans) if p.f0_new[1] > p.f0_new[0]]
        f0_rows = [st.f0 for st in states]
        phase_rows = [st.phase for st in states]
        carry_rows = [st.phase_carry for st in states]
        if not todo:
            return f0_rows, phase_rows, carry_rows
        width = max(plans[i].f0_new[1] + F0_LOOK_RIGHT - plans[i].f0_mel[0] for i in todo)
        batch = torch.zeros(len(todo), self.cfg.in_channels, width, dtype=torch.float64)
        for r, i in enumerate(todo):  # left-aligned, zero right context past the last frame
            lo, hi = plans[i].f0_mel
            start = states[i].mel_start
            batch[r, :, : hi - lo] = mel_rows[i][:, lo - start : hi - start]
        f0_dtype = self.f0_predictor.classifier.weight.dtype  # float64 unless cast by hand
        f0_all = self.f0_predictor(batch.to(self.device, f0_dtype))  # (b, width - 3)
        f0_all = f0_all.to(self.source_dtype).cpu()  # upstream casts f0 to the mel dtype
        for r, i in enumerate(todo):
            (f_from, f_to), lo = plans[i].f0_new, plans[i].f0_mel[0]
            f0_new = f0_all[r, f_from - lo : f_to - lo]  # [t_f0]
            phase_new, carry_rows[i] = self.m_source.advance_phase(f0_new, states[i].phase_carry)
            f0_rows[i] = torch.cat([states[i].f0, f0_new.double()])
            phase_rows[i] = torch.cat([states[i].phase, phase_new])
        return f0_rows, phase_rows, carry_rows

    # -- decoder --------------------------------------------------------------------------------

    def _synthesize(self, states, plans: list[DecodeWindow], mel_rows, f0_rows, phase_rows):
        cfg = self.cfg
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        audio = [torch.zeros(p.num_out_samples, dtype=out_dtype) for p in plans]
        rows = [i for i, p in enumerate(plans) if p.num_out_samples > 0]
        if not rows:
            return audio
        lens = [plans[i].dec_end - plans[i].window for i in rows]  # conv_pre outputs per row
        src_lens = [plans[i].src_end - plans[i].window for i in rows]
        # Padded batch shape: rows and frames may be rounded up (`self.buckets`, for graph
        # reuse); padding rows and frames are like a longer row, never read by valid outputs.
        b, t = self.buckets.rows(len(rows)), self.buckets.frames(max(lens))
        t_f0 = t + max(src_lens) - max(lens)  # a row's source reaches 0 or 1 frame past its t
        fps, look = cfg.stft_frames_per_frame, cfg.conv_pre_look_right
        args = self._core_inputs(b, t, t_f0)
        mel_in, f0, phase, noise_at, n_frames, src_samples = args
        for r, i in enumerate(rows):
            p, st = plans[i], states[i]
            hi = min(p.dec_end + look, p.total)  # past the last frame: zeros (finalize)
            mel_in[r, :, : hi - p.window] = mel_rows[i][
                :, p.window - st.mel_start : hi - st.mel_start
            ]
            a = p.window - st.f0_start
            f0[r, : src_lens[r]] = f0_rows[i][a : a + src_lens[r]]
            phase[r, : src_lens[r]] = phase_rows[i][a : a + src_lens[r]]
            noise_at[r] = p.window * SAMPLES_PER_FRAME
            n_frames[r] = fps * lens[r] + 1
            src_samples[r] = SAMPLES_PER_FRAME * src_lens[r]
        core = self.graphed_core if self.graphed_core is not None else self.synthesize_core
        wav = core(*args)  # (b, 480 t), device
        wav = wav[: len(rows)].to("cpu", out_dtype)
        for r, i in enumerate(rows):
            p = plans[i]
            a = (p.out[0] - p.window) * SAMPLES_PER_FRAME
            audio[i] = wav[r, a : a + p.num_out_samples].clone()
        return audio

    def _core_inputs(self, b: int, t: int, t_f0: int) -> tuple[torch.Tensor, ...]:
        """`synthesize_core`'s arguments for b rows of t frames (source t_f0), host side, as
        for rows that fill all of it: zero mel, f0 and phase; the caller writes its rows."""
        cfg = self.cfg
        return (
            torch.zeros(b, cfg.in_channels, t + cfg.conv_pre_look_right),  # mel_in
            torch.zeros(b, t_f0, dtype=torch.float64),  # f0
            torch.zeros(b, t_f0, cfg.num_harmonics, dtype=torch.float64),  # phase
            torch.zeros(b, dtype=torch.long),  # noise_at: first source sample of each row
            torch.full((b,), cfg.stft_frames_per_frame * t + 1, dtype=torch.long),  # n_frames
            torch.full((b,), SAMPLES_PER_FRAME * t_f0, dtype=torch.long),  # src_samples
        )

    def synthesize_core(self, mel_in, f0, phase, noise_at, n_frames, src_samples):
        """The device part of a batch, from padded host or device inputs to clamped audio:
        mel_in (b, c, t + 4), f0 (b, t_f0) float64, phase (b, t_f0, m) float64, and per row
        noise_at (first source sample), n_frames (iSTFT frames), src_samples (valid source
        samples), all (b,) long -> (b, 480 t) on the device, in the decoder's dtype (float32
        for bfloat16). Nothing here synchronises with the host (CUDA-graph capturable)."""
        cfg = self.cfg
        dev = self.device
        mel_in, f0, phase = mel_in.to(dev), f0.to(dev), phase.to(dev)
        noise_at, n_frames, src_samples = noise_at.to(dev), n_frames.to(dev), src_samples.to(dev)
        t = mel_in.shape[-1] - cfg.conv_pre_look_right
        t_f0 = f0.shape[1]
        idx = noise_at[:, None] + torch.arange(t_f0 * SAMPLES_PER_FRAME, device=dev)  # (b, l)
        noise_buf = sine_noise_on(cfg.noise_seed, dev)
        noise = noise_buf[idx.clamp_max(noise_buf.shape[0] - 1)]  # (b, l, m)
        s = self.m_source.excitation(f0.to(self.source_dtype), phase, noise)
        num_stft = cfg.stft_frames_per_frame * t + 1
        window, hop = self.stft_window, cfg.istft_hop
        stft = source_stft(s, src_samples, num_stft, window, hop, self.stft_forward)
        x = self.decoder(mel_in.to(self.dtype), stft.to(self.dtype))
        wav = istft_head(x, n_frames, window, hop, cfg.magnitude_limit, self.stft_inverse)
        return wav.clamp(-cfg.audio_limit, cfg.audio_limit)

    def decoder(self, mel_in: torch.Tensor, stft: torch.Tensor) -> torch.Tensor:
        """mel_in (b, c, t + 4) incl. conv_pre's right context, stft (b, 18, u), u = 120 t + 1
        -> conv_post output (b, 18, u), the iSTFT head's input."""
        cfg = self.cfg
        n_stages, nk = len(cfg.upsample_rates), len(cfg.resblock_kernel_sizes)
        x = self.conv_pre(mel_in)  # (b, base, t)
        for i in range(n_stages):
            x = self.ups[i](F.leaky_relu(x, cfg.lrelu_slope))
            if i == n_stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # ReflectionPad1d((1, 0)): 120 t + 1
            x = x + self.source_resblocks[i](self.source_downs[i](stft, x.shape[-1]))
            xs = self.resblocks[i * nk](x)
            for j in range(1, nk):
                xs = xs + self.resblocks[i * nk + j](x)
            x = xs / nk
        x = F.leaky_relu(x, cfg.post_lrelu_slope)
        return run_causal(self.conv_post, x)


def _commit(st: HiFTSessionState, plan: DecodeWindow, mel_row, f0, phase, carry, num_samples: int):
    """Apply a computed chunk to its session and trim the state to what the next chunk reads."""
    st.mel = mel_row[:, plan.keep_mel_from - st.mel_start :].clone()
    keep = plan.keep_f0_from - st.f0_start  # f0_start still refers to the old num_f0_frames
    st.phase_carry = carry.clone()
    st.f0 = f0[keep:].clone()
    st.phase = phase[keep:].clone()
    st.num_frames = plan.total
    st.num_f0_frames = plan.f0_new[1]
    st.num_samples_emitted += num_samples
    st.finalized = plan.finalize
