"""Stage-2 vocoder model (issue 4): causal HiFT decode, bounded incremental sessions, batching,
session export, checkpoint loading, input validation. CPU, small preset (same kernels, rates and
receptive field as the full model, 1/8 of the width)."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from bench.vocoder_model import batched_and_solo, make_mel, upstream_schedule
from token2wav import SAMPLES_PER_FRAME
from vocoder_service.model import (
    HIFT_PRESETS,
    HOLDBACK_FRAMES,
    MAX_FRAMES,
    MAX_SAMPLES,
    MEL_BINS,
    SAMPLE_RATE,
    CheckpointError,
    HiFTConfig,
    HiFTGenerator,
    HiFTSessionState,
    InvalidInput,
    hift_noise_buffers,
    load_hift,
    receptive_field_frames,
    spectral,
)
from vocoder_service.model.spectral import dft_bases, hann_window, istft_head, source_stft

# Invariant 3 allows 1e-3 absolute in fp32; the implementation measures ~2e-7, so a tighter
# bound catches phase-carry or window mistakes that would still hide under 1e-3.
TOL_FP32 = 1e-5
TOL_FP64 = 1e-10
TOL_BATCH = 1e-6  # batched vs solo: oneDNN picks kernels by shape, so rounding may differ


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def small() -> HiFTGenerator:
    return load_hift(None, preset="small")


@pytest.fixture(scope="module")
def small64() -> HiFTGenerator:
    return load_hift(None, preset="small", dtype=torch.float64)


def random_schedule(total: int, seed: int, lo: int, hi: int) -> list[int]:
    rng, sizes, n = random.Random(seed), [], 0
    while n < total:
        sizes.append(min(rng.randint(lo, hi), total - n))
        n += sizes[-1]
    return sizes


def stream(model, mel, sizes, finalize_last: bool, state=None):
    state = state or model.new_session()
    outs, pos = [], 0
    for i, n in enumerate(sizes):
        fin = finalize_last and i == len(sizes) - 1
        outs.append(model.decode_one(state, mel[:, pos : pos + n], fin))
        pos += n
    return torch.cat(outs), state


# -- constants, presets, decode semantics -----------------------------------------------------


def test_constants_and_presets():
    assert (SAMPLE_RATE, SAMPLES_PER_FRAME, MEL_BINS, HOLDBACK_FRAMES) == (24000, 480, 80, 8)
    assert MAX_SAMPLES == 300 * 24000 == MAX_FRAMES * SAMPLES_PER_FRAME
    for cfg in HIFT_PRESETS.values():
        assert math.prod(cfg.upsample_rates) * cfg.istft_hop == SAMPLES_PER_FRAME
        assert (cfg.istft_n_fft, cfg.istft_hop, cfg.upsample_rates) == (16, 4, (8, 5, 3))
    assert HIFT_PRESETS["small"].base_channels <= 64 < HIFT_PRESETS["cosyvoice3-0.5b"].base_channels
    full = HiFTGenerator(HIFT_PRESETS["cosyvoice3-0.5b"])
    assert sum(p.numel() for p in full.parameters()) == 20_779_887  # docs/REFERENCE.md §9
    with pytest.raises(ValueError):
        HiFTConfig(upsample_rates=(8, 8, 3))  # 768 samples per frame: not this model


@pytest.mark.parametrize("frames", [1, 5, 8, 9, 40])
def test_decode_lengths_and_range(small, frames):
    mel = make_mel(frames, seed=frames)
    y = small.decode(mel, finalize=True)
    assert y.dtype == torch.float32 and y.shape == (SAMPLES_PER_FRAME * frames,)
    held = small.decode(mel[None], finalize=False)  # (1, 80, T) accepted too
    assert held.shape == (SAMPLES_PER_FRAME * max(frames - HOLDBACK_FRAMES, 0),)
    assert float(y.abs().max()) <= 0.99 and float(y.abs().max()) > 0
    # Without finalize the held-back decode is a prefix of the finalized one (docs/REFERENCE.md §5.5).
    if held.numel():
        assert (held - y[: held.shape[0]]).abs().max().item() <= TOL_FP32


def test_loud_output_is_clamped():
    model = load_hift(None, preset="small")
    with torch.no_grad():
        model.conv_post.bias[:9] += 8.0  # exp(x) far above the magnitude limit of 100
    y = model.decode(make_mel(12, seed=7), finalize=True)
    assert float(y.abs().max()) == pytest.approx(0.99)
    assert float((y.abs() >= 0.99 - 1e-6).float().mean()) > 0.01


# -- incremental == full history --------------------------------------------------------------

SCHEDULES = {
    "upstream_50_100_200": lambda t: upstream_schedule(t),
    "random_1_to_60": lambda t: random_schedule(t, seed=1, lo=1, hi=60),
    "one_frame_then_random": lambda t: [1] * 50 + random_schedule(t - 50, seed=2, lo=1, hi=90),
    "tiny_1_to_9": lambda t: random_schedule(t, seed=3, lo=1, hi=9),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_incremental_equals_full_history(small, name):
    frames = 420 if name != "tiny_1_to_9" else 160
    mel = make_mel(frames, seed=10)
    sizes = SCHEDULES[name](frames)
    assert sum(sizes) == frames
    # With a final flush on the last chunk: equals decode(mel, finalize=True).
    flushed, st = stream(small, mel, sizes, finalize_last=True)
    full = small.decode(mel, finalize=True)
    assert flushed.shape == full.shape and st.finalized
    assert (flushed - full).abs().max().item() <= TOL_FP32
    # Without a final flush: exactly upstream's held-back decode of the same frames ...
    held, st = stream(small, mel, sizes, finalize_last=False)
    held_full = small.decode(mel, finalize=False)
    assert held.shape == held_full.shape == (SAMPLES_PER_FRAME * (frames - HOLDBACK_FRAMES),)
    assert (held - held_full).abs().max().item() <= TOL_FP32
    # ... and an empty finalize chunk flushes the 8 held-back frames.
    tail = small.decode_one(st, torch.zeros(MEL_BINS, 0), finalize=True)
    assert tail.shape == (SAMPLES_PER_FRAME * HOLDBACK_FRAMES,)
    assert (torch.cat([held, tail]) - full).abs().max().item() <= TOL_FP32


def test_incremental_is_exact_in_float64(small64):
    mel = make_mel(300, seed=11)
    y, _ = stream(small64, mel, random_schedule(300, seed=4, lo=1, hi=40), finalize_last=True)
    assert (y - small64.decode(mel, finalize=True)).abs().max().item() <= TOL_FP64


@pytest.mark.slow
def test_sixty_seconds_upstream_schedule_bounded_state(small):
    frames = 60 * 50 + 37  # just over 60 s
    mel = make_mel(frames, seed=12)
    sizes = upstream_schedule(frames)
    st, outs, nbytes = small.new_session(), [], []
    pos = 0
    for i, n in enumerate(sizes):
        outs.append(small.decode_one(st, mel[:, pos : pos + n], i == len(sizes) - 1))
        pos += n
        nbytes.append(st.nbytes)
        ctx = small.cfg.context_frames()
        assert st.mel.shape[1] <= ctx + HOLDBACK_FRAMES and st.f0.shape[0] <= ctx + HOLDBACK_FRAMES
    y = torch.cat(outs)
    full = small.decode(mel, finalize=True)
    assert y.shape == full.shape == (SAMPLES_PER_FRAME * frames,)
    assert (y - full).abs().max().item() <= TOL_FP32
    assert max(nbytes[3:-1]) == min(nbytes[3:-1])  # steady state: constant size, not growing


def test_window_width_does_not_grow_with_history(small, monkeypatch):
    widths = []
    original = small.decoder

    def spy(mel_in, stft):
        widths.append(mel_in.shape[-1])
        return original(mel_in, stft)

    monkeypatch.setattr(small, "decoder", spy)
    mel = make_mel(2600, seed=13)
    stream(small, mel, [50] + [100] * 25, finalize_last=False)
    assert len(set(widths[2:])) == 1  # history 150 frames ... 2550 frames: same window
    assert widths[-1] <= 100 + small.cfg.context_frames() + HOLDBACK_FRAMES


# -- receptive field ----------------------------------------------------------------------------


def _decode_fixed_source(model, mel, source):
    """Decoder + iSTFT of a whole utterance (finalize) with a given source (1, 480 T)."""
    t = mel.shape[-1]
    fps = model.cfg.stft_frames_per_frame
    mel_in = torch.cat([mel, torch.zeros(MEL_BINS, model.cfg.conv_pre_look_right)], 1)[None]
    stft = source_stft(source, torch.tensor([source.shape[1]]), fps * t + 1, model.stft_window, 4)
    x = model.decoder(mel_in.to(model.dtype), stft.to(model.dtype))
    return istft_head(x, torch.tensor([fps * t + 1]), model.stft_window, 4, 100.0)[0]


def test_receptive_field_measured_by_perturbation(small64):
    """Perturb everything before frame j (mel, or source samples) and find the last output frame
    that moves: the analytic trace must cover it and not be loose. Influence decays to ~1e-16 in
    the last frame or two of the field, so the measurement may fall short by a frame or two."""
    cfg, t, j = small64.cfg, 100, 30
    g = torch.Generator().manual_seed(14)
    mel = make_mel(t, seed=14).double()
    source = (torch.rand(1, SAMPLES_PER_FRAME * t, generator=g, dtype=torch.float64) - 0.5) * 0.4
    with torch.no_grad():
        base = _decode_fixed_source(small64, mel, source)
        mel_p = mel.clone()
        mel_p[:, :j] += 3 * torch.randn(MEL_BINS, j, generator=g, dtype=torch.float64)
        src_p = source.clone()
        src_p[:, : SAMPLES_PER_FRAME * j] += 0.5
        reach = []
        for m, s in ((mel_p, source), (mel, src_p)):
            diff = (_decode_fixed_source(small64, m, s) - base).abs().reshape(t, SAMPLES_PER_FRAME)
            moved = (diff.amax(dim=1) > 0).nonzero().flatten()  # fp64 CPU convs: exact 0 outside
            reach.append(int(moved.max()) + 1 - j)  # frames after the perturbed span that moved
    measured = max(reach)
    assert reach[0] > 15 and reach[1] > 20  # mel path (~22 frames) and source path (~29)
    assert measured <= receptive_field_frames(cfg) <= measured + 3
    assert cfg.context_frames() > measured


@pytest.mark.slow
def test_window_size_matters():
    """Margin 0 (window = receptive field) is exact to rounding in fp64; shrinking the window 7
    frames below the field makes the stitched audio measurably wrong, so the incremental tests
    would notice a window that is too small."""
    mel = make_mel(80, seed=15)
    sizes = [30] + [1] * 40 + [10]  # 1-frame chunks: every frame sits at the window's edge
    errors = {}
    for margin in (0, -7):
        cfg = HiFTConfig(base_channels=64, f0_cond_channels=64, context_margin_frames=margin)
        model = load_hift(None, dtype=torch.float64, config=cfg)
        y, _ = stream(model, mel, sizes, finalize_last=True)
        errors[margin] = (y - model.decode(mel, finalize=True)).abs().max().item()
    assert errors[0] <= 1e-12
    assert errors[-7] > 1e4 * max(errors[0], 1e-16) and errors[-7] > 1e-9


# -- phase --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "upstream"])
def test_phase_carry_over_60s_equals_one_shot(mode):
    """The per-frame phase of a chunked run equals a one-shot run over 60 s of f0; in
    "upstream" mode it is upstream's float32 cumulative sum (torch CPU), bit for bit."""
    cfg = HiFTConfig(base_channels=64, f0_cond_channels=64, phase_mode=mode)
    source = HiFTGenerator(cfg).m_source
    g = torch.Generator().manual_seed(16)
    f0 = torch.rand(3000, generator=g) * 400  # float32 Hz, some frames unvoiced (< 10 Hz)
    one_shot, _ = source.advance_phase(f0, torch.zeros(9, dtype=torch.float64))
    carry, parts, pos = torch.zeros(9, dtype=torch.float64), [], 0
    for n in random_schedule(3000, seed=17, lo=1, hi=250):
        part, carry = source.advance_phase(f0[pos : pos + n], carry)
        parts.append(part)
        pos += n
    chunked = torch.cat(parts)
    a = source.sines(chunked[None], torch.float64)
    b = source.sines(one_shot[None], torch.float64)
    if mode == "upstream":
        assert torch.equal(a, b)
        rad = (f0[:, None] * torch.arange(1, 10, dtype=torch.float32)) / SAMPLE_RATE % 1
        upstream = torch.sin(torch.cumsum(rad[None], dim=1) * 2 * math.pi * SAMPLES_PER_FRAME)
        assert torch.equal(a.float(), upstream)
    else:
        assert (a - b).abs().max().item() <= 1e-10
        # The real-number value: 480 x sum of r, reduced mod 1 in exact rational steps.
        rad = (f0[:, None] * torch.arange(1, 10, dtype=torch.float32)) / SAMPLE_RATE % 1
        cycles = (torch.cumsum(rad.double() * SAMPLES_PER_FRAME, dim=0)) % 1
        assert (b[0] - torch.sin(2 * math.pi * cycles)).abs().max().item() <= 1e-9


