"""GPU memory sampling with nvidia-smi, and a description of the machine for the report.

The services are separate processes, so the load generator cannot ask torch for their peak.
It samples `nvidia-smi` instead: the device's memory.used and, where the driver shows our
processes (not always inside containers, whose PIDs differ), each process's used memory. What
nvidia-smi sees is what the CUDA caching allocators hold, which only grows, so a run's figure
is the peak so far of that stack, and the largest concurrency level gives the true peak.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
import time


def _smi(*query: str, timeout: float = 5.0) -> list[list[str]] | None:
    """Rows of a CSV nvidia-smi query, or None when there is no usable nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def _to_int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


class GpuMemorySampler:
    """A daemon thread that samples every `interval_s`; `peak()` reads a time window."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.available = _smi("--query-gpu=memory.used") is not None
        # (perf_counter, MiB used summed over GPUs, {pid: MiB})
        self.samples: list[tuple[float, int, dict[int, int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> GpuMemorySampler:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpu-mem", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def sample(self) -> None:
        rows = _smi("--query-gpu=memory.used")
        if rows is None:
            return
        total = sum(v for row in rows if (v := _to_int(row[0])) is not None)
        apps = _smi("--query-compute-apps=pid,used_memory") or []
        per_pid = {}
        for row in apps:
            if len(row) >= 2 and (pid := _to_int(row[0])) is not None:
                per_pid[pid] = per_pid.get(pid, 0) + (_to_int(row[1]) or 0)
        with self._lock:
            self.samples.append((time.perf_counter(), total, per_pid))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def peak(self, t0: float, t1: float, pids: list[int]) -> dict | None:
        """Peak MiB in [t0, t1]: the whole device (every process on it, the idle stack of the
        other batching mode included) and, when visible, the given processes alone."""
        if not self.available:
            return None
        self.sample()  # at least one sample inside short windows
        with self._lock:
            window = [s for s in self.samples if t0 <= s[0] <= t1 + self.interval_s]
        if not window:
            return None
        stack = [sum(apps.get(p, 0) for p in pids) for _, _, apps in window]
        seen = any(p in apps for _, _, apps in window for p in pids)
        return {
            "device_mib": max(total for _, total, _ in window),
            "stack_mib": max(stack) if seen else None,
        }


def hardware() -> dict:
    """GPUs (name, memory, driver) when nvidia-smi works, CPU model and cores, versions."""
    info: dict = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch  # the services' torch (same environment); CUDA is never initialised here

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    rows = _smi("--query-gpu=name,memory.total,driver_version")
    info["gpus"] = (
        [{"name": r[0], "memory_mib": _to_int(r[1]), "driver": r[2]} for r in rows if len(r) >= 3]
        if rows
        else []
    )
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
