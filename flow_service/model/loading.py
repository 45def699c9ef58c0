"""Build a FlowModel: from an official CosyVoice3 `flow.pt` (strict keys, shapes checked before
any memory is committed, config inferred from the tensors) or as a seeded random model.

Random init (no checkpoint): every parameter is drawn from one CPU generator seeded `seed`, in
registration order, so the same seed gives the same weights on every machine. Weights are
N(0, gain^2 / fan_in), biases N(0, 0.02^2), token embeddings N(0, 1). Unlike training-time
AdaLN-Zero init, the modulation linears are NOT zero: a zero gate makes every block an identity
and the output independent of the voice and tokens. Gains are chosen to keep the residual stream
and the velocity O(1) through 22 blocks, so random-weight numbers exercise realistic values.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from flow_service.model.config import (
    FLOW_PRESETS,
    MEL_BINS,
    PRE_LOOKAHEAD,
    SPK_EMBED_DIM,
    VOCAB_SIZE,
    DiTConfig,
    FlowConfig,
)
from flow_service.model.dit import DiTKernels
from flow_service.model.flow import FlowModel
from token2wav.checkpoint import load_tensors

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "flow.pt"
BIAS_STD = 0.02
ADALN_GAIN = 0.5  # modulation linears: keeps 1 + scale and the gates moderate over 22 blocks
_LIST_LIMIT = 12  # names shown per category in a CheckpointError

_EST = "decoder.estimator."
_BLOCK_RE = re.compile(r"^decoder\.estimator\.transformer_blocks\.(\d+)\.")


class CheckpointError(RuntimeError):
    """flow.pt cannot be used: unreadable, not a CosyVoice3 flow, or keys/shapes that differ."""

    def __init__(
        self,
        message: str,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[tuple[str, tuple, tuple]] | None = None,
    ):
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []
        parts = [message]
        if self.missing:
            parts.append(_listing("missing key", self.missing))
        if self.unexpected:
            parts.append(_listing("unexpected key", self.unexpected))
        if self.mismatched:
            shown = [
                f"{k} checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in self.mismatched
            ]
            parts.append(_listing("shape mismatch", shown))
        super().__init__("\n  ".join(parts))


def _listing(kind: str, names: list[str]) -> str:
    head = ", ".join(names[:_LIST_LIMIT])
    more = f", ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return f"{len(names)} {kind}{'s' if len(names) != 1 else ''}: {head}{more}"


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read `flow.pt` (or `<dir>/flow.pt`) onto the CPU, tensors only."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    state = load_tensors(path, CheckpointError)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"{path}: not a state dict (got {type(state).__name__})")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: non-tensor entries", unexpected=bad)
    return state


def _shape(state: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError("cannot infer the model size from the checkpoint", missing=[key])
    return tuple(state[key].shape)


def config_from_state_dict(state: dict[str, torch.Tensor]) -> FlowConfig:
    """Depth and widths from tensor shapes; solver constants are the CosyVoice3 ones."""
    vocab, mel = _shape(state, "input_embedding.weight")
    _, spk = _shape(state, "spk_embed_affine_layer.weight")
    hidden, _, k1 = _shape(state, "pre_lookahead_layer.conv1.weight")
    dim, _ = _shape(state, _EST + "input_embed.proj.weight")
    (half_rot,) = _shape(state, _EST + "rotary_embed.inv_freq")
    _, freq_dim = _shape(state, _EST + "time_embed.time_mlp.0.weight")
    _, per_group, kernel = _shape(state, _EST + "input_embed.conv_pos_embed.conv1.0.weight")
    ff_inner, _ = _shape(state, _EST + "transformer_blocks.0.ff.ff.0.0.weight")
    depth = 1 + max(int(m.group(1)) for k in state if (m := _BLOCK_RE.match(k)))

    interface = {
        "vocab_size": (vocab, VOCAB_SIZE),
        "mel channels": (mel, MEL_BINS),
        "speaker embedding": (spk, SPK_EMBED_DIM),
        "lookahead": (k1 - 1, PRE_LOOKAHEAD),
    }
    wrong = [
        f"{name} {got} (expected {want})" for name, (got, want) in interface.items() if got != want
    ]
    if wrong:
        raise CheckpointError("not a CosyVoice3 flow checkpoint: " + "; ".join(wrong))
    dim_head = 2 * half_rot
    try:
        dit = DiTConfig(
            dim=dim,
            depth=depth,
            heads=dim // dim_head,
            dim_head=dim_head,
            ff_mult=ff_inner // dim,
            time_freq_dim=freq_dim,
            conv_pos_kernel=kernel,
            conv_pos_groups=dim // per_group,
        )
        return FlowConfig(pre_lookahead_channels=hidden, dit=dit)
    except ValueError as exc:
        raise CheckpointError(f"inconsistent checkpoint shapes: {exc}") from exc


def check_state_dict(model: FlowModel, state: dict[str, torch.Tensor]) -> None:
    """Strict key and shape match against the model (which may live on the meta device)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        (k, tuple(state[k].shape), tuple(v.shape))
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        raise CheckpointError(
            "checkpoint does not match the flow model", missing, unexpected, mismatched
        )