def test_upstream_phase_mode_streams_exactly():
    import dataclasses

    cfg = dataclasses.replace(HIFT_PRESETS["small"], phase_mode="upstream")
    model = load_hift(None, config=cfg)
    mel = make_mel(260, seed=18)
    y, _ = stream(model, mel, random_schedule(260, seed=19, lo=1, hi=70), finalize_last=True)
    full = model.decode(mel, finalize=True)
    assert (y - full).abs().max().item() <= TOL_FP32
    exact = load_hift(None, preset="small").decode(mel, finalize=True)
    assert 0 < (exact - full).abs().max().item() < 1e-3  # same weights, phase rounding only


# -- batching and isolation --------------------------------------------------------------------


def test_batched_step_equals_solo(small):
    """Ragged chunks, fresh and steady sessions, finalize and not, all in one batched call."""
    mels = [make_mel(320, seed=20 + i) for i in range(6)]
    history = [0, 3, 20, 60, 150, 240]
    chunk = [50, 7, 100, 1, 13, 80]
    finalize = [False, True, False, False, True, True]
    batched, solo, batch_states, solo_states = batched_and_solo(
        small, mels, history, chunk, finalize
    )
    for i in range(6):
        alone = solo[i]
        assert alone.shape == batched[i].shape
        if alone.numel():
            assert (alone - batched[i]).abs().max().item() <= TOL_BATCH
        assert batch_states[i].to_bytes() == solo_states[i].to_bytes()


