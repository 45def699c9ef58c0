"""The flow service's flags and its frozen config: the one place flags become values."""

from __future__ import annotations

import argparse
import dataclasses
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
        "--prefix-cache-mb",
        type=int,
        default=d.prefix_cache.mb,
        help="prefix cache budget (MiB) for the per-step keys/values of streams' complete "
        "earlier attention blocks, so a streaming call computes only its new frames (same mel); "
        "-1: 40%% of the free device memory on CUDA, 1024 on CPU; 0: off",
    )
    p.flag(
        "--log-batches",
        type=bool,
        default=d.log_batches,
        help="log each batch: its size, lengths, padding, how it ran (graph or eager, over the "
        "prefix cache, graphs captured inside it), its time and its oldest call's wait",
    )
    return p


@dataclass(frozen=True)
class PrefixCacheConfig:
    mb: int = -1  # -1: auto (40 % of free CUDA memory, 1 GiB on CPU); 0: off
    # The blocks made only of prompt frames are cached once per voice and shared by its
    # streams: the same keys/values, so nothing is gained by storing them per stream.
    share_voices: bool = True
    # A full cache evicts only entries unused this long: a stream between two calls of its
    # utterance (calls come 1-4 s apart) keeps its blocks; one that went quiet loses them.
    evict_idle_s: float = 5.0

    def __post_init__(self):
        if self.mb < -1:
            raise ValueError(
                f"--prefix-cache-mb: {self.mb}, want -1 (auto), 0 (off) or a MiB budget"
            )
        if self.evict_idle_s < 0:
            raise ValueError(f"prefix cache evict_idle_s: {self.evict_idle_s}, want >= 0")


@dataclass(frozen=True)
class FlowConfig:
    server: ServerOptions = field(default_factory=ServerOptions)
    model_dir: str | None = None  # None: seeded random weights of `preset`
    preset: str = "small"
    device: str = "cpu"
    dtype: str = "float32"
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    cost_prior: CostPrior = field(default_factory=CostPrior)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    max_voices: int = 1024
    cuda_graphs: bool = True
    graph_max_batch: int = 64
    graph_max_frames: int = 12288
    log_batches: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FlowConfig:
        if args.graph_max_frames < 0:
            raise ValueError(f"--graph-max-frames: {args.graph_max_frames}, want >= 0")
        if args.max_voices < 1:
            raise ValueError(f"--max-voices: {args.max_voices}, want >= 1")
        d = cls()
        return cls(
            server=ServerOptions.from_args(args),
            model_dir=args.model_dir or None,
            preset=args.preset,
            device=args.device,
            dtype=args.dtype,
            policy=dataclasses.replace(
                d.policy,
                max_batch_size=args.max_batch_size,
                max_batch_frames=args.max_batch_frames,
                max_wait_ms=args.max_wait_ms,
                max_queue=args.max_queue,
            ),
            prefix_cache=dataclasses.replace(d.prefix_cache, mb=args.prefix_cache_mb),
            max_voices=args.max_voices,
            cuda_graphs=args.cuda_graphs,
            graph_max_batch=args.graph_max_batch,
            graph_max_frames=args.graph_max_frames,
            log_batches=args.log_batches,
        )