@torch.no_grad()
def init_random_(model: FlowModel, seed: int = 0) -> FlowModel:
    """Seeded, machine-independent random weights (see the module docstring); also resets the
    rotary buffer, so an uninitialised (`to_empty`) model comes out complete. CPU model only."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    model.decoder.estimator.rotary_embed.reset_buffers()
    for name, param in model.named_parameters():
        if name == "input_embedding.weight":
            param.normal_(0.0, 1.0, generator=gen)
        elif param.dim() == 1:
            param.normal_(0.0, BIAS_STD, generator=gen)
        else:
            gain = ADALN_GAIN if name.endswith("norm.linear.weight") else 1.0
            fan_in = param[0].numel()
            param.normal_(0.0, gain / math.sqrt(fan_in), generator=gen)
    return model


def load_flow(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    preset: str | None = None,
    seed: int = 0,
    kernels: DiTKernels | None = None,
) -> FlowModel:
    """A FlowModel in eval mode on `device`, float32 (as upstream) or bfloat16.

    Every weight is cast to `dtype`.
    The noise, the Euler state, the time sinusoid and the rotary tables are fp32 regardless.

    path: a model dir holding flow.pt, or the file; None gives seeded random weights of
    `preset` (default "small"). With a checkpoint, depth and widths come from its tensors (the
    checkpoint wins; a different `preset` only logs a warning).

    kernels: which DiT kernels run (`DiTKernels`: fused norms), compiled here
    (on CUDA) for the shapes they will meet; None: plain."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype: {dtype} not supported (float32 or bfloat16; fp16 overflows)")
    if preset is not None and preset not in FLOW_PRESETS:
        raise ValueError(f"preset: unknown {preset!r}, expected one of {sorted(FLOW_PRESETS)}")
    if path is None:
        with torch.device("meta"):  # skip torch's default init: it is overwritten anyway
            model = FlowModel(FLOW_PRESETS[preset or "small"])
        model = init_random_(model.to_empty(device="cpu"), seed)
    else:
        state = read_state_dict(path)
        cfg = config_from_state_dict(state)
        if preset is not None and FLOW_PRESETS[preset] != cfg:
            logger.warning("%s is not the %r preset; using its own shapes: %s", path, preset, cfg)
        with torch.device("meta"):
            model = FlowModel(cfg)
        check_state_dict(model, state)
        model = model.to_empty(device=device)
        model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    if kernels is not None:
        model.decoder.estimator.kernels = kernels
        model.decoder.estimator.warm_up_kernels()  # compiles (logged) before anything is served
    return model
