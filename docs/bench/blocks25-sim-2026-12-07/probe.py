"""The simulator on the blocks schedule at 25 tokens/s (the issue's third target), seed 0, a
30 s window: what limits it. Run from the repository root:

  PYTHONPATH=. python docs/bench/blocks25-sim-2026-12-07/probe.py buffers|padding|rows|mixed|busy

buffers   start buffer 0 / 60 / 150 / 250 ms at 3-9 streams/s
padding   min_padding_efficiency 0.7 / 0.4 / 0 at 5 and 6 streams/s (250 ms buffer)
rows      graph row buckets as the runner's, or exact (no padded rows), same runs
mixed     the same two on the mixed workload (SimConfig defaults), seeds 0-1, 9 and 12 streams/s
busy      the flow's busy share per 5 s of the 5 streams/s run, and its batches' rows
"""

import sys
from dataclasses import replace

import bench.simulate as S
from bench.workload import poisson_arrivals
from gateway.schedule import ScheduleConfig

BLOCKS = ScheduleConfig.named("blocks", "full")
KEYS = ("streams", "stack_stalled", "first_chunk_p95_ms", "mean_rows", "batches", "left_out")


def run(cfg, rate, label):
    f = S.poisson(cfg, rate, 30.0, 25.0, 0)
    print(label, f"rate {rate:g}", {k: f[k] for k in KEYS}, flush=True)


def main(what):
    base = S.SimConfig(start_buffer_s=0.25, schedule=BLOCKS)
    if what == "buffers":
        for ms in (0, 60, 150, 250):
            for rate in (3, 4, 5, 6, 9):
                run(replace(base, start_buffer_s=ms / 1e3), rate, f"buffer {ms} ms")
    elif what == "padding":
        for pad in (0.7, 0.4, 0.0):
            cfg = replace(base, policy=replace(base.policy, min_padding_efficiency=pad))
            for rate in (5, 6):
                run(cfg, rate, f"padding {pad}")
    elif what == "rows":
        for rate in (5, 6):
            run(base, rate, "rows bucketed")
        S.graph_rows = lambda n: n
        for rate in (5, 6):
            run(base, rate, "rows exact")
    elif what == "mixed":
        orig = S.graph_rows
        for label, rows in (
            ("bucketed", orig),
            ("exact up to 8", lambda n: n if n <= 8 else orig(n)),
        ):
            S.graph_rows = rows
            for seed in (0, 1):
                for rate in (9.0, 12.0):
                    f = S.poisson(S.SimConfig(), rate, 15.0, 0.0, seed, "mixed")
                    print(
                        f"mixed, rows {label}, seed {seed}, rate {rate:g}",
                        {k: f[k] for k in KEYS[:5]},
                        flush=True,
                    )
    elif what == "busy":
        sim = S.Simulation(base)
        for i, t in enumerate(poisson_arrivals(0, 5.0, 30.0)):
            sim.add_stream(f"p{i}", float(t), 25.0, None)
        sim.run()
        b = sim.batches
        end = max(x["t"] + x["s"] for x in b)
        print(f"{len(b)} batches, flow busy {sum(x['s'] for x in b):.1f} s of {end:.1f}")
        for lo in range(0, int(end), 5):
            w = [x for x in b if lo <= x["t"] < lo + 5]
            n = max(1, len(w))
            print(
                f"{lo:2d}-{lo + 5:2d} s: busy {sum(x['s'] for x in w) / 5:.2f}, "
                f"{len(w)} batches of {sum(x['rows'] for x in w) / n:.1f} rows, "
                f"padded to {sum(x['padded'] for x in w) / n:.0f} frames, "
                f"{sum(x['late'] for x in w)} late rows"
            )
    else:
        sys.exit(f"want buffers, padding, rows, mixed or busy, not {what!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