def _interleave(model, mels, schedules, rng, max_batch):
    """Drive all sessions to the end, each tick advancing a random subset in one decode_batch()."""
    states = [model.new_session() for _ in mels]
    pos = [0] * len(mels)
    idx = [0] * len(mels)
    audio = [[] for _ in mels]
    while True:
        live = [i for i in range(len(mels)) if idx[i] < len(schedules[i])]
        if not live:
            return [torch.cat(a) for a in audio]
        rows = rng.sample(live, min(len(live), rng.randint(1, max_batch)))
        chunks, fins = [], []
        for i in rows:
            n = schedules[i][idx[i]]
            chunks.append(mels[i][:, pos[i] : pos[i] + n])
            fins.append(idx[i] == len(schedules[i]) - 1)
            pos[i] += n
            idx[i] += 1
        for i, out in zip(rows, model.decode_batch([states[i] for i in rows], chunks, fins)):
            audio[i].append(out)


def test_interleaved_sessions_match_sequential(small):
    n = 6
    mels = [make_mel(110 + 15 * i, seed=30 + i) for i in range(n)]
    schedules = [random_schedule(m.shape[1], seed=40 + i, lo=1, hi=70) for i, m in enumerate(mels)]
    sequential = [stream(small, m, s, finalize_last=True)[0] for m, s in zip(mels, schedules)]
    # One session per step, sessions interleaved in random order: bit-identical.
    solo_interleaved = _interleave(small, mels, schedules, random.Random(0), max_batch=1)
    for a, b in zip(solo_interleaved, sequential):
        assert torch.equal(a, b)
    # Random batches of interleaved sessions: same samples up to kernel rounding.
    batched = _interleave(small, mels, schedules, random.Random(1), max_batch=n)
    for a, b, m in zip(batched, sequential, mels):
        assert a.shape == b.shape == (SAMPLES_PER_FRAME * m.shape[1],)
        assert (a - b).abs().max().item() <= TOL_BATCH


