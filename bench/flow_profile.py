r"""Where the flow's time goes, batch by batch, through the service's own engine and runner.

    python -m bench profile-batch --dtype bfloat16 --batch 64     # one CUDA GPU
    python -m bench profile-prefix --dtype bfloat16 --batch 8,32,64
    python -m bench profile-prefix --dtype bfloat16 --schedule blocks   # 25-token block calls
    python -m bench profile-prefix --smoke                        # CPU, small preset (also batch)
    python -m bench profile-batch --count-ops --device meta --batch 1 --frames 200   # no GPU

profile-batch --count-ops: instead of timing, the ops (kernel launches on a GPU, views
excluded) that one solver step dispatches, op by op, counted by a torch dispatch mode: the DiT
over B requests of F frames (what an eager or graphed solve runs per step) and the prefix
graphs' step (`PrefixStep`, one block of queries after a cached prefix of F frames rounded
down to blocks). On `--device meta` it needs no memory and no compute; the count depends on the
code, not on the hardware (meta and CPU count alike). Plain kernels: on CUDA the fused kernels
replace each layer's norm/modulate/residual ops and its rotary by compiled kernels.

profile-batch: the torch profiler's operator table of one flow batch: B requests of the
benchmark workload's longest call (3 s prompt + 10 s utterance, the final full-attention chunk:
656 frames), run through `FlowEngine` as the service runs it (its worker stream; CUDA graphs
for batches it graphs), after --warmup untraced calls. Writes the table and a Chrome trace (.json.gz; chrome://tracing or
Perfetto) to OUT.

profile-prefix: ms per batch of the flow's calls of a 10 s utterance, four ways. B streams (each
its own voice, 3 s prompt) run the gateway's calls (upstream's schedule: 200, 300 and 500 DiT
frames, their 3 lookahead tokens context only, then the final 650; `--schedule blocks`: one
call per 25-token block) as one batch of B rows per call index: through `FlowModel.generate`
without a cache, with a fresh prefix cache (each call stores its blocks, the later ones read
them; the final call recomputes), and on CUDA through a `FlowRunner` replaying graphs, without
and with the cache (the prefix graphs). Each configuration runs --warmup times from an empty
cache untimed, then --repeats times timed (the median per call), each call CUDA-synchronised. With --profile, the operator table
of the cached call 1 batch of the largest B is printed too. The table says where a batch
should stop replaying graphs (`--graph-max-frames`); bench/simulate.py reads its lines.
"""

from __future__ import annotations

import asyncio
import gzip
import shutil
import statistics
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from bench import parts
from bench.flow_model import make_voice
from bench.workload import TOKEN_RATE
from flow_service.engine import FlowEngine
from flow_service.model import (
    FLOW_PRESETS,
    FUSED_KERNELS,
    VOCAB_SIZE,
    DiTKernels,
    FlowModel,
    FlowRequest,
    PrefixCache,
    load_flow,
)
from flow_service.model.prefix_cache import PrefixStep
from flow_service.runner import FlowRunner
from flow_service.scheduler import BatchPolicy
from flow_service.warmup import warmup_batch, warmup_requests
from gateway.schedule import ChunkPlanner, ScheduleConfig

PROMPT_TOKENS = 75  # 3 s
UTTERANCE_TOKENS = 10 * TOKEN_RATE


def _activities(device: str) -> list:
    acts = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _table(prof, acts: list, rows: int, width: int) -> str:
    sort = "cuda_time_total" if ProfilerActivity.CUDA in acts else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=width)


# -- profile-batch ----------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched under it by name, views excluded (they launch nothing). An op
    that may alias (under inference mode `to`, `reshape`, `contiguous` are dispatched as such)
    counts where it copied: its output does not share its input's storage."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not func.is_view or not _same_storage(first, args[0]):
            self.ops[func.overloadpacket.__name__] += 1
        return out


