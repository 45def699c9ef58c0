"""The Stage-1 flow model (docs/REFERENCE.md §2, §3): tokens + voice -> mel, batched over ragged streams.

`FlowModel.generate(requests)` runs flow requests of different streams as ONE Euler/CFG solve of
2b solver rows. Per row: its own token count, lookahead handling (final rows right-pad 3 zero
embeddings, non-final rows read their 3 real context tokens), sequence length, attention
(block-causal or full), and position-locked noise. Padding never reaches a valid frame: padded
token embeddings are exact zeros (what a final row's lookahead reads), the convs after the
token stage are left-causal, and the attention bias hides padded keys.

Dimensions (the legend of docs/DESIGN.md "Shape letters"):
    b  batch rows: flow calls
    r  solver rows, 2b: [b conditional; b unconditional]
    n  tokens, prompt + target, padded to the longest row
    t  mel frames (2 per emitted token), padded to the longest row
    c  channels; the 80 mel bins unless said otherwise
    s  speaker embedding width (192); p pre-lookahead width (1024)
The flow time is `tau` (shape (r,)), its increment `dtau`, the guidance weight `cfg_rate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from flow_service.model.config import MEL_BINS, FlowConfig
from flow_service.model.dit import DiT
from flow_service.model.prefix_cache import PrefixCache, PrefixPlan, solve_with_prefix
from flow_service.model.requests import FlowRequest, validate_request
from flow_service.model.solver import cosine_schedule, euler_cfg, noise_buffer
from token2wav.invalid import InvalidInput

# (x, mu, cond, spks, tau, attn_bias, frame_mask) -> velocity; the DiT itself or a graphed replay
Estimator = Callable[..., torch.Tensor]


class BatchIntegrityError(RuntimeError):
    """A batch result could not be matched to its request slot (docs/DESIGN.md, invariant 5)."""


class PreLookaheadLayer(nn.Module):
    """Residual token block: conv1 (k = lookahead + 1, reads 3 tokens to the right), leaky ReLU
    (slope 0.01), causal conv2 (k = 3, left zero-pad 2), plus the input embeddings.

    Batched contract: `emb` (b, n, c) is exactly zero past each row's last real token, so a
    final row's lookahead reads zeros (upstream's explicit pad) and a non-final row's last
    emitted token reads its 3 real context tokens. Positions past a row's emitted tokens are
    garbage and must be masked downstream."""

    def __init__(self, channels: int, hidden: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, kernel_size=3)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        y = F.pad(emb.transpose(1, 2), (0, self.lookahead))  # (b, c, n + lookahead)
        y = F.leaky_relu(self.conv1(y))  # (b, p, n)
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))  # (b, c, n)
        return y.transpose(1, 2) + emb  # (b, n, c)


class CFMDecoder(nn.Module):
    """`decoder`: the Euler solver with classifier-free guidance around `decoder.estimator`."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg_rate = cfg.cfg_rate
        self.steps = cosine_schedule(cfg.num_steps)
        self.estimator = DiT(cfg.dit)

    def solve(
        self,
        noise: torch.Tensor,  # (b, t, c) fp32
        mu: torch.Tensor,  # (b, t, c) compute dtype
        cond: torch.Tensor,  # (b, t, c)
        spks: torch.Tensor,  # (b, c)
        attn_bias,  # (r, 1, t, t) additive (DiT.attention_mask)
        frame_mask: torch.Tensor,  # (r, t, 1)
        estimator: Estimator | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Integrate dx/dtau = v from noise at tau=0 to the mel at tau=1; returns (b, t, c) fp32.

        Rows [0, b) carry mu, spk and cond; rows [b, 2b) the same x with all three zeroed
        (the unconditional branch). The Euler state stays fp32 whatever the compute dtype.
        `between_steps` is called after every step but the last, once the step's output is
        consumed: the engine runs an urgent batch there (see FlowEngine)."""
        run = estimator if estimator is not None else self.estimator
        b = mu.shape[0]
        dtype = mu.dtype
        mu_in = torch.cat((mu, torch.zeros_like(mu)))  # (r, t, c)
        cond_in = torch.cat((cond, torch.zeros_like(cond)))  # (r, t, c)
        spks_in = torch.cat((spks, torch.zeros_like(spks)))  # (r, c)

        def velocity(step: int, tau: float, x: torch.Tensor) -> torch.Tensor:
            # fresh per step, never filled in place: graph runners may skip re-copying an input
            tau_in = torch.full((2 * b,), tau, dtype=torch.float32, device=mu.device)
            x_in = torch.cat((x, x)).to(dtype)  # (r, t, c)
            return run(x_in, mu_in, cond_in, spks_in, tau_in, attn_bias, frame_mask)

        return euler_cfg(noise, self.steps, self.cfg_rate, velocity, between_steps)


@dataclass
class FlowBatch:
    """Device tensors for one solve, plus where each request's output lies. Built by
    `FlowModel.prepare`; rows may be in any order, `row_slots` maps them back."""

    token_ids: torch.Tensor  # (b, n) long, 0 past each row's tokens
    token_mask: torch.Tensor  # (b, n, 1) compute dtype, 1 on real tokens
    embeddings: torch.Tensor  # (b, s) fp32, raw x-vectors (normalised in fp32, as upstream)
    cond: torch.Tensor  # (b, t, c) compute dtype, prompt mel then zeros
    seq_lens: torch.Tensor  # (b,) long, T per row
    streaming: torch.Tensor  # (b,) bool
    num_frames: int  # t, padded length (>= max T)
    row_slots: list[int]  # [b] request slot of each row
    out_spans: list[tuple[int, int]]  # [b] returned frames [start, stop) of each row

    @property
    def num_rows(self) -> int:
        return len(self.row_slots)


class FlowModel(nn.Module):
    """`CausalMaskedDiffWithDiT` for inference: module names mirror flow.pt's keys."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.mel_dim)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_dim)
        self.pre_lookahead_layer = PreLookaheadLayer(
            cfg.mel_dim, cfg.pre_lookahead_channels, cfg.pre_lookahead_len
        )
        self.decoder = CFMDecoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.spk_embed_affine_layer.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.spk_embed_affine_layer.weight.device

    def validate(self, chunks: Sequence[FlowRequest]) -> None:
        """Validate every request; the error carries the slot of the first bad one."""
        for slot, req in enumerate(chunks):
            try:
                validate_request(req, self.cfg.vocab_size)
            except InvalidInput as exc:
                raise InvalidInput(
                    exc.field, exc.problem, slot, f"chunks[{slot}].{exc.field}"
                ) from None

    def prepare(self, chunks: Sequence[FlowRequest], frame_multiple: int = 1) -> FlowBatch:
        """Validate and lay out a batch (right padding). `frame_multiple` rounds the padded
        length up, e.g. to reuse CUDA graphs captured for bucketed lengths."""
        self.validate(chunks)
        ratio = self.cfg.token_mel_ratio
        num_rows = len(chunks)
        num_tokens = [req.voice.num_prompt_tokens + int(req.tokens.shape[0]) for req in chunks]
        seq_lens = [req.num_seq_frames for req in chunks]
        num_frames = max(max(seq_lens), 1)
        num_frames = math.ceil(num_frames / frame_multiple) * frame_multiple
        # Enough token slots for every padded frame, and always one past a row's real tokens.
        width = max(max(num_tokens), math.ceil(num_frames / ratio))

        ids = torch.zeros(num_rows, width, dtype=torch.long)
        token_mask = torch.zeros(num_rows, width, 1)
        cond = torch.zeros(num_rows, num_frames, MEL_BINS)
        embeddings = torch.empty(num_rows, self.cfg.spk_embed_dim)
        spans = []
        for row, req in enumerate(chunks):
            voice = req.voice
            n_p = voice.num_prompt_tokens
            ids[row, :n_p] = voice.prompt_token
            ids[row, n_p : num_tokens[row]] = req.tokens
            token_mask[row, : num_tokens[row]] = 1.0
            cond[row, : req.num_prompt_frames] = voice.prompt_feat
            embeddings[row] = voice.embedding
            spans.append((req.out_start_frame, req.num_seq_frames))

        device, dtype = self.device, self.dtype
        return FlowBatch(
            token_ids=ids.to(device),
            token_mask=token_mask.to(device, dtype),
            embeddings=embeddings.to(device),
            cond=cond.to(device, dtype),
            seq_lens=torch.tensor(seq_lens, device=device),
            streaming=torch.tensor([req.streaming for req in chunks], device=device),
            num_frames=num_frames,
            row_slots=list(range(num_rows)),
            out_spans=spans,
        )

    def conditioning(self, batch: FlowBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu (b, t, c), spks (b, c)) in the compute dtype: token features and speaker vector."""
        unit = F.normalize(batch.embeddings, dim=1).to(self.dtype)  # (b, s)
        spks = self.spk_embed_affine_layer(unit)  # (b, c)
        emb = self.input_embedding(batch.token_ids) * batch.token_mask  # (b, n, c)
        h = self.pre_lookahead_layer(emb)  # (b, n, c)
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1)[:, : batch.num_frames]
        return mu, spks

    def solve_batch(
        self,
        batch: FlowBatch,
        estimator: Estimator | None = None,
        mask_padding: bool = True,
        between_steps: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Mel for every padded frame of every row: (b, t, c) fp32 on the model's device."""
        t = batch.num_frames
        mu, spks = self.conditioning(batch)

        noise = noise_buffer(mu.device, self.cfg.max_frames)[:t]  # (t, c)
        noise = noise.expand(batch.num_rows, -1, -1)  # (b, t, c)
        seq_lens = batch.seq_lens.repeat(2)  # (r,) CFG rows share their request's masks
        bias = self.decoder.estimator.attention_mask(
            seq_lens, batch.streaming.repeat(2), t, mu.dtype, mask_padding=mask_padding
        )
        pos = torch.arange(t, device=mu.device)
        frame_mask = (pos[None, :] < seq_lens[:, None]).to(mu.dtype)[..., None]  # (r, t, 1)
        return self.decoder.solve(
            noise, mu, batch.cond, spks, bias, frame_mask, estimator, between_steps
        )

    def scatter(
        self, batch: FlowBatch, mel: torch.Tensor, to_cpu: bool = True
    ) -> list[torch.Tensor]:
        """Cut each row's new frames, (c, frames) fp32, and place them by slot."""
        mel = mel.transpose(1, 2)  # (b, c, t)
        if to_cpu:
            mel = mel.cpu()
        outputs: list[torch.Tensor | None] = [None] * batch.num_rows
        for row, slot in enumerate(batch.row_slots):
            if outputs[slot] is not None:
                raise BatchIntegrityError(f"slot {slot} filled twice (row {row})")
            start, stop = batch.out_spans[row]
            outputs[slot] = mel[row, :, start:stop].clone(memory_format=torch.contiguous_format)
        missing = [slot for slot, out in enumerate(outputs) if out is None]
        if missing:
            raise BatchIntegrityError(f"no result for slots {missing}")
        return outputs  # type: ignore[return-value]

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[FlowRequest],
        *,
        estimator: Estimator | None = None,
        frame_multiple: int = 1,
        to_cpu: bool = True,
        mask_padding: bool = True,
        between_steps: Callable[[], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        plan: PrefixPlan | None = None,
        prefix_step: Estimator | None = None,
        prefix_multiple: int = 0,
    ) -> list[torch.Tensor]:
        """New mel (80, frames) fp32 per request, in request order, from ONE solver pass.

        Outputs are on the CPU (default) or, with `to_cpu=False`, on the model's device.
        `estimator` may replace the DiT call (e.g. a `GraphedEstimator`). `mask_padding=False`
        is a fault injection for tests only. `between_steps` runs between solver steps (it may
        itself call `generate`, on the same thread). With `prefix_cache`, streaming rows take
        the keys/values of their stream's complete earlier blocks from it and compute only
        their new frames (the same mel within rounding): eagerly, or through `prefix_step` (a
        `PrefixStep` or its `GraphedEstimator`, prefixes padded to `prefix_multiple` frames).
        `plan` is the cache's plan for these requests when the caller made it already (the
        runner picks graphs by the work left after the cached prefixes). Call from one thread
        at a time."""
        if not requests:
            return []
        try:
            batch = self.prepare(requests, frame_multiple)
        except BaseException:
            if plan is not None:
                prefix_cache.release(plan)
            raise
        if plan is None and prefix_cache is not None:
            plan = prefix_cache.plan(requests)
        if plan is None or not plan.active:
            mel = self.solve_batch(batch, estimator, mask_padding, between_steps)
            if plan is not None:
                prefix_cache.commit(plan, [None] * len(requests))  # drops finished streams
            return self.scatter(batch, mel, to_cpu)
        try:
            mel, new_x = solve_with_prefix(
                self, batch, plan, mask_padding, between_steps, prefix_step, prefix_multiple
            )
        except BaseException:
            prefix_cache.release(plan)
            raise
        prefix_cache.commit(plan, new_x)
        # mel row i starts at its first uncached frame
        spans = [
            (start - row.prefix, stop - row.prefix)
            for (start, stop), row in zip(batch.out_spans, plan.rows, strict=True)
        ]
        return self.scatter(replace(batch, out_spans=spans), mel, to_cpu)
