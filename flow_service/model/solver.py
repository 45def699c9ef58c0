"""The solver's fixed parts (docs/REFERENCE.md §3): upstream's position-locked noise, the cosine
step schedule, and the Euler loop with classifier-free guidance that both solves run
(`CFMDecoder.solve` over whole sequences, `solve_with_prefix` over the frames after a cached
prefix): one loop, so the two cannot drift apart in the order of their float operations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from flow_service.model.config import MEL_BINS, NOISE_SEED

_noise_lock = threading.Lock()
_noise_by_device: dict[str, torch.Tensor] = {}  # device -> (MAX_FRAMES, c) fp32


def noise_buffer(device: torch.device | str, max_frames: int) -> torch.Tensor:
    """Upstream's fixed flow noise as (frames, c) fp32: column i of randn(1, 80, 15000) drawn
    right after seeding the CPU generator with 0 (docs/REFERENCE.md §3.1). Frame i of prompt + target always
    starts from row i, whatever the batch (invariant 2)."""
    key = str(torch.device(device))
    buf = _noise_by_device.get(key)
    if buf is None or buf.shape[0] < max_frames:
        with _noise_lock:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(NOISE_SEED)
            z = torch.randn((1, MEL_BINS, max_frames), generator=gen)  # exactly upstream's draw
            buf = z[0].T.contiguous().to(device)  # (frames, c)
            _noise_by_device[key] = buf
    return buf


def cosine_schedule(num_steps: int) -> list[tuple[float, float]]:
    """(tau_i, dtau_i) per Euler step, as upstream computes them in fp32:
    tau_span = 1 - cos(pi/2 u), u = linspace(0, 1); the running tau accumulates dtau, and the
    next dtau is tau_span[i+1] - tau. Computed on the CPU so every device and batch gets
    identical step values."""
    u = torch.linspace(0, 1, num_steps + 1, dtype=torch.float32, device="cpu")
    tau_span = 1 - torch.cos(u * 0.5 * torch.pi)
    tau, dtau = tau_span[0], tau_span[1] - tau_span[0]
    steps = []
    for i in range(1, num_steps + 1):
        steps.append((float(tau), float(dtau)))
        tau = tau + dtau
        if i < num_steps:
            dtau = tau_span[i + 1] - tau
    return steps


def euler_cfg(
    x: torch.Tensor,  # (b, q, c) fp32: the noise at tau = 0
    steps: Sequence[tuple[float, float]],
    cfg_rate: float,
    velocity: Callable[[int, float, torch.Tensor], torch.Tensor],
    between_steps: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Integrate dx/dtau = v from tau = 0 to 1; returns x (b, q, c) fp32. `velocity(step, tau,
    x)` gives v of the 2b solver rows, [b conditional; b unconditional], in any dtype; the
    Euler state stays fp32. `between_steps` runs after every step but the last, once the
    step's output is consumed (the engine runs an urgent batch there)."""
    b = x.shape[0]
    for step, (tau, dtau) in enumerate(steps):
        v = velocity(step, tau, x).float()
        x = x + dtau * ((1.0 + cfg_rate) * v[:b] - cfg_rate * v[b:])
        if between_steps is not None and step + 1 < len(steps):
            between_steps()
    return x
