"""Where the GPU idles during a stream's block calls: a profiler trace of the runner's calls
(graphs + prefix cache, B streams' 10 block calls), its GPU-idle intervals, the host phase
each one falls in, and (on CUDA) every implicit synchronisation of one B = 2 run, by caller.
Written for the next lease; not yet run on a card.

    PYTHONPATH=. python docs/bench/host-work-2026-12-08/gaps.py --device cuda \
        --dtype bfloat16 --preset cosyvoice3-0.5b --batch 1,2,8 --out DIR
"""

import argparse
import functools
import gzip
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import flow_service.model.flow as flow_mod
import flow_service.model.prefix_cache as pc
from bench.flow_profile import calls_of
from flow_service.model import FUSED_KERNELS, DiTKernels, PrefixCache, load_flow
from flow_service.model.graphs import GraphedEstimator
from flow_service.runner import FlowRunner
from gateway.schedule import ScheduleConfig

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--dtype", default="float32")
p.add_argument("--preset", default="small")
p.add_argument("--batch", default="2")
p.add_argument("--out", default="/tmp/gaps")
p.add_argument("--repeats", type=int, default=3)
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)


def label(name, fn):
    @functools.wraps(fn)
    def inner(*args, **kw):
        with record_function(name):
            return fn(*args, **kw)

    return inner


# phases: patched where they are looked up
for owner, names in (
    (flow_mod.FlowModel, ("validate", "prepare", "conditioning", "scatter", "solve_batch")),
    (pc.PrefixCache, ("plan", "commit")),
):
    for name in names:
        setattr(owner, name, label(f"ph:{name}", getattr(owner, name)))
FlowRunner.generate = label("ph:runner.generate", FlowRunner.generate)
pc.euler_cfg = label("ph:euler", pc.euler_cfg)
flow_mod.solve_with_prefix = label("ph:solve_with_prefix", pc.solve_with_prefix)
pc.window_bias = label("ph:window_bias", pc.window_bias)
pc.IndexedKV.pool_rows = staticmethod(label("ph:pool_rows", pc.IndexedKV.pool_rows))
GraphedEstimator.__call__ = label("ph:graph_call", GraphedEstimator.__call__)

cuda = a.device.startswith("cuda")
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
model = load_flow(
    None,
    device=a.device,
    dtype=dtype,
    preset=a.preset,
    seed=0,
    kernels=FUSED_KERNELS if cuda else DiTKernels(),
)
sizes = [int(x) for x in a.batch.split(",")]
cache = PrefixCache.for_model(model, 8000 << 20, share_voice_blocks=False)
runner = FlowRunner(model, prefix_cache=cache, cuda_graphs=cuda, graph_max_batch=max(sizes))
sched = ScheduleConfig.named("blocks")


def sync():
    if cuda:
        torch.cuda.synchronize()


def run(streams):
    cache.clear()
    ms = []
    for k in range(len(streams[0])):
        t = time.perf_counter()
        runner.generate([s[k] for s in streams])
        sync()
        ms.append(1e3 * (time.perf_counter() - t))
    return ms


report = []
for b in sizes:
    streams = [calls_of(i, 99, sched) for i in range(b)]
    for _ in range(2):
        run(streams)
    walls = [run(streams) for _ in range(a.repeats)]
    per = [statistics.median(w[k] for w in walls) for k in range(len(walls[0]))]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        prof_ms = run(streams)
        wall = 1e3 * (time.perf_counter() - t0)
    path = f"{a.out}/trace_B{b}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    phases = [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in ev
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("ph:")
    ]
    lines = [
        f"B={b}: {len(streams[0])} calls, ms per call (median of {a.repeats}): "
        + " ".join(f"{x:.1f}" for x in per)
        + f", total {sum(per):.1f}",
        f"  profiled run {wall:.1f} ms: " + " ".join(f"{x:.1f}" for x in prof_ms),
    ]
    if gpu:
        busy, merged = 0.0, []
        for s, e in gpu:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        busy = sum(e - s for s, e in merged)
        span0, span1 = merged[0][0], merged[-1][1]
        gaps = [
            (merged[i][1], merged[i + 1][0])
            for i in range(len(merged) - 1)
            if merged[i + 1][0] - merged[i][1] > 20
        ]
        idle = sum(e - s for s, e in gaps)
        by = defaultdict(float)
        for gs, ge in gaps:
            # time of the gap inside each innermost phase; the rest is "none" (between calls)
            cuts = sorted({gs, ge} | {t for s, e, _ in phases for t in (s, e) if gs < t < ge})
            for u, v in zip(cuts, cuts[1:]):
                m = (u + v) / 2
                inner = [(e - s, n) for s, e, n in phases if s <= m < e]
                by[min(inner)[1] if inner else "none"] += v - u
        lines.append(
            f"  GPU busy {busy / 1e3:.1f} ms of {(span1 - span0) / 1e3:.1f} ms span; "
            f"idle gaps >20us: {len(gaps)}, {idle / 1e3:.1f} ms"
        )
        for n, t in sorted(by.items(), key=lambda kv: -kv[1]):
            lines.append(f"    idle in {n:24s} {t / 1e3:7.2f} ms")
    tot = defaultdict(float)
    for s, e, n in phases:
        tot[n] += e - s
    lines.append(
        "  host time per phase (inclusive): "
        + ", ".join(f"{n[3:]} {t / 1e3:.1f}" for n, t in sorted(tot.items(), key=lambda kv: -kv[1]))
    )
    print("\n".join(lines), flush=True)
    report += lines
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
open(f"{a.out}/gaps.txt", "w").write("\n".join(report) + "\n")

# where the calls synchronise: one more run with sync debugging, warnings counted by caller
if cuda:
    import traceback
    import warnings
    from collections import Counter

    seen = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        st = [
            f
            for f in traceback.extract_stack()
            if "/flow_service/" in f.filename or "/bench/" in f.filename
        ]
        where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in st[-1:-4:-1])
        seen[where] += 1

    warnings.showwarning = show
    streams = [calls_of(i, 99, sched) for i in range(2)]
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        run(streams)
    torch.cuda.set_sync_debug_mode(0)
    out = ["syncs in one B=2 stream run (10 calls), by caller:"] + [
        f"  {n:4d}  {w}" for w, n in seen.most_common()
    ]
    print("\n".join(out))
    open(f"{a.out}/gaps.txt", "a").write("\n".join(out) + "\n")
