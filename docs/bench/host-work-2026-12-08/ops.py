"""ATen ops a stream's block calls dispatch outside the DiT, by phase: the host's work around the
graph replays (a tiny DiT, since only the ops outside it count). On the CPU every op counts.
With --meta the model lives on the meta device, so the ops split into device kernels (ops
that touch a device tensor, views left out: what a GPU would launch) and host-tensor ops; a
call that reads a value back from the device cannot run there.

    PYTHONPATH=. python docs/bench/host-work-2026-12-08/ops.py 8 [--meta]   # rows per batch
"""

import functools
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flow_service.model.flow as flow
import flow_service.model.prefix_cache as pc
from bench.flow_profile import calls_of
from flow_service.model import FlowModel, PrefixCache
from flow_service.model.config import DiTConfig, FlowConfig
from flow_service.model.dit import DiT
from gateway.schedule import ScheduleConfig

META = "--meta" in sys.argv
VIEWS = ("view", "slice", "select", "squeeze", "expand", "alias", "detach", "transpose")
VIEWS += ("as_strided", "empty", "permute", "split", "unbind", "lift_fresh")
phase, inside, host, kernels = ["other"], [0], Counter(), Counter()


def on_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not inside[0]:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if not any(on_meta(x) for x in (*outs, *args, *(kwargs or {}).values())):
                host[phase[-1]] += 1
            elif not any(v in str(func) for v in VIEWS):
                kernels[phase[-1]] += 1
        return out


def label(name, fn):
    @functools.wraps(fn)
    def f(*a, **k):
        phase.append(name)
        try:
            return fn(*a, **k)
        finally:
            phase.pop()

    return f


def hidden(fn):
    @functools.wraps(fn)
    def f(*a, **k):
        inside[0] += 1
        try:
            return fn(*a, **k)
        finally:
            inside[0] -= 1

    return f


for name in ("validate", "prepare", "conditioning", "scatter"):
    setattr(flow.FlowModel, name, label(name, getattr(flow.FlowModel, name)))
pc.PrefixCache.plan = label("plan", pc.PrefixCache.plan)
pc.PrefixCache.commit = label("commit", pc.PrefixCache.commit)
pc.euler_cfg = label("solver steps, outside the DiT", pc.euler_cfg)
flow.solve_with_prefix = label("prefix solve's setup", pc.solve_with_prefix)
pc.PrefixStep.__call__ = hidden(pc.PrefixStep.__call__)
DiT.forward = hidden(DiT.forward)

torch.manual_seed(0)
dit = DiTConfig(dim=64, depth=1, heads=1, dim_head=64, ff_mult=1)
model = FlowModel(FlowConfig(pre_lookahead_channels=16, dit=dit)).eval()
model = model.to("meta" if META else "cpu")
cache = PrefixCache.for_model(model, 256 << 20, share_voice_blocks=False)
step = pc.PrefixStep(model.decoder.estimator, cache)
rows = int(next((a for a in sys.argv[1:] if a.isdigit()), 2))
streams = [calls_of(i, 99, ScheduleConfig.named("blocks")) for i in range(rows)]
calls = len(streams[0]) - 1  # the streaming calls; the last one is a full-attention final
with Count():
    for k in range(calls):
        batch = [s[k] for s in streams]
        model.validate(batch)  # FlowRunner.generate's own check, before the plan
        model.generate(
            batch, to_cpu=False, prefix_cache=cache, prefix_step=step, prefix_multiple=200
        )
if META:
    print(
        f"B={rows}: {sum(kernels.values()) / calls:.0f} device kernels and "
        f"{sum(host.values()) / calls:.0f} host-tensor ops per streaming block call outside the DiT"
    )
    for name in sorted(set(host) | set(kernels), key=lambda n: -kernels[n]):
        print(f"  {kernels[name] / calls:6.1f} kernels  {host[name] / calls:6.1f} host  {name}")
else:
    print(
        f"B={rows}: {sum(host.values()) / calls:.0f} ATen ops per streaming block call outside the DiT"
    )
    for name, n in host.most_common():
        print(f"  {n / calls:6.1f}  {name}")