def test_bad_row_rejected_alone(small):
    good, done = small.new_session(), small.new_session()
    small.decode_one(done, make_mel(20, 50), finalize=True)
    before = good.to_bytes()
    cases = [
        ([good, done], [make_mel(10, 1), make_mel(10, 2)], [False, False], "states[1]"),
        ([good, good], [make_mel(10, 1), make_mel(10, 2)], [False, False], "states[1]"),
        (
            [good, small.new_session()],
            [make_mel(10, 1), make_mel(10, 2)[:79]],
            [False] * 2,
            "mels[1]",
        ),
    ]
    for states, mels, fins, field in cases:
        with pytest.raises(InvalidInput) as info:
            small.decode_batch(states, mels, fins)
        assert info.value.field == field and info.value.slot == 1
    assert good.to_bytes() == before  # validation happens before any state changes


# -- export / import -----------------------------------------------------------------------------


def test_export_import_into_fresh_model_continues_identically(small):
    mel = make_mel(400, seed=60)
    sizes = random_schedule(400, seed=61, lo=1, hi=80)
    cut = len(sizes) // 2
    reference, _ = stream(small, mel, sizes, finalize_last=True)
    first, st = stream(small, mel, sizes[:cut], finalize_last=False)
    blob = st.to_bytes()
    other = load_hift(None, preset="small")  # another replica: a fresh instance, same weights
    moved = HiFTSessionState.from_bytes(blob)
    assert moved.num_samples_emitted == st.num_samples_emitted and moved.nbytes == st.nbytes
    rest = []
    pos = sum(sizes[:cut])
    for i, n in enumerate(sizes[cut:]):
        rest.append(other.decode_one(moved, mel[:, pos : pos + n], i == len(sizes) - cut - 1))
        pos += n
    assert torch.equal(torch.cat([first, *rest]), reference)


