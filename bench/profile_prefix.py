"""Time the flow's calls of a 10 s utterance four ways, batch by batch: eagerly without and
with the prefix cache, and through the runner's CUDA graphs without and with the cache.

    python -m bench profile-prefix --dtype bfloat16 --batch 8,32,64   # one CUDA GPU
    python -m bench profile-prefix --dtype bfloat16 --schedule blocks  # 25-token block calls
    python -m bench profile-prefix --device cpu --preset small --batch 2 --dtype float32

B streams (each its own voice, 3 s prompt) run the gateway's calls of a 10 s utterance (upstream's
schedule: 200, 300 and 500 DiT frames, their 3 lookahead tokens context only, then the final 650;
`--schedule blocks`: one call per 25-token block) as one batch of B rows per call index: through
`FlowModel.generate` without a cache, with a fresh prefix cache (each call stores its blocks, the
later ones read them; the final call recomputes), and on CUDA through a `FlowRunner` replaying
graphs (rows padded to `graph_rows`, frames to a multiple of 100), without a cache (every call
recomputes its prefix) and with one (the prefix graphs: queries over the cached prefix).
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
from gateway.schedule import ChunkPlanner, ScheduleConfig
from token2wav.dtypes import DTYPES

PROMPT_TOKENS = 75
UTTERANCE_TOKENS = 250


def calls_of(
    stream: int, num_calls: int, schedule: ScheduleConfig = ScheduleConfig()
) -> list[FlowRequest]:
    v = make_voice(torch.Generator().manual_seed(stream), PROMPT_TOKENS)
    g = torch.Generator().manual_seed(10_000 + stream)
    tokens = torch.randint(0, 6561, (UTTERANCE_TOKENS,), generator=g)
    planner = ChunkPlanner(PROMPT_TOKENS, schedule)
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


def run(streams, generate, cache, device: str, prof_call: int = -1):
    """ms per call batch (every call of every stream, one batch per call index), from an
    empty cache."""
    if cache is not None:
        cache.clear()
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
        "--schedule",
        choices=("upstream", "blocks"),
        default="upstream",
        help="the calls: upstream's chunks (hops 25/50/100 tokens) or one per 25-token block",
    )
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
    schedule = ScheduleConfig.blocks() if a.schedule == "blocks" else ScheduleConfig()
    streams_of = {b: [calls_of(i, 99, schedule) for i in range(b)] for b in sizes}
    frames = [c.num_seq_frames for c in streams_of[sizes[0]][0]]
    print(
        f"{a.preset} {a.dtype} {a.device} {kernels}; ms per batch of calls of each index "
        f"(DiT frames {'/'.join(map(str, frames))})"
    )

    def make(mb: int, graphs: bool):
        cache = None
        if mb:
            cache = PrefixCache.for_model(model, mb << 20, share_voice_blocks=False)
            assert cache.capacity > 0, f"{mb} MiB holds no block of {cache.block_bytes} B"
        if graphs:
            runner = FlowRunner(model, prefix_cache=cache, graph_max_batch=max(sizes))
            return runner.generate, cache

        def generate(batch):
            return model.generate(batch, to_cpu=False, prefix_cache=cache)

        return generate, cache

    modes = [("no cache", 0, False), ("cache", a.cache_mb, False)]
    if cuda:
        modes += [("graphed", 0, True), ("graphs+cache", a.cache_mb, True)]
    for label, mb, graphs in modes:
        generate, cache = make(mb, graphs)
        for b in sizes:
            streams = streams_of[b]
            run(streams, generate, cache, a.device)  # first run: allocator, kernels, graphs
            prof = 1 if a.profile and b == sizes[-1] and mb else -1
            times, table = run(streams, generate, cache, a.device, prof)
            print(f"B={b:3d} {label:12s} " + " / ".join(f"{x:6.1f}" for x in times), flush=True)
            print(f"B={b:3d} {label:12s} total {sum(times):7.1f} ms", flush=True)
            if table:
                print(table, flush=True)
        del generate, cache
        if cuda:
            torch.cuda.empty_cache()
