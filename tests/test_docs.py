"""The operations guide stays true to the code: every service flag and every metric is documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import flow_service.metrics  # noqa: F401 - registers the flow metrics
import gateway.metrics  # noqa: F401
import token2wav.server  # noqa: F401 - the bootstrap's call metrics
import vocoder_service.metrics  # noqa: F401
from flow_service.config import build_parser as flow_parser
from gateway.config import build_parser as gateway_parser
from vocoder_service.config import build_parser as vocoder_parser

OPERATIONS = (Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md").read_text()


@pytest.mark.parametrize("build", [flow_parser, vocoder_parser, gateway_parser])
def test_every_flag_is_in_the_operations_guide(build):
    flags = {
        opt
        for action in build()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }
    assert flags, "no flags found: the parser changed shape"
    missing = sorted(f for f in flags if f"`{f}`" not in OPERATIONS)
    assert not missing, f"flags missing from docs/OPERATIONS.md: {missing}"


def test_every_metric_is_in_the_operations_guide():
    # Counters are collected without their _total suffix; the guide names them in full.
    names = {m.name for m in REGISTRY.collect() if m.name.startswith("t2w_")}
    assert len(names) >= 20
    missing = sorted(n for n in names if n.removeprefix("t2w_") not in OPERATIONS)
    assert not missing, f"metrics missing from docs/OPERATIONS.md: {missing}"
