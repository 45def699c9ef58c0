"""The flow service's flags and its frozen config: the one place flags become values."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from flow_service.costmodel import CostPrior
from flow_service.model import FLOW_PRESETS
from flow_service.scheduler import BatchPolicy
from token2wav.cli import EnvParser, add_server_flags, prog
from token2wav.dtypes import DTYPES
from token2wav.server import ServerOptions


def build_parser() -> EnvParser:
    d = FlowConfig()  # every default is the frozen config's
    p = EnvParser(
        "FLOW",
        prog=prog("flow_service"),
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
        default=d.preset,
        choices=sorted(FLOW_PRESETS),
        help="architecture when no checkpoint is given (a checkpoint's shapes win)",
    )
    p.flag("--device", default=d.device, help="torch device: cpu, cuda, cuda:1, ...")
    p.flag(
        "--dtype",
        default=d.dtype,
        choices=sorted(DTYPES),
        help="model dtype; float32 is upstream's, bfloat16 is ~3x faster on Hopper",
    )
    p.flag(
        "--fused-norms",
        type=bool,
        default=d.fused_norms,
        help="on CUDA, run each DiT layer's gate + residual + layer norm + AdaLN modulate as "
        "one torch.compile'd kernel: fewer passes over memory, so a faster solve (compiled "
        "when the model loads, logged; same mel within rounding); no effect on the CPU",
    )
    p.flag(
        "--max-batch-size",
        type=int,
        default=d.policy.max_batch_size,
        help="requests per solver batch (1 turns batching off, same code path)",
    )
    p.flag(
        "--max-batch-frames",
        type=int,
        default=d.policy.max_batch_frames,
        help="cap on rows x padded length per batch (activation memory)",
    )
    p.flag(
        "--max-wait-ms",
        type=float,
        default=d.policy.max_wait_ms,
        help="while busy, how long a batch may wait to fill (0 when the card is idle)",
    )
    p.flag(
        "--min-padding-efficiency",
        type=float,
        default=d.policy.min_padding_efficiency,
        help="a call joins a batch only if real/padded frames stays above this",
    )
    p.flag(
        "--max-queue",
        type=int,
        default=d.policy.max_queue,
        help="waiting calls; past it Generate answers RESOURCE_EXHAUSTED at once",
    )
    p.flag("--max-voices", type=int, default=d.max_voices, help="voices kept in the LRU cache")
    p.flag(
        "--cuda-graphs",
        type=bool,
        default=d.cuda_graphs,
        help="on CUDA, replay captured graphs for batches of up to --graph-max-batch requests",
    )
    p.flag(
        "--graph-max-batch",
        type=int,
        default=d.graph_max_batch,
        help="largest batch (requests) run through CUDA graphs; larger ones run eagerly",
    )
    p.flag(
        "--graph-max-frames",
        type=int,
        default=d.graph_max_frames,
        help="largest work (rows x the longest row's DiT sequence less half its cached prefix, "
        "frames) a graphed batch may have; larger batches are compute-bound and run eagerly, "
        "unpadded (0: no bound, every batch of up to --graph-max-batch rows is graphed)",
    )
    p.flag(
        "--preempt",
        type=bool,
        default=d.preempt,
        help="time to first audio under load: first chunks batch only with first chunks, and "
        "run between the solver steps of a running batch of later chunks instead of after it",
    )
    p.flag(
        "--deadline-scheduling",
        type=bool,
        default=d.policy.deadline_scheduling,
        help="order calls that carry a playback deadline (slack_ms) by slack, refuse batch "
        "joins that would make a row late, preempt by slack; calls without one keep the "
        "first-chunks-then-arrival order (false: slack_ms is ignored, the order before "
        "deadlines)",
    )
    p.flag(
        "--cost-prior-frames-per-s",
        type=float,
        default=d.cost_prior.frames_per_s,
        help="batch cost model's starting throughput (padded frames per second, all solver "
        "steps) until batches are measured; ~20000 for bf16 on an H200",
    )
    p.flag(
        "--prefix-cache-mb",
        type=int,
        default=d.prefix_cache.mb,
        help="prefix cache budget (MiB) for the per-step keys/values of streams' complete "
        "earlier attention blocks, so a streaming call computes only its new frames (same mel); "
        "-1: 40%% of the free device memory on CUDA, 1024 on CPU; 0: off",
    )
    p.flag(
        "--prefix-cache-share-voices",
        type=bool,
        default=d.prefix_cache.share_voices,
        help="share the cached blocks made only of prompt frames across the streams of a voice",
    )
    p.flag(
        "--prefix-cache-evict-idle-s",
        type=float,
        default=d.prefix_cache.evict_idle_s,
        help="a full prefix cache evicts only entries unused for this long (streams that "
        "went quiet); otherwise it stores no new blocks until room frees up",
    )
    p.flag(
        "--prefix-cache-order-streams",
        type=bool,
        default=d.prefix_cache.order_streams,
        help="with the prefix cache, a stream's call waits for its earlier calls on this "
        "replica (it reuses what they computed; its audio plays after theirs anyway)",
    )
    p.flag(
        "--log-batches",
        type=bool,
        default=d.log_batches,
        help="log each batch's size, lengths, padding and time",
    )
    return p


@dataclass(frozen=True)
class PrefixCacheConfig:
    mb: int = -1  # -1: auto (40 % of free CUDA memory, 1 GiB on CPU); 0: off
    share_voices: bool = True
    evict_idle_s: float = 5.0
    order_streams: bool = True

    def __post_init__(self):
        if self.mb < -1:
            raise ValueError(
                f"--prefix-cache-mb: {self.mb}, want -1 (auto), 0 (off) or a MiB budget"
            )
        if self.evict_idle_s < 0:
            raise ValueError(f"--prefix-cache-evict-idle-s: {self.evict_idle_s}, want >= 0")


@dataclass(frozen=True)
class FlowConfig:
    server: ServerOptions = field(default_factory=ServerOptions)
    model_dir: str | None = None  # None: seeded random weights of `preset`
    preset: str = "small"
    device: str = "cpu"
    dtype: str = "float32"
    fused_norms: bool = True  # CUDA only (service_kernels)
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    cost_prior: CostPrior = field(default_factory=CostPrior)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    max_voices: int = 1024
    cuda_graphs: bool = True
    graph_max_batch: int = 64
    graph_max_frames: int = 12288
    preempt: bool = True
    log_batches: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FlowConfig:
        if args.cost_prior_frames_per_s <= 0:
            raise ValueError("--cost-prior-frames-per-s: want > 0")
        if args.graph_max_frames < 0:
            raise ValueError(f"--graph-max-frames: {args.graph_max_frames}, want >= 0")
        if args.max_voices < 1:
            raise ValueError(f"--max-voices: {args.max_voices}, want >= 1")
        return cls(
            server=ServerOptions.from_args(args),
            model_dir=args.model_dir or None,
            preset=args.preset,
            device=args.device,
            dtype=args.dtype,
            fused_norms=args.fused_norms,
            policy=BatchPolicy(
                max_batch_size=args.max_batch_size,
                max_batch_frames=args.max_batch_frames,
                max_wait_ms=args.max_wait_ms,
                max_queue=args.max_queue,
                min_padding_efficiency=args.min_padding_efficiency,
                first_chunks_apart=args.preempt,
                deadline_scheduling=args.deadline_scheduling,
            ),
            cost_prior=CostPrior(frames_per_s=args.cost_prior_frames_per_s),
            prefix_cache=PrefixCacheConfig(
                args.prefix_cache_mb,
                args.prefix_cache_share_voices,
                args.prefix_cache_evict_idle_s,
                args.prefix_cache_order_streams,
            ),
            max_voices=args.max_voices,
            cuda_graphs=args.cuda_graphs,
            graph_max_batch=args.graph_max_batch,
            graph_max_frames=args.graph_max_frames,
            preempt=args.preempt,
            log_batches=args.log_batches,
        )
