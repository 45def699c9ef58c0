"""CUDA-graph replay of the DiT estimator (or of a `PrefixStep`), one graph per input shape.

A plain object, not an nn.Module: it owns device buffers (static inputs, graph memory pool) the
way a runner does, and the model stays stateless. Pass it as `estimator=` to
`FlowModel.generate` (use `frame_multiple` there to bucket lengths so graphs are reused).

Contract: the returned tensor is a static buffer, overwritten by the next replay; the solver
consumes it before calling again. The inputs at `always_copy` (x and tau) are copied on every
call; the others (mu, cond, speaker, masks (a dense bias): constant over the 10 steps) only when
they are not the very same tensor objects as on the previous call, so never modify those in
place between calls. Another solve
may replay an entry between two calls of a solve in progress (the engine's preemption runs an
urgent batch between solver steps): safe because `last_sources` holds the other solve's
tensors, so the resumed solve's inputs are all copied again, and a solve consumes the output
before its `between_steps` hook.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers, in the estimator's argument order
    output: torch.Tensor
    last_sources: list[object] = field(default_factory=list)  # tensors copied last time


class GraphedEstimator:
    def __init__(
        self,
        estimator: Callable[..., torch.Tensor],
        max_graphs: int = 32,
        warmup: int = 2,
        always_copy: tuple[int, ...] = (0, 4),  # the DiT's x and tau change every step
        share: GraphedEstimator | None = None,
    ):
        self.estimator = estimator
        self.always_copy = frozenset(always_copy)
        self.max_graphs = max_graphs
        self.warmup = warmup
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()  # shape key -> entry
        self._pool = None
        self.num_captures = 0  # since start, evicted graphs' too (--log-batches names them)
        # Graphs of another estimator that never replays at the same time (the same runner
        # thread and stream) may share the memory pool: the two sets then cost one.
        self._share = share

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        args = list(args)
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, args)
        else:
            self._graphs.move_to_end(key)
            for i, (src, dst) in enumerate(zip(args, entry.inputs)):
                if i in self.always_copy or src is not entry.last_sources[i]:
                    dst.copy_(src)
        entry.last_sources = list(args)
        entry.graph.replay()
        return entry.output

    def _capture(self, key: tuple, args: list[torch.Tensor]) -> _Entry:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        if self._pool is None:
            shared = self._share._pool if self._share is not None else None
            self._pool = shared if shared is not None else torch.cuda.graph_pool_handle()
            if self._share is not None and self._share._pool is None:
                self._share._pool = self._pool
        static = [_static_copy(a) for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy init, kernel selection
            for _ in range(self.warmup):
                self.estimator(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.estimator(*static)
        entry = _Entry(graph, static, output)
        self._graphs[key] = entry
        self.num_captures += 1
        return entry


def _static_copy(src):
    """A copy with the same strides: the attention bias keeps its 16-aligned rows (a plain
    clone would compact them and SDPA would pad a copy on every replay)."""
    if 0 in src.stride():
        return src.clone(memory_format=torch.contiguous_format)
    dst = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device=src.device)
    return dst.copy_(src)