def test_state_bytes_rejects_bad_versions_and_blobs(small):
    st = small.new_session()
    small.decode_one(st, make_mel(30, 62), False)
    blob = st.to_bytes()
    assert HiFTSessionState.from_bytes(blob).to_bytes() == blob
    bumped = blob[:8] + (99).to_bytes(4, "little") + blob[12:]
    for bad in (bumped, b"nonsense" + blob[8:], blob[:-3], b""):
        with pytest.raises(InvalidInput) as info:
            HiFTSessionState.from_bytes(bad)
        assert info.value.field == "session"
    foreign = load_hift(None, preset="small", dtype=torch.float32)
    other_cfg = HiFTGenerator(HiFTConfig(base_channels=64, f0_cond_channels=64, noise_seed=7))
    with pytest.raises(InvalidInput, match="another model"):
        other_cfg.decode_one(HiFTSessionState.from_bytes(blob), make_mel(5, 1), False)
    foreign.decode_one(HiFTSessionState.from_bytes(blob), make_mel(5, 1), False)  # same model: ok
    small.decode_one(st, make_mel(60, 63), False)
    short = HiFTSessionState.from_bytes(st.to_bytes())
    short.mel = short.mel[:, 20:]  # a crafted state that lost history the window needs
    with pytest.raises(InvalidInput, match="too little history") as info:
        small.decode_one(short, make_mel(5, 1), False)
    assert info.value.field == "session"


# -- input validation ---------------------------------------------------------------------------


