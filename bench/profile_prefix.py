#!/usr/bin/env python3
"""Time the flow's streaming calls with and without the prefix cache, batch by batch.

    PYTHONPATH=. python3 bench/profile_prefix.py --dtype bfloat16 --batch 8,32,64   # one CUDA GPU
    PYTHONPATH=. python3 bench/profile_prefix.py --device cpu --preset small --batch 2 --dtype float32

B streams (each its own voice, 3 s prompt) run the gateway's first three calls of a 10 s
utterance (200, 300 and 500 DiT frames, each plus 6 lookahead frames) as three batches of B
rows, once through `FlowModel.generate` without a cache and once with a fresh prefix cache
(call 0 stores its blocks, calls 1 and 2 read them). Each configuration runs twice; the second,
CUDA-synchronised, is timed. With --profile, the torch profiler's operator table of the cached
call 1 batch of the largest B is printed too: the cached path's own cost, kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.flow_model_gpu import make_voice
from flow_service.model import FlowRequest, PrefixCache, load_flow
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
    while len(out) < num_calls and (c := planner.next_call(UTTERANCE_TOKENS, False)) is not None:
        out.append(
            FlowRequest(
                v, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming, f"s{stream}"
            )
        )
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, streams, cache_mb: int, device: str, prof_call: int = -1):
    """ms per call batch (calls 0..2 of every stream, one batch per call index)."""
    cache = None
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
                model.generate(batch, to_cpu=False, prefix_cache=cache)
                sync(device)
            sort = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=50)
        else:
            model.generate(batch, to_cpu=False, prefix_cache=cache)
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return times, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="cosyvoice3-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--batch", default="8,32,64", help="rows per batch, comma-separated")
    p.add_argument("--cache-mb", type=int, default=40000, help="prefix cache budget")
    p.add_argument("--profile", action="store_true", help="operator table of cached call 1")
    a = p.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = load_flow(None, device=a.device, dtype=DTYPES[a.dtype], preset=a.preset)
    sizes = [int(x) for x in a.batch.split(",")]
    print(f"{a.preset} {a.dtype} {a.device}; ms per batch of calls 0/1/2 (DiT 206/306/506 frames)")
    for b in sizes:
        streams = [calls_of(i, 3) for i in range(b)]
        for label, mb in (("no cache", 0), ("cache", a.cache_mb)):
            run(model, streams, mb, a.device)  # shapes' first run: allocator, kernel choice
            prof = 1 if a.profile and b == sizes[-1] and mb else -1
            times, table = run(model, streams, mb, a.device, prof)
            print(f"B={b:3d} {label:9s} " + " / ".join(f"{x:7.1f}" for x in times), flush=True)
            if table:
                print(table, flush=True)


if __name__ == "__main__":
    main()
