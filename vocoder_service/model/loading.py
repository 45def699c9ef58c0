"""Build a HiFTGenerator from hift.pt (strict, either weight-norm convention) or from seeded
random weights (docs/REFERENCE.md §1.2, §9)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch

from token2wav import SAMPLES_PER_FRAME
from token2wav.checkpoint import load_tensors
from vocoder_service.model.config import HIFT_PRESETS, HiFTConfig
from vocoder_service.model.errors import CheckpointError
from vocoder_service.model.generator import HiFTGenerator

G_KEY = ".parametrizations.weight.original0"  # weight-norm magnitude g (out, 1, 1)
V_KEY = ".parametrizations.weight.original1"  # weight-norm direction v (out, in, k)
RANDOM_INIT_SEED = 0
RANDOM_F0_HZ = (150.0, 80.0)  # random weights: f0 bias and spread, so frames are mostly voiced
DEFAULT_PRESET = "small"  # what `load_hift(None)` builds: the CPU/laptop default


def load_hift(
    path: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    preset: str | None = None,
    fold_weight_norm: bool = True,
    seed: int = RANDOM_INIT_SEED,
    config: HiFTConfig | None = None,
    phase_mode: str | None = None,
) -> HiFTGenerator:
    """HiFT in eval mode on `device`: decoder in `dtype`, f0 predictor in float64.

    path: a model dir holding hift.pt, or the file. A checkpoint may carry a `generator.` prefix
    and weight-norm keys as `weight_g`/`weight_v` or `parametrizations.weight.original0/1` (or
    plain folded `weight`); it must match the model key for key and shape for shape (strict).
    Its architecture is read off the shapes (dilations, slopes and NSF constants, which no shape
    records, are the defaults) unless `config` or `preset` names it.
    path None: `config`, else `preset` (default "small"), with deterministic random weights
    from `seed`.
    phase_mode: overrides the config's ("exact" or "upstream", see layers.SourceModule).
    fold_weight_norm: compute g v / ||v|| once after loading (identical values, ~110 fewer
    kernels per batch); the state_dict then has plain `.weight` keys.
    """
    if path is None:
        name = preset or DEFAULT_PRESET
        if config is None and name not in HIFT_PRESETS:
            raise CheckpointError(f"unknown preset {name!r}; known: {sorted(HIFT_PRESETS)}")
        cfg = config or HIFT_PRESETS[name]
        state = None
    else:
        state = normalise_keys(read_checkpoint(path))
        if config is None and preset is not None and preset not in HIFT_PRESETS:
            raise CheckpointError(f"unknown preset {preset!r}; known: {sorted(HIFT_PRESETS)}")
        cfg = config or (HIFT_PRESETS[preset] if preset else infer_config(state))
    if phase_mode is not None:
        cfg = dataclasses.replace(cfg, phase_mode=phase_mode)
    model = HiFTGenerator(cfg)
    if state is None:
        init_random_weights(model, seed)
    else:
        _load_strict(model, state)
    model.to(device)
    model.f0_predictor.double()
    if fold_weight_norm:
        model.fold_weight_norm()
    model.set_dtype(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    file = Path(path)
    if file.is_dir():
        file = file / "hift.pt"
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file")
    obj = load_tensors(file, CheckpointError)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{file}: expected a state dict of tensors")
    return obj


def normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip `generator.`; rename weight_g/weight_v to the parametrisation names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("generator.")
        key = re.sub(r"\.weight_g$", G_KEY, key)
        key = re.sub(r"\.weight_v$", V_KEY, key)
        if key in out:
            raise CheckpointError(f"key {key} appears twice after normalisation")
        out[key] = value
    return out


def _unfold_plain_weights(model: HiFTGenerator, state: dict[str, torch.Tensor]) -> None:
    """A folded checkpoint stores `X.weight` where the model has g and v: use v = w, g = ||w||."""
    expected = model.state_dict()
    for key in [k for k in state if k.endswith(".weight")]:
        stem = key[: -len(".weight")]
        if stem + V_KEY in expected and stem + V_KEY not in state:
            w = state.pop(key)
            state[stem + V_KEY] = w
            state[stem + G_KEY] = w.norm(dim=tuple(range(1, w.dim())), keepdim=True)


def _load_strict(model: HiFTGenerator, state: dict[str, torch.Tensor]) -> None:
    state = dict(state)
    _unfold_plain_weights(model, state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"hift checkpoint does not match the model: {len(missing)} missing "
            f"{missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}"
        )
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(
            f"{len(bad)} shape mismatches, e.g. {k}: checkpoint {tuple(state[k].shape)}, "
            f"model {tuple(expected[k].shape)}"
        )
    model.load_state_dict(state, strict=True)


def _v_shape(state: dict[str, torch.Tensor], stem: str) -> tuple[int, ...]:
    if stem + V_KEY in state:
        return tuple(state[stem + V_KEY].shape)
    if stem + ".weight" in state:
        return tuple(state[stem + ".weight"].shape)
    raise CheckpointError(f"checkpoint has no weight for {stem}")


def _count(state: dict[str, torch.Tensor], pattern: str) -> int:
    ids = {int(m.group(1)) for k in state if (m := re.match(pattern, k))}
    if ids != set(range(len(ids))):
        raise CheckpointError(f"non-contiguous indices for {pattern}: {sorted(ids)}")
    return len(ids)


def infer_config(state: dict[str, torch.Tensor]) -> HiFTConfig:
    """HiFTConfig from checkpoint shapes: widths, stage count, kernels, rates, harmonics."""
    d = HiFTConfig()
    try:
        base, in_ch, pre_k = _v_shape(state, "conv_pre")
        n_stages = _count(state, r"ups\.(\d+)\.")
        ups_k = tuple(_v_shape(state, f"ups.{i}")[2] for i in range(n_stages))
        down_k = [tuple(state[f"source_downs.{i}.weight"].shape) for i in range(n_stages)]
        n_fft = down_k[0][1] - 2
        down = [k[2] // 2 if k[2] > 1 else 1 for k in down_k]
        hop = n_fft // 4
        rates = [SAMPLES_PER_FRAME // (hop * down[0])] + [
            down[i] // down[i + 1] for i in range(n_stages - 1)
        ]
        n_res = _count(state, r"resblocks\.(\d+)\.")
        nk = n_res // n_stages
        res_k = tuple(_v_shape(state, f"resblocks.{j}.convs1.0")[2] for j in range(nk))
        src_k = tuple(_v_shape(state, f"source_resblocks.{i}.convs1.0")[2] for i in range(n_stages))
        n_dil = _count(state, r"resblocks\.0\.convs1\.(\d+)\.")
        n_src_dil = _count(state, r"source_resblocks\.0\.convs1\.(\d+)\.")
        harmonics = state["m_source.l_linear.weight"].shape[1]
        f0_c = _v_shape(state, "f0_predictor.condnet.0")[0]
        f0_ids = {
            int(m.group(1)) for k in state if (m := re.match(r"f0_predictor\.condnet\.(\d+)\.", k))
        }
        f0_convs = len(f0_ids)
        if f0_ids != set(range(0, 2 * f0_convs, 2)):  # convs at even indices, ELUs between
            raise ValueError(f"f0 condnet conv indices {sorted(f0_ids)}")
    except (KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(f"cannot infer the HiFT architecture: {exc!r}") from None
    if n_dil != len(d.resblock_dilations[0]) or n_src_dil != len(d.source_resblock_dilations[0]):
        raise CheckpointError("ResBlock dilation count differs from (1, 3, 5); pass a preset")
    try:
        return HiFTConfig(
            in_channels=in_ch,
            base_channels=base,
            nb_harmonics=harmonics - 1,
            upsample_rates=tuple(rates),
            upsample_kernel_sizes=ups_k,
            istft_n_fft=n_fft,
            istft_hop=hop,
            resblock_kernel_sizes=res_k,
            resblock_dilations=(d.resblock_dilations[0],) * nk,
            source_resblock_kernel_sizes=src_k,
            source_resblock_dilations=(d.source_resblock_dilations[0],) * n_stages,
            conv_pre_look_right=pre_k - 1,
            f0_cond_channels=f0_c,
            f0_num_convs=f0_convs,
        )
    except ValueError as exc:
        raise CheckpointError(f"checkpoint implies an unsupported HiFT: {exc}") from None


def init_random_weights(model: HiFTGenerator, seed: int = RANDOM_INIT_SEED) -> None:
    """Deterministic random weights (independent of the global RNG): PyTorch-default-like
    uniform(+-1/sqrt(fan_in)) for v, weights and biases; g = ||v|| x U(0.5, 1.5) per output
    channel (weight norm non-trivial); Snake alpha U(0.5, 1.5); f0 head set so f0 lands near
    150 +- 80 Hz (mostly voiced, so the sine source matters)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)

    def uniform(shape, bound):
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound

    with torch.no_grad():
        params = dict(model.named_parameters())
        for name in sorted(params):  # fixed order: same weights whatever the module order
            p = params[name]
            if name.endswith("original0"):
                continue  # set with its v below
            if name.endswith("original1"):
                fan_in = p.shape[1] * p.shape[2]
                v = uniform(p.shape, 1 / math.sqrt(fan_in))
                p.copy_(v)
                gain = 0.5 + torch.rand(p.shape[0], 1, 1, generator=g, dtype=torch.float64)
                params[name[: -len("1")] + "0"].copy_(v.norm(dim=(1, 2), keepdim=True) * gain)
            elif name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("weight"):
                p.copy_(uniform(p.shape, 1 / math.sqrt(math.prod(p.shape[1:]))))
            else:  # bias: bound from the owning layer's fan-in
                stem = name[: -len(".bias")]
                owner = params.get(stem + ".weight", params.get(stem + V_KEY))
                p.copy_(uniform(p.shape, 1 / math.sqrt(math.prod(owner.shape[1:]))))
        # Calibrate the f0 head on a probe mel from the same generator (log-mel-like values).
        probe = torch.randn(1, model.cfg.in_channels, 200, generator=g, dtype=torch.float64) - 5
        head = model.f0_predictor.classifier
        head.bias.zero_()
        raw = model.f0_predictor.to(torch.float64).raw_output(probe)
        bias_hz, spread_hz = RANDOM_F0_HZ
        scale = spread_hz / raw.std().clamp_min(1e-12)
        head.weight.mul_(scale)
        head.bias.fill_(bias_hz - float(raw.mean() * scale))
        for p in model.parameters():  # float32-representable, like any hift.pt
            p.copy_(p.float())
