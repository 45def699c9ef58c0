"""The operations guide stays true to the code: every metric is documented (every flag is, in
docs/FLAGS.md, generated from the parsers: tests/test_flag_reference.py)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

import flow_service.metrics  # noqa: F401 - registers the flow metrics
import gateway.metrics  # noqa: F401
import token2wav.server  # noqa: F401 - the bootstrap's call metrics
import vocoder_service.metrics  # noqa: F401

OPERATIONS = (Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md").read_text()


def test_every_metric_is_in_the_operations_guide():
    # Counters are collected without their _total suffix; the guide names them in full.
    names = {m.name for m in REGISTRY.collect() if m.name.startswith("t2w_")}
    assert len(names) >= 20
    missing = sorted(n for n in names if n.removeprefix("t2w_") not in OPERATIONS)
    assert not missing, f"metrics missing from docs/OPERATIONS.md: {missing}"
