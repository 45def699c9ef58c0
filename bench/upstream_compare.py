"""Fidelity against upstream CosyVoice3, run from upstream's own code on identical weights.

Builds upstream's `CausalMaskedDiffWithDiT` (DiT CFM flow) and `CausalHiFTGenerator` from their
classes with cosyvoice3.yaml's values (no hyperpyyaml), loads the SAME random state dict into
them and into ours (our loaders take upstream's key names strictly), gives upstream our fixed
noise buffers, and prints SNR (dB, 10 log10 |ref|^2 / |x - ref|^2) per stage and end to end:

  hift     HiFT alone, voiced mel of --hift-seconds (our random HiFT's f0 head puts f0 near
           150 +- 80 Hz, so the sine source and its phase matter): ours in phase_mode "exact" and
           "upstream" against upstream's full decode on the CPU and on --device, and upstream on
           --device against upstream on the CPU.
  stream   flow + HiFT end to end, fp32: upstream's streaming token2wav (CosyVoice3Model, driven
           with tts()'s hop schedule, docs/REFERENCE.md §6.2) against our model-level streaming path (gateway
           ChunkPlanner -> FlowModel.generate per chunk -> one HiFT session). The services are
           proven equal to this path by tests/test_vocoder_service.py and the gateway tests.
  fast     fast modes against upstream fp32 on --device: our bf16 flow + bf16 HiFT, our bf16
           flow + fp32 HiFT, and upstream's own fp16 mode (token2wav with fp16=True: autocast
           over flow and HiFT; CUDA only). HiFT-alone rows feed each HiFT upstream's fp32 mel.

Upstream's code is not part of this repository. Point --upstream at a directory holding
`cosyvoice/` (FunAudioLLM/CosyVoice) and `matcha/models/components/flow_matching.py`
(shivammehta25/Matcha-TTS); imports that would pull training or export machinery (onnxruntime,
hyperpyyaml, lightning, diffusers, the LLM classes) are stubbed. Needs x_transformers (and its
einx, loguru, frozendict, einops), scipy and numpy importable; torchaudio is stubbed if absent
(the DiT imports it for a training-only mel module).

    # pure-python deps once (scipy too where it is missing), into a private directory:
    pip download --no-deps -d .whl x-transformers==2.11.24 einx loguru frozendict einops
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python -m bench upstream-compare --upstream .upstream --device cpu --quick
    PYTHONPATH=/tmp/site python -m bench upstream-compare --upstream .upstream --device cuda

Runs in about 10 s with --quick on one CPU thread; the full comparison runs upstream's HiFT on
the CPU at 300 s (the reference of record), a few minutes.

Prints a markdown table; writes upstream_compare.json to $OUT (or --json) when set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

import torch

from flow_service.model import (
    FUSED_KERNELS,
    FlowModel,
    FlowRequest,
    PrefixCache,
    Voice,
    init_random_,
    load_flow,
    noise_buffer,
)
from flow_service.model.config import FLOW_PRESETS, DiTConfig, FlowConfig
from flow_service.runner import FlowRunner
from gateway.schedule import ChunkPlanner
from vocoder_service.model import HiFTGenerator, hift_noise_buffers, load_hift

SAMPLE_RATE = 24000
MEL_RATE = 50  # mel frames per second
TOKEN_RATE = 25


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().flatten().cpu(), ref.double().flatten().cpu()
    if x.shape != ref.shape:
        raise ValueError(f"length {x.numel()} vs reference {ref.numel()}")
    err = float(((x - ref) ** 2).sum())
    return math.inf if err == 0 else 10 * math.log10(float((ref**2).sum()) / err)


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double().flatten().cpu() - ref.double().flatten().cpu()).abs().max())


# -- upstream, imported with its heavy imports stubbed ------------------------------------------


def _stub(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


class _AttrDict(dict):
    """omegaconf.DictConfig as far as upstream's flow uses it: attribute reads of a dict."""

    __getattr__ = dict.__getitem__


