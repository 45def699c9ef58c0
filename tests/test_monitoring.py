"""deploy/prometheus (scrape config, alert rules) and deploy/grafana (dashboard), checked offline.

Every metric the rules and the dashboard name must be one the services export: a renamed
metric would otherwise leave a silent alert and an empty panel. promtool (Debian's
`prometheus` package) checks the rules' syntax and runs their unit tests when it is on PATH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

import flow_service.metrics  # noqa: F401  (registers the flow's metrics)
import gateway.metrics  # noqa: F401
import token2wav.server  # noqa: F401  (RPC and GPU memory metrics, shared by all three)
import vocoder_service.metrics  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "token2wav.json"
JOBS = {
    "t2w-gateway": ("gateway", 9101),
    "t2w-flow": ("flow", 9102),
    "t2w-vocoder": ("vocoder", 9103),
}

# PromQL words that are not metric names (functions are told apart by their "(").
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def exported_names() -> set[str]:
    """The series names the processes export, suffixes included, labelled or not yet observed."""
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for family in REGISTRY.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
        names.update(s.name for s in family.samples)
    return names


def metric_names(expr: str) -> set[str]:
    # Strings, label matchers, ranges and grouping labels out first: none of them are metrics.
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = _GROUPING.sub(" ", bare)
    words = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)(?!\w|\s*\()", bare)
    return set(words) - _KEYWORDS


def load_rules() -> list[dict]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def unknown_metrics(exprs: list[str], records: set[str]) -> set[str]:
    known = exported_names() | records | {"up"}  # `up`: Prometheus's own, per target
    return {name for expr in exprs for name in metric_names(expr)} - known


def test_metric_name_parser():
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(t2w_a_bucket{job=~"t2w-.*"}[5m]))) '
        '/ clamp_min(sum(t2w:b:rate5m), 1e-9) > 0.02 or up{job="x"} == 0'
    )
    assert metric_names(expr) == {"t2w_a_bucket", "t2w:b:rate5m", "up"}


def test_rules_and_dashboard_name_only_exported_metrics():
    rules = load_rules()
    records = {r["record"] for r in rules if "record" in r}
    rule_exprs = [r["expr"] for r in rules]
    dash_exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    for expr in rule_exprs + dash_exprs:
        assert metric_names(expr), f"no metric found in {expr!r}: the parser missed it"
    assert unknown_metrics(rule_exprs, records) == set()
    assert unknown_metrics(dash_exprs, records) == set()
    # The list: streams, first-chunk latency, late chunks, queue depth, batch sizes,
    # GPU memory, refusals.
    used = {n for e in dash_exprs for n in metric_names(e)}
    for name in (
        "t2w_gateway_active_streams",
        "t2w_gateway_first_chunk_seconds_bucket",
        "t2w_flow_late_calls_total",
        "t2w_flow_queue_depth",
        "t2w_flow_batch_size_bucket",
        "t2w_gpu_memory_allocated_bytes",
        "t2w_gateway_admission_refused_total",
        "up",
    ):
        assert name in used, name


def test_unknown_metric_check_can_fail():
    rules = load_rules()
    records = {r["record"] for r in rules if "record" in r}
    exprs = [
        r["expr"].replace("t2w_flow_late_calls_total", "t2w_flow_late_chunks_total") for r in rules
    ]
    assert unknown_metrics(exprs, records) == {"t2w_flow_late_chunks_total"}
    assert unknown_metrics(["sum(t2w:nope:rate5m)"], records) == {"t2w:nope:rate5m"}


def test_dashboard_layout():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]


def test_scrape_jobs_match_the_services():
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for job, (service, port) in JOBS.items():
        (sd,) = jobs[job]["dns_sd_configs"]
        assert sd["names"] == [service] and sd["port"] == port and sd["type"] == "A"
        env = compose[service]["environment"]
        assert int(env[f"{service.upper()}_METRICS_PORT"]) == port
    # The rules select on these job names.
    for rule in load_rules():
        for job in re.findall(r'job=~?"([^"]+)"', rule["expr"]):
            assert all(j in JOBS for j in job.split("|")), job


def promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("no promtool (apt-get install prometheus)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_promtool_checks_config_and_rules():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rule_unit_tests():
    out = promtool("test", "rules", "alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rule_tests_can_fail(tmp_path):
    for name in ("alerts.yml", "alerts.test.yml"):
        shutil.copy(PROM_DIR / name, tmp_path / name)
    rules = (tmp_path / "alerts.yml").read_text()
    (tmp_path / "alerts.yml").write_text(rules.replace("> 0.02", "> 0.2", 1))
    out = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "T2WLateChunks" in out.stdout + out.stderr
