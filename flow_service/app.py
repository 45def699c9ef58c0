"""Assembling the flow service: flags, model, engine, servicer, server (kept apart from main()
so tests build the same server on port 0)."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from flow_service import metrics
from flow_service.costmodel import CostModel, CostPrior, num_solver_steps
from flow_service.engine import FlowEngine
from flow_service.model import (
    FLOW_PRESETS,
    ChunkRequest,
    FlowModel,
    PrefixCache,
    Voice,
    load_flow,
)
from flow_service.scheduler import BatchPolicy
from flow_service.servicer import FlowServicer
from flow_service.voices import VoiceCache
from token2wav.cli import EnvParser, add_server_flags
from token2wav.server import GrpcServer, ServerOptions
from token2wav.v1 import flow_pb2, flow_pb2_grpc

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> EnvParser:
    p = EnvParser(
        "FLOW",
        prog="python -m flow_service",
        description="Stage 1 of token2wav: speech tokens -> mel by CosyVoice3's DiT "
        "flow matching, calls from all streams batched into masked, "
        "ragged solver passes.",
    )
    # largest legal messages: a 30 s inline voice (0.5 MB) + 300 s of tokens; a 1003-token mel
    add_server_flags(p, port=50052, metrics_port=9102, max_message_mb=2)
    p.flag(
        "--model-dir",
        default="",
        help="directory holding flow.pt (or the file itself); "
        "empty: seeded random weights of --preset",
    )
    p.flag(
        "--preset",
        default="small",
        choices=sorted(FLOW_PRESETS),
        help="architecture when no checkpoint is given (a checkpoint's shapes win)",
    )
    p.flag("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    p.flag(
        "--bf16-fp32-parts",
        type=bool,
        default=False,
        help="with --dtype bfloat16, keep the time MLP, AdaLN and output projections in float32 "
        "(+1.1 dB of mel, -6 %% throughput on an H200; default casts every weight); no effect "
        "in float32",
    )
    p.flag(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="model dtype; float32 is upstream's, bfloat16 is ~3x faster on Hopper",
    )
    p.flag(
        "--max-batch-size",
        type=int,
        default=64,
        help="requests per solver batch (1 turns batching off, same code path)",
    )
    p.flag(
        "--max-batch-frames",
        type=int,
        default=64 * 800,
        help="cap on rows x padded length per batch (activation memory)",
    )
    p.flag(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="while busy, how long a batch may wait to fill (0 when the card is idle)",
    )
    p.flag(
        "--min-padding-efficiency",
        type=float,
        default=0.7,
        help="a call joins a batch only if real/padded frames stays above this",
    )
    p.flag(
        "--max-queue",
        type=int,
        default=1024,
        help="waiting calls; past it Generate answers RESOURCE_EXHAUSTED at once",
    )
    p.flag("--max-voices", type=int, default=1024, help="voices kept in the LRU cache")
    p.flag(
        "--cuda-graphs",
        type=bool,
        default=True,
        help="on CUDA, replay captured graphs for batches of up to --graph-max-batch requests",
    )
    p.flag(
        "--graph-max-batch",
        type=int,
        default=8,
        help="largest batch (requests) run through CUDA graphs; larger ones run eagerly",
    )
    p.flag(
        "--preempt",
        type=bool,
        default=True,
        help="time to first audio under load: first chunks batch only with first chunks, and "
        "run between the solver steps of a running batch of later chunks instead of after it",
    )
    p.flag(
        "--deadline-scheduling",
        type=bool,
        default=True,
        help="order calls that carry a playback deadline (slack_ms) by slack, refuse batch "
        "joins that would make a row late, preempt by slack; calls without one keep the "
        "first-chunks-then-arrival order (false: slack_ms is ignored, the order before "
        "deadlines)",
    )
    p.flag(
        "--cost-prior-frames-per-s",
        type=float,
        default=20000.0,
        help="batch cost model's starting throughput (padded frames per second, all solver "
        "steps) until batches are measured; ~20000 for bf16 on an H200",
    )
    p.flag(
        "--prefix-cache-mb",
        type=int,
        default=-1,
        help="prefix cache budget (MiB) for the per-step keys/values of streams' complete "
        "earlier attention blocks, so a streaming call computes only its new frames (same mel); "
        "-1: 40%% of the free device memory on CUDA, 1024 on CPU; 0: off",
    )
    p.flag(
        "--prefix-cache-share-voices",
        type=bool,
        default=True,
        help="share the cached blocks made only of prompt frames across the streams of a voice",
    )
    p.flag(
        "--prefix-cache-evict-idle-s",
        type=float,
        default=5.0,
        help="a full prefix cache evicts only entries unused for this long (streams that "
        "went quiet); otherwise it stores no new blocks until room frees up",
    )
    p.flag(
        "--prefix-cache-order-streams",
        type=bool,
        default=True,
        help="with the prefix cache, a stream's call waits for its earlier calls on this "
        "replica (it reuses what they computed; its audio plays after theirs anyway)",
    )
    p.flag(
        "--log-batches",
        type=bool,
        default=False,
        help="log each batch's size, lengths, padding and time",
    )
    return p


def policy_from_args(args: argparse.Namespace) -> BatchPolicy:
    return BatchPolicy(
        max_batch_size=args.max_batch_size,
        max_batch_frames=args.max_batch_frames,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        min_padding_efficiency=args.min_padding_efficiency,
        first_chunks_apart=args.preempt,
        deadline_scheduling=args.deadline_scheduling,
    )


def cost_prior_from_args(args: argparse.Namespace) -> CostPrior:
    if args.cost_prior_frames_per_s <= 0:
        raise ValueError("--cost-prior-frames-per-s: want > 0")
    return CostPrior(frames_per_s=args.cost_prior_frames_per_s)


def prefix_cache_from_args(args: argparse.Namespace, model) -> PrefixCache | None:
    mb = args.prefix_cache_mb
    if mb < -1:
        raise ValueError(f"--prefix-cache-mb: {mb}, want -1 (auto), 0 (off) or a MiB budget")
    if args.prefix_cache_evict_idle_s < 0:
        raise ValueError(
            f"--prefix-cache-evict-idle-s: {args.prefix_cache_evict_idle_s}, want >= 0"
        )
    if mb == 0 or not isinstance(model, FlowModel):  # test doubles wrapping a model: none
        return None
    if mb == -1:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(0.4 * free)
        else:
            budget = 1024 << 20
    else:
        budget = mb << 20
    return PrefixCache.for_model(
        model,
        budget,
        share_voice_blocks=args.prefix_cache_share_voices,
        evict_idle_s=args.prefix_cache_evict_idle_s,
        observe=metrics.observe_prefix_cache,
    )


def warmup_batch(batch: int, num_frames: int) -> list[ChunkRequest]:
    """`batch` requests whose DiT sequence is `num_frames` long (>= 4), streaming and final
    rows alternating, from a fixed random voice."""
    rng = np.random.default_rng(0)
    n_p = min(25, num_frames // 4)
    voice = Voice(
        torch.from_numpy(rng.integers(0, 6561, n_p)),
        torch.from_numpy(rng.standard_normal((2 * n_p, 80)).astype(np.float32)),
        torch.from_numpy(rng.standard_normal(192).astype(np.float32)),
    )
    n_emit = num_frames // 2 - n_p
    reqs = []
    for i in range(batch):
        final = i % 2 == 1
        tokens = torch.from_numpy(rng.integers(0, 6561, n_emit + (0 if final else 3)))
        reqs.append(ChunkRequest(voice, tokens, 0, finalize=final, streaming=not final))
    return reqs


def warmup_requests() -> list[ChunkRequest]:
    """A first chunk and a final chunk of a 3 s prompt: what the service will see first."""
    return warmup_batch(2, 200)


def create_server(args: argparse.Namespace, model=None):
    """(server, engine, warmup coroutine factory); `model` overrides loading (tests)."""
    if model is None:
        model = load_flow(
            args.model_dir or None,
            device=args.device,
            dtype=DTYPES[args.dtype],
            preset=args.preset,
            fp32_sensitive=args.bf16_fp32_parts,
        )
    engine = FlowEngine(
        model,
        policy_from_args(args),
        log_batches=args.log_batches,
        cuda_graphs=args.cuda_graphs,
        graph_max_batch=args.graph_max_batch,
        preempt=args.preempt,
        cost=CostModel(num_solver_steps(model), cost_prior_from_args(args)),
        prefix_cache=prefix_cache_from_args(args, model),
        order_streams=args.prefix_cache_order_streams,
    )
    voices = VoiceCache(args.max_voices)
    servicer = FlowServicer(engine, voices)
    server = GrpcServer(
        ServerOptions.from_args(args),
        [flow_pb2.DESCRIPTOR.services_by_name["Flow"].full_name],
        lambda s: flow_pb2_grpc.add_FlowServicer_to_server(servicer, s),
    )

    async def warmup() -> None:
        engine.start()
        await engine.warmup(warmup_requests())

    return server, engine, warmup