def import_upstream(root: str) -> types.SimpleNamespace:
    root_path = Path(root).resolve()
    if not (root_path / "cosyvoice" / "flow" / "DiT" / "dit.py").is_file():
        raise SystemExit(f"--upstream {root}: no cosyvoice/flow/DiT/dit.py there")
    if not (root_path / "matcha" / "models" / "components" / "flow_matching.py").is_file():
        raise SystemExit(f"--upstream {root}: no matcha/models/components/flow_matching.py there")
    sys.path.insert(0, str(root_path))
    # Training / export / LLM machinery the inference path never runs.
    _stub("cosyvoice.utils.onnx", online_feature=False, SpeechTokenExtractor=None, onnx_path="")
    _stub("cosyvoice.utils.file_utils", convert_onnx_to_trt=None, export_cosyvoice2_vllm=None)
    _stub(
        "cosyvoice.utils.class_utils",
        **{f"COSYVOICE_{k}_CLASSES": {} for k in ("EMB", "SUBSAMPLE", "ATTENTION", "ACTIVATION")},
    )
    _stub("matcha.models.components.decoder", Decoder=None)
    _stub("matcha.utils")
    _stub("matcha.utils.pylogger", get_pylogger=logging.getLogger)
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        _stub("omegaconf", DictConfig=_AttrDict)
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        _stub("torchaudio", transforms=types.SimpleNamespace(MelSpectrogram=None))
    import cosyvoice.cli.model as cli_model
    import cosyvoice.flow.DiT.dit as dit
    import cosyvoice.flow.flow as flow
    import cosyvoice.flow.flow_matching as flow_matching
    import cosyvoice.hifigan.f0_predictor as f0_predictor
    import cosyvoice.hifigan.generator as generator
    import cosyvoice.transformer.upsample_encoder as upsample_encoder

    return types.SimpleNamespace(
        CosyVoice3Model=cli_model.CosyVoice3Model,
        DiT=dit.DiT,
        CausalMaskedDiffWithDiT=flow.CausalMaskedDiffWithDiT,
        CausalConditionalCFM=flow_matching.CausalConditionalCFM,
        CausalConvRNNF0Predictor=f0_predictor.CausalConvRNNF0Predictor,
        CausalHiFTGenerator=generator.CausalHiFTGenerator,
        PreLookaheadLayer=upsample_encoder.PreLookaheadLayer,
    )


def upstream_flow(up, cfg: FlowConfig) -> torch.nn.Module:
    """cosyvoice3.yaml's `flow:` block, widths and depth from `cfg`."""
    d: DiTConfig = cfg.dit
    cfm = _AttrDict(
        sigma_min=1e-06,
        solver="euler",
        t_scheduler="cosine",
        training_cfg_rate=0.2,
        inference_cfg_rate=cfg.cfg_rate,
        reg_loss_type="l1",
    )
    estimator = up.DiT(
        dim=d.dim,
        depth=d.depth,
        heads=d.heads,
        dim_head=d.dim_head,
        ff_mult=d.ff_mult,
        mel_dim=80,
        mu_dim=80,
        spk_dim=80,
        out_channels=80,
        static_chunk_size=25 * 2,
        num_decoding_left_chunks=-1,
    )
    decoder = up.CausalConditionalCFM(240, cfm, n_spks=1, spk_emb_dim=80, estimator=estimator)
    return up.CausalMaskedDiffWithDiT(
        input_size=80,
        output_size=80,
        spk_embed_dim=192,
        output_type="mel",
        vocab_size=6561,
        input_frame_rate=25,
        only_mask_loss=True,
        token_mel_ratio=2,
        pre_lookahead_len=3,
        pre_lookahead_layer=up.PreLookaheadLayer(80, cfg.pre_lookahead_channels, 3),
        decoder=decoder,
    )


def upstream_hift(up, base_channels: int, f0_channels: int) -> torch.nn.Module:
    """cosyvoice3.yaml's `hift:` block."""
    return up.CausalHiFTGenerator(
        in_channels=80,
        base_channels=base_channels,
        nb_harmonics=8,
        sampling_rate=SAMPLE_RATE,
        nsf_alpha=0.1,
        nsf_sigma=0.003,
        nsf_voiced_threshold=10,
        upsample_rates=[8, 5, 3],
        upsample_kernel_sizes=[16, 11, 7],
        istft_params={"n_fft": 16, "hop_len": 4},
        resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        lrelu_slope=0.1,
        audio_limit=0.99,
        conv_pre_look_right=4,
        f0_predictor=up.CausalConvRNNF0Predictor(
            num_class=1, in_channels=80, cond_channels=f0_channels
        ),
    )


