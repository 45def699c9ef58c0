"""The simulator's mixed workload at one rate, looked into (the note's figures):

    PYTHONPATH=. python docs/bench/what-limits-2026-12-07/analyse.py 9 1 [chunked]

flow time by batch kind (first chunks, later chunks, finals, batches mixing finals), the
calls waiting whenever a batch was formed against the rows it took, and the flow's busy time in
the 15 s window."""

import sys
from dataclasses import replace

from bench import simulate as S
from bench.workload import WorkloadConfig
from flow_service import scheduler as sched_mod
from gateway.schedule import ScheduleConfig

rate, seed = float(sys.argv[1]), int(sys.argv[2])
chunked = sys.argv[3:] == ["chunked"]
formed = []  # (calls waiting, rows taken) per batch formed
schedule = sched_mod.Scheduler.schedule


def counting(self, *args, **kwargs):
    waiting = len(self.waiting)
    plan = schedule(self, *args, **kwargs)
    if plan is not None:
        formed.append((waiting, len(plan.calls)))
    return plan


sched_mod.Scheduler.schedule = counting
cfg = S.SimConfig(
    start_buffer_s=0.0,
    gateways=2,
    schedule=replace(ScheduleConfig(), chunked_final=chunked),
)
sim = S.Simulation(cfg)
batches = []
done = sim.flow.done


def record(plan, started, now):
    batches.append((started, now, plan))
    done(plan, started, now)


sim.flow.done = record
workload = WorkloadConfig(seed=seed, mix="mixed")
for i, t in enumerate(S.poisson_arrivals(seed, rate, 15)):
    sim.add_stream(f"p{i}", float(t), 0.0, workload.shape(i))
sim.run()

kinds: dict[str, float] = {}
for started, ended, plan in batches:
    if plan.urgent:  # inside another batch's time
        continue
    finals = [c.final for c in plan.calls]
    if all(finals):
        kind = "finals"
    elif any(finals):
        kind = "mixing finals"
    elif all(c.is_first_chunk for c in plan.calls):
        kind = "first chunks"
    else:
        kind = "later chunks"
    kinds[kind] = kinds.get(kind, 0.0) + ended - started
busy = sum(max(0.0, min(b, 15.0) - max(a, 0.0)) for a, b, p in batches if not p.urgent)
print("flow s by batch kind:", {k: round(v, 1) for k, v in sorted(kinds.items())})
print(f"busy {busy:.1f} s of the 15 s window")
print(
    f"batches {len(formed)}, calls waiting when one was formed {sum(w for w, _ in formed) / len(formed):.1f}, "
    f"rows {sum(r for _, r in formed) / len(formed):.2f}"
)
