# ruff: noqa  (scratch timing script as run on the card; see README.md beside it)
# scratch: the DiT's position-conv embedding, cuDNN (hidden + module(hidden)) vs the Triton kernels, graphed
import sys, torch
from torch.profiler import profile, ProfilerActivity
from flow_service.model.dit import CausalConvPositionEmbedding

dev = "cuda"
for dt in (torch.bfloat16, torch.float32):
    torch.manual_seed(0)
    m = CausalConvPositionEmbedding(1024, 31, 16).to(dev, dt)

    def timed(fn, n=30):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n * 1e3

    def kernels(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        return len([e for e in p.events() if e.device_type.name == "CUDA"])

    print(
        dt,
        "rows t | cudnn us (kernels) | triton us (kernels) | speedup | rel diff (triton vs cudnn)",
        flush=True,
    )
    with torch.inference_mode():
        for r, t in [
            (2, 110),
            (4, 110),
            (16, 110),
            (64, 110),
            (2, 250),
            (16, 250),
            (64, 250),
            (16, 650),
            (64, 650),
            (128, 650),
        ]:
            h = torch.randn(r, t, 1024, device=dev, dtype=dt)
            f1 = lambda: h + m(h)
            f2 = lambda: m.fused(h)
            t1, n1 = timed(f1), kernels(f1)
            t2, n2 = timed(f2), kernels(f2)
            e = float((f2().float() - f1().float()).abs().max() / f1().float().abs().max())
            print(
                f"{r:4d} {t:4d} | {t1:8.1f} ({n1}) | {t2:8.1f} ({n2}) | {t1 / t2:5.2f}x | {e:.1e}",
                flush=True,
            )
