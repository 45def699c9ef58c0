# ruff: noqa  (scratch timing script, unrun; see README.md beside it)
"""Scratch: the DiT's grouped position conv (d 1024, 16 groups, k 31, bf16) at the service's shapes."""

import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

dev, dt = "cuda", torch.bfloat16
d, g, k = 1024, 16, 31
torch.manual_seed(0)
w = (torch.randn(d, d // g, k, device=dev) * 0.02).to(dt)
bias = torch.zeros(d, device=dev, dtype=dt)


def timed(fn, n=30):
    gr = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(gr):
        fn()
    gr.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        gr.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    return len(ev)


wj = w.view(g, d // g, d // g, k).permute(3, 0, 2, 1).contiguous()  # (k, g, cin, cout)


def shifted(xp, t):  # xp (r, t + k - 1, d) time-major
    r = xp.shape[0]
    xg = xp.view(r, t + k - 1, g, d // g).permute(2, 0, 1, 3)  # (g, r, T, cin)
    acc = None
    for j in range(k):
        part = torch.matmul(xg[:, :, j : j + t], wj[j].unsqueeze(1))  # (g, r, t, cout)
        acc = part if acc is None else acc + part
    return acc.permute(1, 2, 0, 3).reshape(r, t, d)


print(
    "rows t | conv strided-view us (kernels) | contiguous us (kernels) | benchmark=True us | shifted-matmul us (kernels) | rel diff",
    flush=True,
)
for r, t in [
    (2, 110),
    (4, 110),
    (16, 110),
    (64, 110),
    (16, 250),
    (64, 250),
    (16, 650),
    (64, 650),
    (128, 650),
]:
    h = torch.randn(r, t, d, device=dev, dtype=dt)
    f1 = lambda: F.conv1d(F.pad(h.transpose(1, 2), (k - 1, 0)), w, bias, groups=g)
    f2 = lambda: F.conv1d(F.pad(h.transpose(1, 2).contiguous(), (k - 1, 0)), w, bias, groups=g)
    f4 = lambda: shifted(F.pad(h, (0, 0, k - 1, 0)), t)
    t1, n1 = timed(f1), kernels(f1)
    t2, n2 = timed(f2), kernels(f2)
    torch.backends.cudnn.benchmark = True
    t3 = timed(f1)
    torch.backends.cudnn.benchmark = False
    t4, n4 = timed(f4), kernels(f4)
    ref = F.conv1d(
        F.pad(h.float().transpose(1, 2), (k - 1, 0)), w.float(), bias.float(), groups=g
    ).transpose(1, 2)
    e1 = float((f1().transpose(1, 2).float() - ref).abs().max() / ref.abs().max())
    e4 = float((f4().float() - ref).abs().max() / ref.abs().max())
    print(
        f"{r:4d} {t:4d} | {t1:8.1f} ({n1}) | {t2:8.1f} ({n2}) | {t3:8.1f} | {t4:8.1f} ({n4}) | cudnn {e1:.1e} shifted {e4:.1e}",
        flush=True,
    )
