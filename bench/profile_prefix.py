"""Time the flow's calls of a 10 s utterance three ways, batch by batch: eagerly without and
with the prefix cache, and through the runner's CUDA graphs (which pad and skip the cache).

    python -m bench profile-prefix --dtype bfloat16 --batch 8,32,64   # one CUDA GPU
    python -m bench profile-prefix --device cpu --preset small --batch 2 --dtype float32

B streams (each its own voice, 3 s prompt) run the gateway's four calls of a 10 s utterance
(200, 300 and 500 DiT frames, their 3 lookahead tokens context only, then the final 650) as four
batches of B rows: through `FlowModel.generate` without a cache, with a fresh prefix cache (call 0
stores its blocks, calls 1 and 2 read them; the final call recomputes), and on CUDA through a
`FlowRunner` replaying graphs (rows padded to `graph_rows`, frames to a multiple of 100).
Each configuration runs twice; the second, CUDA-synchronised, is timed. With --profile, the
torch profiler's operator table of the cached call 1 batch of the largest B is printed too.
The table says where a batch should stop replaying graphs (`--graph-max-frames`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.args import add_model_args
from bench.flow_model_gpu import make_voice
from flow_service.model import DiTKernels, FlowRequest, PrefixCache, load_flow
from flow_service.runner import FlowRunner
from gateway.schedule import ChunkPlanner
from token2wav.dtypes import DTYPES

PROMPT_TOKENS = 75
UTTERANCE_TOKENS = 250


def calls_of(stream: int, num_calls: int) -> list[FlowRequest]:
    v = make_voice(torch.Generator().manual_seed(stream), PROMPT_TOKENS)
    g = torch.Generator().manual_seed(10_000 + stream)
    tokens = torch.randint(0, 6561, (UTTERANCE_TOKENS,), generator=g)
    planner = ChunkPlanner(PROMPT_TOKENS)
    out = []
    while len(out) < num_calls and (c := planner.next_call(UTTERANCE_TOKENS, True)) is not None:
        out.append(
            FlowRequest(
                v, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming, f"s{stream}"
            )
        )
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, streams, cache_mb: int, device: str, prof_call: int = -1, runner=None):
    """ms per call batch (every call of every stream, one batch per call index)."""
    cache = None
    if runner is not None:
        generate = runner.generate
    else:

        def generate(batch):
            return model.generate(batch, to_cpu=False, prefix_cache=cache)

    if cache_mb:
        probe = PrefixCache.for_model(model, 0)
        cache = PrefixCache.for_model(model, cache_mb << 20, share_voice_blocks=False)
        assert cache.capacity > 0, f"{cache_mb} MiB holds no block of {probe.block_bytes} B"
    times, table = [], None
    for k in range(len(streams[0])):
        batch = [s[k] for s in streams]
        sync(device)
        t = time.perf_counter()
        if k == prof_call:
            acts = [ProfilerActivity.CPU]
            if device.startswith("cuda"):
                acts.append(ProfilerActivity.CUDA)
            with profile(activities=acts) as prof:
                generate(batch)
                sync(device)
            sort = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=50)
        else:
            generate(batch)
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return times, table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", default="8,32,64", help="rows per batch, comma-separated")
    p.add_argument("--cache-mb", type=int, default=40000, help="prefix cache budget")
    p.add_argument("--profile", action="store_true", help="operator table of cached call 1")
    p.add_argument(
        "--fused-norms",
        type=lambda v: v.lower() in ("1", "true", "yes", "on"),
        default=True,
        help="the service's default kernels (compiled on CUDA only)",
    )
    a = p.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cuda = torch.device(a.device).type == "cuda"
    kernels = DiTKernels(fused_norms=a.fused_norms and cuda)
    model = load_flow(
        None, device=a.device, dtype=DTYPES[a.dtype], preset=a.preset, kernels=kernels
    )
    sizes = [int(x) for x in a.batch.split(",")]
    runner = FlowRunner(model, graph_max_batch=max(sizes)) if cuda else None
    print(
        f"{a.preset} {a.dtype} {a.device} {kernels}; ms per batch of calls 0/1/2/final "
        "(DiT 200/300/500/650 frames; graphed: 200/300/500/700)"
    )
    modes = [("no cache", 0, None), ("cache", a.cache_mb, None)]
    if runner is not None:
        modes.append(("graphed", 0, runner))
    for b in sizes:
        streams = [calls_of(i, 4) for i in range(b)]
        for label, mb, run_by in modes:
            run(
                model, streams, mb, a.device, runner=run_by
            )  # first run: allocator, kernels, graphs
            prof = 1 if a.profile and b == sizes[-1] and mb else -1
            times, table = run(model, streams, mb, a.device, prof, runner=run_by)
            print(f"B={b:3d} {label:9s} " + " / ".join(f"{x:7.1f}" for x in times), flush=True)
            if table:
                print(table, flush=True)
