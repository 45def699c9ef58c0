# PYTHONPATH=. python docs/bench/what-limits-2026-12-07/table.py: the note's table
from dataclasses import replace

from bench import simulate as S
from gateway.schedule import ScheduleConfig

print(
    "| final attention | rate /s | streams | on time | first chunk p95 ms | mean rows | left out: padding / deadline / rows |"
)
print("|---|---|---|---|---|---|---|")
for ch in (False, True):
    for rate in (6.9, 9, 12):
        cfg = S.SimConfig(
            start_buffer_s=0.0, gateways=2, schedule=replace(ScheduleConfig(), chunked_final=ch)
        )
        r = S.poisson(cfg, rate, 15, seed=1, mix="mixed")
        lo = r["left_out"]
        ok = r["streams"] - r["stack_stalled"]
        print(
            f"| {'chunked' if ch else 'full'} | {rate:g} | {r['streams']} | {ok} ({100 * ok / r['streams']:.1f} %) | {r['first_chunk_p95_ms']:.0f} | {r['mean_rows']:.2f} | {lo.get('padding', 0)} / {lo.get('deadline', 0)} / {lo.get('rows', 0)} |"
        )