def test_bad_input_names_the_field(small):
    cases = [
        (make_mel(10, 1)[:79], False, "mel", "80"),
        (torch.full((MEL_BINS, 4), float("nan")), False, "mel", "NaN"),
        (
            torch.cat([make_mel(4, 1), torch.full((MEL_BINS, 1), float("inf"))], 1),
            False,
            "mel",
            "frame 4",
        ),
        (torch.zeros(MEL_BINS, 0), False, "mel", "zero frames"),
        (torch.zeros(MEL_BINS, 3, dtype=torch.int64), False, "mel", "dtype"),
    ]
    for mel, fin, field, text in cases:
        st = small.new_session()
        with pytest.raises(InvalidInput, match=text) as info:
            small.decode_one(st, mel, fin)
        assert info.value.field == field and isinstance(info.value, ValueError)
        assert st.num_frames == 0
    with pytest.raises(InvalidInput) as info:
        small.decode(torch.zeros(MEL_BINS, 0), finalize=True)
    assert info.value.field == "mel"
    st = small.new_session()
    small.decode_one(st, make_mel(12, 2), finalize=True)
    with pytest.raises(InvalidInput, match="finalized") as info:
        small.decode_one(st, make_mel(3, 3), False)
    assert info.value.field == "session"
    st = small.new_session()
    small.decode_one(st, make_mel(20, 4), False)
    st.num_frames = MAX_FRAMES - 5  # as if 300 s had been streamed (checked before any compute)
    with pytest.raises(InvalidInput, match="300 s") as info:
        small.decode_one(st, make_mel(6, 5), False)
    assert info.value.field == "mel"
    with pytest.raises(InvalidInput, match="300 s"):
        small.decode(torch.zeros(MEL_BINS, MAX_FRAMES + 1), finalize=True)


# -- noise buffers --------------------------------------------------------------------------------


def test_noise_buffers_are_seeded_shared_and_not_in_state_dict(small):
    bufs = hift_noise_buffers(small.cfg.noise_seed)
    assert bufs["sine_noise"].shape == (MAX_SAMPLES, 9) and bufs["rand_ini"].shape == (9,)
    assert small.m_source.sine_noise is bufs["sine_noise"]  # one copy per process
    assert load_hift(None, preset="small").m_source.sine_noise is bufs["sine_noise"]
    # The documented recipe reproduces them (noise.py docstring).
    g = torch.Generator().manual_seed(small.cfg.noise_seed)
    rand_ini = torch.rand(1, 9, generator=g)
    rand_ini[:, 0] = 0
    head = torch.rand(1, 4096, 9, generator=g)
    assert torch.equal(rand_ini[0], bufs["rand_ini"]) and torch.equal(
        head[0], bufs["sine_noise"][:4096]
    )
    unfolded = load_hift(None, preset="small", fold_weight_norm=False)
    assert not any(re.search(r"noise|sine_waves|rand_ini|uv", k) for k in unfolded.state_dict())


# -- spectral helpers ----------------------------------------------------------------------------


