"""Torch profiler trace of one flow batch: where the Stage-1 time goes, kernel by kernel.

    python -m bench profile-batch --dtype bfloat16 --batch 64   # one CUDA GPU
    python -m bench profile-batch --device cpu --preset small --batch 2  # smoke

The batch is B requests of the benchmark workload's longest call (3 s prompt + 10 s utterance,
the final full-attention chunk: 656 frames), run through the flow engine exactly as the service
runs it (its worker stream; CUDA graphs for B <= 8). Prints the operator table sorted by device
time and writes it with a Chrome trace (.json.gz; open in chrome://tracing or Perfetto) to --out-dir
(default $OUT, else out/profile).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.args import add_model_args
from flow_service.engine import FlowEngine
from flow_service.model import load_flow
from flow_service.scheduler import BatchPolicy
from flow_service.warmup import warmup_batch, warmup_requests
from token2wav.dtypes import DTYPES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=64, help="requests in the batch")
    p.add_argument("--frames", type=int, default=656, help="DiT sequence length per request")
    p.add_argument("--rows", type=int, default=25, help="operator rows to print")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "out/profile")
    a = p.parse_args(argv)

    model = load_flow(None, device=a.device, dtype=DTYPES[a.dtype], preset=a.preset)
    engine = FlowEngine(model, BatchPolicy())
    asyncio.run(_warm(engine))
    batch = warmup_batch(a.batch, a.frames)
    engine.runner.generate(batch)  # this shape's first call (allocator, kernel choice) not traced
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and a.device != "cpu":
        activities.append(ProfilerActivity.CUDA)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.runner.generate(batch)
    wall_ms = (time.perf_counter() - t) * 1e3
    sort = "cuda_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=a.rows, max_name_column_width=60)
    name = f"flow_{a.dtype}_B{a.batch}_T{a.frames}"
    head = f"{name}: one generate() (10 solver steps) in {wall_ms:.1f} ms wall, under the profiler"
    print(head, table, sep="\n", flush=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(head + "\n" + table)
    trace = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:  # ~10x smaller
        shutil.copyfileobj(src, dst)
    trace.unlink()
    engine.runner.close()


async def _warm(engine: FlowEngine) -> None:
    await engine.warmup(warmup_requests())
