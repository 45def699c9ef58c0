"""What a smaller fixed cost per flow batch would buy, in the simulator (a model, not a
measurement): the mixed workload and the `blocks` schedule at 25 tokens/s, with the flow's
per-batch floor (`FlowCostFit.solve_floor_s` + `overhead_s`, 21 ms in the H200 fit) cut by
0, 3 and 6 ms: the range of host time a call spends before its first graph replay.

    PYTHONPATH=. python docs/bench/host-work-2026-12-08/sim_floor.py
"""

import json
from dataclasses import replace

from bench.simulate import SimConfig, poisson
from gateway.schedule import ScheduleConfig

base = SimConfig()
for cut_ms in (0, 3, 6):
    cost = replace(base.flow_cost, solve_floor_s=base.flow_cost.solve_floor_s - cut_ms / 1e3)
    mixed = replace(base, flow_cost=cost, start_buffer_s=0.0, gateways=2)
    blocks = replace(
        base, flow_cost=cost, start_buffer_s=0.25, schedule=ScheduleConfig.named("blocks")
    )
    for name, cfg, rates, pace, mix in (
        ("mixed", mixed, (9.0, 12.0), 0.0, "mixed"),
        ("blocks at 25 tokens/s", blocks, (4.47, 5.0, 6.0), 25.0, "uniform"),
    ):
        for rate in rates:
            stalled, streams, p95 = [], [], []
            for seed in (0, 1, 2):
                f = poisson(cfg, rate, 15.0, pace, seed, mix)
                stalled.append(f["stack_stalled"])
                streams.append(f["streams"])
                p95.append(round(f["first_chunk_p95_ms"]))
            print(
                json.dumps(
                    {
                        "floor_cut_ms": cut_ms,
                        "workload": name,
                        "rate": rate,
                        "streams": streams,
                        "stack_stalled": stalled,
                        "first_chunk_p95_ms": p95,
                    }
                ),
                flush=True,
            )