def test_ragged_stft_and_istft_match_torch_per_row():
    g = torch.Generator().manual_seed(70)
    lens = [480 * 7, 480 * 3, 480 * 5]
    s = torch.zeros(3, max(lens))
    for i, n in enumerate(lens):
        s[i, :n] = torch.randn(n, generator=g)
    win = hann_window(16)
    frames = [n // 4 + 1 for n in lens]
    ours = source_stft(s, torch.tensor(lens), max(frames), win, 4)
    x = torch.randn(3, 18, max(frames), generator=g)
    wav = istft_head(x, torch.tensor(frames), win, 4, 100.0)
    for i, n in enumerate(lens):
        ref = torch.stft(s[i, :n], 16, 4, 16, window=win, return_complex=True)
        ref = torch.cat([ref.real, ref.imag], 0)
        assert (ours[i, :, : frames[i]] - ref).abs().max().item() <= 1e-5
        mag = torch.clip(torch.exp(x[i, :9, : frames[i]]), max=100.0)
        ph = torch.sin(x[i, 9:, : frames[i]])
        spec = torch.complex(mag * torch.cos(ph), mag * torch.sin(ph))
        ref_wav = torch.istft(spec, 16, 4, 16, window=win)
        assert ref_wav.shape[0] == 4 * (frames[i] - 1)
        assert (
            wav[i, : ref_wav.shape[0]] - ref_wav
        ).abs().max().item() <= 1e-4 * ref_wav.abs().max()


def fft_rfft(frames, forward):
    """The transform as torch.fft computed it before `dft_bases`: the window is forward's DC
    column (cos 0 = 1)."""
    spec = torch.fft.rfft(frames * forward[:, 0], dim=-1)
    return torch.cat([spec.real, spec.imag], dim=-1)


def fft_irfft(spec, inverse):
    """Likewise for the inverse: the window is 16 x inverse's DC column (weight 1/16)."""
    j = spec.shape[1] // 2
    n_fft = inverse.shape[0]
    seg = torch.fft.irfft(torch.complex(spec[:, :j], spec[:, j:]), n=n_fft, dim=1)
    return seg * (n_fft * inverse[:, 0])[None, :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dft_bases_compute_the_windowed_fft(dtype):
    g = torch.Generator().manual_seed(71)
    forward, inverse = (m.to(dtype) for m in dft_bases(hann_window(16)))
    frames = torch.randn(3, 500, 16, generator=g, dtype=dtype)
    spec = torch.randn(3, 18, 500, generator=g, dtype=dtype)  # DC/Nyquist imag: irfft drops it
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    for ours, ref in (
        (spectral.windowed_rfft(frames, forward), fft_rfft(frames, forward)),
        (spectral.windowed_irfft(spec, inverse), fft_irfft(spec, inverse)),
    ):
        assert ours.dtype == dtype
        assert (ours - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("fixture", ["small", "small64"])
def test_vocoder_audio_with_dft_bases_equals_the_fft_path(fixture, request, monkeypatch):
    """Before/after of the matrix DFT, the whole vocoder: the same audio as through torch.fft,
    to float32 rounding (float64: to its own), and no torch.fft call left in a decode."""
    model = request.getfixturevalue(fixture)
    mel = make_mel(60, seed=3).to(model.dtype)
    with torch.inference_mode():
        with monkeypatch.context() as m:
            m.setattr(spectral, "windowed_rfft", fft_rfft)
            m.setattr(spectral, "windowed_irfft", fft_irfft)
            before = model.decode(mel, finalize=True)

        def no_fft(*args, **kwargs):
            raise AssertionError("torch.fft called")

        for name in ("rfft", "irfft", "fft", "ifft"):
            monkeypatch.setattr(torch.fft, name, no_fft)
        after = model.decode(mel, finalize=True)
    tol = 1e-5 if model.dtype == torch.float32 else 1e-12
    assert before.shape == after.shape and before.abs().max().item() > 0
    assert (after - before).abs().max().item() <= tol * before.abs().max().item()


# -- weights ----------------------------------------------------------------------------------


def _old_convention(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for k, v in state.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        renamed["generator." + k] = v
    return renamed


def test_both_weight_norm_conventions_load(small, tmp_path):
    source = load_hift(None, preset="small", seed=5, fold_weight_norm=False)
    state = {k: v.float().clone() for k, v in source.state_dict().items()}
    assert any(k.endswith("parametrizations.weight.original1") for k in state)
    mel = make_mel(30, seed=80)
    reference = load_hift(None, preset="small", seed=5).decode(mel, True)
    for name, sd in (("new.pt", state), ("old.pt", _old_convention(state))):
        torch.save(sd, tmp_path / name)
        loaded = load_hift(tmp_path / name)  # architecture inferred from the shapes
        assert loaded.cfg == HIFT_PRESETS["small"]
        assert torch.equal(loaded.decode(mel, True), reference)
    assert not torch.equal(small.decode(mel, True), reference)  # seed 5 weights really differ
    unfolded = load_hift(tmp_path / "old.pt", fold_weight_norm=False)
    assert torch.equal(unfolded.decode(mel, True), reference)  # folding changes no value


def upstream_hift_keys(base: int = 512, f0_ch: int = 512) -> dict[str, tuple[int, ...]]:
    """Key -> shape of upstream CausalHiFTGenerator's state_dict, written from the module
    structure in docs/REFERENCE.md §9 (not from our model)."""
    keys: dict[str, tuple[int, ...]] = {}

    def wn(name, cout, cin, k):
        keys[f"{name}.bias"] = (cout,)
        keys[f"{name}.parametrizations.weight.original0"] = (cout, 1, 1)
        keys[f"{name}.parametrizations.weight.original1"] = (cout, cin, k)

    def resblock(name, ch, k):
        for j in range(3):
            wn(f"{name}.convs1.{j}", ch, ch, k)
            wn(f"{name}.convs2.{j}", ch, ch, k)
            keys[f"{name}.activations1.{j}.alpha"] = (ch,)
            keys[f"{name}.activations2.{j}.alpha"] = (ch,)

    ch = [base // 2, base // 4, base // 8]
    keys["m_source.l_linear.weight"], keys["m_source.l_linear.bias"] = (1, 9), (1,)
    wn("conv_pre", base, 80, 5)
    for i, k in enumerate((16, 11, 7)):
        wn(f"ups.{i}", ch[i], base if i == 0 else ch[i - 1], k)
    for i, k in enumerate((30, 6, 1)):
        keys[f"source_downs.{i}.weight"], keys[f"source_downs.{i}.bias"] = (ch[i], 18, k), (ch[i],)
    for i, k in enumerate((7, 7, 11)):
        resblock(f"source_resblocks.{i}", ch[i], k)
    for i in range(3):
        for j, k in enumerate((3, 7, 11)):
            resblock(f"resblocks.{3 * i + j}", ch[i], k)
    wn("conv_post", 18, ch[2], 7)
    wn("f0_predictor.condnet.0", f0_ch, 80, 4)
    for i in (2, 4, 6, 8):
        wn(f"f0_predictor.condnet.{i}", f0_ch, f0_ch, 3)
    keys["f0_predictor.classifier.weight"], keys["f0_predictor.classifier.bias"] = (1, f0_ch), (1,)
    return keys


@pytest.mark.parametrize("convention", ["parametrizations", "weight_g_v"])
def test_synthetic_upstream_checkpoint_full_preset_loads_strictly(tmp_path, convention):
    shapes = upstream_hift_keys()
    assert len(shapes) == 328 and sum(math.prod(s) for s in shapes.values()) == 20_779_887
    g = torch.Generator().manual_seed(90)
    state = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    saved = state if convention == "parametrizations" else _old_convention(state)
    torch.save(saved, tmp_path / "hift.pt")
    model = load_hift(tmp_path, fold_weight_norm=False)  # a model dir holding hift.pt
    assert model.cfg == HIFT_PRESETS["cosyvoice3-0.5b"]
    loaded = model.state_dict()
    assert set(loaded) == set(shapes)
    for key in (
        "conv_pre.parametrizations.weight.original1",
        "resblocks.8.activations2.2.alpha",
        "f0_predictor.condnet.8.parametrizations.weight.original0",
        "source_downs.0.weight",
    ):
        assert torch.equal(loaded[key].to(state[key].dtype), state[key])
    assert model.f0_predictor.classifier.weight.dtype == torch.float64
    y = model.decode(torch.randn(MEL_BINS, 12, generator=g) - 5, finalize=True)
    assert y.shape == (12 * SAMPLES_PER_FRAME,) and bool(torch.isfinite(y).all())


def test_checkpoint_errors(small, tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_hift(tmp_path / "missing")
    state = load_hift(None, preset="small", fold_weight_norm=False).state_dict()
    dropped = {k: v for k, v in state.items() if not k.startswith("conv_post.bias")}
    torch.save(dropped, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match="missing"):
        load_hift(tmp_path / "a.pt", preset="small")
    extra = dict(state, **{"conv_post.extra": torch.zeros(1)})
    torch.save(extra, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match="unexpected"):
        load_hift(tmp_path / "b.pt")
    wrong = dict(state)
    wrong["resblocks.0.activations1.0.alpha"] = torch.ones(7)
    torch.save(wrong, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="shape"):
        load_hift(tmp_path / "c.pt", preset="small")


def test_reduced_precision_keeps_f0_in_float64():
    model = load_hift(None, preset="small", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.float64 for p in model.f0_predictor.parameters())
    mel = make_mel(20, seed=95)
    y = model.decode(mel, finalize=True)
    ref = load_hift(None, preset="small").decode(mel, finalize=True)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert (y - ref).abs().max().item() < 0.1 * ref.abs().max().item() + 1e-3


@pytest.mark.gpu
def test_cuda_sessions_match_full_decode_and_cpu():
    torch.backends.cudnn.allow_tf32 = False
    model = load_hift(None, preset="small", device="cuda")
    model.warmup()
    mel = make_mel(400, seed=99)
    y, _ = stream(model, mel, random_schedule(400, seed=98, lo=1, hi=120), finalize_last=True)
    full = model.decode(mel, finalize=True)
    assert (y - full).abs().max().item() <= 1e-4
    cpu = load_hift(None, preset="small").decode(mel, finalize=True)
    assert (full - cpu).abs().max().item() <= 1e-3