def _same_storage(a, b) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def step_ops(
    preset: str, dtype: torch.dtype, device: str, rows: int, frames: int
) -> dict[str, Counter]:
    """The ops of one solver step (see --count-ops): {"DiT": ..., "prefix step": ...}."""
    with torch.device(device):
        model = FlowModel(FLOW_PRESETS[preset])
    model = model.to(dtype).eval()
    dit = model.decoder.estimator
    # a real device keeps the rotary frequencies fp32 by value (RotaryEmbedding._apply); meta
    # has no values to keep
    dit.rotary_embed.inv_freq = dit.rotary_embed.inv_freq.float()
    r, c = 2 * rows, model.cfg.mel_dim
    x = torch.zeros(r, frames, c, dtype=dtype, device=device)
    lens = torch.full((r,), frames, device=device)
    bias = dit.attention_mask(lens, lens > 0, frames, dtype)  # streaming rows
    mask = torch.ones(r, frames, 1, dtype=dtype, device=device)
    spks, tau = torch.zeros(r, c, dtype=dtype, device=device), torch.zeros(r, device=device)
    counts = {}
    with torch.inference_mode():
        with OpCounter() as counter:
            dit(x, x, x, spks, tau, bias, mask)
        counts["DiT"] = counter.ops
        cache = PrefixCache.for_model(model, 0)
        step = PrefixStep(dit, cache)
        cache.pool()  # allocated once, at the first solve
        args = step.example_args(rows, frames // cache.block * cache.block, cache.block)
        with OpCounter() as counter:
            step(*args)
        counts["prefix step"] = counter.ops
    return counts


def count_ops(a, dtype: str) -> int:
    counts = step_ops(a.preset, parts.DTYPES[dtype], a.device, a.batch, a.frames)
    names = sorted(set().union(*counts.values()), key=lambda n: -max(c[n] for c in counts.values()))
    print(
        f"ops per solver step, {a.preset} {dtype}, {a.batch} requests ({2 * a.batch} rows), "
        f"{a.frames} frames, plain kernels (views excluded)"
    )
    print(f"{'op':32s}" + "".join(f"{k:>14s}" for k in counts))
    for name in names:
        print(f"{name:32s}" + "".join(f"{c[name]:14d}" for c in counts.values()))
    print(f"{'total':32s}" + "".join(f"{sum(c.values()):14d}" for c in counts.values()))
    record = {"preset": a.preset, "dtype": dtype, "batch": a.batch, "frames": a.frames}
    record["ops"] = {k: dict(c) for k, c in counts.items()}
    record["total"] = {k: sum(c.values()) for k, c in counts.items()}
    parts.save(a, record, "step_ops")
    return 0


def profile_batch(argv: list[str] | None = None) -> int:
    p = parts.parser(
        "profile-batch",
        __doc__,
        repeats=1,
        warmup=1,
        smoke={"dtype": ["float32"], "batch": 2, "frames": 206},
    )
    p.add_argument("--batch", type=int, default=64, help="requests in the batch")
    p.add_argument("--frames", type=int, default=656, help="DiT sequence length per request")
    p.add_argument("--rows", type=int, default=25, help="operator rows to print")
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="count the ops of one solver step instead of profiling (see above; --device meta)",
    )
    a = parts.parse(p, argv)
    dtype = parts.one_dtype(p, a)
    if a.count_ops:
        return count_ops(a, dtype)
    model = load_flow(
        a.model_dir, device=a.device, dtype=parts.DTYPES[dtype], preset=a.preset, seed=a.seed
    )
    engine = FlowEngine(model, BatchPolicy())
    asyncio.run(engine.warmup(warmup_requests()))
    batch = warmup_batch(a.batch, a.frames)
    for _ in range(a.warmup):  # this shape's first calls (allocator, kernel choice) untraced
        engine.runner.generate(batch)
    acts = _activities(a.device)
    with profile(activities=acts) as prof:
        timing = parts.measure(lambda _: engine.runner.generate(batch), a.device, repeats=a.repeats)
    wall_ms = timing.median
    table = _table(prof, acts, a.rows, 60)
    name = f"flow_{dtype}_B{a.batch}_T{a.frames}"
    calls = "one generate()" if a.repeats == 1 else f"{a.repeats} generate() calls (median)"
    head = f"{name}: {calls} (10 solver steps) in {wall_ms:.1f} ms wall, under the profiler"
    print(head, table, sep="\n", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(head + "\n" + table)
    trace = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:  # ~10x smaller
        shutil.copyfileobj(src, dst)
    trace.unlink()
    parts.save(
        a,
        {"name": name, "batch": a.batch, "frames": a.frames, "dtype": dtype, "wall_ms": wall_ms},
        f"profile_{name}",
    )
    engine.runner.close()
    return 0


# -- profile-prefix ---------------------------------------------------------------------------


def calls_of(
    stream: int, num_calls: int, schedule: ScheduleConfig = ScheduleConfig()
) -> list[FlowRequest]:
    """The gateway's flow calls of one 10 s utterance of stream `stream`, all tokens in hand."""
    v = make_voice(torch.Generator().manual_seed(stream), PROMPT_TOKENS)
    g = torch.Generator().manual_seed(10_000 + stream)
    tokens = torch.randint(0, VOCAB_SIZE, (UTTERANCE_TOKENS,), generator=g)
    planner = ChunkPlanner(PROMPT_TOKENS, schedule)
    out = []
    while len(out) < num_calls and (c := planner.next_call(UTTERANCE_TOKENS, True)) is not None:
        out.append(
            FlowRequest(
                v, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming, f"s{stream}"
            )
        )
    return out


def run_calls(streams, generate, cache, device: str, prof_call: int = -1):
    """ms per call batch (every call of every stream, one batch per call index), from an
    empty cache; the profiler's table of call `prof_call` when asked."""
    if cache is not None:
        cache.clear()
    times, table = [], None
    for k in range(len(streams[0])):
        batch = [s[k] for s in streams]
        if k == prof_call:
            acts = _activities(device)
            with profile(activities=acts) as prof:
                _, ms = parts.once(lambda: generate(batch), device)  # noqa: B023
            table = _table(prof, acts, 22, 50)
        else:
            _, ms = parts.once(lambda: generate(batch), device)  # noqa: B023
        times.append(ms)
    return times, table


def profile_prefix(argv: list[str] | None = None) -> int:
    p = parts.parser(
        "profile-prefix",
        __doc__,
        repeats=1,
        warmup=1,
        smoke={"dtype": ["float32"], "batch": "2", "cache_mb": 256},
    )
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
        "--modes",
        default="no cache,cache,graphed,graphs+cache",
        help="which of the four ways to time, comma-separated (the graphed two on CUDA only)",
    )
    p.add_argument(
        "--fused-kernels",
        type=lambda v: v.lower() in ("1", "true", "yes", "on"),
        default=True,
        help="the service's default kernels, FUSED_KERNELS (compiled on CUDA only)",
    )
    a = parts.parse(p, argv)
    dtype = parts.one_dtype(p, a)
    wanted = a.modes.split(",")
    ways = ("no cache", "cache", "graphed", "graphs+cache")
    if unknown := sorted(set(wanted) - set(ways)):
        p.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(ways)})")
    parts.cpu_threads(a.device)
    cuda = torch.device(a.device).type == "cuda"
    kernels = FUSED_KERNELS if a.fused_kernels and cuda else DiTKernels()
    model = load_flow(
        a.model_dir,
        device=a.device,
        dtype=parts.DTYPES[dtype],
        preset=a.preset,
        seed=a.seed,
        kernels=kernels,
    )
    sizes = [int(x) for x in a.batch.split(",")]
    schedule = ScheduleConfig.named(a.schedule)
    streams_of = {b: [calls_of(i, 99, schedule) for i in range(b)] for b in sizes}
    frames = [c.num_seq_frames for c in streams_of[sizes[0]][0]]
    print(
        f"{a.preset} {dtype} {a.device} {kernels}; ms per batch of calls of each index "
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
    modes = [m for m in modes if m[0] in wanted]
    record: dict = {"frames": frames, "schedule": a.schedule, "dtype": dtype, "ms": {}}
    for label, mb, graphs in modes:
        generate, cache = make(mb, graphs)
        for b in sizes:
            streams = streams_of[b]
            for _ in range(a.warmup):  # allocator, kernels, graph captures
                run_calls(streams, generate, cache, a.device)
            prof = 1 if a.profile and b == sizes[-1] and mb else -1
            runs = [run_calls(streams, generate, cache, a.device, prof)]
            runs += [run_calls(streams, generate, cache, a.device) for i in range(1, a.repeats)]
            table = runs[0][1]
            times = [statistics.median(r[0][k] for r in runs) for k in range(len(runs[0][0]))]
            record["ms"].setdefault(label, {})[b] = times
            print(f"B={b:3d} {label:12s} " + " / ".join(f"{x:6.1f}" for x in times), flush=True)
            print(f"B={b:3d} {label:12s} total {sum(times):7.1f} ms", flush=True)
            if table:
                print(table, flush=True)
            parts.save(a, record, "profile_prefix")
        del generate, cache
        if cuda:
            torch.cuda.empty_cache()
    return 0