def load_upstream_hift(up, preset: str, state: dict, device: str) -> torch.nn.Module:
    cfg = load_hift(None, preset=preset).cfg
    m = upstream_hift(up, cfg.base_channels, cfg.f0_cond_channels)
    m.load_state_dict(state, strict=True)
    # Upstream draws its fixed noise from the global RNG; give it ours (vocoder noise.py).
    buffers = hift_noise_buffers(cfg.noise_seed)
    m.m_source.l_sin_gen.rand_ini = buffers["rand_ini"][None].clone()
    m.m_source.l_sin_gen.sine_waves = buffers["sine_noise"][None]
    return m.to(device).eval()


def load_upstream_flow(up, cfg: FlowConfig, state: dict, device: str) -> torch.nn.Module:
    m = upstream_flow(up, cfg)
    m.load_state_dict(state, strict=True)
    m.decoder.rand_noise = noise_buffer("cpu", cfg.max_frames).T[None].clone()  # (1, 80, frames)
    return m.to(device).eval()


# -- inputs ----------------------------------------------------------------------------------------


def voiced_mel(frames: int, seed: int) -> torch.Tensor:
    """(1, 80, frames) smooth random log-mel-like input (values around -6..2)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(1, 80, frames // 5 + 2, generator=g)
    mel = torch.nn.functional.interpolate(coarse, size=frames, mode="linear", align_corners=True)
    return mel * 1.5 - 2.0


def voiced_fraction(hift: HiFTGenerator, mel: torch.Tensor) -> float:
    with torch.no_grad():
        f0 = hift.f0_predictor(mel.to(hift.device, torch.float64))  # (1, frames - 3)
    return float((f0 > hift.cfg.nsf_voiced_threshold).double().mean())


# -- sections --------------------------------------------------------------------------------------


def run_hift(up, a, rows: list[dict], tmp: Path) -> None:
    preset = "small" if a.quick else "cosyvoice3-0.5b"
    state = load_hift(None, preset=preset, fold_weight_norm=False).state_dict()
    torch.save(state, tmp / "hift.pt")
    devices = ["cpu"] + ([a.device] if a.device != "cpu" else [])
    ups = {d: load_upstream_hift(up, preset, state, d) for d in devices}
    ours = {
        (d, mode): load_hift(tmp / "hift.pt", device=d, preset=preset, phase_mode=mode)
        for d in devices
        for mode in ("exact", "upstream")
    }
    voiced = voiced_fraction(ours["cpu", "exact"], voiced_mel(500, 1))
    print(f"hift: preset {preset}, voiced frames {voiced:.0%}", file=sys.stderr)
    for seconds in a.hift_seconds:
        mel = voiced_mel(int(seconds * MEL_RATE), seed=int(seconds))
        refs = {}
        for d in devices:
            t = time.perf_counter()
            with torch.no_grad():
                refs[d] = ups[d].inference(mel.to(d), finalize=True)[0][0].float().cpu()
            sec = time.perf_counter() - t
            print(f"  upstream hift {seconds:g} s on {d}: {sec:.1f} s", file=sys.stderr)
        if a.device != "cpu":
            rows.append(
                _row(
                    "hift",
                    f"upstream {a.device}",
                    "upstream cpu",
                    seconds,
                    refs[a.device],
                    refs["cpu"],
                )
            )
        for (d, mode), model in ours.items():
            if d == "cpu" and a.device != "cpu" and seconds > a.cpu_max_seconds:
                continue  # upstream's CPU decode is the reference; ours on CPU only up to here
            out = model.decode(mel[0].to(d), finalize=True).float().cpu()
            rows.append(_row("hift", f"ours {mode} {d}", "upstream cpu", seconds, out, refs["cpu"]))
            if d != "cpu":
                rows.append(
                    _row("hift", f"ours {mode} {d}", f"upstream {d}", seconds, out, refs[d])
                )


def _row(stage: str, case: str, ref: str, seconds: float, x, r, **extra) -> dict:
    return {
        "stage": stage,
        "case": case,
        "reference": ref,
        "seconds": round(seconds, 2),
        "snr_db": round(snr_db(x, r), 1),
        "max_abs": float(f"{max_abs(x, r):.3g}"),
        **extra,
    }


def flow_config(a) -> FlowConfig:
    return FLOW_PRESETS["small"] if a.quick else full_width_flow(a.flow_depth)


def full_width_flow(depth: int) -> FlowConfig:
    """The official flow's widths with `depth` DiT layers (22 in the real model)."""
    full = FLOW_PRESETS["cosyvoice3-0.5b"]
    return dataclasses.replace(full, dit=dataclasses.replace(full.dit, depth=depth))


