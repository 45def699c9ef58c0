"""The note's figures from a run's unpacked folders (run.sh's items X-*, XC-*, BK-*):

    python docs/bench/h100-2026-12-07d/analyse.py DIR...

per Poisson run: streams on time (completed, first chunk <= 250 ms, <= 20 ms of buffer
beyond what the token input forces) and audio s/s; per flow log (--log-batches): batches, the
flow's own time, graphs captured inside batches, the warm-up's end after the first log line,
calls left out by reason, and time by path x rows x padded length; per paced capacity probe
(BK): streams on time, and on time had the first audio been held 60 ms."""

import datetime
import glob
import json
import re
import sys

BATCH = re.compile(
    r"batch \d+(?: \([^)]*\))?: (\d+) reqs, T \d+\.\.\d+, padded (\d+), efficiency [\d.]+, first-chunks \d+, "
    r"([a-z+]+),(.*?)[\d.]+ ms \(own ([\d.]+)\)(.*)$"
)


def on_time(s: dict, hold_ms: float = 0.0, first_chunk: bool = True) -> bool:
    return (
        s["status"] == "OK"
        and (s.get("excess_buffer_ms") or 0.0) <= 20.0 + hold_ms
        and (not first_chunk or (s.get("first_chunk_ms") or 1e9) <= 250.0)
    )


def stamp(line: str) -> datetime.datetime:
    return datetime.datetime.strptime(" ".join(line.split()[:2]), "%Y-%m-%d %H:%M:%S,%f")


for d in sys.argv[1:]:
    for f in sorted(glob.glob(f"{d}/*-open-*.json")):
        r = json.load(open(f))
        s = r["streams"]
        n = sum(map(on_time, s))
        print(
            f"{d} {f.split('/')[-1]}: {n} of {len(s)} on time ({100 * n / len(s):.1f} %), "
            f"{r['metrics']['xrt']:.1f} audio s/s"
        )
    for f in sorted(glob.glob(f"{d}/runs/*pace25.json")):
        s = json.load(open(f))["streams"]
        print(
            f"{d} {f.split('/')[-1]}: {sum(on_time(x, 0, False) for x in s)} of {len(s)} "
            f"on time, {sum(on_time(x, 60, False) for x in s)} with the first audio held 60 ms"
        )
    for log in glob.glob(f"{d}/logs/*flow_service.log"):
        lines = [ln for ln in open(log) if ln[:2] == "20"]
        own, batches, captures, left, kinds = 0.0, 0, 0, {}, {}
        for ln in lines:
            m = BATCH.search(ln)
            if not m:
                continue
            rows, padded, path, mid, ms, tail = m.groups()
            batches += 1
            own += float(ms) / 1e3
            c = re.search(r"captured (\d+)", mid)
            captures += int(c.group(1)) if c else 0
            for reason, k in (
                re.findall(r"(\w+) (\d+)", tail.split("left out for")[-1])
                if "left out" in tail
                else []
            ):
                left[reason] = left.get(reason, 0) + int(k)
            key = (
                path,
                "1 row" if rows == "1" else "2+ rows",
                "<=400" if int(padded) <= 400 else "<=800" if int(padded) <= 800 else ">800",
            )
            kinds[key] = kinds.get(key, 0.0) + float(ms) / 1e3
        warm = [ln for ln in lines if "CUDA graphs" in ln and "captured" in ln]
        ready = (stamp(warm[0]) - stamp(lines[0])).total_seconds() if warm else float("nan")
        print(
            f"{d} flow: {batches} batches, own {own:.1f} s, {captures} graphs captured inside "
            f"batches, warm-up done {ready:.0f} s after the first log line "
            f"({warm[0].split(': ')[-1].strip() if warm else '-'}), left out {left}"
        )
        for key, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"    {' / '.join(key)}: {sec:.1f} s ({100 * sec / own:.0f} %)")
