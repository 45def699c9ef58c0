"""The runner: owns the model and the device, runs one vocoder batch (one batched HiFT call) in the worker thread.

It sees slots (a list of states and mels), never sessions or request ids. Results come back
by slot; a model that answers a different number of slots fails the whole batch (invariant 5).
A bad input in one slot (a ValueError with `.field`, raised before any state changes) does not
sink the others: the batch is re-run slot by slot, so only the offending chunk is rejected.
An out-of-GPU-memory does not either: the batch is re-run as two halves, recursively, and a slot
out of memory alone gets a `RowOutOfMemory` (not fatal: its state is untouched). A sticky device
error (token2wav/faults.py) is raised out of `execute` for the batcher to take the replica down.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from token2wav import MEL_BINS
from token2wav.errors import InvalidArgument
from token2wav.faults import (
    FaultInjector,
    RowOutOfMemory,
    free_device_memory,
    is_device_lost,
    is_out_of_memory,
    without_frames,
)
from vocoder_service.metrics import GPU_FAULTS, GRAPH_CALLS

logger = logging.getLogger(__name__)


def is_input_error(exc: BaseException) -> bool:
    """A caller mistake the model detected before touching any state."""
    return isinstance(exc, ValueError) and bool(getattr(exc, "field", None))


@dataclass
class BatchOutput:
    """What one batch produced, slot by slot."""

    audio: list[np.ndarray | None]  # [num_slots] (S_i,) float32; None where the slot failed
    errors: list[BaseException | None]  # [num_slots]
    fatal: list[bool]  # [num_slots] True: the slot's state may be half-advanced
    state_samples: list[int | None] = field(default_factory=list)  # [num_slots] after the batch
    compute_ms: float = 0.0


class HiFTRunner:
    """`execute(states, mels, finalize)` advances one chunk per slot in one model call."""

    def __init__(self, model: Any, device: str | torch.device = "cpu"):
        self.model = model  # loaded in its compute dtype; it casts each batch's mel itself
        self.device = torch.device(device)
        # A dedicated stream keeps the worker thread's kernels off the default stream, so
        # anything else on the device (another model in the process) does not serialise with it.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._graph_counts = (0, 0, 0)  # the model's graph (captures, replays, eager) so far
        self.faults: FaultInjector | None = None  # tests only: errors raised before a batch

    def new_state(self) -> Any:
        return self.model.new_session()

    def _run_batch(self, states: list, mels: list[np.ndarray], finalize: list[bool]) -> list:
        if self.faults is not None:
            self.faults.check(mels)
        # CPU float32 in: the model keeps its mel history on the host and moves each
        # batch to the device itself (one copy per batch rather than one per chunk).
        return self.model.decode_batch(states, [torch.from_numpy(m) for m in mels], finalize)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def execute(self, states: list, mels: list[np.ndarray], finalize: list[bool]) -> BatchOutput:
        n = len(states)
        out = BatchOutput([None] * n, [None] * n, [False] * n)
        start = time.perf_counter()
        with torch.inference_mode(), self._on_stream():
            self._run_slots(list(range(n)), states, mels, finalize, out)
            if self.stream is not None:
                self.stream.synchronize()
        out.compute_ms = (time.perf_counter() - start) * 1e3
        graphs = getattr(self.model, "graphed_core", None)
        if graphs is not None:
            self._count_graph_calls(graphs)
        out.state_samples = [getattr(s, "num_samples_emitted", None) for s in states]
        return out

    def _count_graph_calls(self, graphs) -> None:
        counts = (graphs.captures, graphs.replays, graphs.eager)
        captures, replays, eager = (a - b for a, b in zip(counts, self._graph_counts))
        self._graph_counts = counts
        GRAPH_CALLS.labels("capture").inc(captures)
        GRAPH_CALLS.labels("replay").inc(replays - captures)
        GRAPH_CALLS.labels("eager").inc(eager)

    def _run_slots(self, slots: list[int], states, mels, finalize, out: BatchOutput) -> None:
        """Run `slots` as one batch; a bad row is taken out (the model validates every row before
        any state changes) and the rest re-run, so one bad chunk never fails the others."""
        while slots:
            oom = None
            try:
                audio = self._run_batch(
                    [states[i] for i in slots],
                    [mels[i] for i in slots],
                    [finalize[i] for i in slots],
                )
                if len(audio) != len(slots):
                    raise RuntimeError(
                        f"model.decode_batch answered {len(audio)} slots for {len(slots)}"
                    )
                for i, a in zip(slots, audio):
                    out.audio[i] = _to_numpy(a)
                return
            except Exception as exc:  # noqa: BLE001 - sorted into input errors and failures
                if is_device_lost(exc):
                    raise
                if is_out_of_memory(exc):
                    oom = without_frames(exc)
                else:
                    bad = getattr(exc, "slot", None)  # the culprit's index in this batch's list
                    if is_input_error(exc) and isinstance(bad, int) and 0 <= bad < len(slots):
                        i = slots.pop(bad)
                        out.errors[i], out.fatal[i] = _client_error(exc)
                        continue
                    if is_input_error(exc) and len(slots) > 1:
                        for i in slots:  # no slot given: find the culprit(s) one by one
                            self._run_slots([i], states, mels, finalize, out)
                        return
                    if not is_input_error(exc):
                        logger.error("HiFT batch of %d slots failed: %r", len(slots), exc)
                    for i in slots:
                        out.errors[i], out.fatal[i] = _client_error(exc)
                    return
            # outside the except block: there the failed batch's frames would still be alive
            self._split_after_oom(slots, states, mels, finalize, out, oom)
            return

    def _split_after_oom(self, slots, states, mels, finalize, out, exc) -> None:
        """Out of memory: decode_batch commits the states only after all its device work, so
        every state is as it was and the halves can be re-run; a slot alone keeps its state
        and its seq open (a retry of the chunk may fit later)."""
        free_device_memory()
        if len(slots) == 1:
            GPU_FAULTS.labels("oom_row").inc()
            logger.error("HiFT slot out of memory alone: %s", exc)
            out.errors[slots[0]], out.fatal[slots[0]] = RowOutOfMemory(exc), False
            return
        GPU_FAULTS.labels("oom_split").inc()
        half = len(slots) // 2
        logger.warning("HiFT batch of %d slots out of memory; retrying as halves", len(slots))
        for part in (slots[:half], slots[half:]):
            self._run_slots(part, states, mels, finalize, out)

    def warmup(self, num_frames: int = 24) -> float:
        """One dummy batch (kernels, allocator, lazy init), then, with CUDA graphs on, the
        capture of the streaming schedule's graphs (in this thread, on the runner's stream,
        where they replay); returns the dummy batch's time in ms."""
        state = self.new_state()
        mel = np.zeros((MEL_BINS, num_frames), dtype=np.float32)
        out = self.execute([state], [mel], [True])
        if out.errors[0] is not None:
            raise RuntimeError(f"warm-up batch failed: {out.errors[0]!r}")
        capture = getattr(self.model, "warmup_graphs", None)
        if capture is not None and getattr(self.model, "graphed_core", None) is not None:
            start = time.perf_counter()
            with torch.inference_mode(), self._on_stream():
                n = capture()
                if self.stream is not None:
                    self.stream.synchronize()
            self._count_graph_calls(self.model.graphed_core)  # start-up captures count too
            logger.info("captured %d HiFT CUDA graphs in %.1f s", n, time.perf_counter() - start)
        return out.compute_ms


def _client_error(exc: BaseException) -> tuple[BaseException, bool]:
    """(error for the chunk's caller, whether its session must fail). The model names batch
    rows (`mels[3]`); the client sent one chunk, whose fields are `mel` and `finalize`."""
    if not is_input_error(exc):
        return exc, True
    name = exc.field.split("[", 1)[0]
    field = {"mels": "mel", "mel": "mel", "finalize": "finalize"}.get(name)
    if field is None:  # the model refused the session state itself: our bug, not the client's
        return RuntimeError(f"model refused the session state: {exc}"), True
    return InvalidArgument(field, getattr(exc, "problem", str(exc))), False


def _to_numpy(audio: torch.Tensor) -> np.ndarray:
    return audio.detach().to("cpu", torch.float32).contiguous().numpy().reshape(-1)