def make_inputs(n_p: int, n: int) -> dict:
    """A voice of n_p prompt tokens and an utterance of n tokens (seeded)."""
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_token": torch.randint(0, 6561, (n_p,), generator=g),
        "prompt_feat": voiced_mel(2 * n_p, seed=8)[0].T.contiguous(),  # (2 n_p, 80)
        "embedding": torch.randn(192, generator=g),
        "tokens": torch.randint(0, 6561, (n,), generator=g),
    }


def upstream_stream(up, flow, hift, x: dict, device: str, fp16: bool):
    """Upstream's CosyVoice3Model.token2wav driven with tts()'s streaming schedule (docs/REFERENCE.md §6.2:
    hop 25 + prompt pad, doubling to 100, 3 lookahead tokens, final call finalize=True with
    stream=False). Returns (full mel (80, T), audio, [(num_tokens, offset, finalize)])."""
    model = up.CosyVoice3Model(None, flow, hift, fp16=fp16)
    model.device = torch.device(device)
    rid = str(uuid.uuid1())
    model.hift_cache_dict[rid] = None
    args = {
        "prompt_token": x["prompt_token"][None].int(),
        "prompt_feat": x["prompt_feat"][None],
        "embedding": x["embedding"][None],
        "uuid": rid,
    }
    tokens = x["tokens"][None].int()
    n = tokens.shape[1]
    hop = model.token_hop_len
    pad = math.ceil(x["prompt_token"].shape[0] / hop) * hop - x["prompt_token"].shape[0]
    offset, audio, calls = 0, [], []
    while True:
        this_hop = hop + pad if offset == 0 else hop
        if n < offset + this_hop + 3:
            break
        end = offset + this_hop + 3
        audio.append(
            model.token2wav(
                tokens[:, :end], token_offset=offset, stream=True, finalize=False, **args
            )
        )
        calls.append((end, offset, False))
        offset += this_hop
        hop = min(model.token_max_hop_len, hop * model.stream_scale_factor)
    audio.append(model.token2wav(tokens, token_offset=offset, finalize=True, **args))
    calls.append((n, offset, True))
    mel = model.hift_cache_dict[rid]["mel"][0].float().cpu()
    return mel, torch.cat([s[0].float().cpu() for s in audio]), calls


def ours_stream(flow: FlowModel, hifts: dict[str, HiFTGenerator], x: dict, generate=None):
    """Our model-level streaming path: the gateway's planner, one flow call per chunk, one HiFT
    session per vocoder. Returns (mel (80, T), {name: audio}, [(num_tokens, offset, final)]).
    `generate` (default `flow.generate`) runs one call: `served_generate` runs it the way the
    flow service does."""
    generate = generate or flow.generate
    voice = Voice(x["prompt_token"], x["prompt_feat"], x["embedding"])
    planner = ChunkPlanner(voice.num_prompt_tokens)
    states = {name: h.new_session() for name, h in hifts.items()}
    mels, audio, calls = [], {name: [] for name in hifts}, []
    n = x["tokens"].shape[0]
    while (c := planner.next_call(n, ended=True)) is not None:
        req = FlowRequest(
            voice,
            x["tokens"][: c.num_tokens],
            c.token_offset,
            c.finalize,
            c.streaming,
            cache_key="stream-0",
        )
        mel = generate([req])[0]
        mels.append(mel)
        for name, h in hifts.items():
            audio[name].append(h.decode_one(states[name], mel, c.finalize).float().cpu())
        calls.append((c.num_tokens, c.token_offset, c.finalize))
    return torch.cat(mels, dim=1), {k: torch.cat(v) for k, v in audio.items()}, calls


SERVED_MODES = {
    # name -> (prefix cache, CUDA graphs): the flow service's two batch paths. A graphed batch
    # recomputes its prefix; an eager one reads the prefix cache (flow_service/runner.py).
    "fused norms + prefix cache": (True, False),
    "fused norms + CUDA graphs": (False, True),
}


def served_generate(flow: FlowModel, mode: str):
    """`generate` for `ours_stream` through the flow service's runner: the service's kernels
    (fused norms, compiled on CUDA) and, per SERVED_MODES, its prefix cache or its CUDA
    graphs. Returns (generate, runner)."""
    use_cache, graphs = SERVED_MODES[mode]
    cache = PrefixCache.for_model(flow, 1 << 30) if use_cache else None
    runner = FlowRunner(flow, prefix_cache=cache, cuda_graphs=graphs)
    return runner.generate, runner


