"""docs/FLAGS.md is what tools/flag_reference.py makes from the parsers, and each default is
stated once: a parser's defaults give exactly its frozen config's defaults."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

import flow_service.config as flow_config
import gateway.config as gateway_config
import vocoder_service.config as vocoder_config
from token2wav.server import ServerOptions

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("flag_reference", ROOT / "tools/flag_reference.py")
flag_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flag_reference)

CONFIGS = [
    (flow_config.build_parser, flow_config.FlowConfig),
    (vocoder_config.build_parser, vocoder_config.VocoderServiceConfig),
    (gateway_config.build_parser, gateway_config.GatewayConfig),
]
# The listener's defaults that differ per service by design (add_server_flags' arguments).
PER_SERVICE = {"server.port", "server.metrics_port", "server.max_message_mb"}


def test_flags_page_is_current():
    assert (ROOT / "docs/FLAGS.md").read_text() == flag_reference.render(), (
        "docs/FLAGS.md is stale: run `make flags`"
    )


def test_flags_page_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("FLOW_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("GATEWAY_PORT", "1234")
    assert flag_reference.render() == (ROOT / "docs/FLAGS.md").read_text()


def _leaves(value, prefix=""):
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{prefix}{f.name}.")
    else:
        yield prefix[:-1], value


@pytest.mark.parametrize("build, config", CONFIGS, ids=["flow", "vocoder", "gateway"])
def test_parser_defaults_are_the_config_defaults(build, config, monkeypatch):
    for key in [k for k in os.environ if k.startswith(("FLOW_", "VOCODER_", "GATEWAY_"))]:
        monkeypatch.delenv(key)
    from_flags = dict(_leaves(config.from_args(build().parse_args([]))))
    declared = dict(_leaves(config()))
    assert from_flags.keys() == declared.keys()
    differ = {k: (from_flags[k], declared[k]) for k in declared if from_flags[k] != declared[k]}
    assert set(differ) <= PER_SERVICE, f"(flag default, config default) disagree: {differ}"
    # and the listener's per-service defaults are the bootstrap's, but for the three above
    assert from_flags["server.host"] == ServerOptions.host


@pytest.mark.parametrize("build", [b for b, _ in CONFIGS], ids=["flow", "vocoder", "gateway"])
def test_every_flag_says_what_it_does(build):
    for action in build()._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            text = (action.help or "").split(" [env ")[0]
            assert len(text) >= 8, f"{action.option_strings[0]}: help text {text!r}"
