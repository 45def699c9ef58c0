"""The fixed source-noise buffers of the causal SineGen (docs/REFERENCE.md §5.4), shared by every model instance.

Upstream draws, in its SineGen2 constructor, `rand_ini = torch.rand(1, 9)` (then sets entry 0 to
0) and `sine_waves = torch.rand(1, 300 * 24000, 9)` from the global CPU generator; the causal
path then multiplies `sine_waves[:, :L]` by the noise amplitude, so sample n always gets row n.
The values are not in hift.pt, so any fixed buffer indexed by absolute sample position is as
good; ours is reproducible by name:

    g = torch.Generator(device="cpu"); g.manual_seed(seed)        # seed = HiFTConfig.noise_seed
    rand_ini   = torch.rand(1, 9, generator=g); rand_ini[:, 0] = 0  # first draw
    sine_noise = torch.rand(1, MAX_SAMPLES, 9, generator=g)         # second draw, U[0, 1)

`hift_noise_buffers(seed)` returns exactly these (without the leading 1). To make upstream use
them: `m_source.l_sin_gen.rand_ini = b["rand_ini"][None]` and
`m_source.l_sin_gen.sine_waves = b["sine_noise"][None]`. `rand_ini` is added to sample 0 only,
which the frame-rate resampling never reads (docs/REFERENCE.md §5.4), so it changes nothing; it is drawn to keep
upstream's order. Upstream's third buffer (`SourceModuleHnNSF.uv`, the noise branch) is unused by
the generator and not drawn.

One CPU copy per seed and process (7.2M x 9 float32 = 259 MB, about 1 s to draw), plus one copy
per device it is used on; never per session, never in a state_dict.
"""

from __future__ import annotations

import threading

import torch

from vocoder_service.model.config import MAX_SAMPLES

NUM_NOISE_COLUMNS = 9  # one per sine component (fundamental + 8 overtones)

_lock = threading.Lock()
_cpu: dict[int, dict[str, torch.Tensor]] = {}  # seed -> buffers
_on_device: dict[tuple[int, str], torch.Tensor] = {}  # (seed, device) -> sine_noise


def hift_noise_buffers(seed: int) -> dict[str, torch.Tensor]:
    """{"rand_ini": (9,), "sine_noise": (MAX_SAMPLES, 9)} float32 on CPU; cached, do not modify."""
    with _lock:
        if seed not in _cpu:
            g = torch.Generator(device="cpu")
            g.manual_seed(seed)
            rand_ini = torch.rand(1, NUM_NOISE_COLUMNS, generator=g)
            rand_ini[:, 0] = 0
            sine_noise = torch.rand(1, MAX_SAMPLES, NUM_NOISE_COLUMNS, generator=g)
            _cpu[seed] = {"rand_ini": rand_ini[0], "sine_noise": sine_noise[0]}
        return _cpu[seed]


def sine_noise_on(seed: int, device: torch.device) -> torch.Tensor:
    """The (MAX_SAMPLES, 9) buffer on `device`, copied there once per process."""
    key = (seed, str(device))
    buf = _on_device.get(key)
    if buf is None:
        cpu = hift_noise_buffers(seed)["sine_noise"]
        buf = cpu if device.type == "cpu" else cpu.to(device)
        with _lock:
            buf = _on_device.setdefault(key, buf)
    return buf