def save_random_weights(tmp: Path, cfg: FlowConfig, hift_preset: str) -> tuple[dict, dict]:
    """Seeded random flow.pt and hift.pt (upstream key names) in `tmp`; returns both states."""
    with torch.device("meta"):
        model = FlowModel(cfg)
    state = init_random_(model.to_empty(device="cpu"), seed=3).state_dict()
    torch.save(state, tmp / "flow.pt")
    hift_state = load_hift(None, preset=hift_preset, fold_weight_norm=False).state_dict()
    torch.save(hift_state, tmp / "hift.pt")
    return state, hift_state


def run_flow(up, a, rows: list[dict], tmp: Path) -> None:
    cfg = flow_config(a)
    hift_preset = "small" if a.quick else "cosyvoice3-0.5b"
    state, hift_state = save_random_weights(tmp, cfg, hift_preset)
    d = a.device
    x = make_inputs(a.prompt_tokens, a.utterance_tokens)
    seconds = a.utterance_tokens / TOKEN_RATE
    print(
        f"flow: dim {cfg.dit.dim}, depth {cfg.dit.depth}; {seconds:g} s utterance", file=sys.stderr
    )

    up_flow = load_upstream_flow(up, cfg, state, d)
    up_hift = load_upstream_hift(up, hift_preset, hift_state, d)
    t = time.perf_counter()
    ref_mel, ref_audio, up_calls = upstream_stream(up, up_flow, up_hift, x, d, fp16=False)
    print(
        f"  upstream fp32 stream: {time.perf_counter() - t:.1f} s, {len(up_calls)} calls",
        file=sys.stderr,
    )

    hifts = {
        f"hift {dt} {mode}": load_hift(
            tmp / "hift.pt", device=d, preset=hift_preset, dtype=getattr(torch, dt), phase_mode=mode
        )
        for dt, mode in (("float32", "exact"), ("float32", "upstream"), ("bfloat16", "exact"))
    }
    # HiFT alone on upstream's fp32 mel: the vocoder's share of each distance.
    for name, h in hifts.items():
        rows.append(
            _row(
                "hift on upstream mel",
                f"ours {name}",
                "upstream fp32",
                seconds,
                _session_decode(h, ref_mel),
                ref_audio,
            )
        )
    for flow_dtype in ("float32", "bfloat16"):
        ours = load_flow(tmp / "flow.pt", device=d, dtype=getattr(torch, flow_dtype))
        t = time.perf_counter()
        mel, audio, calls = ours_stream(ours, hifts, x)
        print(f"  ours {flow_dtype} stream: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        if calls != up_calls:
            raise SystemExit(f"chunk schedules differ: ours {calls} vs upstream {up_calls}")
        rows.append(
            _row("flow mel", f"ours flow {flow_dtype}", "upstream fp32", seconds, mel, ref_mel)
        )
        for name, wav in audio.items():
            rows.append(
                _row(
                    "end to end",
                    f"ours flow {flow_dtype} + {name}",
                    "upstream fp32",
                    seconds,
                    wav,
                    ref_audio,
                )
            )
    if a.served:
        # As the flow service runs it (fused norms and rotary on by default on CUDA): fidelity
        # must not move with the kernels, the cache or the graphs on.
        for flow_dtype in ("float32", "bfloat16"):
            ours = load_flow(
                tmp / "flow.pt",
                device=d,
                dtype=getattr(torch, flow_dtype),
                kernels=FUSED_KERNELS,
            )
            for mode, (_, graphs) in SERVED_MODES.items():
                if graphs and not d.startswith("cuda"):
                    continue  # CUDA graphs need CUDA
                generate, runner = served_generate(ours, mode)
                case = f"ours flow {flow_dtype} served ({mode})"
                t = time.perf_counter()
                mel, audio, calls = ours_stream(ours, hifts, x, generate)
                runner.close()
                cache = runner.prefix_cache
                hits = f", prefix cache hits {cache.stats['hits']}" if cache is not None else ""
                print(f"  {case}: {time.perf_counter() - t:.1f} s{hits}", file=sys.stderr)
                if calls != up_calls:
                    raise SystemExit(f"chunk schedules differ: ours {calls} vs upstream {up_calls}")
                rows.append(_row("flow mel", case, "upstream fp32", seconds, mel, ref_mel))
                wav = audio["hift float32 exact"]
                rows.append(
                    _row(
                        "end to end",
                        f"{case} + hift float32 exact",
                        "upstream fp32",
                        seconds,
                        wav,
                        ref_audio,
                    )
                )
    if d.startswith("cuda"):
        fp16_mel, fp16_audio, _ = upstream_stream(up, up_flow, up_hift, x, d, fp16=True)
        rows.append(
            _row("flow mel", "upstream fp16 autocast", "upstream fp32", seconds, fp16_mel, ref_mel)
        )
        rows.append(
            _row(
                "end to end",
                "upstream fp16 autocast",
                "upstream fp32",
                seconds,
                fp16_audio,
                ref_audio,
            )
        )
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            up_alone = up_hift.inference(ref_mel[None].to(d), finalize=True)[0][0].float().cpu()
        rows.append(
            _row(
                "hift on upstream mel",
                "upstream hift fp16 autocast",
                "upstream fp32",
                seconds,
                up_alone,
                ref_audio,
            )
        )


def _session_decode(h: HiFTGenerator, mel: torch.Tensor) -> torch.Tensor:
    return h.decode(mel, finalize=True).float().cpu()


def markdown(rows: list[dict]) -> str:
    lines = [
        "| stage | case | reference | seconds | SNR dB | max abs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['case']} | {r['reference']} | {r['seconds']:g} "
            f"| {r['snr_db']} | {r['max_abs']:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--upstream", required=True, help="dir with cosyvoice/ and matcha/ sources")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quick", action="store_true", help="small presets and short inputs (CPU)")
    p.add_argument("--sections", default="hift,stream", help="hift, stream (stream runs fast)")
    p.add_argument(
        "--hift-seconds", default=None, help="comma list; default 10,60,300 (quick 2,10)"
    )
    p.add_argument(
        "--cpu-max-seconds",
        type=float,
        default=60,
        help="with a CUDA --device, run ours on the CPU only up to this length (time)",
    )
    p.add_argument("--flow-depth", type=int, default=2, help="DiT layers at full width")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 75 (quick 30)")
    p.add_argument("--utterance-tokens", type=int, default=None, help="default 250 (quick 60)")
    p.add_argument(
        "--tf32",
        default="default",
        choices=["default", "on", "off"],
        help="CUDA TF32 for matmuls and cuDNN convs: PyTorch's defaults (cuDNN on, matmul off; "
        "as both stacks run as shipped), or forced on/off for both",
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="also run our flow as the flow service does (fused norms; prefix cache, and CUDA "
        "graphs on CUDA) in fp32 and bf16 against upstream fp32",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    p.add_argument(
        "--json", default=None, help="write rows here (default $OUT/upstream_compare.json)"
    )
    a = p.parse_args(argv)
    a.hift_seconds = [
        float(s) for s in (a.hift_seconds or ("2,10" if a.quick else "10,60,300")).split(",")
    ]
    a.prompt_tokens = a.prompt_tokens or (30 if a.quick else 75)
    a.utterance_tokens = a.utterance_tokens or (60 if a.quick else 250)
    sections = set(a.sections.split(","))
    if not sections <= {"hift", "stream"}:
        p.error(f"--sections {a.sections!r}: want hift and/or stream")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.tf32 != "default":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.tf32 == "on"
    logging.basicConfig(level=logging.WARNING)

    up = import_upstream(a.upstream)
    torch.set_grad_enabled(False)
    rows: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if "hift" in sections:
            run_hift(up, a, rows, Path(tmp))
        if "stream" in sections:
            run_flow(up, a, rows, Path(tmp))
    elapsed = time.perf_counter() - started
    device_name = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu"
    tf32 = {
        "matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn": torch.backends.cudnn.allow_tf32,
    }
    print(f"\n{device_name}, torch {torch.__version__}, tf32 {tf32}, {elapsed:.0f} s\n")
    print(markdown(rows))
    out = a.json or (
        os.path.join(os.environ["OUT"], "upstream_compare.json") if os.environ.get("OUT") else None
    )
    if out:
        meta = {
            "argv": sys.argv,
            "device": device_name,
            "torch": torch.__version__,
            "tf32": tf32,
            "elapsed_s": elapsed,
        }
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0
