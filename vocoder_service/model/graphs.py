"""CUDA-graph replay of the HiFT decode's device part (`HiFTGenerator.synthesize_core`), one graph
per padded batch shape, and the shape buckets that make graphs reusable.

A vocoder batch is ~900 small kernels (85 convolutions, ~75 Snake activations of 4-5 kernels
each, the source module, the STFT and the iSTFT): at one or a few rows the GPU mostly waits
for the host to launch them. A graph launches them all at once.

Buckets: rows are rounded up to the next of `row_sizes` and frames to a multiple of
`frame_multiple`, so a handful of graphs serve every batch. Padding is a zero row or zero
frames past every row's end, exactly what a longer row in a ragged batch already gives the
others: each row's valid outputs never read it (generator.py, step 3), so a padded batch equals
the unpadded one up to kernel rounding (the model tests check it on the CPU). Batches larger
than `row_sizes[-1]` rows or `max_frames` frames are not padded and run eagerly.

A plain object, not an nn.Module: it owns device buffers (static inputs, the graph memory
pool) and is used by one thread (the runner's worker). The replayed output is a static
buffer; the caller copies it to the host before the next call (`_synthesize` does).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEFAULT_ROW_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # and the largest batch, when larger
# The service's defaults (vocoder_service/config.py ModelConfig; --graph-max-rows,
# --graph-max-frames). Windows are padded to a multiple of 16 frames: 256 / 16 = 16 window
# buckets to capture at start-up per row bucket, and at most 15 frames of padding per window.
DEFAULT_MAX_ROWS, DEFAULT_FRAME_MULTIPLE, DEFAULT_MAX_FRAMES = 32, 16, 256


@dataclass(frozen=True)
class ShapeBuckets:
    """How a batch's rows and frames are padded. The default pads nothing."""

    row_sizes: tuple[int, ...] = ()  # increasing; empty: rows are never padded
    frame_multiple: int = 1
    max_frames: int = 0  # frames are padded only up to this (0: never)

    def __post_init__(self):
        if list(self.row_sizes) != sorted(set(self.row_sizes)) or any(
            r < 1 for r in self.row_sizes
        ):
            raise ValueError(f"row_sizes {self.row_sizes}: want increasing sizes >= 1")
        if self.frame_multiple < 1 or self.max_frames < 0:
            raise ValueError("frame_multiple must be >= 1 and max_frames >= 0")

    @classmethod
    def for_limits(
        cls,
        max_rows: int = DEFAULT_MAX_ROWS,
        frame_multiple: int = DEFAULT_FRAME_MULTIPLE,
        max_frames: int = DEFAULT_MAX_FRAMES,
    ) -> ShapeBuckets:
        """The service's buckets: DEFAULT_ROW_SIZES below max_rows, then max_rows itself."""
        rows = sorted({r for r in DEFAULT_ROW_SIZES if r < max_rows} | {max_rows})
        return cls(tuple(rows), frame_multiple, max_frames)

    @property
    def max_rows(self) -> int:
        return self.row_sizes[-1] if self.row_sizes else 0

    def rows(self, n: int) -> int:
        return next((r for r in self.row_sizes if r >= n), n)

    def frames(self, t: int) -> int:
        padded = -(-t // self.frame_multiple) * self.frame_multiple
        return padded if padded <= self.max_frames else t

    @property
    def frame_sizes(self) -> tuple[int, ...]:
        """Every padded frame count the buckets produce."""
        return tuple(range(self.frame_multiple, self.max_frames + 1, self.frame_multiple))

    @property
    def num_graph_shapes(self) -> int:
        """Graph shapes the buckets produce: rows x frames x (source 0 or 1 frame longer:
        a non-final chunk's source runs one frame past its decoder window, a final one's not)."""
        return 2 * len(self.row_sizes) * len(self.frame_sizes)

    def bucketed(self, rows: int, frames: int) -> bool:
        """Whether a padded batch of this shape is one the buckets produce (graph-worthy)."""
        return (
            rows in self.row_sizes
            and frames <= self.max_frames
            and frames % self.frame_multiple == 0
        )


@dataclass
class _Entry:
    graph: object  # torch.cuda.CUDAGraph (anything with replay() in tests)
    inputs: list[torch.Tensor]  # static device buffers, in the core's argument order
    output: torch.Tensor


class GraphedCore:
    """`core(mel_in, f0, phase, noise_at, n_frames, src_samples)` with the same contract as
    `HiFTGenerator.synthesize_core`: bucketed shapes replay a captured graph (captured on first
    use, at most `max_graphs` kept, least recently used dropped), other shapes run eagerly."""

    def __init__(
        self,
        core: Callable[..., torch.Tensor],
        device: torch.device,
        buckets: ShapeBuckets,
        look_right: int,
        max_graphs: int = 256,
        warmup: int = 1,
    ):
        if max_graphs < 1 or warmup < 1:  # a first run does the lazy work outside the capture
            raise ValueError("max_graphs and warmup must be >= 1")
        self.core = core
        self.device = torch.device(device)
        self.buckets = buckets
        self.look_right = look_right  # mel_in's frames past the decoder's (conv_pre context)
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.captures = 0  # graphs captured so far (evicted ones included)
        self.replays = 0
        self.eager = 0  # calls with a shape the buckets do not produce, or after a failure
        self.failed: str | None = None  # why a capture failed; then every call runs eagerly
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        mel_in = args[0]
        frames = mel_in.shape[-1] - self.look_right
        if self.failed or not self.buckets.bucketed(mel_in.shape[0], frames):
            self.eager += 1
            return self.core(*args)
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        with torch.inference_mode():
            entry = self._graphs.get(key)
            if entry is None:
                start = time.perf_counter()
                try:
                    entry = self._capture(key, args)
                except Exception as exc:  # noqa: BLE001 - serving goes on eagerly, said once
                    self.failed = repr(exc)
                    self.clear()
                    logger.error("HiFT CUDA-graph capture failed, running eagerly: %r", exc)
                    self.eager += 1
                    return self.core(*args)
                logger.info(
                    "captured a HiFT CUDA graph: %d rows x %d frames in %.0f ms",
                    mel_in.shape[0],
                    frames,
                    (time.perf_counter() - start) * 1e3,
                )
            else:
                self._graphs.move_to_end(key)
                for src, dst in zip(args, entry.inputs):
                    dst.copy_(src)
            entry.graph.replay()
            self.replays += 1
            return entry.output

    def _capture(self, key: tuple, args) -> _Entry:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        static = [torch.zeros(a.shape, dtype=a.dtype, device=self.device) for a in args]
        for src, dst in zip(args, static):
            dst.copy_(src)
        graph, output = self._record(static)
        entry = _Entry(graph, static, output)
        self._graphs[key] = entry
        self.captures += 1
        return entry

    def _record(self, static: list[torch.Tensor]):
        with torch.cuda.device(self.device):  # captures run on the current device
            return self._record_on_device(static)

    def _record_on_device(self, static: list[torch.Tensor]):
        """Warm up off the capture (lazy init, cuDNN plans), then capture one call."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.core(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a second model in the process) may go on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self.core(*static)
        return graph, output
