"""The simulator (bench/simulate.py) on the night's two questions, run from the repository root:

  PYTHONPATH=. python docs/bench/h100-2026-12-07e/sim.py mixed|blocks

mixed   the mixed workload at the new default padding limit, max_wait_ms 5 and 10, seeds 0-3
blocks  the blocks schedule at 25 tokens/s, 250 ms start buffer, padding 0.8 and 0.7, seed 0"""

import sys
from dataclasses import replace

import bench.simulate as S
from gateway.schedule import ScheduleConfig

KEYS = ("streams", "stack_stalled", "first_chunk_p95_ms", "mean_rows", "batches")
what = sys.argv[1]
if what == "mixed":
    for wait in (5.0, 10.0):
        cfg = S.SimConfig()
        cfg = replace(cfg, policy=replace(cfg.policy, max_wait_ms=wait))
        for seed in (0, 1, 2, 3):
            for rate in (9.0, 12.0):
                f = S.poisson(cfg, rate, 15.0, 0.0, seed, "mixed")
                print(
                    f"pad {cfg.policy.min_padding_efficiency} wait {wait} seed {seed} rate {rate:g}",
                    {k: f[k] for k in KEYS},
                    flush=True,
                )
else:
    base = S.SimConfig(start_buffer_s=0.25, schedule=ScheduleConfig.named("blocks", "full"))
    for pad in (0.8, 0.7):
        cfg = replace(base, policy=replace(base.policy, min_padding_efficiency=pad))
        for rate in (4.0, 4.47, 5.0):
            f = S.poisson(cfg, rate, 30.0, 25.0, 0)
            print(f"blocks pad {pad} rate {rate:g}", {k: f[k] for k in KEYS}, flush=True)
